"""Correctness gates: every bucket against an unpadded eager run, at its boundary shapes (docs/DESIGN.md section 4).

:func:`boundary_cases` lists, per bucket, the request shapes at the bucket's size, one below it, and the
smallest request that maps to it (per dimension; "one below" a bucket's size may fall into the next
smaller bucket, and is then checked there). :func:`verify_runner` runs each case through a runner
(padded: static buffers, graph replay on CUDA) and through the adapter's unpadded eager forward with the
same inputs, and reports the relative error per bucket. ``bcg verify`` prints the report.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .buckets import BucketKey, BucketTable, ShapeQuery
from .config import LimitsConfig
from .padding import DenoiseInputs, DiTAdapter
from .runner import BucketRunner

__all__ = ["BoundaryCase", "BucketVerdict", "boundary_cases", "random_inputs", "verify_runner"]


@dataclass(frozen=True)
class BoundaryCase:
    """One request shape to check: ``rows`` transformer rows of an image with token grid ``grid``."""

    key: BucketKey
    rows: int
    grid: tuple[int, int]
    text_tokens: int


@dataclass
class BucketVerdict:
    """Result of :func:`verify_runner` for one bucket: worst relative error over its cases."""

    key: BucketKey
    cases: int = 0
    max_rel_err: float = 0.0
    nan: bool = False
    rtol: float = 1e-5
    shapes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no output had a NaN and every relative error is below ``rtol``."""
        return self.cases > 0 and not self.nan and self.max_rel_err <= self.rtol


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
            image = [key.latent_hw]
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
        prev_s = max([s for s in table.texts_for(key.image_tokens, key.latent_hw) if s < key.text_tokens], default=0)
        texts = sorted({key.text_tokens} if table.rules.native_text_tokens else
                       {key.text_tokens, key.text_tokens - 1, prev_s + 1} - {0})
        for r, g, s in itertools.product(rows, image, texts):
            lk = table.lookup(ShapeQuery(r, g[0] * g[1], s, g if table.rules.grid_keyed else None))
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

    guidance = torch.full((n,), 3.5, device=device, dtype=dtype) if getattr(adapter, "guidance_embeds", False) else None
    return DenoiseInputs(
        latents=adapter.example_latents(n, case.grid, g).to(device=device, dtype=dtype),
        text=rnd(n, case.text_tokens, adapter.seq_dim), pooled=rnd(n, adapter.pooled_dim),
        timestep=(torch.rand(n, generator=g) * adapter.timestep_max).to(device=device, dtype=dtype),
        grid=case.grid, guidance=guidance,
    )


def verify_runner(adapter: DiTAdapter, runner: BucketRunner, cases: list[BoundaryCase], device, dtype,
                  rtol: float) -> list[BucketVerdict]:
    """Run every case padded (through ``runner``) and unpadded (``adapter.forward_eager``); compare.

    Relative error is ``max|padded - eager| / max|eager|`` over the real rows and tokens.

    Returns:
        One verdict per bucket that has cases, in bucket order.
    """
    verdicts: dict[BucketKey, BucketVerdict] = {}
    for i, case in enumerate(cases):
        x = random_inputs(adapter, case, device, dtype, seed=i)
        with torch.inference_mode():
            ref = adapter.forward_eager(x).float()
        out = runner.run(case.key, x).float()
        v = verdicts.setdefault(case.key, BucketVerdict(case.key, rtol=rtol))
        v.cases += 1
        v.nan |= bool(torch.isnan(out).any())
        err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        v.max_rel_err = max(v.max_rel_err, err)
        v.shapes.append(f"{case.rows}x{case.grid[0]}x{case.grid[1]}+{case.text_tokens}")
    return [verdicts[k] for k in sorted(verdicts)]
