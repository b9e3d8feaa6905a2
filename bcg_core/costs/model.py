"""The cost model: measured forward times, and the cheapest way to run a step's rows.

One denoising step of a bucket shape has ``R`` real rows (images, and their uncond rows with classifier-free
guidance), from any requests at any steps. They can run as:

- **fill** / **pad**: one bucket forward of ``b >= R`` rows (a graph replay on CUDA; padded rows when
  ``b > R``);
- **split**: several bucket forwards whose rows add up to ``R`` (9 rows as 8 + 1 instead of padding to 16);
- **eager**: the unpadded eager forward of ``R`` rows (or a chunk of them), where no graph pays.

:meth:`CostModel.choose` chooses the combination of chunks with the least expected milliseconds for the ``R``
rows (so the least per real row), by dynamic programming over the row count: ``best[r] = min over chunks c
(best[r - c] + chunk_ms(c))``, where ``chunk_ms(c)`` is the cheapest of the bucket forwards that hold ``c``
rows (a larger bucket only when more than :data:`PAD_MARGIN` faster than the smallest) and the eager
forward of ``c`` rows. No chunk is larger than the shape's largest batch bucket, so an
eager chunk never needs more activation memory than the largest captured forward (measured at capture); a
miss runs in one eager forward while its activations fit the memory the replica can spare (:mod:`.miss_memory`;
:class:`~.decider.StepDecider` asks both).
Every row of a step is computed before any request advances, so a split never separates an image's cond
and uncond rows across steps.

A cached step (:mod:`bcg_core.step_cache`) runs two halves: the head (first block) over every row and the tail
(remaining blocks) over the rows that compute. Their forwards are priced at the whole forward's time times each
half's share, measured against the whole-forward graph when the halves are captured (:attr:`CostModel.piece_shares`);
the head's share is what a reused row costs.

Where the times come from (:attr:`CostModel.source`):

- ``measured`` (:func:`~.measure.measure_costs`, at prepare): each bucket's forward through its runner (on CUDA a graph
  replay, timed with CUDA events; elsewhere the static padded eager forward, timed with the host clock), and
  each shape's unpadded eager forward at 1, 2, 4, ... rows and at every batch size of the table; eager
  milliseconds between measured row counts are interpolated linearly, beyond them extrapolated from the
  last two points;
- ``token-count`` (:meth:`CostModel.token_model`): a stand-in when nothing is measured (``scheduler.measure_costs:
  false``): milliseconds proportional to the tokens computed (padded for a bucket, real for eager) plus a
  fixed launch cost per forward, ``launch_ms + tokens * ms_per_token``; graph replays pay ``launch_ms / 10``
  (a replay is one launch instead of hundreds; docs/DESIGN.md section 3).

Pure Python and torch, no Ray; the scripted-cost tests build :class:`CostModel` directly.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bcg_core.keys import BucketKey

__all__ = ["DECISIONS", "PAD_MARGIN", "PHASES", "Chunk", "CostModel", "Decision", "StepForwards"]

class Decision(str, enum.Enum):
    """How a step's rows ran (:attr:`StepForwards.decision`)."""

    FILL = "fill"
    """One bucket forward, every row real."""
    PAD = "pad"
    """One bucket forward with padded rows."""
    SPLIT = "split"
    """Several bucket forwards."""
    EAGER = "eager"
    """Any unpadded eager forward (alone or in a split)."""


DECISIONS = tuple(d.value for d in Decision)
"""The :class:`Decision` values, in order (counter keys of ``/v1/buckets``)."""


PHASES = ("head", "tail")
"""The halves of a cached step (:mod:`bcg_core.step_cache.step`): the first block over every row, the remaining
blocks over the rows that compute; :meth:`CostModel.choose` prices their forwards (``phase``)."""

PAD_MARGIN = 0.05
"""A larger bucket than the smallest that holds a chunk is chosen only when it is measured more than 5%
faster: replay times of neighbouring launch-bound buckets are equal within timing noise, and padding for
noise would only add padded-token waste."""


@dataclass(frozen=True)
class Chunk:
    """One forward of a step: ``rows`` real rows on bucket ``key`` (None: unpadded eager), ``ms`` expected.

    ``home``: for an eager chunk, the smallest bucket of the shape that holds its rows (the largest when none
    does): where the forward is counted in the bucket metrics (``forwards_by_mode.eager``).
    """

    key: BucketKey | None
    rows: int
    ms: float
    home: BucketKey | None = None

    @property
    def kind(self) -> str:
        """``"bucket"`` or ``"eager"``."""
        return "eager" if self.key is None else "bucket"


@dataclass(frozen=True)
class StepForwards:
    """The forwards one step of ``rows`` rows runs as, in row order, and their expected milliseconds.

    ``home``: the shape's largest bucket (eager chunks without their own ``home`` are counted under it in the
    bucket metrics); None for a miss (counted as a miss forward).
    """

    chunks: tuple[Chunk, ...]
    home: BucketKey | None = None

    @property
    def rows(self) -> int:
        """Real rows of the step."""
        return sum(c.rows for c in self.chunks)

    @property
    def ms(self) -> float:
        """Expected milliseconds of the whole step."""
        return sum(c.ms for c in self.chunks)

    @property
    def ms_per_row(self) -> float:
        """Expected milliseconds per real row (what the plan minimises, at a fixed row count)."""
        return self.ms / self.rows if self.rows else 0.0

    @property
    def padded_rows(self) -> int:
        """Rows computed that hold no request (bucket rows beyond the real ones)."""
        return sum(c.key.batch - c.rows for c in self.chunks if c.key is not None)

    @property
    def decision(self) -> Decision:
        """How the rows run (``eager`` wins over ``split``: any eager chunk)."""
        if any(c.key is None for c in self.chunks):
            return Decision.EAGER
        if len(self.chunks) > 1:
            return Decision.SPLIT
        return Decision.PAD if self.padded_rows else Decision.FILL

    @property
    def counted_key(self) -> BucketKey | None:
        """The bucket the step is counted under: its first bucket forward's; all eager, the smallest bucket that
        holds the first chunk (its ``home``, else the shape's ``home``); None for a miss."""
        return next((c.key for c in self.chunks if c.key is not None), None) or self.chunks[0].home or self.home

    def computed_tokens(self, tokens_per_row: int) -> int:
        """Tokens the step computes: a bucket forward's padded tokens, an eager chunk's real rows x
        ``tokens_per_row``."""
        return sum(c.key.tokens if c.key is not None else c.rows * tokens_per_row for c in self.chunks)


@dataclass
class CostModel:
    """Expected milliseconds of bucket forwards and unpadded eager forwards, per bucket shape.

    Args:
        bucket_ms: milliseconds of one forward of each bucket (replay on CUDA).
        eager_ms: per bucket shape (:attr:`BucketKey.shape`), unpadded eager milliseconds by row count.
        source: ``"measured"``, ``"token-count"`` or ``"scripted"`` (shown in ``/v1/buckets``).
        eager: whether eager chunks may be chosen at all.
        lora_ms: with LoRA adapters (``lora.dir``), milliseconds of each bucket's forward with adapter rows (its
            LoRA graph, which adds every row's deltas), where measured; ``bucket_ms`` is then the plain graph's.
        eager_bytes_per_row_token: the most activation bytes per row x real token of the unpadded eager forwards
            :func:`~.measure.measure_costs` timed (CUDA only; None: not measured), for
            :class:`~.miss_memory.MissMemory`.
        piece_shares: with the step cache, each bucket's head and tail halves' milliseconds as shares of its
            whole forward's, ``(head, tail)``, measured together with CUDA events when the halves are captured
            (:meth:`~bcg_core.runners.piecewise.PiecewiseReplay.time_pieces`). The head over a row is what a
            reused row costs (its first block, the residual added, the output layers); :meth:`choose` prices a
            half's forwards with them (``phase``).

    Raises:
        ValueError: a negative time, or an eager measurement at 0 rows or fewer.
    """

    bucket_ms: dict[BucketKey, float]
    eager_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    source: str = "scripted"
    eager: bool = True
    lora_ms: dict[BucketKey, float] = field(default_factory=dict)
    eager_bytes_per_row_token: float | None = None
    piece_shares: dict[BucketKey, tuple[float, float]] = field(default_factory=dict)
    _chosen: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Plans already chosen, by (shape, rows, buckets): the times do not change, and every step asks."""

    def __post_init__(self):
        if any(v < 0 for v in (*self.bucket_ms.values(), *self.lora_ms.values())):
            raise ValueError("bucket forward times must be >= 0 ms")
        if any(not 0 <= v <= 2 for pair in self.piece_shares.values() for v in pair):
            raise ValueError(f"step-cache half shares must be in 0..2 of the whole forward: {self.piece_shares}")
        for shape, points in self.eager_ms.items():
            if any(r < 1 for r in points) or any(v < 0 for v in points.values()):
                raise ValueError(f"eager times of {shape} need row counts >= 1 and times >= 0 ms: {points}")

    @classmethod
    def token_model(cls, keys: Iterable[BucketKey], graphs: bool, launch_ms: float = 5.0,
                    ms_per_token: float = 1e-3) -> CostModel:
        """The token-count stand-in (module docstring): ``launch_ms + tokens * ms_per_token`` per forward.

        Args:
            keys: the table's buckets.
            graphs: bucket forwards are graph replays (launch cost ``launch_ms / 10``).
            launch_ms: launch overhead of one eager forward, milliseconds.
            ms_per_token: milliseconds per token computed (:attr:`BucketKey.tokens`: rows x tokens per row).
        """
        keys = list(keys)
        launch = launch_ms / 10 if graphs else launch_ms
        bucket = {k: launch + k.tokens * ms_per_token for k in keys}
        eager: dict[str, dict[int, float]] = {}
        for k in keys:  # the bucket's own tokens: an upper bound of a request of the shape
            eager.setdefault(k.shape, {})[k.batch] = launch_ms + k.tokens * ms_per_token
        return cls(bucket, eager, source="token-count")

    def eager_cost(self, shape: str, rows: int, share: float = 1.0) -> float | None:
        """Expected milliseconds of an unpadded eager forward of ``rows`` rows of ``shape`` (None: unknown).

        Piecewise linear through the measured points; below the first point, scaled down linearly from the
        origin's intercept (the line through the first two points, never below 0); above the last,
        extrapolated from the last two.

        ``share``: the rows' real tokens over the shape's tokens per row (below 1 for a request padded into a
        masked tier, whose eager forward was measured at the tier's size, :func:`~.measure.measure_costs`). The part of
        the time that grows with the rows is scaled by it; the fixed part, :meth:`fixed_ms`, is not. Linear in
        the tokens, so for attention (quadratic) an upper bound: the estimate never favours eager over a bucket
        more than the tokens do.
        """
        e = self._eager_at(shape, rows)
        if e is None or share >= 1.0:
            return e
        fixed = min(self.fixed_ms(shape), e)
        return fixed + (e - fixed) * max(0.0, share)

    def fixed_ms(self, shape: str) -> float:
        """The part of ``shape``'s eager forward that does not grow with its rows, in milliseconds: the
        intercept at 0 rows of the line through its first two measured points (launches, weights read once),
        at least 0; 0 with fewer than two points."""
        points = self.eager_ms.get(shape) or {}
        if len(points) < 2:
            return 0.0
        a, b = sorted(points)[:2]
        return max(0.0, points[a] - (points[b] - points[a]) / (b - a) * a)

    def _eager_at(self, shape: str, rows: int) -> float | None:
        points = self.eager_ms.get(shape)
        if not points or rows < 1:
            return None
        xs = sorted(points)
        if rows in points:
            return points[rows]
        if len(xs) == 1:
            return points[xs[0]] * rows / xs[0]
        if rows < xs[0]:
            a, b = xs[0], xs[1]
        elif rows > xs[-1]:
            a, b = xs[-2], xs[-1]
        else:
            b = next(x for x in xs if x > rows)
            a = max(x for x in xs if x < rows)
        slope = (points[b] - points[a]) / (b - a)
        return max(0.0, points[a] + slope * (rows - a))

    def phase_share(self, key: BucketKey, phase: str | None, shape: str | None = None) -> float:
        """What one forward of ``phase`` (``"head"`` or ``"tail"`` of the step cache; None: the whole forward) on
        bucket ``key`` costs, as a share of its whole forward: :attr:`piece_shares` where measured, else the mean of
        the measured buckets of its shape (of ``shape``, for an eager chunk's ``key`` None), else 1.0 (priced as
        the whole forward)."""
        if phase is None:
            return 1.0
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not a step-cache half; allowed: {', '.join(PHASES)} or None")
        i = PHASES.index(phase)
        if key is not None and key in self.piece_shares:
            return self.piece_shares[key][i]
        shape = key.shape if key is not None else shape
        same = [v[i] for k, v in self.piece_shares.items() if k.shape == shape]
        return sum(same) / len(same) if same else 1.0

    def choose(self, shape: str, rows: int, buckets: Sequence[BucketKey], share: float = 1.0,
               phase: str | None = None) -> StepForwards:
        """The cheapest forwards for ``rows`` real rows of ``shape`` on its ``buckets`` (module docstring).

        Args:
            shape: the bucket shape (:attr:`BucketKey.shape`).
            rows: real rows of the step, at least 1.
            buckets: the shape's bucket keys that can run (prepared), any order.
            share: real tokens per row over the shape's (:meth:`eager_cost`): an eager chunk computes only
                those, a bucket forward all of the shape's.
            phase: ``"head"`` or ``"tail"``: forwards of that half of a cached step (:mod:`bcg_core.step_cache`),
                each priced at its whole forward's time times :meth:`phase_share`; None: whole forwards.

        Returns:
            The plan; ties go to fewer forwards, then to buckets over eager.

        Raises:
            ValueError: ``rows`` below 1, or no bucket and no eager time to run them with.
        """
        if rows < 1:
            raise ValueError(f"a step needs at least 1 row, got {rows}")
        share = min(1.0, round(share, 4))
        memo = (shape, rows, frozenset(buckets), share, phase)
        chosen = self._chosen.get(memo)
        if chosen is None:
            chosen = self._chosen[memo] = self._cheapest(shape, rows, buckets, share, phase)
        return chosen

    def _cheapest(self, shape: str, rows: int, buckets: Sequence[BucketKey], share: float,
                  phase: str | None = None) -> StepForwards:
        """The dynamic program of :meth:`choose` (module docstring)."""
        bucket_ms = {k: self.bucket_ms[k] * self.phase_share(k, phase) for k in buckets if k in self.bucket_ms}
        keys = sorted(bucket_ms, key=lambda k: (k.batch, bucket_ms[k]))
        largest = max((k.batch for k in keys), default=0)
        eager_ok = self.eager and shape in self.eager_ms
        if not keys and not eager_ok:
            raise ValueError(f"no cost is known for shape {shape}: neither a bucket nor an eager time")
        max_chunk = largest if keys else rows
        options: list[Chunk | None] = [None] * (max_chunk + 1)  # cheapest single forward of c rows
        for c in range(1, max_chunk + 1):
            best: Chunk | None = None
            for k in keys:  # smallest first: a larger bucket must be cheaper by more than the noise margin
                if k.batch >= c and (best is None or bucket_ms[k] < best.ms * (1 - PAD_MARGIN)):
                    best = Chunk(k, c, bucket_ms[k])
            if eager_ok:
                e = self.eager_cost(shape, c, share)
                e = None if e is None else e * self.phase_share(None, phase, shape)
                if e is not None and (best is None or e < best.ms):
                    home = next((k for k in keys if k.batch >= c), keys[-1] if keys else None)
                    best = Chunk(None, c, e, home)
            options[c] = best
        # best[r] = (ms, forwards, chunks): fewest ms, then fewest forwards
        inf = (float("inf"), 0, ())
        table: list[tuple[float, int, tuple[Chunk, ...]]] = [(0.0, 0, ())] + [inf] * rows
        for r in range(1, rows + 1):
            for c in range(1, min(r, max_chunk) + 1):
                opt = options[c]
                if opt is None:
                    continue
                ms, n, chunks = table[r - c]
                cand = (ms + opt.ms, n + 1, chunks + (opt,))
                best_ms, best_n, _ = table[r]
                if cand[0] < best_ms - 1e-9 or (abs(cand[0] - best_ms) <= 1e-9 and cand[1] < best_n):
                    table[r] = cand
        chunks = table[rows][2]
        if not chunks:
            raise ValueError(f"shape {shape} cannot run {rows} rows")
        # largest chunks first: the bucket forwards in a stable order
        home = max(keys, key=lambda k: k.batch) if keys else None
        return StepForwards(tuple(sorted(chunks, key=lambda c: (-c.rows, c.key is None))), home)

    def lora_factor(self, key: BucketKey | None) -> float:
        """How many times longer bucket ``key``'s forward runs with adapter rows than without (``lora_ms`` over
        ``bucket_ms``); 1.0 where either is unmeasured (and for None, an eager forward)."""
        if key is None or key not in self.lora_ms or not self.bucket_ms.get(key):
            return 1.0
        return self.lora_ms[key] / self.bucket_ms[key]

    def describe(self) -> dict:
        """JSON-ready view for ``/v1/buckets``: the source, bucket milliseconds, eager milliseconds by rows, with
        adapters each bucket's milliseconds with adapter rows (``lora_ms``), and once a bucket's step-cache halves
        are measured their shares of its whole forward (``step_cache_shares``: ``head``, what a reused row costs,
        and ``tail``)."""
        return {
            "source": self.source, "eager": self.eager,
            "bucket_ms": {str(k): round(v, 4) for k, v in sorted(self.bucket_ms.items())},
            "eager_ms": {s: {str(r): round(v, 4) for r, v in sorted(p.items())}
                         for s, p in sorted(self.eager_ms.items())},
            **({"lora_ms": {str(k): round(v, 4) for k, v in sorted(self.lora_ms.items())}} if self.lora_ms else {}),
            **({"step_cache_shares": {str(k): {"head": round(h, 4), "tail": round(t, 4)}
                                      for k, (h, t) in sorted(self.piece_shares.items())}}
               if self.piece_shares else {}),
        }

    def merged(self, other: CostModel) -> CostModel:
        """This model with ``other``'s times added (newer measurements win), e.g. after a shape is captured."""
        eager = {s: dict(p) for s, p in self.eager_ms.items()}
        for s, p in other.eager_ms.items():
            eager.setdefault(s, {}).update(p)
        source = other.source if other.source == self.source else f"{self.source}+{other.source}"
        per = [b for b in (self.eager_bytes_per_row_token, other.eager_bytes_per_row_token) if b is not None]
        return CostModel({**self.bucket_ms, **other.bucket_ms}, eager, source, self.eager and other.eager,
                         {**self.lora_ms, **other.lora_ms}, max(per, default=None),
                         {**self.piece_shares, **other.piece_shares})
