"""Every family end to end: ``verify`` (padded buckets vs unpadded eager) and ``bench`` (eager vs bcg, a request).

``verify``: each family's tiny checkpoint (tests/tiny) loaded through ``model.path`` with ``runner.mode: auto`` (CUDA
graphs on a GPU, static eager buffers on a CPU), fp32 and bf16; every bucket's boundary cases through the runner vs
the unpadded eager forward (``bcg_core.verify``, ``RTOL`` of commands.py, the tables of tests/families/test_*.py).
Exit status 1 if any bucket fails.

``bench``: each family's diffusers pipeline assembled in memory (published transformer config, random weights N(0,
0.02) as ``bench_graphs.build``, bf16; the real VAE config, random weights; random STAND-IN text encoders of the
real class and output width with the tiny tokenizers of tests/tiny), ``save_pretrained`` under ``--scratch`` and
loaded through ``model.path``. Two ``DiTPipeline``s over the one loaded model, one exact bucket each (nothing
padded): ``eager`` (``runner.mode: eager``) and ``bcg`` (``runner.mode: graph``). Per case and n: a warm-up per
mode, then ``--repeats`` requests per mode, alternating; median wall and encode/denoise/decode; ``speedup`` = eager
/ bcg wall; GPU floor = summed CUDA kernel times of one bcg request (torch.profiler). JSON written after each case.

FLUX.2 and Z-Image (bf16, random weights): ``flux2-klein-1024`` is FLUX.2 [klein] 4B's published transformer (the base
checkpoint's way: not distilled, so guidance 4.0 runs CFG), ``flux2-dev-slice-1024`` FLUX.2 [dev]'s published width
with 2 of its 8 double- and 12 of its 48 single-stream blocks (:data:`FLUX2_DEV_SLICE_LAYERS`), ``zimage-1024``
Z-Image's published transformer with the non-Turbo scheduler and defaults (50 steps, guidance 5.0: CFG); their text
encoders are stand-ins of the published class and width with only the layers the pipeline reads
(:func:`text_encoder_layers`); VAEs at the published configs (``AutoencoderKLFlux2``; FLUX.1's for Z-Image).

On the GPU machine, after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site &&
export PYTHONPATH=$HOME/site:$PWD`` (scratch needs ~25 GB free for flux-dev, ~18 GB for flux2-dev-slice, ~13 GB for
zimage, ~8 GB for flux2-klein, ~5 GB for the others)::

    python benchmarks/bench_families.py verify --out verify_families.json
    python benchmarks/bench_families.py bench --scratch /dev/shm --out bench_families.json \\
        --cases pixart-512,pixart-1024,sd3-512,sd3-1024,sana-1024
    python benchmarks/bench_families.py bench --scratch /dev/shm --out bench_flux.json --cases flux-dev-1024
    python benchmarks/bench_families.py bench --scratch /dev/shm --out bench_flux2_zimage.json \\
        --cases flux2-klein-1024,flux2-dev-slice-1024,zimage-1024

CPU smoke (tests/engine/test_bench_families.py; tiny configs and tables, fp32, eager only)::

    python benchmarks/bench_families.py verify --device cpu --tiny --out verify.json
    python benchmarks/bench_families.py bench --device cpu --tiny --repeats 1 --out bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, namedtuple
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "benchmarks", ROOT / "tests", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bcg_core import DiTPipeline, GenerationRequest, RequestValidator, describe_model, load_model  # noqa: E402
from bcg_core.config import BucketConfig, EngineConfig, LimitsConfig, ModelConfig, RunnerConfig  # noqa: E402
from bcg_core.verify import RTOL, verify_runner  # noqa: E402
from bcg_core.verify_inputs import boundary_cases  # noqa: E402

PROMPT = "a photo of a cat sitting on a red chair"
FLUX2_TINY_TEXT = 96
"""``bcg_text_tokens`` of the tiny FLUX.2 checkpoints (``tiny.flux2.TEXT_TOKENS``): their only text bucket."""

# -- verify: tiny checkpoints (tests/tiny) and the bucket tables of tests/families/test_*.py ---------------------


def _t(resolutions: list[str], text: list[int], batch=(1, 2, 4, 8)) -> dict:
    return dict(batch_sizes=list(batch), resolutions=resolutions, text_lengths=text)


_FLUX_T, _SD3_T = _t(["32x32", "64x64"], [32], (1, 2, 4)), _t(["64x64", "64x96", "96x64"], [333])
VERIFY = {  # name: (tests/tiny module, build kwargs, bucket table)
    "flux-dev": ("flux", {"variant": "dev"}, _FLUX_T),
    "flux-schnell": ("flux", {"variant": "schnell"}, _FLUX_T),
    "sd3": ("sd3", {"variant": "sd3"}, _SD3_T),
    "sd35": ("sd3", {"variant": "sd35"}, _SD3_T),
    "pixart": ("pixart", {}, _t(["256x256", "304x208", "208x304"], [16, 32, 64])),
    "sana": ("sana", {}, _t(["512x512", "608x416", "416x608"], [8, 16, 32])),
    "qwenimage": ("qwenimage", {}, _t(["64x64", "208x144", "144x208"], [8, 16, 32])),
    # FLUX.2: text at the tiny checkpoint's native length only (bcg_text_tokens, tiny.flux2.TEXT_TOKENS); 64x64 has
    # a masked 256-token tier below it (tests/families/test_flux2.py)
    "flux2-dev": ("flux2", {"variant": "dev"}, _t(["32x32", "64x64"], [FLUX2_TINY_TEXT], (1, 2, 4))),
    "flux2-klein": ("flux2", {"variant": "klein"}, _t(["32x32", "64x64"], [FLUX2_TINY_TEXT], (1, 2, 4))),
    # Z-Image: grid-keyed; 40x36 is a 10 x 9 grid (90 tokens, padded to 96 inside the model); masked captions
    "zimage": ("zimage", {}, _t(["32x32", "40x36"], [32, 64], (1, 2, 4))),
}
VERIFY_LIMITS = dict(min_side_px=16, max_side_px=1024)  # as tests/reference_gate.py

# -- bench: published configs (tiny ones for the CPU smoke) ------------------------------------------------------
_ENC, _DEC = ("DownEncoderBlock2D",) * 4, ("UpDecoderBlock2D",) * 4
SDXL_VAE = dict(  # PixArt-Sigma's VAE = SDXL's (pixart_sigma_sdxlvae_T5_diffusers vae/config.json)
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=_ENC, up_block_types=_DEC, norm_num_groups=32, sample_size=1024, scaling_factor=0.13025)
SD3_VAE = dict(SDXL_VAE, latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
               use_post_quant_conv=False)  # stable-diffusion-3-medium-diffusers vae/config.json
FLUX_VAE = dict(SD3_VAE, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1-dev vae/config.json
_DC, _CH = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3, (128, 256, 512, 512, 1024, 1024)
DC_AE = dict(  # mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers (0.31B)
    in_channels=3, latent_channels=32, attention_head_dim=32, encoder_block_types=_DC, decoder_block_types=_DC,
    encoder_block_out_channels=_CH, decoder_block_out_channels=_CH, encoder_layers_per_block=(2, 2, 2, 3, 3, 3),
    decoder_layers_per_block=(3,) * 6, encoder_qkv_multiscales=((),) * 3 + ((5,),) * 3,
    decoder_qkv_multiscales=((),) * 3 + ((5,),) * 3, upsample_block_type="interpolate",
    downsample_block_type="Conv", decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407)
SANA_1600M = dict(  # Efficient-Large-Model/Sana_1600M_1024px_diffusers transformer (1.60B)
    in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
    num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304,
    mlp_ratio=2.5, attention_bias=False, sample_size=32, patch_size=1, norm_elementwise_affine=False,
    norm_eps=1e-6, interpolation_scale=None)


# FLUX.2 transformers: diffusers' scripts/convert_flux2_to_diffusers.py (get_flux2_transformer_config: "flux2-dev",
# the model_id black-forest-labs/FLUX.2-dev, 32.2B; "klein-4b", FLUX.2 [klein] 4B, 3.9B, whose transformer the
# distilled FLUX.2-klein-4B and the base FLUX.2-klein-base-4B share: the script tells them apart only by is_distilled);
# Flux2Transformer2DModel's defaults in diffusers 0.42.1 are the [dev] config. The joint_attention_dim is 3 x the text
# encoder's width (text_encoder_out_layers stacks 3 hidden layers): Mistral Small 3.1's 5120, Qwen3-4B's 2560.
FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                 num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True)
FLUX2_KLEIN_4B = dict(FLUX2_DEV, num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                      guidance_embeds=False)
FLUX2_DEV_SLICE_LAYERS = (2, 12)
"""Double- and single-stream blocks of the FLUX.2 [dev] slice: a quarter of the published 8 + 48 (the same 1:6 mix),
8.67B parameters (17.3 GB in bf16; the blocks 0.98B / 0.49B each, 0.81B embedders and modulation) at the published
width 6144, so that bench_tiers' three resident copies (diffusers' transformer, bcg-serve's, and the one ``bcg-fp8``
loads in bf16 before turning it to float8: 52 GB) fit an 80 GB GPU; the whole 32.2B [dev] is 64 GB in bf16 alone."""
FLUX2_VAE: dict = {}
"""``AutoencoderKLFlux2``'s defaults: the config the conversion script builds the published FLUX.2 VAE into
(``AutoencoderKLFlux2()`` in its ``main``): 32 latent channels, 2x2 patch, batch-norm statistics, 84M parameters."""
# Z-Image: Tongyi-MAI/Z-Image and Z-Image-Turbo transformer/config.json (the same 6.15B S3-DiT; copied verbatim by
# the loaders that ship it without the hub, e.g. "DEFAULT_ZIMAGE_TRANSFORMER_CONFIG" of _diffusers_version
# 0.36.0.dev0); ZImageTransformer2DModel's defaults are the same but axes_lens (1024, 512, 512).
ZIMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
              n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
              t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512))
ZIMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)
"""Tongyi-MAI/Z-Image (the non-Turbo base) scheduler/scheduler_config.json; Turbo's has shift 3.0
(``tiny.zimage.ZIMAGE_SCHEDULER_CONFIG``). Its VAE is FLUX.1's (:data:`FLUX_VAE`: vae/config.json, 16 channels,
scaling 0.3611, shift 0.1159)."""

BenchModel = namedtuple("BenchModel", "family transformer vae")  # family; transformer and VAE constructor configs
TINY = {"flux2": ("flux2", {"variant": "dev"}), "flux2-klein": ("flux2", {"variant": "klein"})}
"""``family: (tests/tiny module, build kwargs)`` where they are not ``(family, {})``."""


def _tiny_configs(family: str) -> tuple[dict, dict]:
    """Transformer and VAE configs of the family's tests/tiny checkpoint (:data:`TINY`; built into a temp dir, read
    back)."""
    module, kwargs = TINY.get(family, (family, {}))
    with tempfile.TemporaryDirectory() as tmp:
        folder = importlib.import_module(f"tiny.{module}").build(Path(tmp) / family, **kwargs)
        cfgs = (json.loads((folder / c / "config.json").read_text()) for c in ("transformer", "vae"))
        return tuple({k: v for k, v in c.items() if not k.startswith("_")} for c in cfgs)


def bench_models(tiny: bool) -> dict[str, BenchModel]:
    """The published configs (transformers of ``bench_graphs.MODELS`` and the FLUX.2 / Z-Image ones above), or with
    ``tiny`` those of tests/tiny (same families, tiny widths)."""
    from bench_graphs import MODELS

    pix = MODELS["pixart-sigma"].config  # PixArt-Sigma-XL-2-1024-MS; the 512-MS has sample_size 64, scale 1
    models = {"pixart-sigma-512": BenchModel("pixart", dict(pix, sample_size=64, interpolation_scale=1), SDXL_VAE),
              "pixart-sigma-1024": BenchModel("pixart", pix, SDXL_VAE),
              "sd3-medium": BenchModel("sd3", MODELS["sd3-medium"].config, SD3_VAE),
              "sana-1.6b-1024": BenchModel("sana", SANA_1600M, DC_AE),
              "flux-dev": BenchModel("flux", MODELS["flux-dev"].config, FLUX_VAE),
              # FLUX.1-dev's width with 2 double and 4 single blocks (bench_saturation.FLUX_DEV_WIDTH_LAYERS)
              "flux-dev-width": BenchModel("flux", dict(MODELS["flux-dev"].config, num_layers=2, num_single_layers=4),
                                           FLUX_VAE),
              "flux2-klein-4b": BenchModel("flux2-klein", FLUX2_KLEIN_4B, FLUX2_VAE),
              "flux2-dev-slice": BenchModel("flux2", dict(FLUX2_DEV, num_layers=FLUX2_DEV_SLICE_LAYERS[0],
                                                          num_single_layers=FLUX2_DEV_SLICE_LAYERS[1]), FLUX2_VAE),
              "zimage": BenchModel("zimage", ZIMAGE, FLUX_VAE)}
    if tiny:
        configs = {f: _tiny_configs(f) for f in dict.fromkeys(m.family for m in models.values())}
        models = {name: BenchModel(m.family, *configs[m.family]) for name, m in models.items()}
    return models


def text_widths(family: str, tr: dict) -> dict:
    """Output widths the transformer reads: T5 / Gemma2 sequence width, CLIP widths (SD3: CLIP-L + CLIP-G, 768 +
    1280 of the 2048 pooled channels; FLUX: CLIP-L's pooled 768); FLUX.2: the LM's hidden width, a third of
    ``joint_attention_dim`` (three hidden layers stacked: Mistral Small 3.1's 5120 for [dev], Qwen3-4B's 2560 for
    [klein] 4B); Z-Image: ``cap_feat_dim`` (Qwen3-4B's 2560)."""
    if family in ("flux2", "flux2-klein"):
        return {"mistral" if family == "flux2" else "qwen3": tr["joint_attention_dim"] // 3}
    if family == "zimage":
        return {"qwen3": tr["cap_feat_dim"]}
    if family in ("pixart", "sana"):
        return {"t5" if family == "pixart" else "gemma": tr["caption_channels"]}
    pooled = tr["pooled_projection_dim"]
    clip = (pooled * 3 // 8, pooled - pooled * 3 // 8) if family == "sd3" else (pooled,)
    return {"t5": tr["joint_attention_dim"], "clip": clip}


CASES = {  # case: (model, size, size with --tiny, steps, guidance_scale)
    "pixart-512": ("pixart-sigma-512", 512, 256, 20, 4.5),
    "pixart-1024": ("pixart-sigma-1024", 1024, 256, 20, 4.5),
    "sd3-512": ("sd3-medium", 512, 64, 20, 7.0),
    "sd3-1024": ("sd3-medium", 1024, 96, 20, 7.0),
    "sana-1024": ("sana-1.6b-1024", 1024, 512, 20, 4.5),
    "flux-dev-1024": ("flux-dev", 1024, 64, 28, 3.5),  # FLUX.1-dev: guidance embedding, no CFG
    "flux-dev-width-512": ("flux-dev-width", 512, 64, 20, 3.5),  # launch-bound: a reused step is a few kernels
    # FLUX.2 and Z-Image: each pipeline's __call__ defaults (bcg_core.families.defaults.pipeline_defaults: 50 steps;
    # guidance 4.0 FLUX.2, 5.0 Z-Image); bench_tiers' --steps runs fewer where the GPU time is short
    "flux2-klein-1024": ("flux2-klein-4b", 1024, 64, 50, 4.0),  # klein base, not distilled: CFG (2 rows) against ""
    "flux2-dev-slice-1024": ("flux2-dev-slice", 1024, 64, 50, 4.0),  # [dev]: guidance embedding, no CFG
    "zimage-1024": ("zimage", 1024, 64, 50, 5.0),  # Z-Image (not Turbo's 8-9 steps, guidance 0): CFG above 0
}
CLASSES = {  # family: (pipeline, transformer, VAE)
    "pixart": ("PixArtSigmaPipeline", "PixArtTransformer2DModel", "AutoencoderKL"),
    "sd3": ("StableDiffusion3Pipeline", "SD3Transformer2DModel", "AutoencoderKL"),
    "sana": ("SanaPipeline", "SanaTransformer2DModel", "AutoencoderDC"),
    "flux": ("FluxPipeline", "FluxTransformer2DModel", "AutoencoderKL"),
    "flux2": ("Flux2Pipeline", "Flux2Transformer2DModel", "AutoencoderKLFlux2"),
    "flux2-klein": ("Flux2KleinPipeline", "Flux2Transformer2DModel", "AutoencoderKLFlux2"),
    "zimage": ("ZImagePipeline", "ZImageTransformer2DModel", "AutoencoderKL"),
}
PIPELINE_KWARGS = {"flux2-klein": {"is_distilled": False}}
"""Further pipeline constructor arguments per family (``model_index.json``): [klein] as the base checkpoint, CFG on."""


def random_transformer(cls, config: dict, device, dtype) -> torch.nn.Module:
    """Random weights as ``bench_graphs.build``: matrices N(0, 0.02), norm scales 1, biases 0; materialised from
    the meta device in ``dtype`` (a model with buffers, e.g. sin-cos tables, is built on ``device`` instead)."""
    with torch.device("meta"):
        model = cls(**config)
    if any(True for _ in model.buffers()):
        with torch.device(device):
            model = cls(**config).to(dtype)
    else:
        model = model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                torch.nn.init.normal_(p, std=0.02)
            else:
                (torch.nn.init.ones_ if name.endswith("weight") else torch.nn.init.zeros_)(p)
    return model.eval()


def text_encoder_layers(family: str) -> int:
    """Hidden layers of the family's stand-in LM: FLUX.2 stacks the hidden states of the pipeline's default
    ``text_encoder_out_layers`` ((10, 20, 30) [dev], (9, 18, 27) [klein], read from ``__call__``'s signature), so the
    stand-in has one more than the last of them (31, 28; the published LMs have 40 and 36); Z-Image reads
    ``hidden_states[-2]``: 2. The depth does not enter the denoising time, only the encode's."""
    if family == "zimage":
        return 2
    import inspect

    import diffusers

    cls = getattr(diffusers, CLASSES[family][0])
    return max(inspect.signature(cls.__call__).parameters["text_encoder_out_layers"].default) + 1


def _qwen3_tokenizer():
    """The tiny Qwen2 tokenizer with ``<think>`` tokens and Qwen3's chat template (as tests/tiny/flux2.py [klein]
    and tests/tiny/zimage.py build theirs)."""
    from tiny.flux2 import QWEN3_CHAT_TEMPLATE
    from tiny.qwenimage import qwen2_tokenizer

    tok = qwen2_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def _lm_encoder(family: str, width: int):
    """FLUX.2's / Z-Image's stand-in LM: the published class at the published hidden ``width``, random weights, with
    :func:`text_encoder_layers` layers of 2 heads of 64 (1 KV head) and a 256-wide MLP (the published 32 / 8 heads
    of 128 and 32768 / 9728-wide MLPs would be the encode's cost only); tiny offline tokenizers (tests/tiny).

    Returns:
        ``(tokenizer, model)``: [dev] ``Mistral3ForConditionalGeneration`` (a 1-layer Pixtral vision tower that text
        prompts never run) with the Mistral-style tokenizer of ``tiny.flux2``; [klein] ``Qwen3ForCausalLM``,
        Z-Image ``Qwen3Model``, with :func:`_qwen3_tokenizer`.
    """
    import transformers as tf

    layers = text_encoder_layers(family)
    lm = dict(hidden_size=width, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, max_position_embeddings=1024)
    if family == "flux2":
        from tiny.flux2 import mistral_tokenizer

        tok = mistral_tokenizer()
        ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        return tok, tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(
            text_config=dict(model_type="mistral", vocab_size=len(tok), rms_norm_eps=1e-5, rope_theta=1e9,
                             sliding_window=None, **lm, **ids),
            vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=16, image_size=32, patch_size=8, num_channels=3, head_dim=8),
            image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2))
    tok = _qwen3_tokenizer()
    config = tf.Qwen3Config(vocab_size=len(tok), bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id, **lm)
    return tok, (tf.Qwen3ForCausalLM if family == "flux2-klein" else tf.Qwen3Model)(config)


def _text_encoders(spec: BenchModel) -> dict:
    """Stand-in text encoders (random weights; real classes and output widths) with tiny offline tokenizers."""
    import transformers as tf

    from tiny.tokenizers import clip_tokenizer, t5_tokenizer

    widths = text_widths(spec.family, spec.transformer)
    if spec.family in ("flux2", "flux2-klein", "zimage"):
        return dict(zip(("tokenizer", "text_encoder"), _lm_encoder(spec.family, *widths.values()), strict=True))

    def t5(width, max_length):
        tok = t5_tokenizer(max_length=max_length)
        return tok, tf.T5EncoderModel(tf.T5Config(vocab_size=len(tok), d_model=width, d_kv=64, d_ff=256, num_layers=1,
                                                  num_heads=4, relative_attention_num_buckets=32, pad_token_id=0,
                                                  eos_token_id=1, decoder_start_token_id=0))

    def clip(width, cls):  # 2 layers: SD3 reads the penultimate hidden states
        tok = clip_tokenizer()
        return tok, cls(tf.CLIPTextConfig(
            vocab_size=len(tok), hidden_size=width, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=max(1, width // 64), max_position_embeddings=77, projection_dim=width,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))

    if spec.family == "pixart":
        return dict(zip(("tokenizer", "text_encoder"), t5(widths["t5"], 300), strict=True))
    if spec.family == "sana":
        from tiny.sana import gemma_tokenizer

        tok = gemma_tokenizer()
        return dict(tokenizer=tok, text_encoder=tf.Gemma2Model(tf.Gemma2Config(
            vocab_size=len(tok), hidden_size=widths["gemma"], intermediate_size=256, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
            pad_token_id=0, eos_token_id=1, bos_token_id=2)))
    tok3, te3 = t5(widths["t5"], 512)
    if spec.family == "sd3":  # CLIP-L and CLIP-G
        (tok, te), (tok2, te2) = (clip(w, tf.CLIPTextModelWithProjection) for w in widths["clip"])
        return dict(tokenizer=tok, text_encoder=te, tokenizer_2=tok2, text_encoder_2=te2, tokenizer_3=tok3,
                    text_encoder_3=te3)
    tok, te = clip(widths["clip"][0], tf.CLIPTextModel)
    return dict(tokenizer=tok, text_encoder=te, tokenizer_2=tok3, text_encoder_2=te3)


def _scheduler(family: str):
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

    from tiny.pixart import PIXART_SIGMA_SCHEDULER
    from tiny.sana import SANA_SCHEDULER_CONFIG

    if family in ("pixart", "sana"):
        return DPMSolverMultistepScheduler(**(PIXART_SIGMA_SCHEDULER if family == "pixart" else SANA_SCHEDULER_CONFIG))
    if family == "zimage":
        return FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER)
    # FLUX.1-dev scheduler_config.json; FLUX.2's conversion script saves this very one (from_pretrained of FLUX.1-dev's
    # scheduler), and its pipelines pass mu (compute_empirical_mu) themselves
    flux = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                max_image_seq_len=4096)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                           **(flux if family in ("flux", "flux2", "flux2-klein") else {}))


def _params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _text_width(m: torch.nn.Module) -> int:
    """Output width of a stand-in text encoder (T5's ``d_model``; a multimodal LM's text model's hidden size)."""
    cfg = m.config.get_text_config()
    return getattr(cfg, "d_model", None) or cfg.hidden_size


def _text_layers(m: torch.nn.Module) -> int:
    """Layers of a stand-in text encoder (of its text model)."""
    cfg = m.config.get_text_config()
    return getattr(cfg, "num_layers", None) or cfg.num_hidden_layers


def build_checkpoint(spec: BenchModel, folder: Path, device, dtype) -> dict:
    """Assemble the diffusers pipeline in memory and ``save_pretrained`` it to ``folder``; what was built."""
    import diffusers

    pipe_cls, tr_cls, vae_cls = (getattr(diffusers, c) for c in CLASSES[spec.family])
    torch.manual_seed(0)
    transformer = random_transformer(tr_cls, spec.transformer, device, dtype)
    with torch.device(device):
        vae = vae_cls(**spec.vae).to(dtype).eval()
        text = {k: v.to(dtype).eval() if isinstance(v, torch.nn.Module) else v
                for k, v in _text_encoders(spec).items()}
    pipe_cls(transformer=transformer, vae=vae, scheduler=_scheduler(spec.family), **text,
             **PIPELINE_KWARGS.get(spec.family, {})).save_pretrained(folder)
    stand_ins = {k: dict(cls=type(m).__name__, stand_in=True, random_weights=True, width=_text_width(m),
                         layers=_text_layers(m), params_m=round(_params(m) / 1e6, 1))
                 for k, m in text.items() if isinstance(m, torch.nn.Module)}
    info = dict(pipeline=pipe_cls.__name__, transformer=tr_cls.__name__, params_b=round(_params(transformer) / 1e9, 3),
                vae=vae_cls.__name__, vae_params_m=round(_params(vae) / 1e6, 1), text_encoders=stand_ins)
    del transformer, vae, text
    _free()
    return info


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_events(prof) -> list:
    """The CUDA kernel and memory-copy events of a finished ``torch.profiler.profile`` (user annotations left
    out), read from the raw kineto events: no Python event objects for ~10^5 kernels. Each has ``name()`` and
    ``duration_ns()``."""
    return [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", lambda: False)()]


def request_floor(pipe: DiTPipeline, request: GenerationRequest) -> tuple[float, int]:
    """``(ms, events)``: summed CUDA kernel (and memcpy) times of one warm request, as ``profile.kernel_floor``
    sums them (:func:`cuda_events`)."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pipe.generate(pipe.validator.validate(request))
        _sync()
    ev = cuda_events(prof)
    return sum(e.duration_ns() for e in ev) / 1e6, len(ev)


def exact_buckets(folder: Path, request: GenerationRequest, limits: LimitsConfig) -> BucketConfig:
    """The one bucket that holds ``request`` exactly (its rows, generation size, text length), as the family's
    own validator keys it (tokenizers and JSON configs only)."""
    mc = ModelConfig(path=str(folder), device="cpu")
    spec = describe_model(mc)
    size = "{}x{}".format(*spec.generation_size(request.width, request.height))
    probe = BucketConfig(batch_sizes=[2 * limits.max_images], resolutions=[size],
                         text_lengths=[spec.rules.native_text_tokens or 300])
    validator = RequestValidator.from_config(EngineConfig(model=mc, limits=limits, buckets=probe))
    q = validator.validate(request).lookup.query
    return BucketConfig(batch_sizes=[q.batch], resolutions=[size], text_lengths=[q.text_tokens], miss_policy="reject")


def _medians(runs: list[tuple[float, dict]]) -> dict:
    return dict(wall_ms=round(statistics.median(w for w, _ in runs), 1),
                **{f"{k}_ms": round(statistics.median(t[k] for _, t in runs), 1)
                   for k in ("encode", "denoise", "decode", "total")}, walls_ms=[round(w, 1) for w, _ in runs])


def bench_case(model, folder: Path, case: str, n: int, args, device: torch.device, dtype: str) -> dict:
    """One case at one n: exact-bucket eager and bcg pipelines over the loaded ``model``, interleaved."""
    _, size, tiny_size, steps, guidance = CASES[case]
    size, steps = (tiny_size, 2) if args.tiny else (size, steps)
    req = GenerationRequest(PROMPT, n=n, width=size, height=size, num_inference_steps=steps,
                            guidance_scale=guidance, seed=1)
    limits = LimitsConfig(min_side_px=16)
    buckets = exact_buckets(folder, req, limits)
    mc = ModelConfig(path=str(folder), device=device.type, dtype=dtype)
    modes = ["eager", "graph"] if device.type == "cuda" else ["eager"]
    pipes, prepare_s = {}, {}
    for mode in modes:
        t0 = time.perf_counter()
        cfg = EngineConfig(model=mc, buckets=buckets, limits=limits, runner=RunnerConfig(mode=mode, kernels="eager"))
        pipes[mode] = DiTPipeline(cfg, model)  # graph: captures its one bucket here
        _sync()
        prepare_s[mode] = round(time.perf_counter() - t0, 2)
    validated = pipes["eager"].validator.validate(req)

    def timed(mode: str) -> tuple[float, dict]:
        _sync()
        t0 = time.perf_counter()
        out = pipes[mode].generate(pipes[mode].validator.validate(req))
        _sync()
        return (time.perf_counter() - t0) * 1e3, out.timings_ms

    for mode in modes:  # warm-up
        timed(mode)
    runs: dict[str, list] = {m: [] for m in modes}
    for i in range(args.repeats):  # alternating, and alternating which mode goes first
        for mode in modes if i % 2 == 0 else modes[::-1]:
            runs[mode].append(timed(mode))
    lk = validated.lookup
    row = dict(case=case, n=n, size=f"{size}x{size}", steps=steps, guidance_scale=guidance,
               cfg=pipes["eager"].validator.spec.uses_cfg(validated.request), bucket=str(lk.key), rows=lk.query.batch,
               exact=lk.hit and lk.key.tokens == lk.query.tokens, prepare_s=prepare_s, eager=_medians(runs["eager"]),
               bcg=None, bcg_modes=None, speedup=None, floor_ms=None, floor_events=None, bcg_over_floor=None,
               eager_over_floor=None)
    if "graph" in pipes:
        row.update(bcg=_medians(runs["graph"]),
                   bcg_modes=dict(Counter(d["mode"] for d in pipes["graph"].runner.describe())))
        row["speedup"] = round(row["eager"]["wall_ms"] / row["bcg"]["wall_ms"], 3)
        if not args.no_floor:
            floor, events = request_floor(pipes["graph"], req)
            row.update(floor_ms=round(floor, 1), floor_events=events,
                       bcg_over_floor=round(row["bcg"]["wall_ms"] / floor, 3),
                       eager_over_floor=round(row["eager"]["wall_ms"] / floor, 3))
    pipes.clear()
    _free()
    return row


def run_bench(args, device: torch.device) -> dict:
    if device.type != "cuda" and not args.tiny:
        raise SystemExit("bench at published model sizes needs CUDA; on a CPU use --tiny")
    dtype = "float32" if args.tiny else "bfloat16"
    cases = args.cases.split(",") if args.cases else list(CASES)
    if unknown := [c for c in cases if c not in CASES]:
        raise SystemExit(f"unknown case {unknown[0]!r}; cases: {', '.join(CASES)}")
    models = bench_models(args.tiny)
    result = dict(subcommand="bench", env=_env(device, args), dtype=dtype, tiny=args.tiny, repeats=args.repeats,
                  prompt=PROMPT, models={}, cases=[], errors=[],
                  stand_ins="every text encoder is a random-weight stand-in (its real class and output width, 1-2 "
                            "layers, tiny trained tokenizers); transformer and VAE configs are the published ones"
                            f"{' (tiny here)' if args.tiny else ''}, with random weights")
    for name in dict.fromkeys(CASES[c][0] for c in cases):  # each model once, in case order
        folder, model = Path(tempfile.mkdtemp(prefix=f"bcg-{name}-", dir=args.scratch)), None
        try:
            t0 = time.perf_counter()
            info = build_checkpoint(models[name], folder, device, getattr(torch, dtype))
            info["build_save_s"] = round(time.perf_counter() - t0, 1)
            info["folder_gb"] = round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e9, 2)
            t0 = time.perf_counter()
            model = load_model(ModelConfig(path=str(folder), device=device.type, dtype=dtype))
            _sync()
            info["load_s"] = round(time.perf_counter() - t0, 1)
            result["models"][name] = info
            print(f"{name}: {info['params_b']}B transformer, built+saved in {info['build_save_s']} s "
                  f"({info['folder_gb']} GB), loaded in {info['load_s']} s", flush=True)
            for case, n in ((c, n) for c in cases if CASES[c][0] == name for n in args.ns):
                with _recorded(result, args, f"{case} n={n}"):
                    result["cases"].append(dict(model=name, **bench_case(model, folder, case, n, args, device, dtype)))
                    print(json.dumps(result["cases"][-1]), flush=True)
        except Exception as e:  # noqa: BLE001 - a model that fails to build or load: record it, run the others
            result["errors"].append(f"{name}: {type(e).__name__}: {e}"[:1000])
        finally:
            del model
            _free()
            shutil.rmtree(folder, ignore_errors=True)
        _save(args, result)
    result["ok"] = not result["errors"]
    _table(["case", "n", "bucket", "eager ms", "bcg ms", "speedup", "floor ms", "bcg/floor", "bcg enc/den/dec ms"],
           [[r["case"], r["n"], r["bucket"], r["eager"]["wall_ms"], (r["bcg"] or {}).get("wall_ms"), r["speedup"],
             r["floor_ms"], r["bcg_over_floor"], r["bcg"] and "/".join(f"{r['bcg'][k + '_ms']:.0f}" for k in
                                                                        ("encode", "denoise", "decode"))]
            for r in result["cases"]])
    print("\n".join(["ERRORS:", *result["errors"]]) if result["errors"] else "")
    return result


@contextlib.contextmanager
def _recorded(result: dict, args, what: str):
    """Run the block; an exception in it is recorded in ``result["errors"]`` (and the JSON saved), not raised."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - one failing case must not lose the others' results
        result["errors"].append(f"{what}: {type(e).__name__}: {e}"[:1000])
        print(f"FAILED {result['errors'][-1]}", flush=True)
    _free()
    _save(args, result)


def _save(args, result: dict) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


def format_table(header: list[str], rows: list[list]) -> str:
    """``rows`` under ``header`` as text, columns as wide as their widest cell (None as "-"; floats with one
    decimal from 10 up, else 3 significant digits)."""
    def fmt(c) -> str:
        if isinstance(c, float):
            return f"{c:.1f}" if abs(c) >= 10 else f"{c:.3g}"
        return "-" if c is None else str(c)

    cells = [header] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def _table(header: list[str], rows: list[list]) -> None:
    """Print :func:`format_table` after a blank line."""
    print("\n" + format_table(header, rows))


def run_verify(args, device: torch.device) -> dict:
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32"] if args.tiny else ["float32", "bfloat16"]
    names = args.families.split(",") if args.families else list(VERIFY)
    result = dict(subcommand="verify", env=_env(device, args), tiny=args.tiny, families=[], errors=[])
    limits = LimitsConfig(**VERIFY_LIMITS)
    with tempfile.TemporaryDirectory(prefix="bcg-verify-", dir=args.scratch) as tmp:
        for name in names:
            module, kwargs, table = VERIFY[name]
            if args.tiny:  # a smaller table: the first two values of each dimension
                table = {k: v[:2] for k, v in table.items()}
            folder = importlib.import_module(f"tiny.{module}").build(Path(tmp) / name, **kwargs)
            for dt in dtypes:
                with _recorded(result, args, f"{name}/{dt}"):
                    result["families"].append(_verify_one(name, folder, dt, table, limits, device))
                    print(json.dumps(result["families"][-1]), flush=True)
    result["ok"] = not result["errors"] and all(not r["failed"] and r["checked"] for r in result["families"])
    _table(["family", "dtype", "buckets", "passed", "worst rel err", "rtol", "runner modes"],
           [[r["family"], r["dtype"], r["buckets"], r["passed"], r["max_rel_err"], r["rtol"],
             ", ".join(f"{k} {v}" for k, v in r["modes"].items())] for r in result["families"]])
    bad = [f"{r['family']}/{r['dtype']}: {r['failed'] or 'nothing checked'}" for r in result["families"]
           if r["failed"] or not r["checked"]] + result["errors"]
    print("FAILED: " + "; ".join(bad) if bad else "every bucket passed")
    return result


def _verify_one(name: str, folder: Path, dtype: str, table: dict, limits: LimitsConfig, device) -> dict:
    """Every bucket of ``table`` on the tiny checkpoint ``folder`` in ``dtype``: runner vs unpadded eager."""
    t0 = time.perf_counter()
    pipe = DiTPipeline.from_config(EngineConfig(
        model=ModelConfig(path=str(folder), device=device.type, dtype=dtype), buckets=BucketConfig(**table),
        limits=limits, runner=RunnerConfig(mode="auto", kernels="eager")))
    m = pipe.model
    cases = boundary_cases(pipe.table, limits)
    verdicts = verify_runner(m.adapter, pipe.runner, cases, m.device, m.dtype, rtol=RTOL[m.dtype])
    return dict(family=name, dtype=dtype, buckets=len(pipe.table.keys), checked=len(verdicts),
                passed=sum(v.passed for v in verdicts), cases=len(cases),
                max_rel_err=float(f"{max((v.max_rel_err for v in verdicts), default=0.0):.3e}"), rtol=RTOL[m.dtype],
                modes=dict(Counter(d["mode"] for d in pipe.runner.describe())),
                failed=[str(v.key) + (" (NaN)" if v.nan else "") for v in verdicts if not v.passed],
                unreached=sorted({str(k) for k in pipe.table.keys} - {str(v.key) for v in verdicts}),
                seconds=round(time.perf_counter() - t0, 1))


def _git(*cmd: str) -> str | None:
    out = shutil.which("git") and subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True,
                                                   check=False)
    return out.stdout.strip() if out and out.returncode == 0 else None


def _env(device: torch.device, args) -> dict:
    import diffusers
    import transformers

    status = _git("status", "--porcelain")
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                commit=args.commit or os.environ.get("BCG_COMMIT") or _git("rev-parse", "HEAD") or "unknown",
                dirty=None if status is None else bool(status), torch=torch.__version__, cuda=torch.version.cuda,
                diffusers=diffusers.__version__, transformers=transformers.__version__, device=device.type,
                gpu=torch.cuda.get_device_name() if device.type == "cuda" else None)


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    common.add_argument("--tiny", action="store_true", help="CPU smoke: tiny configs and tables, fp32")
    common.add_argument("--scratch", help="folder for the checkpoints written (default: a temp dir; /dev/shm on a GPU)")
    common.add_argument("--out", help="write the JSON result here")
    common.add_argument("--commit", help="git commit to record (default: $BCG_COMMIT, else git rev-parse HEAD)")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", parents=[common], help="every family's buckets vs unpadded eager (tiny checkpoints)")
    v.add_argument("--families", help=f"comma-separated, of {','.join(VERIFY)} (default: all)")
    v.add_argument("--dtypes", help="comma-separated (default: float32,bfloat16; float32 with --tiny)")
    b = sub.add_parser("bench", parents=[common], help="whole request, eager vs bcg, published configs")
    b.add_argument("--cases", help=f"comma-separated, of {','.join(CASES)} (default: all)")
    b.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4], help="images per request")
    b.add_argument("--repeats", type=int, default=3, help="timed requests per mode, case and n")
    b.add_argument("--no-floor", action="store_true", help="skip the profiled request (GPU floor)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    result = run_verify(args, device) if args.command == "verify" else run_bench(args, device)
    _save(args, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
