"""The step scheduler's loop: continuous batching of denoising steps into bucket forwards, per replica.

Requests join and leave at step boundaries. One denoising thread runs *iterations*; each iteration:

1. **Admits** waiting requests (:mod:`bcg_core.scheduler.admission`) and starts them
   (:meth:`~bcg_core.pipeline.DiTPipeline.start`: text encoded, noise drawn, its own scheduler set up). With
   requests in flight, the starts of one boundary stop once they took as long as the last iteration's steps (at
   least one starts), so a burst of arrivals delays the requests in flight by about one iteration per boundary.
2. **Steps every group** in flight (one bucket shape and token grid; a request with more rows than the largest
   batch bucket belongs to its shape's group), oldest group first: one denoising step of every request of the
   group, each at its own step and timestep, in the forwards the pipeline's
   :class:`~bcg_core.scheduler.costs.StepDecider` chooses (``fill``, ``pad``, ``split`` or ``eager``). Every
   group steps once per iteration, so a rare shape waits at most one step of each other group.
3. **Retires** finished requests (to the :class:`~bcg_core.scheduler.finish.Finisher`: decode thread and
   encoding pool) and cancelled ones (their rows leave at this step boundary).

Streamed requests hand a latent copy to the preview thread after the steps
:func:`~bcg_core.preview.preview_steps` picks (:mod:`bcg_core.scheduler.previews`); a result is held until the
request's queued previews are drawn, so they reach the caller first.

Cancellation: a caller's ``asyncio.CancelledError`` sets the request's cancel event; a waiting request leaves the
queue at the next admission, a running one at the next step boundary, a finished one is not decoded. Errors: a
request whose start raises gets that error alone; a forward that raises fails the requests of that step only (an
out-of-memory step is answered 503 with ``Retry-After``), and the thread goes on serving. Counters:
:mod:`bcg_core.scheduler.stats`. Pure threads and asyncio, no Ray: :mod:`deployments.dit` owns one per replica.
docs/DESIGN.md section 12.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import torch

from bcg_core import failpoints
from bcg_core.errors import RequestCancelled, ServiceUnavailable

from bcg_core.metrics import token_shares
from bcg_core.pipeline import DiTPipeline, timing_mark
from bcg_core.preview import PartialImage, preview_steps
from bcg_core.request import GenerationResult, PlannedRequest
from bcg_core.runners.base import is_out_of_memory
from bcg_core.scheduler.admission import Admission, InFlight, tensor_bytes
from bcg_core.scheduler.costs import CostModel
from bcg_core.scheduler.finish import Finisher
from bcg_core.scheduler.load import LoadMeter
from bcg_core.scheduler.memtrim import IdleTrimmer
from bcg_core.scheduler.previews import PreviewWorker, stream_events
from bcg_core.scheduler.stats import SchedulerStats, StepTimes, queue_lengths

__all__ = ["StepScheduler"]

log = logging.getLogger(__name__)

class StepScheduler:
    """Continuous step-level batching for one replica's pipeline (see the module docstring).

    Args:
        pipeline: the replica's pipeline (planner, table, runner, family).
        costs: the cost model, given to the pipeline's decider (:class:`~bcg_core.scheduler.costs.StepDecider`);
            None: the decider's own (the token-count stand-in until measured costs are set).
        max_rows: most transformer rows in flight (``runner.max_rows_in_flight``).
        memory_budget_bytes: most bytes of request tensors in flight (None: unbounded); see
            :meth:`from_pipeline` for how a replica measures it on CUDA.
        decode_batch_images: most images of one decode call.
        encode_threads: PNG encoder threads.
        fair_wait_s: a request waiting longer than this for admission holds back every later request.
        max_queue_wait_s: a request not admitted within this many seconds is answered
            :class:`~bcg_core.errors.ServiceUnavailable` (503 with Retry-After) and counted as ``expired``; None: no
            deadline.
        meter: load meter (arrivals, running requests and completions per shape) for autoscaling.
        retry_after_s: the ``Retry-After`` seconds of a 503 it answers (a request expired in the queue, a step
            out of memory); the serving layer passes its ``routing.retry_after_s``.
        trim_idle_s: once no request has been submitted and not answered for this many seconds, give the C heap's
            free memory back to the OS (:class:`~bcg_core.scheduler.memtrim.IdleTrimmer`: glibc ``malloc_trim``; without it the
            resident memory at rest follows the largest requests served together). None: never.

    Raises:
        ValueError: ``max_rows``, ``decode_batch_images`` or ``encode_threads`` below 1, ``fair_wait_s`` < 0.
    """

    def __init__(self, pipeline: DiTPipeline, costs: CostModel | None = None, max_rows: int = 64,
                 memory_budget_bytes: int | None = None, decode_batch_images: int = 8, encode_threads: int = 4,
                 fair_wait_s: float = 2.0, meter: LoadMeter | None = None, max_queue_wait_s: float | None = None,
                 trim_idle_s: float | None = 1.0, retry_after_s: float = 1.0):
        if max_rows < 1 or decode_batch_images < 1 or encode_threads < 1:
            raise ValueError("max_rows, decode_batch_images and encode_threads must be at least 1")
        if fair_wait_s < 0:
            raise ValueError(f"fair_wait_s must be >= 0, got {fair_wait_s}")
        self.pipeline = pipeline
        self._admission = Admission(max_rows, memory_budget_bytes, fair_wait_s, max_queue_wait_s)
        self.meter = meter if meter is not None else LoadMeter()
        self.retry_after_s = float(retry_after_s)
        self.decider = pipeline.decider
        if costs is not None:
            self.decider.set_costs(costs, merge=False)
        self._cv = threading.Condition()
        self._starting: deque[InFlight] = deque()  # admitted (rows counted), not started yet
        self._running: dict[tuple, list[InFlight]] = {}
        self._finishing: set[InFlight] = set()  # denoised, being decoded and encoded
        self._live: set[InFlight] = set()  # every request submitted and not answered yet
        self._last_steps_s = 0.0  # seconds the last iteration's steps took (bounds the starts of the next)
        self._rows_in_flight = 0
        self._bytes_in_flight = 0
        self._stats = SchedulerStats()
        self._iterations = 0
        self._oom_steps = 0
        self._step_times = StepTimes(pipeline.metrics)
        self._busy_s = 0.0
        self._closed = False
        self._miss_ids = itertools.count()
        self._device = pipeline.model.device
        self._cuda = torch.device(self._device).type == "cuda"
        self._finisher = Finisher(pipeline, decode_batch_images, encode_threads, self._release_bytes,
                                  self._retire_done, self._answer)
        self._previews = PreviewWorker(pipeline.model, self._device, self._preview_left)
        self._trimmer = None if trim_idle_s is None else IdleTrimmer(self._idle, trim_idle_s)
        self._threads: list[threading.Thread] = []
        self._started = False
        self._start_lock = threading.Lock()

    @classmethod
    def from_pipeline(cls, pipeline: DiTPipeline, costs: CostModel | None = None, load_window_s: float = 10.0,
                      retry_after_s: float = 1.0) -> StepScheduler:
        """A scheduler configured by ``pipeline.config.runner`` (``max_rows_in_flight``, ``decode_batch_images``,
        ``encode_threads``, ``fair_wait_s``, ``max_queue_wait_s``, ``trim_idle_s``), its load meter's window
        ``load_window_s`` (the serving layer passes ``autoscaling.look_back_period_s``). On CUDA the memory budget
        of request tensors in flight is half of the device memory free now (after the weights, the graph pool and
        the cost measurement's forwards, whose activation peak the caching allocator keeps reserved)."""
        r = pipeline.config.runner
        sched = cls(pipeline, costs, max_rows=r.max_rows_in_flight, decode_batch_images=r.decode_batch_images,
                    encode_threads=r.encode_threads, fair_wait_s=r.fair_wait_s, max_queue_wait_s=r.max_queue_wait_s,
                    trim_idle_s=r.trim_idle_s, retry_after_s=retry_after_s,
                    meter=LoadMeter(window_s=load_window_s, snapshot_s=min(0.5, load_window_s)))
        sched.measure_memory_budget()
        return sched

    def measure_memory_budget(self) -> None:
        """On CUDA, set the memory budget of request tensors in flight to half of the device memory free now
        (call it again after capture and cost measurement, whose activation peak the caching allocator keeps
        reserved); elsewhere leave it as it is."""
        if self._cuda:
            free, _ = torch.cuda.mem_get_info(self._device)
            with self._cv:
                self._admission.memory_budget_bytes = int(0.5 * free)

    @property
    def costs(self) -> CostModel:
        """The cost model the pipeline's decider uses now."""
        return self.decider.costs

    def set_costs(self, costs: CostModel) -> None:
        """Use ``costs`` from now on (merged over the current model: a shape captured later adds its times)."""
        self.decider.set_costs(costs)

    # -- the request path ---------------------------------------------------------------------------

    async def submit(self, plan: PlannedRequest,
                     on_preview: Callable[[PartialImage], None] | None = None) -> GenerationResult:
        """Queue a request, wait for its images, and return its result.

        With ``on_preview`` and the request's ``partial_images`` > 0, a copy of its latents is taken after each
        step :func:`~bcg_core.preview.preview_steps` picks and drawn by the preview thread (the family's
        ``preview`` hook, resized to the requested size, encoded in its ``output_format``); ``on_preview`` is
        called there, once per image of each preview, with a :class:`~bcg_core.preview.PartialImage`.

        ``timings_ms`` of the result: ``queue`` (submission to admission), ``encode`` (text encoding and noise),
        ``denoise`` (its steps, sharing forwards), ``decode`` (waiting for and running the batched VAE decode),
        ``image_encode`` (PNG, JPEG or WebP encoding) and ``total``, milliseconds.

        Args:
            plan: the request as the planner made it (trusted: it is not validated again).

        Raises:
            TypeError: ``plan`` is not a :class:`~bcg_core.request.PlannedRequest` (nothing is queued).
            RequestCancelled: its cancel event was set.
            asyncio.CancelledError: the caller was cancelled; the request leaves at the next step boundary.
            Exception: whatever broke its start or a forward it took part in.
        """
        if not isinstance(plan, PlannedRequest):
            raise TypeError(f"the step scheduler takes a PlannedRequest (Planner.plan), got {type(plan).__name__}")
        shape = plan.shape
        # requests share forwards only within one bucket shape and token grid; a miss runs alone
        group = (shape, plan.grid) if shape is not None else ("miss", next(self._miss_ids))
        loop = asyncio.get_running_loop()
        item = InFlight(plan, plan.lookup.query.batch, group, shape, threading.Event(), loop.create_future(), loop,
                        time.perf_counter())
        if on_preview is not None and self._previews.available and plan.request.partial_images > 0:
            item.on_preview = on_preview
            item.preview_at = preview_steps(plan.request.num_inference_steps, plan.request.partial_images)
        self._ensure_started()
        self.meter.arrive(shape)
        with self._cv:
            if self._closed:
                raise RuntimeError("the step scheduler is closed")
            self._admission.waiting.append(item)
            self._live.add(item)
            self._cv.notify_all()
        try:
            return await item.future
        except asyncio.CancelledError:
            item.cancel.set()
            with self._cv:
                self._cv.notify_all()
            raise

    async def submit_stream(self, plan: PlannedRequest) -> AsyncIterator[PartialImage | GenerationResult]:
        """:meth:`submit` as an async iterator: the request's previews (:class:`~bcg_core.preview.PartialImage`,
        as they are drawn), then its :class:`GenerationResult`: the result waits for the request's own previews
        that were queued before its last step (so every preview taken comes first; one dropped because the
        preview queue was full never comes). Closing the iterator early (its caller went away) cancels the
        request, as cancelling :meth:`submit` does.

        Raises:
            As :meth:`submit`.
        """
        async for event in stream_events(lambda on_preview: self.submit(plan, on_preview=on_preview)):
            yield event

    def _resolve(self, item: InFlight, value: GenerationResult | BaseException) -> None:
        """Hand ``value`` to the caller's future on its event loop (unless the caller has gone)."""
        with self._cv:
            self._live.discard(item)
            self._finishing.discard(item)
            idle = not self._live
        if idle and self._trimmer is not None:
            self._trimmer.notify()

        item.answer(value)

    def _idle(self) -> bool:
        """No request submitted and not answered yet (the idle trimmer's test)."""
        with self._cv:
            return not self._live and not self._closed

    # -- threads ------------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._started:
                return
            self._started = True
            self._previews.start()
            self._finisher.start()
            t = threading.Thread(target=self._step_loop, name="bcg-step", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the threads; every request not answered yet (waiting, running, decoding or encoding) gets
        :class:`RequestCancelled`."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._previews.close(timeout_s)
        for t in self._threads:
            t.join(timeout_s)
        self._finisher.close(timeout_s)
        if self._trimmer is not None:
            self._trimmer.close(timeout_s)
        with self._cv:
            left = list(self._live)
            self._rows_in_flight = self._bytes_in_flight = 0
        for item in left:
            self._resolve(item, RequestCancelled("the replica is shutting down"))

    def _step_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._admission.waiting and not self._starting and not self._running:
                    self._cv.wait()
                if self._closed:
                    leftover = [*self._admission.waiting, *self._starting, *(i for g in self._running.values() for i in g)]
                    self._admission.waiting.clear()
                    self._starting.clear()
                    self._running.clear()
                    break
                self._starting.extend(self._admit_locked())
            t0 = time.perf_counter()
            with torch.inference_mode():
                self._start_some()
                t1 = time.perf_counter()
                self._iterate()
            t2 = time.perf_counter()
            self._last_steps_s = t2 - t1
            self._busy_s += t2 - t0
        for item in leftover:
            self._resolve(item, RequestCancelled("the replica is shutting down"))

    def _start_some(self) -> None:
        """Start admitted requests (text encoding, noise). With nothing running, all of them; else while the
        starts of this boundary took less than the last iteration's steps (at least one), so a burst of
        arrivals delays the requests in flight by about one iteration, not by every start at once."""
        t0 = time.perf_counter()
        first = True
        with self._cv:
            busy = bool(self._running)  # requests in flight before these starts: they must not wait long
        while True:
            with self._cv:
                if not self._starting:
                    return
                if busy and not first and time.perf_counter() - t0 >= self._last_steps_s:
                    return
                item = self._starting.popleft()
            first = False
            self._start(item)

    def _admit_locked(self) -> list[InFlight]:
        """The requests to start now (:class:`~bcg_core.scheduler.admission.Admission`); the cancelled and expired
        ones are answered. Called with the lock held."""
        now = time.perf_counter()
        out = self._admission.admit(self._rows_in_flight, self._bytes_in_flight, now)
        for item in out.cancelled:
            self._stats.shape(item.shape).cancelled_waiting += 1
            self._resolve(item, RequestCancelled("the request was cancelled by its caller"))
        for item in out.expired:
            self._stats.shape(item.shape).expired += 1
            retry = self.retry_after_s
            self._resolve(item, ServiceUnavailable(
                "request", f"the request waited {now - item.submitted:.0f} s in the replica's queue without "
                f"starting, past runner.max_queue_wait_s {self._admission.max_queue_wait_s:g}; retry after "
                f"{retry:g} s", retry_after_s=retry))
        self._rows_in_flight = out.rows
        return out.start

    def _start(self, item: InFlight) -> None:
        """Start an admitted request (text, noise, its scheduler); a failure is its own error. Its queue wait
        ends here (submission to start)."""
        item.admitted = time.perf_counter()
        wait_ms = (item.admitted - item.submitted) * 1e3
        with self._cv:
            st = self._stats.shape(item.shape)
            st.admitted += 1
            st.waits_ms.append(wait_ms)
            st.wait_ms_sum += wait_ms
            st.wait_ms_max = max(st.wait_ms_max, wait_ms)
        if item.cancel.is_set():
            self._retire(item, RequestCancelled("the request was cancelled by its caller"), cancelled=True)
            return
        try:
            item.state = self.pipeline.start(item.plan, item.cancel)
        except Exception as e:  # noqa: BLE001 - this request's own error
            with self._cv:
                self._admission.failed(item)
            self._retire(item, e, failed=True)
            return
        item.started = time.perf_counter()
        item.nbytes = tensor_bytes(item.state)
        with self._cv:
            self._bytes_in_flight += item.nbytes
            self._admission.measured(item)
            self._running.setdefault(item.group, []).append(item)
        self.meter.start(item, item.shape)

    def _retire(self, item: InFlight, error: BaseException | None, cancelled: bool = False,
                failed: bool = False) -> None:
        """Take ``item`` out of flight (its rows and bytes freed); with ``error``, hand it to the caller."""
        with self._cv:
            self._leave_running(item)
            self._bytes_in_flight -= item.nbytes
            item.nbytes = 0
            st = self._stats.shape(item.shape)
            if cancelled:
                st.cancelled += 1
            if failed:
                st.failed += 1
            self._cv.notify_all()
        self.meter.finish(item, 0)
        if error is not None:
            self._resolve(item, error)

    def _leave_running(self, item: InFlight) -> None:
        """Take ``item`` out of its running group and free its rows; called with the lock held."""
        group = self._running.get(item.group)
        if group is not None and item in group:
            group.remove(item)
            if not group:
                del self._running[item.group]
        self._rows_in_flight -= item.rows

    def _iterate(self) -> None:
        """Step every group in flight once (oldest group first), then retire what finished or left."""
        with self._cv:
            groups = sorted(self._running.items(), key=lambda kv: min(i.submitted for i in kv[1]))
        self._iterations += 1
        for group, items in groups:
            live = []
            for item in items:
                if item.cancel.is_set():
                    self._retire(item, RequestCancelled("the request was cancelled by its caller"), cancelled=True)
                else:
                    live.append(item)
            if live:
                self._step_group(group, live)

    def _step_group(self, group: tuple, items: list[InFlight]) -> None:
        states = [i.state for i in items]
        shape = items[0].shape
        rows = sum(s.rows for s in states)
        forwards = self.decider.decide(shape, rows)
        begin = timing_mark(self._device)
        try:
            failpoints.step_oom()
            self.pipeline.step(states, forwards)
        except Exception as e:
            if is_out_of_memory(e):
                # the requests of this step are answered 503 with Retry-After; the replica goes on serving
                self._oom_steps += 1
                log.warning("a step of %d requests (shape %s) ran out of GPU memory; answering them 503: %s",
                            len(items), shape, str(e).splitlines()[0] if str(e) else type(e).__name__)
                if self._cuda:
                    torch.cuda.empty_cache()
                retry = self.retry_after_s
                e = ServiceUnavailable("request", f"the GPU ran out of memory during this request's denoising step; "
                                       f"retry after {retry:g} s", retry_after_s=retry)
            else:
                log.exception("a step of %d requests (shape %s) failed", len(items), shape)
            for item in items:
                self._retire(item, e, failed=True)
            return
        with self._cv:
            computed = self._stats.count_step(shape, forwards, [(i.rows, i.plan.lookup.query) for i in items])
        key = forwards.counted_key
        self._step_times.add(begin, timing_mark(self._device), key, states)
        for item, share in zip(items, token_shares(computed, [s.rows for s in states])):
            if item.first_key is None and item.state.step_index == 1:
                item.first_key = key if key is not None else item.plan.lookup.key
                item.first_share = share
            item.company = max(item.company, len(items))
        for item in items:
            if item.preview_at and item.state.step_index in item.preview_at:
                self._take_preview(item)
        for item in items:
            if item.state.done:
                self._finish_denoise(item)

    def _finish_denoise(self, item: InFlight) -> None:
        """A request's last step is queued: record its event and hand it to the decode thread."""
        item.denoised = time.perf_counter()
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self._device))
            item.done_event = ev
        with self._cv:
            self._leave_running(item)
            self._finishing.add(item)
            self._cv.notify_all()
        self._finisher.put(item)

    # -- previews -------------------------------------------------------------------------------------

    def _take_preview(self, item: InFlight) -> None:
        """On the denoising thread: hand a copy of the request's latents to the preview worker (a latent copy and
        a queue put, timed there); counted pending until it leaves the worker's queue."""
        with self._cv:
            item.previews_pending += 1
        if not self._previews.take(item):
            with self._cv:
                item.previews_pending -= 1

    def _preview_left(self, item: InFlight) -> None:
        """One preview of ``item`` left the worker's queue; the last one releases a result held for it."""
        with self._cv:
            item.previews_pending -= 1
            held = item.held if item.previews_pending == 0 else None
            item.held = None if held is not None else item.held
        if held is not None:
            self._resolve(item, held)

    # -- finishing (the decode thread and the encoding pool call these) ---------------------------------

    def _release_bytes(self, item: InFlight) -> None:
        with self._cv:
            self._bytes_in_flight -= item.nbytes
            item.nbytes = 0
            self._cv.notify_all()

    def _retire_done(self, item: InFlight, error: BaseException, cancelled: bool = False, failed: bool = False):
        """A request that finished denoising but will not be answered with images."""
        with self._cv:
            st = self._stats.shape(item.shape)
            st.cancelled += cancelled
            st.failed += failed
        self.meter.finish(item, 0)
        self._resolve(item, error)

    def _answer(self, item: InFlight, result: GenerationResult) -> None:
        """A finished request's result (built by the finisher): counted, held for its pending previews or
        handed to its caller; once :meth:`close` has begun, :class:`RequestCancelled` instead (close answers every
        request not answered yet that way, whichever thread finishes it)."""
        if self._closed:
            self._retire_done(item, RequestCancelled("the replica is shutting down"), cancelled=True)
            return
        with self._cv:
            self._stats.shape(item.shape).completed += 1
            held = item.previews_pending > 0
            if held:  # its previews are still being drawn: the last one resolves it, so they all come first
                item.held = result
        self.meter.finish(item, 1)
        if not held:
            self._resolve(item, result)

    # -- introspection ------------------------------------------------------------------------------

    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting, starting, running, decoding or encoding per bucket shape (misses left out), for
        routing stats, the ``bcg_queue_length`` gauge and autoscaling's in-flight count."""
        with self._cv:
            return queue_lengths([*self._admission.waiting, *self._starting,
                                  *(i for g in self._running.values() for i in g), *self._finishing])

    @property
    def oom_steps(self) -> int:
        """Steps that ran out of device memory since start (their requests were answered 503)."""
        return self._oom_steps

    def stats(self) -> dict:
        """``GET /v1/buckets``'s ``scheduler`` section (:mod:`bcg_core.scheduler.stats`): settings, totals,
        ``padded_token_waste`` over every forward, the cost model, and per shape its counters."""
        with self._cv:
            in_flight = [*self._starting, *(i for g in self._running.values() for i in g)]
            out = self._stats.describe(in_flight, list(self._admission.waiting))
            return {
                "kind": "step", "max_rows_in_flight": self._admission.max_rows, "rows_in_flight": self._rows_in_flight,
                "bytes_in_flight": self._bytes_in_flight, "memory_budget_bytes": self._admission.memory_budget_bytes,
                "waiting": len(self._admission.waiting), "starting": len(self._starting),
                "running": sum(len(g) for g in self._running.values()), "finishing": len(self._finishing),
                "iterations": self._iterations, "busy_s": round(self._busy_s, 3), "oom_steps": self._oom_steps,
                "decode_batch_images": self._finisher.decode_batch_images, "fair_wait_s": self._admission.fair_wait_s,
                **out, "costs": self.costs.describe(), "previews": self._previews.describe(),
                "memory_trim": self._trimmer.describe() if self._trimmer is not None else None,
            }
