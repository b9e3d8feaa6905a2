"""Stable Diffusion 3 adapter: MMDiT (joint attention over image and text), keyed on the latent grid.

How diffusers 0.42.1 runs the model, and what that means for bucketing (line numbers are
``diffusers/models/transformers/transformer_sd3.py`` and ``diffusers/models/embeddings.py``):

- ``SD3Transformer2DModel.forward`` takes ``hidden_states`` as the VAE latent image (B, C, H, W) and
  reads ``height, width = hidden_states.shape[-2:]`` (transformer_sd3.py:289). ``PatchEmbed.forward``
  (embeddings.py:359) crops the learned-size sin-cos table ``pos_embed`` (``pos_embed_max_size``
  squared positions) around its centre by those Python ints (``cropped_pos_embed``, embeddings.py:336),
  and the unpatchify reshapes by them (transformer_sd3.py:332). A captured graph therefore bakes in one
  (h, w): 512x768 and 768x512 need two graphs. The key carries ``latent_hw`` (``grid_keyed=True``) and
  image tokens are never rounded up: a padded latent would shift the crop and change every position.
- Text: ``encoder_hidden_states`` is CLIP-L and CLIP-G (77 tokens, channel-padded to 4096) concatenated
  with T5 (``max_sequence_length`` tokens, 256 by default) in ``StableDiffusion3Pipeline.encode_prompt``
  (``torch.cat([clip_prompt_embeds, t5_prompt_embed], dim=-2)``): 77 + 256 = 333 tokens. The joint
  attention (``JointAttnProcessor2_0``) takes no mask and the model was trained on this fixed length,
  so text keeps its native length, unmasked (padding it changes the output; tests/test_sd3.py checks).
- Timestep: the pipeline passes ``timestep = t.expand(batch)`` with ``t`` from
  ``FlowMatchEulerDiscreteScheduler.timesteps`` (sigma x 1000), undivided; the model embeds it with
  sinusoidal ``Timesteps`` on that 0-1000 scale. The static buffer holds it in fp32 whatever the model
  dtype (the scheduler's timesteps are fp32; bf16 would round 999 to 1000).
- Batch: pad rows are copies of real row 0 and are dropped after the forward; every op of the model is
  per row, so real rows do not see them.
"""

from __future__ import annotations

import torch

from .buckets import BucketKey, ShapeRules
from .padding import DenoiseInputs, _copy_rows

__all__ = ["SD3_NATIVE_TEXT_TOKENS", "SD3Adapter"]

SD3_NATIVE_TEXT_TOKENS = 77 + 256
"""CLIP tokens + T5 tokens of ``StableDiffusion3Pipeline`` with its default ``max_sequence_length=256``."""


class SD3Adapter:
    """SD3 family (diffusers ``SD3Transformer2DModel``): exact latent grid, native-length unmasked text.

    Layout (see the module docstring for the diffusers lines behind each fact):

    - ``DenoiseInputs.latents``: (rows, in_channels, h * patch, w * patch), the latent image exactly as the
      pipeline passes ``hidden_states``; ``grid`` is the token grid (h, w).
    - ``DenoiseInputs.text``: (rows, native_text_tokens, joint_attention_dim); ``text_mask`` must be None.
    - ``DenoiseInputs.pooled``: (rows, pooled_projection_dim) (CLIP-L and CLIP-G pooled, concatenated).
    - ``DenoiseInputs.timestep``: (rows,) the scheduler's timestep on the 0-1000 scale, not divided.
    - output: (rows, out_channels, h * patch, w * patch), the velocity prediction.

    Args:
        model: an ``SD3Transformer2DModel`` (with ``pos_embed_max_size`` set, as every SD3 checkpoint).
        native_text_tokens: text length of the pipeline that feeds the model: 77 CLIP tokens plus
            ``max_sequence_length`` T5 tokens (333 for ``StableDiffusion3Pipeline``'s default 256).
        vae_scale_factor: pixels per latent pixel (8 for SD3's VAE).

    Raises:
        ValueError: if the model has no ``pos_embed_max_size`` (then its forward would not crop a table
            and this adapter's facts would not hold).
    """

    family = "sd3"
    guidance_embeds = False
    timestep_max = 1000.0

    def __init__(self, model: torch.nn.Module, native_text_tokens: int = SD3_NATIVE_TEXT_TOKENS,
                 vae_scale_factor: int = 8):
        cfg = model.config
        if not cfg.pos_embed_max_size:
            raise ValueError("SD3Adapter needs an SD3Transformer2DModel with pos_embed_max_size set "
                             "(SD3 checkpoints use 192 or 384)")
        self.model = model
        self.patch = int(cfg.patch_size)
        self.rules = ShapeRules(pixels_per_token=vae_scale_factor * self.patch, grid_keyed=True,
                                native_text_tokens=native_text_tokens)
        self.in_channels = int(cfg.in_channels)
        self.out_channels = int(cfg.out_channels or cfg.in_channels)
        self.seq_dim = int(cfg.joint_attention_dim)
        self.pooled_dim = int(cfg.pooled_projection_dim)
        self.max_grid_side = int(cfg.pos_embed_max_size)

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Latent images (rows, in_channels, h * patch, w * patch), standard normal, CPU fp32."""
        h, w = grid[0] * self.patch, grid[1] * self.patch
        return torch.randn(rows, self.in_channels, h, w, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments).

        Raises:
            ValueError: if the key has no grid, or a grid side exceeds ``pos_embed_max_size`` (the forward
                cannot crop the position table to it).
        """
        if key.latent_hw is None:
            raise ValueError(f"bucket {key} has no latent_hw: SD3 buckets are keyed on the latent grid")
        h, w = key.latent_hw
        if max(h, w) > self.max_grid_side:
            px = self.max_grid_side * self.rules.pixels_per_token
            raise ValueError(f"bucket {key}: grid {h}x{w} exceeds the model's pos_embed_max_size "
                             f"{self.max_grid_side} (sides up to {px} px)")
        b, t, p = key.batch, key.text_tokens, self.patch
        return {
            # (B, C, H, W)
            "latents": torch.zeros(b, self.in_channels, h * p, w * p, device=device, dtype=dtype),
            "text": torch.zeros(b, t, self.seq_dim, device=device, dtype=dtype),  # (B, T, D_text)
            "pooled": torch.zeros(b, self.pooled_dim, device=device, dtype=dtype),  # (B, D_pooled)
            "timestep": torch.zeros(b, device=device, dtype=torch.float32),  # (B,) 0-1000 scale, fp32
        }

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Copy ``inputs`` into the buffers; pad rows are copies of row 0 (every element is written).

        Raises:
            ValueError: if the inputs do not fit (more rows, another grid, another text length) or carry a
                text mask (SD3 text is unmasked).
        """
        lat = buffers["latents"]
        b = lat.shape[0]
        t = buffers["text"].shape[1]
        n = inputs.rows
        if inputs.text_mask is not None:
            raise ValueError("SD3 was trained on unmasked fixed-length text: inputs.text_mask must be None")
        if n > b or tuple(inputs.latents.shape[1:]) != tuple(lat.shape[1:]) or inputs.text_tokens != t:
            raise ValueError(
                f"inputs of {n} rows x latents {tuple(inputs.latents.shape[1:])} x {inputs.text_tokens} text "
                f"tokens do not fit bucket buffers of {b} rows x latents {tuple(lat.shape[1:])} x {t} text "
                f"tokens"
            )
        _copy_rows(lat, inputs.latents)
        _copy_rows(buffers["text"], inputs.text)
        _copy_rows(buffers["pooled"], inputs.pooled)
        _copy_rows(buffers["timestep"], inputs.timestep)

    def _call(self, latents, text, pooled, timestep) -> torch.Tensor:
        return self.model(
            hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=timestep,
            return_dict=False,
        )[0]

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded forward over the static buffers: (B, C_out, H, W)."""
        return self._call(buffers["latents"], buffers["text"], buffers["pooled"], buffers["timestep"])

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` of ``output`` (no image or text padding to remove)."""
        return output[: inputs.rows]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded reference forward, as ``StableDiffusion3Pipeline`` calls the transformer."""
        if inputs.text_mask is not None:
            raise ValueError("SD3 was trained on unmasked fixed-length text: inputs.text_mask must be None")
        p = next(self.model.parameters())
        cast = lambda x: x.to(device=p.device, dtype=p.dtype)  # noqa: E731
        return self._call(cast(inputs.latents), cast(inputs.text), cast(inputs.pooled),
                          inputs.timestep.to(device=p.device, dtype=torch.float32))
