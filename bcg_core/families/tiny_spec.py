"""The tiny default's spec, request defaults and component configs (``BCGFluxPipeline``), apart from its model code,
so that the processes which only validate requests (the ingress, the ownership coordinator) describe it without
importing torch.
:mod:`bcg_core.families.tiny` re-exports every name here.
"""

from __future__ import annotations

from bcg_core.families.spec import QUALITY_STEPS, ModelSpec
from bcg_core.step_cache.spec import METHODS as CACHE_METHODS
from bcg_core.table import ShapeRules

__all__ = ["TINY_DEFAULT_GUIDANCE_SCALE", "TINY_DEFAULT_STEPS", "TINY_EDITS", "TINY_NAME", "TINY_TEXT_TOKENS",
           "tiny_spec", "tiny_transformer_config", "tiny_vae_config"]

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

TINY_EDITS = dict(edit_pipelines=("FluxImg2ImgPipeline", "FluxInpaintPipeline"), default_strength=0.6,
                  cache_methods=CACHE_METHODS)
"""The tiny default serves edits through the FLUX.1 edit path (:mod:`bcg_core.families.flux_edit`) with its own
request defaults (few steps for a CPU) and the edit pipelines' strength, 0.6; and FLUX.1's step cache (its
transformer is FLUX's)."""


def tiny_spec(name: str = TINY_NAME, text_tokens: int = TINY_TEXT_TOKENS, pixels_per_token: int = 16) -> ModelSpec:
    """The tiny default's spec: FLUX shape rules at ``pixels_per_token`` pixels a token side and ``text_tokens``
    native text tokens, CFG by ``guidance_scale``, its own request defaults and FLUX.1's edits and step cache."""
    return ModelSpec(name, "flux", "BCGFluxPipeline",
                     ShapeRules(pixels_per_token=pixels_per_token, grid_keyed=False, native_text_tokens=text_tokens),
                     guidance_embeds=False, cfg_rule="guidance_scale", quality_steps=QUALITY_STEPS["bcg-tiny"],
                     default_steps=TINY_DEFAULT_STEPS, default_guidance_scale=TINY_DEFAULT_GUIDANCE_SCALE, **TINY_EDITS)


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
