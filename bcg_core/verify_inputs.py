"""The inputs of the correctness gates (:mod:`bcg_core.verify`): which request shapes each bucket is checked at,
and seeded random transformer inputs of a shape.

- :func:`boundary_cases`: per bucket, the request shapes at the bucket's size, one below it, and the smallest
  request that maps to it (per dimension; "one below" a bucket's size may fall into the next smaller bucket, and is
  then checked there), each a :class:`BoundaryCase` carrying the key the table maps it to (docs/DESIGN.md
  section 4). ``bcg verify``, the family tests and the GPU tests check them.
- :func:`random_inputs`: seeded inputs of one case, drawn on the CPU in fp32 and cast, so that the padded and the
  unpadded run get the same values on any device; :func:`bucket_inputs`: inputs that fill a bucket (its rows, text
  tokens and a near-square token grid, :func:`square_grid`, which ``bcg profile`` uses too), on which the compile
  check and the eager forward's rounding error run; :func:`text_pad_of`: how many text tokens the compile check
  leaves to a bucket's text padding.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from bcg_core.config import LimitsConfig
from bcg_core.keys import BucketKey, ShapeQuery
from bcg_core.padding import DenoiseInputs, DiTAdapter
from bcg_core.table import BucketTable

__all__ = ["BoundaryCase", "boundary_cases", "bucket_inputs", "random_inputs", "square_grid", "text_pad_of"]


@dataclass(frozen=True)
class BoundaryCase:
    """One request shape to check: ``rows`` transformer rows of an image with token grid ``grid`` (a video's:
    ``(frames, h, w)``)."""

    key: BucketKey
    rows: int
    grid: tuple[int, ...]
    text_tokens: int


def _grids(table: BucketTable, limits: LimitsConfig) -> list[tuple[int, int]]:
    step = table.rules.pixels_per_token
    sides = range(-(-limits.min_side_px // step), limits.max_side_px // step + 1)
    return [(h, w) for h in sides for w in sides]


def boundary_cases(table: BucketTable, limits: LimitsConfig) -> list[BoundaryCase]:
    """Shapes at each bucket's size, one below it, and the smallest valid request that maps to it.

    Image shapes are drawn from the grids of request sizes the limits allow (multiples of the model's
    pixels per token between ``min_side_px`` and ``max_side_px``), so every case is a real request size.
    Each case carries the key the table maps it to.
    """
    grids = _grids(table, limits)
    out: dict[tuple, BoundaryCase] = {}
    for key in table.keys:
        prev_b = max([b for b in table.batch_sizes if b < key.batch], default=0)
        rows = sorted({key.batch, key.batch - 1, prev_b + 1} - {0})
        if table.rules.grid_keyed:
            image = [key.grid]  # (h, w), or a video's (frames, h, w)
        else:
            prev_t = max([t for t in table.image_tiers if t < key.image_tokens], default=0)
            mapped = [g for g in grids if prev_t < g[0] * g[1] <= key.image_tokens]
            if not mapped:
                continue
            exact = [g for g in mapped if g[0] * g[1] == key.image_tokens][:1]
            under = [g for g in mapped if g[0] * g[1] < key.image_tokens]
            below = [max(under, key=lambda g: g[0] * g[1])] if under else []
            smallest = [min(mapped, key=lambda g: g[0] * g[1])]
            image = sorted({*exact, *below, *smallest})
        prev_s = max([s for s in table.texts_for(key.image_tokens, key.latent_hw, key.frames) if s < key.text_tokens],
                     default=0)
        texts = sorted({key.text_tokens} if table.rules.native_text_tokens else
                       {key.text_tokens, key.text_tokens - 1, prev_s + 1} - {0})
        for r, g, s in itertools.product(rows, image, texts):
            frames = g[0] if len(g) == 3 else None
            lk = table.lookup(ShapeQuery(r, math.prod(g), s, g[-2:] if table.rules.grid_keyed else None, frames))
            if lk.key is not None:
                out[(r, g, s)] = BoundaryCase(lk.key, r, g, s)
    return sorted(out.values(), key=lambda c: (c.key, c.rows, c.grid, c.text_tokens))


def random_inputs(adapter: DiTAdapter, case: BoundaryCase, device, dtype, seed: int = 0) -> DenoiseInputs:
    """Seeded random inputs of the case's shape (drawn on the CPU in fp32, then cast), for ``adapter``.

    Latents come in the family's layout (:meth:`DiTAdapter.example_latents`), timesteps uniform on the
    family's scale ``[0, adapter.timestep_max)``; every text token is real (``text_mask`` None).
    """
    g = torch.Generator().manual_seed(seed)
    n = case.rows

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    guidance = torch.full((n,), 3.5, device=device, dtype=dtype) if adapter.guidance_embeds else None
    return DenoiseInputs(
        latents=adapter.example_latents(n, case.grid, g).to(device=device, dtype=dtype),
        text=rnd(n, case.text_tokens, adapter.seq_dim), pooled=rnd(n, adapter.pooled_dim),
        timestep=(torch.rand(n, generator=g) * adapter.timestep_max).to(device=device, dtype=dtype),
        grid=case.grid, guidance=guidance,
    )


def square_grid(tokens: int) -> tuple[int, int]:
    """A token grid ``(h, w)`` with ``h * w == tokens``, as square as possible (``h <= w``; FLUX-style buckets key on
    the token count only, so any grid of that count fills them)."""
    h = max(d for d in range(1, int(tokens ** 0.5) + 1) if tokens % d == 0)
    return h, tokens // h


def bucket_inputs(adapter: DiTAdapter, key: BucketKey, device, dtype, seed: int = 0,
                  text_pad: int = 0) -> DenoiseInputs:
    """Seeded random inputs (:func:`random_inputs`) that fill bucket ``key``: all its rows and text tokens (but the
    last ``text_pad``, left to the bucket's text padding), and its image tokens as a near-square grid
    (``key.grid`` for grid-keyed families: a video's ``(frames, h, w)``); a masked bucket gets one grid column fewer,
    so that its padding mask is exercised."""
    if key.grid is not None:
        grid = key.grid
    else:
        h, w = square_grid(key.image_tokens)
        grid = (h, w - 1) if key.image_mask and w > 1 else (h, w)
    case = BoundaryCase(key, key.batch, grid, key.text_tokens - text_pad)
    return random_inputs(adapter, case, device, dtype, seed)


def text_pad_of(adapter: DiTAdapter, key: BucketKey) -> int:
    """Text tokens the compile check leaves to bucket ``key``'s text padding: a quarter of them (at least one)
    where the family buckets its text lengths with masked pads (``rules.native_text_tokens`` None: PixArt-Sigma,
    SANA, Qwen-Image), else 0 (a fixed text length, never padded)."""
    if adapter.rules.native_text_tokens is not None or key.text_tokens < 2:
        return 0
    return max(1, key.text_tokens // 4)
