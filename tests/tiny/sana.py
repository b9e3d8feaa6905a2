"""A tiny SANA pipeline (``SanaPipeline``) in the real layout, built offline with seeded random weights.

Components, each the real class with few channels (docs/DESIGN.md section 4):

- ``tokenizer``: a ``GemmaTokenizer`` (BPE with byte fallback, ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2,
  ``<unk>`` 3, ``<mask>`` 4, then the 256 ``<0xNN>`` byte tokens), trained with the ``tokenizers`` library
  on :func:`tests.tiny.tokenizers.corpus` plus the pipeline's default complex human instruction (so that
  instruction, prepended to every prompt, takes a realistic number of tokens rather than bytes);
- ``text_encoder``: ``Gemma2Model`` (one layer, hidden 32);
- ``transformer``: ``SanaTransformer2DModel`` with SANA's 32 latent channels, patch 1, two blocks;
  ``sample_size`` 16 (so ``use_resolution_binning`` uses ``ASPECT_RATIO_512_BIN``);
- ``vae``: ``AutoencoderDC`` with six stages (32x downsampling, 32 latent channels, 8-32 channels), the
  block, norm and activation types and ``scaling_factor`` of SANA's DC-AE f32c32;
- ``scheduler``: SANA's ``DPMSolverMultistepScheduler`` config (flow prediction, flow sigmas, shift 3), or
  its SDE variant (``scheduler="sde"``), or ``FlowMatchEulerDiscreteScheduler`` (``scheduler="euler"``).
"""

from __future__ import annotations

import inspect
import json
import string
from pathlib import Path

import torch

from .tokenizers import corpus

__all__ = ["SANA_SCHEDULER_CONFIG", "build", "gemma_tokenizer"]

SANA_SCHEDULER_CONFIG = dict(
    algorithm_type="dpmsolver++", beta_end=0.02, beta_schedule="linear", beta_start=0.0001, flow_shift=3.0,
    lower_order_final=True, num_train_timesteps=1000, prediction_type="flow_prediction", solver_order=2,
    solver_type="midpoint", timestep_spacing="linspace", use_flow_sigmas=True, final_sigmas_type="zero",
)
"""``scheduler/scheduler_config.json`` of SANA's diffusers checkpoints (Sana_1600M_1024px_diffusers)."""


def _instruction() -> list[str]:
    from diffusers import SanaPipeline

    return inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default


def gemma_tokenizer(vocab_size: int = 1200):
    """A ``GemmaTokenizer``: BPE with byte fallback over ``▁``-joined text, as Gemma's tokenizer.json.

    Trained within words (split before each ``▁``); the ``GemmaTokenizer`` class then applies the merges to
    whole normalised strings, as Gemma does. Characters outside the trained alphabet fall back to bytes.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special,
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation + "▁\n"),
    )
    text = list(corpus()) + [s.lower() for s in corpus()] + _instruction() * 4
    tok.train_from_iterator(text, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ")) for m in model["merges"]]
    return GemmaTokenizer(vocab=dict(model["vocab"]), merges=merges, add_bos_token=True, add_eos_token=False)


def build(folder: Path, *, learned_sigma: bool = False, pos_embed: bool = False, scheduler: str = "dpm",
          sample_size: int = 16, seed: int = 0) -> Path:
    """Build and save a tiny ``SanaPipeline`` into ``folder`` (deterministic for a seed).

    Args:
        folder: output folder (``save_pretrained`` layout).
        learned_sigma: the transformer outputs 64 channels (noise and variance); the pipeline keeps the first 32.
        pos_embed: sin-cos position embeddings (``interpolation_scale=1``, as SANA 4K), else none (SANA 1K).
        scheduler: ``"dpm"`` (SANA's DPM-Solver++ flow config), ``"sde"`` (the same as SDE-DPM-Solver++, which
            draws noise in every step from the request's generators) or ``"euler"``
            (``FlowMatchEulerDiscreteScheduler``, shift 3).
        sample_size: transformer ``sample_size`` (16/32/64/128 pick the resolution-binning table).
        seed: ``torch.manual_seed`` before the weights are drawn.

    Returns:
        ``folder``.
    """
    from diffusers import (
        AutoencoderDC,
        DPMSolverMultistepScheduler,
        FlowMatchEulerDiscreteScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    tokenizer = gemma_tokenizer()
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )).eval()
    transformer = SanaTransformer2DModel(
        in_channels=32, out_channels=64 if learned_sigma else 32, num_attention_heads=2, attention_head_dim=16,
        num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
        caption_channels=32, mlp_ratio=2.5, sample_size=sample_size, patch_size=1,
        interpolation_scale=1 if pos_embed else None,
    ).eval()
    kinds = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
    channels = (8, 8, 16, 16, 32, 32)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=32, attention_head_dim=8,
        encoder_block_types=kinds, decoder_block_types=kinds,
        encoder_block_out_channels=channels, decoder_block_out_channels=channels,
        encoder_layers_per_block=(1,) * 6, decoder_layers_per_block=(1,) * 6,
        encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)), decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        upsample_block_type="interpolate", downsample_block_type="Conv",
        decoder_norm_types=("batch_norm",) * 3 + ("rms_norm",) * 3, decoder_act_fns=("relu",) * 3 + ("silu",) * 3,
        scaling_factor=0.41407,
    ).eval()
    if scheduler == "dpm":
        sched = DPMSolverMultistepScheduler(**SANA_SCHEDULER_CONFIG)
    elif scheduler == "sde":
        sched = DPMSolverMultistepScheduler(**{**SANA_SCHEDULER_CONFIG, "algorithm_type": "sde-dpmsolver++"})
    elif scheduler == "euler":
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    else:
        raise ValueError(f"scheduler {scheduler!r}: use 'dpm', 'sde' or 'euler'")
    pipe = SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=sched)
    pipe.save_pretrained(folder)
    return folder
