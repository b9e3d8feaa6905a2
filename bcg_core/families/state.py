"""The per-request step state and its rows: what a request carries between steps, and how the rows of several
requests become the inputs of one forward (docs/DESIGN.md section 10, "The step-level loop").

- :class:`TextRows`: one prompt's encoded text as the family's transformer takes it ((1, T, D_text) embeddings, the
  pooled embedding, the key-padding mask of masked families); :func:`pad_text` pads it to a text bucket's length
  with masked zero vectors.
- :class:`RequestState`: one request in flight, as :meth:`~bcg_core.families.base.Family.start` builds it and
  :meth:`~bcg_core.families.base.Family.advance` moves it on: its text rows, latents, own scheduler and step index.
- :func:`concat_rows`: the transformer rows of several requests, each at its own step, as one forward's
  :class:`~bcg_core.padding.DenoiseInputs` (masked text padded to the longest, rows without LoRA entries on slot 0
  at scale 0); raises ValueError where they cannot share one.

The family contract that produces and consumes them is :mod:`bcg_core.families.base`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg_core.padding import DenoiseInputs

__all__ = ["RequestState", "TextRows", "concat_rows", "pad_text"]


@dataclass
class TextRows:
    """One prompt's encoded text, as the family's transformer takes it (one row, broadcast to images).

    Attributes:
        text: (1, T, D_text) sequence embeddings; ``T`` is the real length for masked families (the
            pipeline pads rows of a forward to a common length), the native length otherwise.
        pooled: (1, D_pooled) pooled embedding, (1, 0) for families without one.
        mask: (1, T) bool, True for real tokens, for families trained with a text key-padding mask; None for
            families whose text is never masked.
    """

    text: torch.Tensor
    pooled: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Text tokens ``T``."""
        return self.text.shape[1]


@dataclass(eq=False)
class RequestState:
    """One request in flight at the step level: everything its denoising loop carries between steps.

    Attributes:
        validated: the validated request with its bucket lookup (:class:`~bcg_core.request.ValidatedRequest`).
        cond: the prompt's text rows.
        uncond: the negative prompt's text rows when the request runs classifier-free guidance with uncond
            rows, else None (the *CFG pairing*: every image has one cond row and, with CFG, one uncond row,
            always in the same forward).
        latents: (n, ...) latents in the family's layout (packed tokens for FLUX and Qwen-Image, latent
            images for SD3, PixArt and SANA) and in the dtype its diffusers pipeline keeps them.
        scheduler: this request's own diffusers scheduler, timesteps set; multistep history lives in it.
        timesteps: (steps,) the scheduler's timesteps.
        step_index: steps done so far.
        grid: (h, w) token grid of the generated image (PixArt: of its aspect-ratio bin).
        extras: per-request values a family keeps (guidance tensor, image shapes, generation size ...).
        cancel: set by the caller to drop the request at the next step boundary.
        step_ms: milliseconds of each finished step as seen by this request.
    """

    validated: Any
    cond: TextRows
    uncond: TextRows | None
    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    grid: tuple[int, int]
    step_index: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    cancel: threading.Event | None = None
    step_ms: list[float] = field(default_factory=list)

    @property
    def request(self):
        """The validated :class:`~bcg_core.request.GenerationRequest`."""
        return self.validated.request

    @property
    def n(self) -> int:
        """Images of the request."""
        return self.latents.shape[0]

    @property
    def cfg(self) -> bool:
        """True when uncond rows run beside the cond rows."""
        return self.uncond is not None

    @property
    def rows(self) -> int:
        """Transformer rows per step: ``n``, doubled with CFG."""
        return self.n * (2 if self.cfg else 1)

    @property
    def done(self) -> bool:
        """True when every timestep has run."""
        return self.step_index >= len(self.timesteps)

    @property
    def cancelled(self) -> bool:
        """True when the caller gave up on the request."""
        return self.cancel is not None and self.cancel.is_set()

    @property
    def timestep(self) -> torch.Tensor:
        """The scheduler timestep of the next step (0-d tensor)."""
        return self.timesteps[self.step_index]


def pad_text(rows: TextRows, tokens: int) -> TextRows:
    """``rows`` padded to ``tokens`` text tokens with zero vectors and mask False (masked families only).

    Raises:
        ValueError: ``rows`` has no mask (its family was trained on unmasked fixed-length text) and differs
            in length, or is longer than ``tokens``.
    """
    t = rows.tokens
    if t == tokens:
        return rows
    if rows.mask is None or t > tokens:
        raise ValueError(f"text of {t} tokens cannot be padded to {tokens}: "
                         f"{'it is longer' if t <= tokens or rows.mask is not None else 'it has no mask'}")
    extra = tokens - t
    text = torch.cat([rows.text, rows.text.new_zeros(1, extra, rows.text.shape[2])], dim=1)
    mask = torch.cat([rows.mask, rows.mask.new_zeros(1, extra)], dim=1)
    return TextRows(text, rows.pooled, mask)


def concat_rows(parts: list[DenoiseInputs]) -> DenoiseInputs:
    """The rows of several requests (each at its own step) as the inputs of one forward.

    Rows keep their order (request by request). All parts must share one grid and reference layout
    (:attr:`~bcg_core.padding.DenoiseInputs.references`); masked text is padded to the longest part with masked zeros
    (unmasked text must already share one length). Where some parts carry LoRA entries, the others' rows get slot 0
    with scale 0 (no adapter); where none do, the forward has none.

    Raises:
        ValueError: parts of different grids or reference layouts, or unmasked text of different lengths.
    """
    if len(parts) == 1:
        return parts[0]
    grids = {p.grid for p in parts}
    if len(grids) > 1:
        raise ValueError(f"rows of different token grids {sorted(grids)} cannot share one forward")
    layouts = {p.references for p in parts}
    if len(layouts) > 1:
        raise ValueError(f"rows of different reference images (token grids {sorted(layouts)}) cannot share one "
                         f"forward: their image streams have different position ids")
    masked = [p.text_mask is not None for p in parts]
    if any(masked) and not all(masked):
        raise ValueError("masked and unmasked text rows cannot share one forward")
    tokens = max(p.text_tokens for p in parts)
    texts, masks = [], []
    for p in parts:
        if p.text_tokens != tokens:
            if p.text_mask is None:
                raise ValueError(f"unmasked text of {p.text_tokens} and {tokens} tokens cannot share one forward")
            extra = tokens - p.text_tokens
            texts.append(torch.cat([p.text, p.text.new_zeros(p.rows, extra, p.text.shape[2])], dim=1))
            masks.append(torch.cat([p.text_mask, p.text_mask.new_zeros(p.rows, extra)], dim=1))
        else:
            texts.append(p.text)
            masks.append(p.text_mask)
    guidance = [p.guidance for p in parts]
    lora = next((p for p in parts if p.lora_slots is not None), None)
    if lora is not None:  # rows without adapters get slot 0 with scale 0 beside those with some
        k, dev = lora.lora_slots.shape[1], lora.lora_slots.device
        slots = [p.lora_slots if p.lora_slots is not None else torch.zeros(p.rows, k, dtype=torch.int64, device=dev)
                 for p in parts]
        scales = [p.lora_scales if p.lora_scales is not None else torch.zeros(p.rows, k, device=dev)
                  for p in parts]
    return DenoiseInputs(
        latents=torch.cat([p.latents for p in parts]),
        text=torch.cat(texts),
        pooled=torch.cat([p.pooled for p in parts]),
        timestep=torch.cat([p.timestep for p in parts]),
        grid=parts[0].grid,
        guidance=None if guidance[0] is None else torch.cat(guidance),
        text_mask=torch.cat(masks) if masked[0] else None,
        lora_slots=None if lora is None else torch.cat(slots),
        lora_scales=None if lora is None else torch.cat(scales),
        references=parts[0].references,
    )
