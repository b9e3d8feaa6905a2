"""Model adapters: how one DiT family pads a forward up to a bucket, masks the padding, and unpads.

A family opts in by implementing :class:`DiTAdapter` (a ``typing.Protocol``); nothing matches class
names. The runner owns the static buffers; the adapter knows their layout:

1. :meth:`DiTAdapter.allocate` makes the static buffers of one bucket (fixed shapes and addresses, so a
   CUDA graph can be captured over them);
2. :meth:`DiTAdapter.fill` writes *every element* of them from a request's real inputs (pad rows are
   copies of real row 0, never zeros: an all-masked row would make softmax NaN; pad tokens are zero and
   masked out), so nothing of an earlier request survives;
3. :meth:`DiTAdapter.forward` runs the model reading only the buffers;
4. :meth:`DiTAdapter.unpad` slices the real rows and tokens back out.

:meth:`DiTAdapter.forward_eager` is the unpadded reference that every bucket is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .buckets import BucketKey, ShapeRules

__all__ = ["DenoiseInputs", "DiTAdapter", "FluxAdapter", "flux_image_ids"]


@dataclass
class DenoiseInputs:
    """The real (unpadded) inputs of one transformer forward.

    All rows share one token grid and one text length (a forward never mixes image shapes). The layout
    of ``latents`` and the scale of ``timestep`` are the family's own, exactly as its diffusers pipeline
    hands them to the transformer (each adapter's ``example_latents`` builds the layout):

    - FLUX: latents (rows, image_tokens, in_channels), packed 2x2 latent patches; timestep in [0, 1]
      (``FluxPipeline`` divides the scheduler's timestep by 1000; the transformer multiplies back).
    - SD3, PixArt: latents (rows, in_channels, h * patch, w * patch), the VAE latent image; timestep on
      the scheduler's 0-1000 scale, undivided (``StableDiffusion3Pipeline``: ``t.expand(batch)``;
      ``PixArtSigmaPipeline``: ``current_timestep.expand(batch)``).

    Attributes:
        latents: the latents in the family's layout (above).
        text: (rows, text_tokens, seq_dim) text-encoder sequence embeddings.
        pooled: (rows, pooled_dim) pooled text embeddings (pooled_dim 0 for families without them).
        timestep: (rows,) denoising time on the family's scale (above).
        grid: (h, w) token grid of the image; ``h * w == image_tokens``.
        guidance: (rows,) guidance scale for guidance-distilled models (FLUX.1-dev), else None.
        text_mask: (rows, text_tokens) bool, True for real tokens, for families trained with a text
            key-padding mask (PixArt); None means every token is real. Families trained on unmasked text
            refuse a mask.
    """

    latents: torch.Tensor
    text: torch.Tensor
    pooled: torch.Tensor
    timestep: torch.Tensor
    grid: tuple[int, int]
    guidance: torch.Tensor | None = None
    text_mask: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """Real rows of the forward."""
        return self.latents.shape[0]

    @property
    def image_tokens(self) -> int:
        """Real image tokens per row (dim 1 of packed latents; ``h * w`` of the grid for image latents)."""
        return self.latents.shape[1] if self.latents.ndim == 3 else self.grid[0] * self.grid[1]

    @property
    def text_tokens(self) -> int:
        """Text tokens per row."""
        return self.text.shape[1]

    def select(self, rows: slice | list[int]) -> "DenoiseInputs":
        """The same inputs restricted to some rows (for tests of batch invariance)."""
        g = None if self.guidance is None else self.guidance[rows]
        m = None if self.text_mask is None else self.text_mask[rows]
        return DenoiseInputs(self.latents[rows], self.text[rows], self.pooled[rows], self.timestep[rows], self.grid,
                             g, m)


class DiTAdapter(Protocol):
    """A DiT family's padding semantics (see the module docstring for the contract)."""

    family: str
    rules: ShapeRules
    model: torch.nn.Module
    timestep_max: float
    """Upper end of :attr:`DenoiseInputs.timestep` in this family (1.0 for FLUX, 1000.0 for SD3, PixArt)."""

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Standard-normal CPU fp32 latents of ``rows`` rows of token grid ``grid``, in the family's layout."""
        ...

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of bucket ``key``."""
        ...

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Write every element of ``buffers`` from ``inputs``. Raises ValueError if they do not fit."""
        ...

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded forward: (key.batch, key.image_tokens, out_channels) (image families: (B, C_out, H, W))."""
        ...

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Real part of ``output``, a view: (rows, image_tokens, out_channels) or (rows, C_out, H, W)."""
        ...

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded reference forward, in the same layout as :meth:`unpad`."""
        ...


def flux_image_ids(grid: tuple[int, int], device=None, dtype=torch.float32) -> torch.Tensor:
    """FLUX image position ids, as ``FluxPipeline._prepare_latent_image_ids``.

    Args:
        grid: (h, w) token grid.

    Returns:
        (h * w, 3): channel 0 zero, channel 1 the row, channel 2 the column.
    """
    h, w = grid
    ids = torch.zeros(h, w, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w, device=device, dtype=dtype)[None, :]
    return ids.reshape(h * w, 3)


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:n] = src``; every pad row ``dst[n:]`` = ``src[0]`` (a real row, never zeros)."""
    n = src.shape[0]
    dst[:n].copy_(src)
    if dst.shape[0] > n:
        dst[n:].copy_(src[:1].expand(dst.shape[0] - n, *src.shape[1:]))


class FluxAdapter:
    """FLUX architecture (diffusers ``FluxTransformer2DModel``): double-stream then single-stream blocks.

    Padding semantics:

    - batch: pad rows copy real row 0 and are dropped after the forward.
    - image tokens: the forward depends only on the token count (positions come in as ``img_ids``
      tensors), so a tier holds any grid with its token count (512x768 and 768x512 share a graph)
      unmasked. A masked bucket (``key.image_mask``) also holds grids with fewer tokens: pad tokens are
      zero latents with zero position ids, and a boolean key-padding mask ``(batch, 1, 1, text + image)``
      (passed through ``joint_attention_kwargs`` to every attention) keeps real tokens from attending to
      them; every other op of the model is per token or per row, so real tokens are unchanged.
    - text tokens: FLUX was trained on unmasked fixed-length T5 text (512 tokens for FLUX.1-dev); text
      keeps its native length and is never masked (DESIGN.md section 2: a mask changes the output).

    Args:
        model: a ``FluxTransformer2DModel``.
        native_text_tokens: the text length the model was trained with.
        vae_scale_factor: pixels per latent pixel (8 for FLUX's VAE).
    """

    family = "flux"
    timestep_max = 1.0

    def __init__(self, model: torch.nn.Module, native_text_tokens: int, vae_scale_factor: int = 8):
        self.model = model
        patch = int(getattr(model.config, "patch_size", 1))
        # FLUX packs 2x2 latent pixels into one token (FluxPipeline._pack_latents), then patch_size=1.
        self.rules = ShapeRules(
            pixels_per_token=vae_scale_factor * 2 * patch, grid_keyed=False, native_text_tokens=native_text_tokens
        )
        self.in_channels = int(model.config.in_channels)
        self.out_channels = int(model.config.out_channels or model.config.in_channels)
        self.seq_dim = int(model.config.joint_attention_dim)
        self.pooled_dim = int(model.config.pooled_projection_dim)
        self.guidance_embeds = bool(model.config.guidance_embeds)
        self._ids_cache: dict[tuple, torch.Tensor] = {}

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Packed latents (rows, h * w, in_channels), standard normal, CPU fp32."""
        return torch.randn(rows, grid[0] * grid[1], self.in_channels, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments)."""
        b, s, t = key.batch, key.image_tokens, key.text_tokens
        buf = {
            "latents": torch.zeros(b, s, self.in_channels, device=device, dtype=dtype),  # (B, S, C_in)
            "text": torch.zeros(b, t, self.seq_dim, device=device, dtype=dtype),  # (B, T, D_text)
            "pooled": torch.zeros(b, self.pooled_dim, device=device, dtype=dtype),  # (B, D_pooled)
            "timestep": torch.zeros(b, device=device, dtype=dtype),  # (B,)
            "img_ids": torch.zeros(s, 3, device=device, dtype=dtype),  # (S, 3)
            "txt_ids": torch.zeros(t, 3, device=device, dtype=dtype),  # (T, 3)
        }
        if key.image_mask:
            buf["attn_mask"] = torch.ones(b, 1, 1, t + s, device=device, dtype=torch.bool)  # (B, 1, 1, T + S)
        if self.guidance_embeds:
            buf["guidance"] = torch.zeros(b, device=device, dtype=dtype)  # (B,)
        return buf

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Copy ``inputs`` into the buffers, padding rows with row 0 and image tokens with masked zeros.

        Raises:
            ValueError: if the inputs do not fit the buffers (more rows, tokens or a different text length).
        """
        lat = buffers["latents"]
        b, s, _ = lat.shape
        t = buffers["text"].shape[1]
        n, k = inputs.rows, inputs.image_tokens
        masked = "attn_mask" in buffers
        if inputs.text_mask is not None:
            raise ValueError("FLUX was trained on unmasked fixed-length text: inputs.text_mask must be None")
        if n > b or k > s or (k < s and not masked) or inputs.text_tokens != t or inputs.grid[0] * inputs.grid[1] != k:
            raise ValueError(
                f"inputs of {n} rows x {k} image tokens x {inputs.text_tokens} text tokens (grid {inputs.grid}) "
                f"do not fit bucket buffers of {b} rows x {s} image tokens x {t} text tokens"
            )
        _copy_rows(lat[:, :k], inputs.latents)
        if k < s:
            lat[:, k:].zero_()
        _copy_rows(buffers["text"], inputs.text)
        _copy_rows(buffers["pooled"], inputs.pooled)
        _copy_rows(buffers["timestep"], inputs.timestep)
        if self.guidance_embeds:
            if inputs.guidance is None:
                raise ValueError("this FLUX model is guidance-distilled: inputs.guidance is required")
            _copy_rows(buffers["guidance"], inputs.guidance)
        ids = buffers["img_ids"]
        ids[:k].copy_(self._image_ids(inputs.grid, ids.device, ids.dtype))
        if k < s:
            ids[k:].zero_()
        buffers["txt_ids"].zero_()
        if masked:
            mask = buffers["attn_mask"]
            mask[..., : t + k].fill_(True)
            if k < s:
                mask[..., t + k :].fill_(False)

    def _image_ids(self, grid: tuple[int, int], device, dtype) -> torch.Tensor:
        """Cached :func:`flux_image_ids` (one small tensor per grid and device)."""
        key = (grid, str(device), dtype)
        ids = self._ids_cache.get(key)
        if ids is None:
            ids = self._ids_cache[key] = flux_image_ids(grid, device=device, dtype=dtype)
        return ids

    def _call(self, latents, text, pooled, timestep, img_ids, txt_ids, guidance, attention_kwargs):
        return self.model(
            hidden_states=latents,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            joint_attention_kwargs=attention_kwargs,
            return_dict=False,
        )[0]

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded forward over the static buffers: (B, S, C_out)."""
        return self._call(
            buffers["latents"], buffers["text"], buffers["pooled"], buffers["timestep"], buffers["img_ids"],
            buffers["txt_ids"], buffers.get("guidance"),
            {"attention_mask": buffers["attn_mask"]} if "attn_mask" in buffers else None,
        )

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` and image tokens ``[0, inputs.image_tokens)`` of ``output``."""
        return output[: inputs.rows, : inputs.image_tokens]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded, unmasked reference forward, exactly as ``FluxPipeline`` calls the transformer."""
        p = next(self.model.parameters())
        cast = lambda x: None if x is None else x.to(device=p.device, dtype=p.dtype)  # noqa: E731
        return self._call(
            cast(inputs.latents), cast(inputs.text), cast(inputs.pooled), cast(inputs.timestep),
            flux_image_ids(inputs.grid, device=p.device, dtype=p.dtype),
            torch.zeros(inputs.text_tokens, 3, device=p.device, dtype=p.dtype),
            cast(inputs.guidance) if self.guidance_embeds else None, None,
        )
