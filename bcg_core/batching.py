"""Micro-batching inside a replica: concurrent requests of one bucket shape share one transformer forward.

A replica serves concurrent requests (Ray Serve's ``max_ongoing_requests``). Run one by one, two requests
of 512x512 with guidance take two denoising loops of 2-row forwards; batched, they take one loop of 4-row
forwards, and on a GPU a 4-row forward costs far less than two 2-row forwards (the bucket table already
holds graphs of every batch size). :class:`MicroBatcher` groups requests by
:meth:`~bcg_core.pipeline.DiTPipeline.batch_group` (bucket shape without the batch dimension and token grid;
requests of different groups are never padded together; steps, guidance and seeds may differ) and hands each
batch to :meth:`~bcg_core.pipeline.DiTPipeline.generate_batch` in a worker thread, whose step-level loop runs
every request still going in one forward per step (a request leaves when its own steps are done). A request
joins a batch only while its window is open; joining a loop that already runs is the step scheduler's work.

Plan once: a request arrives planned (a :class:`~bcg_core.planner.Plan` from the ingress, which validated it
and looked its bucket up) and is trusted as it is: grouped by its plan and handed to the pipeline as that plan,
never planned again. A raw :class:`~bcg_core.planner.GenerationRequest` (a caller holding a DiT handle
directly) is planned here, once, and then travels as its plan the same way.

Window: the first request of a group opens a batch and a window of ``wait_ms``; requests of the same group
that arrive within it join while the batch's transformer rows stay within ``max_rows``. The batch runs when
the window closes, or at once when its rows reach ``max_rows``; a request that would overflow it sends it
off and opens the next batch. A bucket miss, a request of ``max_rows`` rows or more, and every request when
``enabled`` is False run alone at once. Batches (of different groups, or consecutive batches of one group)
may run concurrently: the bucket runner serialises the forwards themselves with its lock.

Pure asyncio and threads, no Ray: the DiT replica (``deployments/dit.py``) owns one batcher per pipeline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from .load import LoadMeter
from .pipeline import DiTPipeline, GenerationResult
from .planner import GenerationRequest, Plan

__all__ = ["MicroBatcher", "RunBatch"]

RunBatch = Callable[[list[Plan], list[threading.Event]], Sequence[GenerationResult | BaseException]]
"""``run_batch(plans, cancels) -> one result or exception per plan`` (blocking; runs in a worker thread)."""


@dataclasses.dataclass(eq=False)
class _Item:
    """One submitted request: its plan (defaults and seed filled in, bucket looked up), rows, shape and
    caller's future."""

    plan: Plan
    rows: int
    shape: str | None
    cancel: threading.Event
    future: asyncio.Future
    submitted: float
    released: bool = False


@dataclasses.dataclass(eq=False)
class _Batch:
    """Requests of one group that will share a denoising loop; ``full`` closes the window early."""

    group: tuple | None
    full: asyncio.Event
    items: list[_Item] = dataclasses.field(default_factory=list)
    rows: int = 0
    started: bool = False


class MicroBatcher:
    """Batches concurrent same-shape requests of one replica into shared forwards (see the module docstring).

    Args:
        pipeline: plans raw requests (``pipeline.planner.plan``; a :class:`Plan` is not planned again),
            groups them (``pipeline.batch_group``) and, by default, runs batches (``pipeline.generate_batch``).
        max_rows: most transformer rows of one batch; None: the largest batch bucket of the pipeline's table.
        wait_ms: how long the first request of a batch waits for others of its group (0: only requests
            submitted in the same event-loop turn share).
        enabled: False runs every request alone at once (no window).
        run_batch: runs one batch (blocking, in a worker thread) instead of ``pipeline.generate_batch``;
            ``(plans, cancels) -> [result or exception per plan]``.
        meter: where arrivals, running batches and completions per bucket shape are counted (the load the
            replica reports for autoscaling, :mod:`bcg_core.load`); a fresh 10 s :class:`LoadMeter` when None.

    Raises:
        ValueError: ``max_rows`` below 1 or ``wait_ms`` negative.
    """

    def __init__(self, pipeline: DiTPipeline, max_rows: int | None = None, wait_ms: float = 10.0,
                 enabled: bool = True, run_batch: RunBatch | None = None, meter: LoadMeter | None = None):
        self.pipeline = pipeline
        self.max_rows = int(max_rows if max_rows is not None else pipeline.table.batch_sizes[-1])
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        if wait_ms < 0:
            raise ValueError(f"wait_ms must be >= 0, got {wait_ms}")
        self.wait_ms = float(wait_ms)
        self.enabled = bool(enabled)
        self._run_batch: RunBatch = run_batch if run_batch is not None else pipeline.generate_batch
        self.meter = meter if meter is not None else LoadMeter()
        self._open: dict[tuple, _Batch] = {}  # group -> its batch still in its window
        self._tasks: set[asyncio.Task] = set()  # keep the drivers alive until they end
        self._lock = threading.Lock()  # the counters below are read from other threads (stats calls)
        self._queued: Counter[str] = Counter()  # shape -> requests waiting or running
        self._waiting = 0
        self._running = 0
        self._runs = 0
        self._requests = 0
        self._batches = 0
        self._batched_requests = 0

    @classmethod
    def from_pipeline(cls, pipeline: DiTPipeline, run_batch: RunBatch | None = None) -> "MicroBatcher":
        """A batcher configured by ``pipeline.config.runner`` (``micro_batching``, ``batch_wait_ms``), its load
        meter's window by ``pipeline.config.autoscaling.look_back_period_s``."""
        r = pipeline.config.runner
        window = pipeline.config.autoscaling.look_back_period_s
        return cls(pipeline, wait_ms=r.batch_wait_ms, enabled=r.micro_batching, run_batch=run_batch,
                   meter=LoadMeter(window_s=window, snapshot_s=min(0.5, window)))

    # -- the request path ---------------------------------------------------------------------------

    async def submit(self, request: Plan | GenerationRequest) -> GenerationResult:
        """Queue a planned request into its batch, wait for the batch to run, and return its own result.

        The result's ``timings_ms`` gains ``queue``: milliseconds from submission until its batch started.

        Args:
            request: a :class:`Plan` (the ingress's: trusted as it is, not planned again), or a raw
                :class:`GenerationRequest`, which is planned here once (with the pipeline's planner).

        Raises:
            RequestError: a raw request fails validation (raised at once, nothing is queued), or misses under
                the reject policy.
            RequestCancelled: its cancel event was set by the time its batch decoded.
            asyncio.CancelledError: the caller's task was cancelled; the request's cancel event is set, so a
                waiting request leaves its batch and a running one is not decoded (and stops the loop when
                every request of its batch is cancelled).
            Exception: whatever broke the batch's forward (every request of the batch gets it).
        """
        plan = request if isinstance(request, Plan) else self.pipeline.planner.plan(request)
        lookup = plan.lookup
        rows = lookup.query.batch
        shape = lookup.key.shape if lookup.hit else None
        group = self.pipeline.batch_group(plan) if self.enabled and rows < self.max_rows else None
        loop = asyncio.get_running_loop()
        item = _Item(plan, rows, shape, threading.Event(), loop.create_future(), time.perf_counter())
        with self._lock:
            if shape is not None:
                self._queued[shape] += 1
            self._waiting += 1
        self.meter.arrive(shape)
        batch = self._enqueue(item, group)
        try:
            return await item.future
        except asyncio.CancelledError:
            item.cancel.set()
            if not batch.started and item in batch.items:  # still in its window: leave the batch
                batch.items.remove(item)
                batch.rows -= item.rows
                self._release(item, waiting=True)
                if not batch.items:
                    self._close(batch)
            raise

    def _enqueue(self, item: _Item, group: tuple | None) -> _Batch:
        """Put ``item`` into its group's open batch (opening one if needed); returns that batch."""
        if group is None:  # a miss, a full batch by itself, or batching off: alone, at once
            batch = self._new_batch(None)
            self._add(batch, item)
            self._close(batch)
            return batch
        batch = self._open.get(group)
        if batch is not None and batch.rows + item.rows > self.max_rows:
            self._close(batch)  # would overflow: send it off now, this request opens the next batch
            batch = None
        if batch is None:
            batch = self._open[group] = self._new_batch(group)
        self._add(batch, item)
        if batch.rows >= self.max_rows:
            self._close(batch)
        return batch

    @staticmethod
    def _add(batch: _Batch, item: _Item) -> None:
        batch.items.append(item)
        batch.rows += item.rows

    def _new_batch(self, group: tuple | None) -> _Batch:
        batch = _Batch(group, asyncio.Event())
        task = asyncio.get_running_loop().create_task(self._drive(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return batch

    def _close(self, batch: _Batch) -> None:
        """End ``batch``'s window: no request joins it any more, and its driver runs it now."""
        if self._open.get(batch.group) is batch:
            del self._open[batch.group]
        batch.full.set()

    def _release(self, item: _Item, waiting: bool) -> None:
        """Drop ``item`` from the queue counters (once)."""
        if item.released:
            return
        item.released = True
        with self._lock:
            if item.shape is not None:
                self._queued[item.shape] -= 1
                if self._queued[item.shape] <= 0:
                    del self._queued[item.shape]
            if waiting:
                self._waiting -= 1
            else:
                self._running -= 1

    async def _drive(self, batch: _Batch) -> None:
        """Wait out ``batch``'s window, run it in a worker thread, and hand every caller its result."""
        if not batch.full.is_set():
            try:
                await asyncio.wait_for(batch.full.wait(), timeout=self.wait_ms / 1e3)
            except asyncio.TimeoutError:
                pass
        self._close(batch)
        batch.started = True
        items = [i for i in batch.items if not i.future.done()]
        for i in batch.items:
            if i.future.done():
                self._release(i, waiting=True)
        if not items:
            return
        started = time.perf_counter()
        with self._lock:
            self._waiting -= len(items)
            self._running += len(items)
            self._runs += 1
            self._requests += len(items)
            if len(items) > 1:
                self._batches += 1
                self._batched_requests += len(items)
        self.meter.start(batch, items[0].shape)
        try:
            results = list(await asyncio.to_thread(self._run_batch, [i.plan for i in items],
                                                   [i.cancel for i in items]))
            if len(results) != len(items):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(items)} requests")
        except asyncio.CancelledError:  # the event loop is shutting down: stop the worker, tell the callers
            for i in items:
                i.cancel.set()
                i.future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the batch's error is each of its requests' error
            results = [e] * len(items)
        finally:
            self.meter.finish(batch, len(items))
            for i in items:
                self._release(i, waiting=False)
        for i, r in zip(items, results):
            if i.future.done():  # its caller was cancelled while the batch ran
                continue
            if isinstance(r, BaseException):
                i.future.set_exception(r)
            else:
                queue_ms = round((started - i.submitted) * 1e3, 2)
                i.future.set_result(dataclasses.replace(r, timings_ms={**r.timings_ms, "queue": queue_ms}))

    # -- introspection ------------------------------------------------------------------------------

    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting or running per bucket shape (``"i1024_t256"``: the key without its batch
        dimension), for routing stats; shapes with none are left out, and so are misses (no shape)."""
        with self._lock:
            return {s: n for s, n in sorted(self._queued.items()) if n > 0}

    def stats(self) -> dict:
        """Counters since start: ``runs`` (batches handed to the pipeline, alone or shared), ``requests`` (in
        them), ``batches`` and ``batched_requests`` (runs shared by 2+ requests, and their requests),
        ``mean_batch_size`` (requests per run), ``waiting`` and ``running`` now, and the settings."""
        with self._lock:
            return {
                "enabled": self.enabled, "wait_ms": self.wait_ms, "max_rows": self.max_rows,
                "runs": self._runs, "requests": self._requests, "batches": self._batches,
                "batched_requests": self._batched_requests,
                "mean_batch_size": round(self._requests / self._runs, 3) if self._runs else 0.0,
                "waiting": self._waiting, "running": self._running,
            }
