"""The step scheduler's cost model: measured forward times, and the cheapest way to run a step's rows.

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
miss runs in one eager forward while its activations fit the memory the replica can spare (:mod:`.miss_memory`).
Every row of a step is computed before any request advances, so a split never separates an image's cond
and uncond rows across steps.

Where the times come from (:attr:`CostModel.source`):

- ``measured`` (:func:`measure_costs`, at prepare): each bucket's forward through its runner (on CUDA a graph
  replay, timed with CUDA events; elsewhere the static padded eager forward, timed with the host clock), and
  each shape's unpadded eager forward at 1, 2, 4, ... rows and at every batch size of the table; eager
  milliseconds between measured row counts are interpolated linearly, beyond them extrapolated from the
  last two points;
- ``token-count`` (:meth:`CostModel.token_model`): a stand-in when nothing is measured (``runner.measure_costs:
  false``): milliseconds proportional to the tokens computed (padded for a bucket, real for eager) plus a
  fixed launch cost per forward, ``launch_ms + tokens * ms_per_token``; graph replays pay ``launch_ms / 10``
  (a replay is one launch instead of hundreds; docs/DESIGN.md section 3).

Pure Python and torch, no Ray; the scripted-cost tests build :class:`CostModel` directly.
"""

from __future__ import annotations

import enum
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from bcg_core.keys import BucketKey, BucketShape
from bcg_core.scheduler.miss_memory import ActivationPeaks, MissMemory

__all__ = ["Chunk", "CostModel", "Decision", "StepDecider", "StepForwards", "measure_costs"]

log = logging.getLogger(__name__)

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
        """Tokens the step computes: a bucket forward's padded tokens, an eager chunk's real rows x ``tokens_per_row``."""
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
            :func:`measure_costs` timed (CUDA only; None: not measured), for :class:`~.miss_memory.MissMemory`.

    Raises:
        ValueError: a negative time, or an eager measurement at 0 rows or fewer.
    """

    bucket_ms: dict[BucketKey, float]
    eager_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    source: str = "scripted"
    eager: bool = True
    lora_ms: dict[BucketKey, float] = field(default_factory=dict)
    eager_bytes_per_row_token: float | None = None
    _chosen: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Plans already chosen, by (shape, rows, buckets): the times do not change, and every step asks."""

    def __post_init__(self):
        if any(v < 0 for v in (*self.bucket_ms.values(), *self.lora_ms.values())):
            raise ValueError("bucket forward times must be >= 0 ms")
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
        masked tier, whose eager forward was measured at the tier's size, :func:`measure_costs`). The part of
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

    def choose(self, shape: str, rows: int, buckets: Sequence[BucketKey], share: float = 1.0) -> StepForwards:
        """The cheapest forwards for ``rows`` real rows of ``shape`` on its ``buckets`` (module docstring).

        Args:
            shape: the bucket shape (:attr:`BucketKey.shape`).
            rows: real rows of the step, at least 1.
            buckets: the shape's bucket keys that can run (prepared), any order.
            share: real tokens per row over the shape's (:meth:`eager_cost`): an eager chunk computes only
                those, a bucket forward all of the shape's.

        Returns:
            The plan; ties go to fewer forwards, then to buckets over eager.

        Raises:
            ValueError: ``rows`` below 1, or no bucket and no eager time to run them with.
        """
        if rows < 1:
            raise ValueError(f"a step needs at least 1 row, got {rows}")
        share = min(1.0, round(share, 4))
        memo = (shape, rows, frozenset(buckets), share)
        chosen = self._chosen.get(memo)
        if chosen is None:
            chosen = self._chosen[memo] = self._cheapest(shape, rows, buckets, share)
        return chosen

    def _cheapest(self, shape: str, rows: int, buckets: Sequence[BucketKey], share: float) -> StepForwards:
        """The dynamic program of :meth:`choose` (module docstring)."""
        keys = sorted((k for k in buckets if k in self.bucket_ms), key=lambda k: (k.batch, self.bucket_ms[k]))
        largest = max((k.batch for k in keys), default=0)
        eager_ok = self.eager and shape in self.eager_ms
        if not keys and not eager_ok:
            raise ValueError(f"no cost is known for shape {shape}: neither a bucket nor an eager time")
        max_chunk = largest if keys else rows
        options: list[Chunk | None] = [None] * (max_chunk + 1)  # cheapest single forward of c rows
        for c in range(1, max_chunk + 1):
            best: Chunk | None = None
            for k in keys:  # smallest first: a larger bucket must be cheaper by more than the noise margin
                if k.batch >= c and (best is None or self.bucket_ms[k] < best.ms * (1 - PAD_MARGIN)):
                    best = Chunk(k, c, self.bucket_ms[k])
            if eager_ok:
                e = self.eager_cost(shape, c, share)
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
        """JSON-ready view for ``/v1/buckets``: the source, bucket milliseconds, eager milliseconds by rows, and
        with adapters each bucket's milliseconds with adapter rows (``lora_ms``)."""
        return {
            "source": self.source, "eager": self.eager,
            "bucket_ms": {str(k): round(v, 4) for k, v in sorted(self.bucket_ms.items())},
            "eager_ms": {s: {str(r): round(v, 4) for r, v in sorted(p.items())} for s, p in sorted(self.eager_ms.items())},
            **({"lora_ms": {str(k): round(v, 4) for k, v in sorted(self.lora_ms.items())}} if self.lora_ms else {}),
        }

    def merged(self, other: CostModel) -> CostModel:
        """This model with ``other``'s times added (newer measurements win), e.g. after a shape is captured."""
        eager = {s: dict(p) for s, p in self.eager_ms.items()}
        for s, p in other.eager_ms.items():
            eager.setdefault(s, {}).update(p)
        source = other.source if other.source == self.source else f"{self.source}+{other.source}"
        per = [b for b in (self.eager_bytes_per_row_token, other.eager_bytes_per_row_token) if b is not None]
        return CostModel({**self.bucket_ms, **other.bucket_ms}, eager, source, self.eager and other.eager,
                         {**self.lora_ms, **other.lora_ms}, max(per, default=None))


def _timer(device) -> Callable[[Callable[[], object], int], float]:
    """``time(fn, iters) -> median ms`` on ``device`` after one warm-up call: CUDA events on CUDA
    (:func:`bcg_core.planning.profile.cuda_ms`), the host clock elsewhere."""
    import torch

    if torch.device(device).type == "cuda":
        from bcg_core.devices import cuda_ms

        return lambda fn, iters: cuda_ms(fn, iters, warmup=1)

    def host_ms(fn: Callable[[], object], iters: int) -> float:
        fn()  # warm-up (allocator, kernels selected)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return float(statistics.median(times))

    return host_ms


def eager_row_counts(batch_sizes: Sequence[int]) -> list[int]:
    """Row counts an eager shape is measured at: 1, 2, 4, ... up to the largest batch, and every batch size."""
    largest = max(batch_sizes)
    rows = {b for b in batch_sizes}
    r = 1
    while r <= largest:
        rows.add(r)
        r *= 2
    return sorted(rows)


def measure_costs(runner, adapter, keys: Sequence[BucketKey], inputs_for: Callable[[BucketKey, int], object],
                  device, iters: int = 2) -> CostModel:
    """Measure the forward times of ``keys`` and, per shape, the unpadded eager forward against row count.

    Args:
        runner: the bucket runner (``runner.run(key, inputs)``), its buckets prepared.
        adapter: the family's adapter (``adapter.forward_eager(inputs)``).
        keys: buckets to measure (those of the shapes this replica owns).
        inputs_for: ``(key, rows) -> DenoiseInputs``: real inputs of ``rows`` rows at the size of ``key``'s
            exact tier (a request that fills the tier, so eager and bucket forwards compute the same tokens).
        device: the model's device (CUDA events there, the host clock elsewhere).
        iters: timed calls per point (median), after one warm-up call.

    Returns:
        A ``measured`` :class:`CostModel`. The forwards go through the runner, so they count as forwards of
        their buckets in the metrics (``forwards_by_mode``). With LoRA adapters (an adapter with
        ``forward_plain``, :class:`~bcg_core.lora.rows.LoRAAdapter`) ``bucket_ms`` times each bucket's plain
        graph (no row has an adapter) and ``lora_ms`` its LoRA graph: the same inputs with every row on slot 0,
        which computes every row's deltas as a real adapter does (zeros, at the same cost). On CUDA its
        ``eager_bytes_per_row_token`` is the eager forwards' most peak bytes per row-token (:class:`ActivationPeaks`).
    """
    import torch

    time_ms = _timer(device)
    bucket: dict[BucketKey, float] = {}
    lora: dict[BucketKey, float] = {}
    slot_zero = getattr(adapter, "on_slot_zero", None)  # a LoRA deployment: time its adapter-row graphs too
    eager: dict[str, dict[int, float]] = {}
    by_shape: dict[str, list[BucketKey]] = {}
    for k in keys:
        by_shape.setdefault(k.shape, []).append(k)
    seen: dict[tuple, float] = {}
    peaks = ActivationPeaks(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for shape, ks in sorted(by_shape.items()):
            for k in sorted(ks, key=lambda k: k.batch):
                x = inputs_for(k, k.batch)
                bucket[k] = time_ms(lambda k=k, x=x: runner.run(k, x), iters)
                if slot_zero is not None:
                    xl = slot_zero(x)
                    lora[k] = time_ms(lambda k=k, xl=xl: runner.run(k, xl), iters)
            ref = max(ks, key=lambda k: k.batch)
            for rows in eager_row_counts([k.batch for k in ks]):
                # an exact tier and its masked twin run the same unpadded eager forward: measured once
                same = (ref.image_tokens, ref.text_tokens, ref.latent_hw, rows)
                if same not in seen:
                    x = inputs_for(ref, rows)
                    seen[same] = peaks.measure(x, lambda x=x: time_ms(lambda: adapter.forward_eager(x), iters))
                eager.setdefault(shape, {})[rows] = seen[same]
    log.info("measured %d bucket forwards and %d eager points in %.1f s", len(bucket),
             sum(len(p) for p in eager.values()), time.perf_counter() - t0)
    return CostModel(bucket, eager, source="measured", lora_ms=lora, eager_bytes_per_row_token=peaks.most)


class StepDecider:
    """Decides each step's forwards: the cost model's cheapest over the shape's prepared buckets.

    The one decider of a replica (the pipeline holds it): the step scheduler and :meth:`DiTPipeline.generate` ask
    it, the pipeline and the runners trust what it returns.

    Args:
        keys: the table's buckets.
        prepared: returns the buckets prepared now (captured on CUDA); only those are chosen, unless a shape has
            none prepared yet.
        graphs: bucket forwards are graph replays (for the token-count stand-in, :meth:`CostModel.token_model`).
        spare_bytes: the bytes the replica can spare now (:func:`~.miss_memory.cuda_spare_bytes`), None: no bound.
    """

    def __init__(self, keys: Iterable[BucketKey], prepared: Callable[[], set], graphs: bool,
                 spare_bytes: Callable[[], int | None] | None = None):
        keys = list(keys)
        self.miss = MissMemory(spare_bytes)
        """The memory bound on a miss's forwards; measured costs bring its bytes per row-token (:meth:`set_costs`)."""
        self._prepared = prepared
        self.fallback = CostModel.token_model(keys, graphs=graphs)
        """The token-count stand-in: used for shapes the cost model has no time of."""
        self.costs = self.fallback
        """The cost model (measured at prepare on CUDA, else the stand-in)."""
        self._by_shape: dict[BucketShape, list[BucketKey]] = {}
        for k in keys:
            self._by_shape.setdefault(k.shape, []).append(k)

    def set_costs(self, costs: CostModel, merge: bool = True) -> None:
        """Use ``costs`` from now on: merged over the current model (a shape captured later adds its times), or
        in its place when ``merge`` is False or nothing was measured before. Its eager bytes per row-token, where
        measured, go to :attr:`miss` (the largest seen is kept either way)."""
        self.miss.observe(costs.eager_bytes_per_row_token)
        self.costs = costs if not merge or self.costs is self.fallback else self.costs.merged(costs)

    def decide(self, shape: BucketShape | None, rows: int, real_per_row: int | None = None) -> StepForwards:
        """The forwards of one step of ``rows`` rows of ``shape``. ``real_per_row``: the rows' real tokens
        (:attr:`~bcg_core.keys.ShapeQuery.tokens_per_row`), fewer than the shape's in a masked tier, where an eager
        chunk computes fewer tokens than a bucket forward (None: the shape's).

        A miss (``shape`` None) runs unpadded and eager, in one forward while its activations fit the memory the
        replica can spare now, else in as few, as even chunks as fit (:meth:`~.miss_memory.MissMemory.chunk_rows`).

        Raises:
            ValueError: ``rows`` below 1.
        """
        if shape is None:
            return StepForwards(tuple(Chunk(None, r, 0.0) for r in self.miss.chunk_rows(rows, real_per_row)))
        prepared = self._prepared()
        every = self._by_shape.get(shape, [])
        keys = [k for k in every if k in prepared] or every
        costs = self.costs if any(k in self.costs.bucket_ms for k in keys) else self.fallback
        share = 1.0 if real_per_row is None else real_per_row / max(1, shape.tokens_per_row)
        return costs.choose(shape, rows, keys, share)

    def split_adapters(self, shape: BucketShape | None, plain_rows: int, adapter_rows: int) -> bool:
        """Whether a step of ``shape`` whose rows mix requests without adapters (``plain_rows``) and with them
        (``adapter_rows``) costs less as two steps: the plain rows on the buckets' plain graphs, the adapter rows
        on their LoRA graphs, than all rows together on LoRA graphs, where every row pays the deltas' passes
        over its activations. Expected milliseconds of :meth:`decide`'s forwards, a bucket forward with adapter
        rows scaled by :meth:`CostModel.lora_factor` (an eager chunk by its home bucket's); False where the factors
        are unmeasured (1.0: one forward is then never dearer than two), for a miss, or when either side has no
        rows."""
        if shape is None or plain_rows < 1 or adapter_rows < 1:
            return False
        costs = self.costs  # one snapshot: set_costs may swap it from the capture thread

        def with_lora(forwards: StepForwards) -> float:
            # an eager chunk with adapter rows pays the deltas too: priced at its home bucket's factor
            return sum(c.ms * costs.lora_factor(c.key or c.home or forwards.home) for c in forwards.chunks)

        together = with_lora(self.decide(shape, plain_rows + adapter_rows))
        return self.decide(shape, plain_rows).ms + with_lora(self.decide(shape, adapter_rows)) < together
