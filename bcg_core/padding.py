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

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from bcg_core.keys import BucketKey
from bcg_core.table import ShapeRules

__all__ = ["DenoiseInputs", "DiTAdapter", "GridMaskedTextAdapter", "copy_rows", "fill_masked_text"]


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
    - Wan (video): latents (rows, in_channels, frames, h * patch, w * patch), the VAE latent video; ``grid``
      ``(frames, h, w)``.

    Attributes:
        latents: the latents in the family's layout (above).
        text: (rows, text_tokens, seq_dim) text-encoder sequence embeddings.
        pooled: (rows, pooled_dim) pooled text embeddings (pooled_dim 0 for families without them).
        timestep: (rows,) denoising time on the family's scale (above).
        grid: (h, w) token grid of the image, ``h * w == image_tokens``; ``(frames, h, w)`` of a video (its product).
        guidance: (rows,) guidance scale for guidance-distilled models (FLUX.1-dev), else None.
        text_mask: (rows, text_tokens) bool, True for real tokens, for families trained with a text
            key-padding mask (PixArt); None means every token is real. Families trained on unmasked text
            refuse a mask.
        lora_slots, lora_scales: (rows, K) int64 and float32: each row's LoRA slots and scales
            (:mod:`bcg_core.lora.layers`; slot 0 is no adapter), or None (no adapter on any row).
        references: token grids ``(h, w)`` of reference images whose tokens follow the grid's in every row's image
            stream (FLUX.2 reference edits: ``latents`` (rows, h * w + sum of theirs, C), the reference tokens
            conditioning, not denoised); ``()`` for none. Rows of one forward share it (and so their position ids).
    """

    latents: torch.Tensor
    text: torch.Tensor
    pooled: torch.Tensor
    timestep: torch.Tensor
    grid: tuple[int, int]
    guidance: torch.Tensor | None = None
    text_mask: torch.Tensor | None = None
    lora_slots: torch.Tensor | None = None
    lora_scales: torch.Tensor | None = None
    references: tuple[tuple[int, int], ...] = ()

    @property
    def rows(self) -> int:
        """Real rows of the forward."""
        return self.latents.shape[0]

    @property
    def image_tokens(self) -> int:
        """Real image tokens per row (dim 1 of packed latents, references included; the product of the grid for image
        and video latents: ``h * w``, ``frames * h * w``)."""
        return self.latents.shape[1] if self.latents.ndim == 3 else math.prod(self.grid)

    @property
    def text_tokens(self) -> int:
        """Text tokens per row."""
        return self.text.shape[1]

    def select(self, rows: slice | list[int]) -> DenoiseInputs:
        """The same inputs restricted to some rows (a split step's chunk; tests of batch invariance)."""
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return DenoiseInputs(self.latents[rows], self.text[rows], self.pooled[rows], self.timestep[rows], self.grid,
                             pick(self.guidance), pick(self.text_mask), pick(self.lora_slots), pick(self.lora_scales),
                             self.references)


class DiTAdapter(Protocol):
    """A DiT family's padding semantics (see the module docstring for the contract)."""

    family: str
    rules: ShapeRules
    model: torch.nn.Module
    timestep_max: float
    """Upper end of :attr:`DenoiseInputs.timestep` in this family (1.0 for FLUX, 1000.0 for SD3, PixArt)."""
    guidance_embeds: bool
    """Its transformer takes a guidance value per row (:attr:`DenoiseInputs.guidance`: FLUX.1-dev), else False."""

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



def fill_masked_text(text: torch.Tensor, mask: torch.Tensor, inputs: DenoiseInputs) -> None:
    """Write ``inputs``' text into a bucket's text buffers, for families trained with a text key-padding mask.

    Real tokens ``[0, s)`` are copied (pad rows copy row 0, its mask too, so no row is all-masked); pad tokens
    ``[s, T)`` are zero vectors with mask False, so the masked attention gives them weight exp(-10000) = 0.

    Args:
        text: (B, T, D) static text buffer; mask: (B, T) bool static buffer, True = real token.
        inputs: the forward's real inputs, ``inputs.text`` (rows, s, D) with ``s <= T`` and ``text_mask``
            (rows, s) or None (every token real).
    """
    s, t = inputs.text_tokens, text.shape[1]
    copy_rows(text[:, :s], inputs.text)
    if inputs.text_mask is None:
        mask[:, :s].fill_(True)
    else:
        copy_rows(mask[:, :s], inputs.text_mask)
    if s < t:
        text[:, s:].zero_()
        mask[:, s:].fill_(False)


class GridMaskedTextAdapter:
    """Padding shared by the cross-attention DiTs keyed on the latent grid with masked text (PixArt-Sigma, SANA).

    Their forward reads the latent image's (h, w) as Python ints, so a bucket holds one exact grid
    (``grid_keyed``; image tokens are never padded); their text is only keys and values of a cross-attention
    with a key-padding mask, so text lengths round up to a text bucket (``native_text_tokens=None``) with
    masked zero pads (:func:`fill_masked_text`). Pad rows copy real row 0 and are dropped after the forward.
    A subclass sets the model's attributes in ``__init__`` and implements ``_call(latents, text, mask,
    timestep)``, the transformer call as its diffusers pipeline makes it.

    Layout: ``DenoiseInputs.latents`` (rows, in_channels, h * patch, w * patch); ``text`` (rows, T, seq_dim)
    with ``text_mask`` (rows, T) bool or None (all real); ``pooled`` (rows, 0); ``timestep`` (rows,) on the
    0-1000 scale, held in fp32 whatever the model dtype (bf16 would round 999 to 1000). Output:
    (rows, out_channels, h * patch, w * patch).

    Attributes (set by the subclass): ``model``, ``patch``, ``in_channels``, ``out_channels``, ``seq_dim``,
    ``max_text_tokens`` (the longest text the pipeline feeds), ``rules``, ``family`` (for messages).
    """

    guidance_embeds = False
    timestep_max = 1000.0
    pooled_dim = 0
    family = "grid"
    model: torch.nn.Module
    patch: int
    in_channels: int
    out_channels: int
    seq_dim: int
    max_text_tokens: int

    def _call(self, latents, text, mask, timestep) -> torch.Tensor:
        raise NotImplementedError

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Latent images (rows, in_channels, h * patch, w * patch), standard normal, CPU fp32."""
        return torch.randn(rows, self.in_channels, grid[0] * self.patch, grid[1] * self.patch, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments).

        Raises:
            ValueError: if the key has no grid or more text tokens than the pipeline ever feeds.
        """
        if key.latent_hw is None:
            raise ValueError(f"bucket {key} has no latent_hw: {self.family} buckets are keyed on the latent grid")
        if key.text_tokens > self.max_text_tokens:
            raise ValueError(f"bucket {key}: {key.text_tokens} text tokens exceed the {self.max_text_tokens} "
                             f"the {self.family} pipeline feeds; use text_lengths up to {self.max_text_tokens}")
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
        lat, text = buffers["latents"], buffers["text"]
        b, t = text.shape[:2]
        n, s = inputs.rows, inputs.text_tokens
        if n > b or tuple(inputs.latents.shape[1:]) != tuple(lat.shape[1:]) or s > t:
            raise ValueError(
                f"inputs of {n} rows x latents {tuple(inputs.latents.shape[1:])} x {s} text tokens "
                f"do not fit bucket buffers of {b} rows x latents {tuple(lat.shape[1:])} x {t} text tokens"
            )
        copy_rows(lat, inputs.latents)
        fill_masked_text(text, buffers["text_mask"], inputs)
        copy_rows(buffers["timestep"], inputs.timestep)

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded, masked forward over the static buffers: (B, C_out, H, W)."""
        return self._call(buffers["latents"], buffers["text"], buffers["text_mask"], buffers["timestep"])

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` of ``output`` (text padding leaves no trace in the image output)."""
        return output[: inputs.rows]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded reference forward: the real text with its mask (all True when ``text_mask`` is None), as the
        pipelines always pass one (on CUDA a mask can select another attention kernel)."""
        p = next(self.model.parameters())
        mask = inputs.text_mask
        if mask is None:
            mask = torch.ones(inputs.rows, inputs.text_tokens, dtype=torch.bool)
        return self._call(inputs.latents.to(device=p.device, dtype=p.dtype),
                          inputs.text.to(device=p.device, dtype=p.dtype), mask.to(device=p.device, dtype=torch.bool),
                          inputs.timestep.to(device=p.device, dtype=torch.float32))
