"""The step scheduler's counters per bucket shape (``GET /v1/buckets`` under ``scheduler``).

Per shape (or ``"miss"``): rows and requests in flight, requests waiting, steps, forwards by kind
(:data:`FORWARD_KINDS`), step decisions (:class:`~bcg_core.costs.Decision`), the mean fill of bucket
forwards (real rows / bucket rows), padded-token waste (``1 - real / computed tokens`` over every forward),
admissions, completions, cancellations, failures, expiries and queue waits (submission to start, milliseconds:
sum, mean, p50, p99 over the last :data:`WAITS_KEPT`, max). Prometheus reads them through
``deployments/metrics.py``. Not thread-safe: the scheduler holds its lock.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter, deque
from collections.abc import Sequence

import torch

from bcg_core.costs import DECISIONS, StepForwards
from bcg_core.devices import elapsed_ms
from bcg_core.keys import BucketKey, ShapeQuery
from bcg_core.metrics import BucketMetrics

__all__ = ["FORWARD_KINDS", "ForwardKind", "SchedulerStats", "ShapeStats", "StepTimes", "WAITS_KEPT", "queue_lengths"]

class ForwardKind(str, enum.Enum):
    """A forward as the step scheduler counts it (a ``str``: its value is the counter key)."""

    GRAPH = "graph"
    """A step's only forward, on a bucket (a graph replay on CUDA)."""
    SPLIT = "split"
    """A bucket forward of a step split into several."""
    EAGER = "eager"
    """An unpadded eager forward (a miss, or the cost model's choice)."""

    @classmethod
    def of(cls, bucket: bool, split: bool) -> ForwardKind:
        """The kind of a forward on a bucket (``bucket``) or unpadded, in a step of several forwards (``split``)."""
        return cls.EAGER if not bucket else cls.SPLIT if split else cls.GRAPH


FORWARD_KINDS = tuple(k.value for k in ForwardKind)
"""Forwards counted by the step scheduler: a step's only forward, on a bucket (a graph replay on CUDA); a
bucket forward of a step split into several; an unpadded eager forward (a miss, or the cost model's choice)."""

WAITS_KEPT = 1024
"""Queue waits kept per shape for the p50 / p99 in :meth:`StepScheduler.stats` (the most recent ones)."""

@dataclasses.dataclass
class ShapeStats:
    """Counters of one bucket shape (or ``"miss"``)."""

    forwards: Counter = dataclasses.field(default_factory=Counter)
    decisions: Counter = dataclasses.field(default_factory=Counter)
    bucket_rows: int = 0
    bucket_real_rows: int = 0
    real_tokens: int = 0
    computed_tokens: int = 0
    steps: int = 0
    admitted: int = 0
    completed: int = 0
    cancelled: int = 0
    cancelled_waiting: int = 0
    expired: int = 0
    failed: int = 0
    waits_ms: deque = dataclasses.field(default_factory=lambda: deque(maxlen=WAITS_KEPT))
    wait_ms_sum: float = 0.0
    wait_ms_max: float = 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return round(xs[i], 2)


class SchedulerStats:
    """Every shape's :class:`ShapeStats`, and the JSON of ``/v1/buckets`` built from them."""

    def __init__(self):
        self.by_shape: dict[str, ShapeStats] = {}

    def shape(self, shape: str | None) -> ShapeStats:
        """The counters of ``shape`` (None: ``"miss"``), made on first use."""
        key = shape or "miss"
        s = self.by_shape.get(key)
        if s is None:
            s = self.by_shape[key] = ShapeStats()
        return s

    def count_step(self, shape: str | None, forwards: StepForwards, rows: Sequence[tuple[int, ShapeQuery]]) -> int:
        """Count one step of requests of ``rows`` (each ``(rows, exact shape query)``) run as ``forwards``; returns
        the tokens it computed (a bucket forward's padded tokens, an eager chunk's real ones)."""
        per_row = rows[0][1].tokens_per_row
        real = sum(n * r.tokens_per_row for n, r in rows)
        computed = 0
        st = self.shape(shape)
        st.steps += 1
        st.decisions[forwards.decision.value] += 1
        split = len(forwards.chunks) > 1
        for c in forwards.chunks:
            if c.key is None:
                st.forwards[ForwardKind.EAGER.value] += 1
                computed += c.rows * per_row
            else:
                st.forwards[ForwardKind.of(True, split).value] += 1
                st.bucket_rows += c.key.batch
                st.bucket_real_rows += c.rows
                computed += c.key.tokens
        st.computed_tokens += computed
        st.real_tokens += real
        return computed

    def describe(self, in_flight: Sequence, waiting: Sequence) -> dict:
        """Totals and per-shape counters; ``in_flight`` and ``waiting`` are the scheduler's requests (each with
        ``shape`` and ``rows``)."""
        rows: Counter[str] = Counter()
        requests: Counter[str] = Counter()
        queued: Counter[str] = Counter()
        for i in in_flight:
            rows[i.shape or "miss"] += i.rows
            requests[i.shape or "miss"] += 1
        for i in waiting:
            queued[i.shape or "miss"] += 1
        shapes = {}
        for name in sorted(set(self.by_shape) | set(rows) | set(queued)):
            st = self.by_shape.get(name, ShapeStats())
            waits = list(st.waits_ms)
            shapes[name] = {
                "rows_in_flight": rows.get(name, 0), "requests_in_flight": requests.get(name, 0),
                "waiting": queued.get(name, 0), "steps": st.steps,
                "forwards": {k: st.forwards.get(k, 0) for k in FORWARD_KINDS},
                "decisions": {k: st.decisions.get(k, 0) for k in DECISIONS},
                "fill": round(st.bucket_real_rows / st.bucket_rows, 4) if st.bucket_rows else None,
                "real_tokens": st.real_tokens, "computed_tokens": st.computed_tokens,
                "padded_token_waste": round(1 - st.real_tokens / st.computed_tokens, 4) if st.computed_tokens else 0.0,
                "admitted": st.admitted, "completed": st.completed, "cancelled": st.cancelled, "failed": st.failed,
                "cancelled_waiting": st.cancelled_waiting, "expired": st.expired,
                "queue_wait_ms": {"sum": st.wait_ms_sum,
                                  "mean": round(st.wait_ms_sum / st.admitted, 2) if st.admitted else None,
                                  "p50": percentile(waits, 50), "p99": percentile(waits, 99),
                                  "max": round(st.wait_ms_max, 2)},
            }
        real = sum(s.real_tokens for s in self.by_shape.values())
        computed = sum(s.computed_tokens for s in self.by_shape.values())
        forwards: Counter = Counter()
        decisions: Counter = Counter()
        for s in self.by_shape.values():
            forwards.update(s.forwards)
            decisions.update(s.decisions)
        return {
            "forwards": {k: forwards.get(k, 0) for k in FORWARD_KINDS},
            "decisions": {k: decisions.get(k, 0) for k in DECISIONS},
            "real_tokens": real, "computed_tokens": computed,
            "padded_token_waste": round(1 - real / computed, 4) if computed else 0.0, "shapes": shapes,
        }


class StepTimes:
    """Milliseconds of each denoising step, recorded per bucket in the pipeline's metrics and in each request's
    ``step_ms`` once the device has finished the step (on CUDA the marks are events, read without a host sync).

    Args:
        metrics: the pipeline's per-bucket counters.
    """

    def __init__(self, metrics: BucketMetrics):
        self._metrics = metrics
        self._spans: deque = deque()  # (start, end, key, states) of steps not yet recorded

    def add(self, begin, end, key: BucketKey | None, states: list) -> None:
        """A step on bucket ``key`` (None: a miss) of ``states`` between marks ``begin`` and ``end``
        (:func:`~bcg_core.pipeline.timing_mark`); then record every step the device has finished (never waits)."""
        self._spans.append((begin, end, key, states))
        done: dict[BucketKey | None, list[float]] = {}
        while self._spans:
            a, b, k, sts = self._spans[0]
            if isinstance(b, torch.cuda.Event) and not b.query():
                break
            ms = elapsed_ms(a, b)
            self._spans.popleft()
            done.setdefault(k, []).append(ms)
            for state in sts:
                state.step_ms.append(ms)
        for k, ms in done.items():
            self._metrics.record_steps(k, ms)


def queue_lengths(items: Sequence) -> dict[str, int]:
    """Requests per bucket shape among ``items`` (each with ``shape``; misses left out), sorted by shape."""
    counts: Counter[str] = Counter(i.shape for i in items if i.shape)
    return dict(sorted(counts.items()))
