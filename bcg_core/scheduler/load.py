"""Per-bucket-shape load of one replica: arrivals, completions and busy time over a sliding window.

This is what a DiT replica reports to the autoscaling policy (``record_autoscaling_stats``, see
:mod:`router.autoscaling`) and to the ownership coordinator. Per bucket shape (``BucketKey.shape``, e.g.
``"i1024_t256"``; ``"miss"`` for requests no bucket holds):

- ``arrival_rps``: requests submitted per second over the window;
- ``completion_rps``: requests whose denoising loop finished, per second;
- ``busy``: fraction of the replica's time spent on the shape (0..1; summed over shapes it is the replica's
  utilisation). While k requests run at once (the step scheduler's requests in flight, whose steps share one
  denoising thread, so one GPU or one CPU pool) each is charged 1/k of the elapsed time: processor-sharing
  accounting, so busy time is never counted twice. The split among shapes is an approximation (a request
  waiting for its group's next step is charged like one computing), the total is exact;
- ``service_s``: measured replica seconds per request, ``busy seconds / completions`` over the window (the
  inverse of the shape's measured capacity in requests per second). The first request of each shape to run is
  left out of it (its busy time still counts in ``busy``): the first forward at a new size pays one-time
  costs (on an H200 a first 768x768 request took 2.2 s, the next ones 0.4-0.9 s: the VAE's cuDNN algorithm
  search, allocator growth). It keeps its last measured value when the window has no completion, and is
  0.0 until the shape's second request completed;
- ``offered``: ``arrival_rps x service_s``, the replicas' worth of work arriving (1.0 = one replica busy all
  the time).

Pure Python with an injectable monotonic clock; thread-safe (the step scheduler updates it from the event
loop and its threads, the stats calls read it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LoadMeter", "ShapeLoad", "MISS_SHAPE"]

MISS_SHAPE = "miss"
"""Shape name under which requests without a bucket (misses, served unpadded) are counted."""


@dataclass(frozen=True)
class ShapeLoad:
    """The load of one shape over the window (see the module docstring for each field's meaning).

    Attributes:
        arrival_rps: requests per second submitted.
        completion_rps: requests per second completed.
        busy: fraction of replica time (0..1).
        service_s: replica seconds per request (0.0 before the first completion).
    """

    arrival_rps: float
    completion_rps: float
    busy: float
    service_s: float

    @property
    def offered(self) -> float:
        """``arrival_rps x service_s``: the work arriving, in replicas (0.0 while unmeasured)."""
        return self.arrival_rps * self.service_s


@dataclass
class _Totals:
    arrivals: int = 0
    completions: int = 0
    busy_s: float = 0.0
    svc_completions: int = 0  # completions and busy time of every batch but the shape's first
    svc_busy_s: float = 0.0
    batches: int = 0


class LoadMeter:
    """Cumulative per-shape counters with snapshots every ``snapshot_s``, read as rates over ``window_s``.

    Args:
        window_s: the sliding window in seconds (the autoscaling ``look_back_period_s``).
        snapshot_s: spacing of the snapshots the window is measured from, seconds (the rate's resolution).
        clock: monotonic seconds (``time.monotonic``; tests pass a fake).

    Raises:
        ValueError: a window or snapshot spacing that is not positive, or a window shorter than the spacing.
    """

    def __init__(self, window_s: float = 10.0, snapshot_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0 or snapshot_s <= 0 or window_s < snapshot_s:
            raise ValueError(f"need window_s >= snapshot_s > 0; got window_s={window_s}, snapshot_s={snapshot_s}")
        self.window_s = float(window_s)
        self.snapshot_s = float(snapshot_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._totals: dict[str, _Totals] = {}
        self._active: dict[object, str] = {}  # running batch -> its shape
        self._batch_busy: dict[object, float] = {}  # running batch -> busy seconds charged to it so far
        self._last = clock()
        self._snaps: deque[tuple[float, dict[str, tuple[int, int, float, int, float]]]] = deque()
        self._service: dict[str, float] = {}  # last measured seconds per request, by shape
        self._snaps.append((self._last, {}))

    # -- updates ------------------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Charge the time since the last event to the running batches (1/k each); take due snapshots."""
        elapsed = max(0.0, now - self._last)
        if self._active and elapsed > 0:
            share = elapsed / len(self._active)
            for batch, shape in self._active.items():
                self._totals.setdefault(shape, _Totals()).busy_s += share
                self._batch_busy[batch] = self._batch_busy.get(batch, 0.0) + share
        self._last = now
        if now - self._snaps[-1][0] >= self.snapshot_s:
            self._snaps.append((now, {s: (t.arrivals, t.completions, t.busy_s, t.svc_completions, t.svc_busy_s)
                                      for s, t in self._totals.items()}))
            # keep one snapshot at or before the window's start
            while len(self._snaps) > 2 and now - self._snaps[1][0] >= self.window_s:
                self._snaps.popleft()

    def arrive(self, shape: str | None, count: int = 1) -> None:
        """``count`` requests of ``shape`` were submitted (None: a miss)."""
        with self._lock:
            self._advance(self._clock())
            self._totals.setdefault(shape or MISS_SHAPE, _Totals()).arrivals += count

    def start(self, batch: object, shape: str | None) -> None:
        """A run (any hashable token; the step scheduler passes the request it starts) of ``shape`` starts."""
        with self._lock:
            self._advance(self._clock())
            self._active[batch] = shape or MISS_SHAPE

    def finish(self, batch: object, completed: int) -> None:
        """The run ``batch`` ended; ``completed`` requests of it were served (the step scheduler passes 1 for a
        request answered with images, 0 for one cancelled or failed)."""
        with self._lock:
            self._advance(self._clock())
            shape = self._active.pop(batch, None)
            busy = self._batch_busy.pop(batch, 0.0)
            if shape is not None:
                t = self._totals.setdefault(shape, _Totals())
                t.completions += completed
                t.batches += 1
                if t.batches > 1:  # the shape's first batch pays one-time costs: not a service time
                    t.svc_completions += completed
                    t.svc_busy_s += busy

    # -- reads --------------------------------------------------------------------------------------

    def loads(self, shapes: list[str] | None = None) -> dict[str, ShapeLoad]:
        """Per-shape load over the window: counts and busy seconds of the last ``window_s`` divided by
        ``window_s`` (also while the meter is younger than the window).

        Args:
            shapes: shapes to report even when idle (every shape of the table); shapes seen are always in.

        Returns:
            ``{shape: ShapeLoad}``, sorted by shape.
        """
        with self._lock:
            now = self._clock()
            self._advance(now)
            t0, base = self._snaps[0]
            for t, snap in self._snaps:  # the newest snapshot at or before the window's start
                if now - t >= self.window_s:
                    t0, base = t, snap
            # always divided by the whole window, also while the meter is younger: after a scale-up the older
            # replicas' windows still hold traffic the new one now takes, and the rates summed over replicas
            # must not count it twice (a fresh deployment ramps up over one window instead)
            span = max(now - t0, self.window_s)
            names = sorted(set(self._totals) | set(shapes or ()))
            out: dict[str, ShapeLoad] = {}
            for s in names:
                cur = self._totals.get(s, _Totals())
                a0, c0, b0, sc0, sb0 = base.get(s, (0, 0, 0.0, 0, 0.0))
                arrivals, completions, busy = cur.arrivals - a0, cur.completions - c0, cur.busy_s - b0
                svc_n, svc_busy = cur.svc_completions - sc0, cur.svc_busy_s - sb0
                if svc_n > 0:
                    self._service[s] = svc_busy / svc_n
                out[s] = ShapeLoad(arrival_rps=arrivals / span, completion_rps=completions / span,
                                   busy=min(1.0, busy / span), service_s=self._service.get(s, 0.0))
            return out
