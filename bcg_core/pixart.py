"""PixArt-Sigma adapter: cross-attention DiT trained with a text key-padding mask, keyed on the grid.

How diffusers 0.42.1 runs the model, and what that means for bucketing (line numbers are
``diffusers/models/transformers/pixart_transformer_2d.py`` unless named otherwise):

- ``PixArtTransformer2DModel.forward`` takes ``hidden_states`` as the VAE latent image (B, C, H, W) and
  computes the token grid ``height, width = H // patch, W // patch`` as Python ints (line 302).
  ``PatchEmbed.forward`` (embeddings.py:375) recomputes the sin-cos position table for that grid whenever
  it differs from ``sample_size // patch`` (``get_2d_sincos_pos_embed(grid_size=(height, width))``,
  interpolated by ``interpolation_scale``), and the unpatchify reshapes by them (line 351). A captured
  graph therefore bakes in one (h, w): the key carries ``latent_hw`` (``grid_keyed=True``) and image
  tokens are never rounded up.
- Text: the model was trained with a T5 key-padding mask. ``PixArtSigmaPipeline.encode_prompt`` pads the
  prompt to ``max_sequence_length`` (300) tokens and passes the tokenizer's mask as
  ``encoder_attention_mask`` (pipeline_pixart_sigma.py:864). The forward turns a 2-D mask into a bias
  (``(1 - mask) * -10000``, line 297) added to the cross-attention scores of every block
  (``BasicTransformerBlock`` passes it as ``attn2``'s ``attention_mask``, attention.py:1046). Text
  tokens are only ever keys and values of that cross-attention (``caption_projection`` is per token), so
  masked pad tokens contribute exp(-10000) = 0 in fp32: text lengths can be bucketed
  (``native_text_tokens=None``), pad tokens are zero vectors with mask False.
- ``encoder_attention_mask=None`` and an all-True mask give bit-identical outputs on CPU fp32 (checked;
  the bias is all zeros), but on CUDA a mask can select a different SDPA kernel. The unpadded reference
  therefore passes an all-True mask of the real length, as the pipeline always passes a mask.
- Timestep: the pipeline passes ``current_timestep.expand(batch)`` (line 858 of the pipeline) with the
  DPM-Solver's integer timesteps in [0, 1000), undivided; ``AdaLayerNormSingle`` embeds them with
  sinusoidal ``Timesteps`` (which cast to float). The static buffer holds them in fp32 whatever the
  model dtype (exact for integers; bf16 would round 999 to 1000).
- ``added_cond_kwargs={"resolution": None, "aspect_ratio": None}``, as the pipeline passes
  (pipeline_pixart_sigma.py:834): PixArt-Sigma has ``use_additional_conditions`` False. PixArt-Alpha's
  1024 models (micro-conditions on) are refused.
- Batch: pad rows are copies of real row 0 (its mask included, so no row is all-masked) and are dropped
  after the forward; every op of the model is per row.
"""

from __future__ import annotations

import torch

from .buckets import BucketKey, ShapeRules
from .padding import DenoiseInputs, _copy_rows

__all__ = ["PIXART_SIGMA_MAX_TEXT_TOKENS", "PixArtAdapter"]

PIXART_SIGMA_MAX_TEXT_TOKENS = 300
"""``PixArtSigmaPipeline``'s ``max_sequence_length``: the most T5 tokens PixArt-Sigma was trained with."""

_ADDED_COND = {"resolution": None, "aspect_ratio": None}


class PixArtAdapter:
    """PixArt family (diffusers ``PixArtTransformer2DModel``): exact latent grid, masked text buckets.

    Layout (see the module docstring for the diffusers lines behind each fact):

    - ``DenoiseInputs.latents``: (rows, in_channels, h * patch, w * patch), the latent image exactly as the
      pipeline passes ``hidden_states``; ``grid`` is the token grid (h, w).
    - ``DenoiseInputs.text``: (rows, text_tokens, caption_channels) T5 embeddings; ``text_mask``
      (rows, text_tokens) bool or None (all real).
    - ``DenoiseInputs.pooled``: (rows, 0): PixArt has no pooled embedding (``pooled_dim`` is 0).
    - ``DenoiseInputs.timestep``: (rows,) the scheduler's timestep in [0, 1000), not divided.
    - output: (rows, out_channels, h * patch, w * patch); PixArt-Sigma predicts noise and a learned
      variance (out_channels = 2 x in_channels), and the pipeline keeps the first half.

    Args:
        model: a ``PixArtTransformer2DModel`` with ``use_additional_conditions`` False.
        max_text_tokens: the longest text the model was trained with (300 T5 tokens for PixArt-Sigma); a
            bucket with more text tokens is a start-up error.
        vae_scale_factor: pixels per latent pixel (8 for PixArt's SDXL VAE).

    Raises:
        ValueError: if the model uses additional (resolution, aspect-ratio) conditions.
    """

    family = "pixart"
    guidance_embeds = False
    timestep_max = 1000.0
    pooled_dim = 0

    def __init__(self, model: torch.nn.Module, max_text_tokens: int = PIXART_SIGMA_MAX_TEXT_TOKENS,
                 vae_scale_factor: int = 8):
        if model.use_additional_conditions:
            raise ValueError("PixArtAdapter serves PixArt-Sigma (use_additional_conditions=False); this "
                             "model wants per-row resolution and aspect-ratio conditions (PixArt-Alpha 1024)")
        cfg = model.config
        self.model = model
        self.patch = int(cfg.patch_size)
        self.rules = ShapeRules(pixels_per_token=vae_scale_factor * self.patch, grid_keyed=True,
                                native_text_tokens=None)
        self.in_channels = int(cfg.in_channels)
        self.out_channels = int(model.out_channels)
        self.seq_dim = int(cfg.caption_channels or cfg.cross_attention_dim)
        self.max_text_tokens = max_text_tokens

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Latent images (rows, in_channels, h * patch, w * patch), standard normal, CPU fp32."""
        h, w = grid[0] * self.patch, grid[1] * self.patch
        return torch.randn(rows, self.in_channels, h, w, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments).

        Raises:
            ValueError: if the key has no grid or more text tokens than the model was trained with.
        """
        if key.latent_hw is None:
            raise ValueError(f"bucket {key} has no latent_hw: PixArt buckets are keyed on the latent grid")
        if key.text_tokens > self.max_text_tokens:
            raise ValueError(f"bucket {key}: {key.text_tokens} text tokens exceed the {self.max_text_tokens} "
                             f"the model was trained with; use text_lengths up to {self.max_text_tokens}")
        (h, w), b, t, p = key.latent_hw, key.batch, key.text_tokens, self.patch
        return {
            # (B, C, H, W)
            "latents": torch.zeros(b, self.in_channels, h * p, w * p, device=device, dtype=dtype),
            "text": torch.zeros(b, t, self.seq_dim, device=device, dtype=dtype),  # (B, T, D_caption)
            "text_mask": torch.zeros(b, t, device=device, dtype=torch.bool),  # (B, T), True = real token
            "timestep": torch.zeros(b, device=device, dtype=torch.float32),  # (B,) 0-1000 scale, fp32
        }

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Copy ``inputs`` into the buffers: pad rows copy row 0, pad text tokens are zeros with mask False.

        Every element is written, so nothing of an earlier request survives.

        Raises:
            ValueError: if the inputs do not fit (more rows, another grid, more text tokens).
        """
        lat, text, mask = buffers["latents"], buffers["text"], buffers["text_mask"]
        b, t = text.shape[:2]
        n, s = inputs.rows, inputs.text_tokens
        if n > b or tuple(inputs.latents.shape[1:]) != tuple(lat.shape[1:]) or s > t:
            raise ValueError(
                f"inputs of {n} rows x latents {tuple(inputs.latents.shape[1:])} x {s} text tokens "
                f"do not fit bucket buffers of {b} rows x latents {tuple(lat.shape[1:])} x {t} text tokens"
            )
        _copy_rows(lat, inputs.latents)
        _copy_rows(text[:, :s], inputs.text)
        if inputs.text_mask is None:
            mask[:, :s].fill_(True)
        else:
            _copy_rows(mask[:, :s], inputs.text_mask)
        if s < t:
            text[:, s:].zero_()
            mask[:, s:].fill_(False)
        _copy_rows(buffers["timestep"], inputs.timestep)

    def _call(self, latents, text, mask, timestep) -> torch.Tensor:
        return self.model(
            latents, encoder_hidden_states=text, timestep=timestep, added_cond_kwargs=_ADDED_COND,
            encoder_attention_mask=mask, return_dict=False,
        )[0]

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded, masked forward over the static buffers: (B, C_out, H, W)."""
        return self._call(buffers["latents"], buffers["text"], buffers["text_mask"], buffers["timestep"])

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` of ``output`` (text padding leaves no trace in the image output)."""
        return output[: inputs.rows]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded reference forward: the real text with its mask (all True when ``text_mask`` is None)."""
        p = next(self.model.parameters())
        cast = lambda x: x.to(device=p.device, dtype=p.dtype)  # noqa: E731
        mask = inputs.text_mask
        if mask is None:
            mask = torch.ones(inputs.rows, inputs.text_tokens, dtype=torch.bool)
        return self._call(cast(inputs.latents), cast(inputs.text), mask.to(device=p.device, dtype=torch.bool),
                          inputs.timestep.to(device=p.device, dtype=torch.float32))
