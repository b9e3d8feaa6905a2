"""The padding contract: how one DiT family pads a forward up to a bucket, masks the padding, and unpads.

Each family module of :mod:`bcg_core.families` holds its adapter, implementing :class:`DiTAdapter` (a
``typing.Protocol``); nothing matches class names. The runner owns the static buffers; the adapter knows their layout:

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

__all__ = ["DenoiseInputs", "DiTAdapter", "copy_rows"]


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


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:n] = src``; every pad row ``dst[n:]`` = ``src[0]`` (a real row, never zeros)."""
    n = src.shape[0]
    dst[:n].copy_(src)
    if dst.shape[0] > n:
        dst[n:].copy_(src[:1].expand(dst.shape[0] - n, *src.shape[1:]))

