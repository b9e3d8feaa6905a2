"""The step scheduler: continuous batching of denoising steps into bucket forwards, per replica.

Requests join and leave at step boundaries instead of sharing a whole loop. One denoising thread runs
*iterations*; each iteration:

1. **Admits** waiting requests (at a step boundary), oldest first, while the rows in flight stay within
   ``runner.max_rows_in_flight`` (and, on CUDA, their tensors within the measured memory budget; a group's
   first request is admitted alone until its tensors are measured), and starts them
   (:meth:`~bcg_core.pipeline.DiTPipeline.start`: text encoded, noise drawn, its own scheduler set up). With
   requests in flight, the starts of one boundary stop once they took as long as the last iteration's steps
   (at least one starts; the rest start at the next boundaries), so a burst of arrivals delays the requests
   in flight by about one iteration per boundary. A request's queue wait runs from submission to its start. Admission is FIFO within a batch group (bucket shape and token grid): a request
   that does not fit holds back the later requests of its group only, so an incompatible request at the head
   never blocks the others. A request that has waited longer than ``fair_wait_s`` holds back every later
   request until it fits, so no request (and no rare shape) waits for admission without bound. A request
   larger than the whole budget is admitted alone, when nothing else runs or is being decoded.
2. **Steps every group** that has requests in flight, oldest group first (a request with more rows than the
   largest batch bucket belongs to its shape's group, :meth:`~bcg_core.pipeline.DiTPipeline.split_home`): one denoising step of *every*
   request of the group (each at its own step and timestep, with its own guidance and scheduler), in the
   forwards the cost model (:class:`~bcg_core.scheduler.costs.CostModel`) finds cheapest for the group's rows: one full
   bucket (``fill``), one bucket with padded rows (``pad``), several buckets (``split``, e.g. 9 rows as
   8 + 1), or unpadded eager chunks where no graph pays (``eager``). Every group steps once per iteration,
   so a rare shape is never starved: it waits at most one step of each other group.
3. **Retires** finished requests (handed to the decode thread) and cancelled ones (their rows leave at this
   step boundary; the caller gets :class:`~bcg_core.errors.RequestCancelled` if still waiting).

Off the denoising thread's path:

- a **decode thread** takes finished requests, batches those of one image size (up to
  ``runner.decode_batch_images`` images) into one family decode call, on its own CUDA stream (waiting on an
  event recorded after each request's last step), so decoding overlaps the next denoising steps;
- a **thread pool** (``runner.encode_threads``) encodes each decoded image (PNG, JPEG or WebP, the request's
  ``output_format``); the caller's future is resolved on its event loop when the request's last image is
  encoded. Each image's file goes into the :class:`~bcg_core.request.GenerationResult` once; the replica
  returns that object to the ingress.
- a **preview thread** draws the previews of streamed requests (``partial_images``, :mod:`bcg_core.preview`):
  after a step :func:`~bcg_core.preview.preview_steps` picks, the denoising thread only copies the request's
  latents (one device copy; on CUDA an event marks its end) and puts the copy on a bounded queue
  (:data:`~bcg_core.scheduler.previews.PREVIEW_QUEUE`; full: the preview is dropped and counted, never waited
  for; :class:`~bcg_core.scheduler.previews.PreviewWorker`). The preview thread
  waits for the copy on its own CUDA stream, calls the family's ``preview`` hook (a linear latent-to-RGB map
  on the host), resizes, encodes and hands each image to the request's callback; a request's result is held
  until its queued previews are drawn, so they reach the caller first. What the hand-off costs the denoising
  thread is measured per preview (``previews`` in :meth:`StepScheduler.stats`).

Cancellation: a caller's ``asyncio.CancelledError`` sets the request's cancel event; a waiting request leaves
the queue at the next admission, a running one at the next step boundary, a finished one is not decoded.

Errors: a request whose start raises gets that error alone; a forward that raises fails the requests of
that step only (each gets the error), and the thread goes on serving.

Metrics (:meth:`StepScheduler.stats`, ``GET /v1/buckets`` under ``scheduler``; Prometheus through
``deployments/metrics.py``), per bucket shape: rows and requests in flight, requests waiting, forwards by kind
(``graph``: a one-forward step on a bucket; ``split``: a bucket forward of a split step; ``eager``: an
unpadded forward), step decisions, the mean fill of bucket forwards (real rows / bucket rows),
padded-token waste (``1 - real / computed tokens`` over every forward) and queue wait (submission to
admission, milliseconds). Each completed request is also recorded in the pipeline's
:class:`~bcg_core.metrics.BucketMetrics` (the bucket of its first forward, its share by rows of that step's
computed tokens).

Pure threads and asyncio, no Ray: :mod:`deployments.dit` owns one scheduler per replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from bcg_core import failpoints
from bcg_core.errors import RequestCancelled, ServiceUnavailable
from bcg_core.families import RequestState
from bcg_core.images import encode_image
from bcg_core.keys import BucketKey, BucketShape
from bcg_core.metrics import token_shares
from bcg_core.pipeline import DiTPipeline, elapsed_ms, timing_mark
from bcg_core.preview import PartialImage, preview_steps
from bcg_core.request import GenerationResult, PlannedRequest
from bcg_core.runners.base import is_out_of_memory
from bcg_core.scheduler.costs import DECISIONS, CostModel, StepForwards
from bcg_core.scheduler.finish import build_result
from bcg_core.scheduler.load import LoadMeter
from bcg_core.scheduler.memtrim import IdleTrimmer
from bcg_core.scheduler.previews import PreviewWorker

__all__ = ["FORWARD_KINDS", "StepScheduler"]

log = logging.getLogger(__name__)

FORWARD_KINDS = ("graph", "split", "eager")
"""Forwards counted by the step scheduler: a step's only forward, on a bucket (a graph replay on CUDA); a
bucket forward of a step split into several; an unpadded eager forward (a miss, or the cost model's choice)."""

_WAITS_KEPT = 1024
"""Queue waits kept per shape for the p50 / p99 in :meth:`StepScheduler.stats` (the most recent ones)."""

@dataclasses.dataclass(eq=False)
class _Request:
    """One submitted request and what the scheduler tracks of it."""

    plan: PlannedRequest
    rows: int
    group: tuple
    shape: BucketShape | None
    cancel: threading.Event
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float
    admitted: float = 0.0
    started: float = 0.0
    denoised: float = 0.0
    decoded: float = 0.0
    state: RequestState | None = None
    first_key: BucketKey | None = None
    first_share: int = 0
    company: int = 1  # most requests that shared one step with it
    nbytes: int = 0
    done_event: object | None = None
    on_preview: Callable[[PartialImage], None] | None = None  # called from the preview thread
    preview_at: tuple[int, ...] = ()  # steps done after which a preview is taken
    previews_pending: int = 0  # queued for the preview thread, not drawn yet
    held: GenerationResult | None = None  # the result, waiting for the request's pending previews


@dataclasses.dataclass
class _ShapeStats:
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
    waits_ms: deque = dataclasses.field(default_factory=lambda: deque(maxlen=_WAITS_KEPT))
    wait_ms_sum: float = 0.0
    wait_ms_max: float = 0.0


def _tensor_bytes(state: RequestState) -> int:
    """Bytes of a request state's tensors (latents and text rows) held while it is in flight."""
    total = state.latents.numel() * state.latents.element_size()
    for rows in (state.cond, state.uncond):
        if rows is None:
            continue
        for f in dataclasses.fields(rows):  # not astuple: it would deep-copy the tensors
            t = getattr(rows, f.name)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return round(xs[i], 2)


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
        self.max_rows = int(max_rows)
        self.memory_budget_bytes = memory_budget_bytes
        self.decode_batch_images = int(decode_batch_images)
        self.fair_wait_s = float(fair_wait_s)
        self.max_queue_wait_s = None if max_queue_wait_s is None else float(max_queue_wait_s)
        self.meter = meter if meter is not None else LoadMeter()
        self.retry_after_s = float(retry_after_s)
        self.decider = pipeline.decider
        if costs is not None:
            self.decider.set_costs(costs, merge=False)
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._starting: deque[_Request] = deque()  # admitted (rows counted), not started yet
        self._running: dict[tuple, list[_Request]] = {}
        self._finishing: set[_Request] = set()  # denoised, being decoded and encoded
        self._live: set[_Request] = set()  # every request submitted and not answered yet
        self._unmeasured: set[tuple] = set()  # groups with a request admitted before their bytes are known
        self._last_steps_s = 0.0  # seconds the last iteration's steps took (bounds the starts of the next)
        self._rows_in_flight = 0
        self._bytes_in_flight = 0
        self._bytes_per_row: dict[tuple, float] = {}
        self._stats: dict[str, _ShapeStats] = {}
        self._iterations = 0
        self._oom_steps = 0
        self._spans: deque = deque()  # (start, end, key, states) of steps not yet recorded
        self._busy_s = 0.0
        self._closed = False
        self._miss_ids = itertools.count()
        self._decode_q: queue.Queue = queue.Queue()
        self._pool = ThreadPoolExecutor(max_workers=int(encode_threads), thread_name_prefix="bcg-png")
        self._device = pipeline.model.device
        self._cuda = torch.device(self._device).type == "cuda"
        self._decode_stream = torch.cuda.Stream(self._device) if self._cuda else None
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
                self.memory_budget_bytes = int(0.5 * free)

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
        item = _Request(plan, plan.lookup.query.batch, group, shape, threading.Event(), loop.create_future(), loop,
                        time.perf_counter())
        if on_preview is not None and self._previews.available and plan.request.partial_images > 0:
            item.on_preview = on_preview
            item.preview_at = preview_steps(plan.request.num_inference_steps, plan.request.partial_images)
        self._ensure_started()
        self.meter.arrive(shape)
        with self._cv:
            if self._closed:
                raise RuntimeError("the step scheduler is closed")
            self._waiting.append(item)
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
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        task = loop.create_task(self.submit(plan, on_preview=lambda p: loop.call_soon_threadsafe(events.put_nowait, p)))
        try:
            while True:
                getter = loop.create_task(events.get())
                try:
                    done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter in done:
                    yield getter.result()
                    continue
                while not events.empty():
                    yield events.get_nowait()
                yield task.result()
                return
        finally:
            if not task.done():
                task.cancel()  # submit's handler sets the request's cancel event

    def _resolve(self, item: _Request, value: GenerationResult | BaseException) -> None:
        """Hand ``value`` to the caller's future on its event loop (unless the caller has gone)."""
        with self._cv:
            self._live.discard(item)
            self._finishing.discard(item)
            idle = not self._live
        if idle and self._trimmer is not None:
            self._trimmer.notify()

        def set_it():
            if item.future.done():
                return
            if isinstance(value, BaseException):
                item.future.set_exception(value)
            else:
                item.future.set_result(value)

        try:
            item.loop.call_soon_threadsafe(set_it)
        except RuntimeError:  # the caller's loop has closed
            pass

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
            for target, name in ((self._step_loop, "bcg-step"), (self._decode_loop, "bcg-decode")):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self._threads.append(t)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the threads; every request not answered yet (waiting, running, decoding or encoding) gets
        :class:`RequestCancelled`."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._decode_q.put(None)
        self._previews.close(timeout_s)
        for t in self._threads:
            t.join(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
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
                while not self._closed and not self._waiting and not self._starting and not self._running:
                    self._cv.wait()
                if self._closed:
                    leftover = [*self._waiting, *self._starting, *(i for g in self._running.values() for i in g)]
                    self._waiting.clear()
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

    def _admit_locked(self) -> list[_Request]:
        """Pop the waiting requests to admit now (module docstring, step 1); called with the lock held."""
        now = time.perf_counter()
        out: list[_Request] = []
        held: set[tuple] = set()
        rows, nbytes = self._rows_in_flight, self._bytes_in_flight
        for item in list(self._waiting):
            if item.cancel.is_set():
                self._waiting.remove(item)
                self._stat(item.shape).cancelled_waiting += 1
                self._resolve(item, RequestCancelled("the request was cancelled by its caller"))
                continue
            if self.max_queue_wait_s is not None and now - item.submitted > self.max_queue_wait_s:
                self._waiting.remove(item)
                self._stat(item.shape).expired += 1
                retry = self.retry_after_s
                self._resolve(item, ServiceUnavailable(
                    "request", f"the request waited {now - item.submitted:.0f} s in the replica's queue without "
                    f"starting, past runner.max_queue_wait_s {self.max_queue_wait_s:g}; retry after {retry:g} s",
                    retry_after_s=retry))
                continue
            if item.group in held:
                continue
            known = item.group in self._bytes_per_row
            if self.memory_budget_bytes is not None and not known and item.group in self._unmeasured:
                held.add(item.group)  # one request of a new group first: its tensors give the estimate
                continue
            estimate = int(self._bytes_per_row.get(item.group, 0.0) * item.rows)
            alone = rows == 0 and nbytes == 0 and not out  # nothing in flight, nothing being decoded
            fits = rows + item.rows <= self.max_rows and (
                self.memory_budget_bytes is None or nbytes + estimate <= self.memory_budget_bytes)
            if fits or alone:
                self._waiting.remove(item)
                if not known:
                    self._unmeasured.add(item.group)
                out.append(item)
                rows += item.rows
                nbytes += estimate
                continue
            held.add(item.group)
            if now - item.submitted > self.fair_wait_s:
                break  # it has waited past the bound: nothing later jumps ahead of it
        self._rows_in_flight = rows
        return out

    def _stat(self, shape: str | None) -> _ShapeStats:
        key = shape or "miss"
        s = self._stats.get(key)
        if s is None:
            s = self._stats[key] = _ShapeStats()
        return s

    def _start(self, item: _Request) -> None:
        """Start an admitted request (text, noise, its scheduler); a failure is its own error. Its queue wait
        ends here (submission to start)."""
        item.admitted = time.perf_counter()
        wait_ms = (item.admitted - item.submitted) * 1e3
        with self._cv:
            st = self._stat(item.shape)
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
                self._unmeasured.discard(item.group)
            self._retire(item, e, failed=True)
            return
        item.started = time.perf_counter()
        item.nbytes = _tensor_bytes(item.state)
        with self._cv:
            self._bytes_in_flight += item.nbytes
            self._bytes_per_row[item.group] = item.nbytes / max(1, item.rows)
            self._unmeasured.discard(item.group)
            self._running.setdefault(item.group, []).append(item)
        self.meter.start(item, item.shape)

    def _retire(self, item: _Request, error: BaseException | None, cancelled: bool = False,
                failed: bool = False) -> None:
        """Take ``item`` out of flight (its rows and bytes freed); with ``error``, hand it to the caller."""
        with self._cv:
            self._leave_running(item)
            self._bytes_in_flight -= item.nbytes
            item.nbytes = 0
            st = self._stat(item.shape)
            if cancelled:
                st.cancelled += 1
            if failed:
                st.failed += 1
            self._cv.notify_all()
        self.meter.finish(item, 0)
        if error is not None:
            self._resolve(item, error)

    def _leave_running(self, item: _Request) -> None:
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

    def _step_group(self, group: tuple, items: list[_Request]) -> None:
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
        computed = self._count_step(shape, forwards, items)
        key = forwards.counted_key
        self._spans.append((begin, timing_mark(self._device), key, states))
        self._record_spans()
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

    def _record_spans(self) -> None:
        """Record the step milliseconds of every step the GPU has finished (never waits for one): per bucket
        in the pipeline's metrics, and in each request's ``step_ms``."""
        done: dict[BucketKey | None, list[float]] = {}
        while self._spans:
            a, b, key, states = self._spans[0]
            if self._cuda and not b.query():
                break
            ms = elapsed_ms(a, b)
            self._spans.popleft()
            done.setdefault(key, []).append(ms)
            for state in states:
                state.step_ms.append(ms)
        for key, ms in done.items():
            self.pipeline.metrics.record_steps(key, ms)

    @staticmethod
    def _real_tokens(items: list[_Request], rows: int) -> int:
        """Real tokens of ``rows`` rows of these requests (tokens per row of the first; one shape)."""
        q = items[0].plan.lookup.query
        return rows * (q.image_tokens + q.text_tokens)

    def _count_step(self, shape: BucketShape | None, plan: StepForwards, items: list[_Request]) -> int:
        """Count one step of ``items`` run as ``plan`` in the shape's stats; returns the tokens it computed
        (a bucket forward's padded tokens, an eager chunk's real ones)."""
        real = sum(i.rows * (i.plan.lookup.query.image_tokens + i.plan.lookup.query.text_tokens) for i in items)
        computed = 0
        with self._cv:
            st = self._stat(shape)
            st.steps += 1
            st.decisions[plan.decision.value] += 1
            split = len(plan.chunks) > 1
            for c in plan.chunks:
                if c.key is None:
                    st.forwards["eager"] += 1
                    computed += self._real_tokens(items, c.rows)
                else:
                    st.forwards["split" if split else "graph"] += 1
                    st.bucket_rows += c.key.batch
                    st.bucket_real_rows += c.rows
                    computed += c.key.tokens
            st.computed_tokens += computed
            st.real_tokens += real
        return computed

    def _finish_denoise(self, item: _Request) -> None:
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
        self._decode_q.put(item)

    # -- previews -------------------------------------------------------------------------------------

    def _take_preview(self, item: _Request) -> None:
        """On the denoising thread: hand a copy of the request's latents to the preview worker (a latent copy and
        a queue put, timed there); counted pending until it leaves the worker's queue."""
        with self._cv:
            item.previews_pending += 1
        if not self._previews.take(item):
            with self._cv:
                item.previews_pending -= 1

    def _preview_left(self, item: _Request) -> None:
        """One preview of ``item`` left the worker's queue; the last one releases a result held for it."""
        with self._cv:
            item.previews_pending -= 1
            held = item.held if item.previews_pending == 0 else None
            item.held = None if held is not None else item.held
        if held is not None:
            self._resolve(item, held)

    # -- decode and encode ----------------------------------------------------------------------------

    @staticmethod
    def _decode_key(item: _Request) -> tuple:
        s = item.state
        r = s.request
        return (tuple(s.latents.shape[1:]), s.latents.dtype, r.width, r.height, s.extras.get("size"))

    def _decode_loop(self) -> None:
        pending: deque[_Request] = deque()
        while True:
            item = pending.popleft() if pending else self._decode_q.get()
            if item is None:
                break
            batch = [item]
            key, images = self._decode_key(item), item.state.n
            while True:  # take every finished request queued now; same size joins this decode
                try:
                    nxt = self._decode_q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    pending.append(None)  # stop after this batch
                    break
                if self._decode_key(nxt) == key and images + nxt.state.n <= self.decode_batch_images:
                    batch.append(nxt)
                    images += nxt.state.n
                else:
                    pending.append(nxt)
            self._decode(batch)

    def _decode(self, batch: list[_Request]) -> None:
        live = []
        for item in batch:
            if item.cancel.is_set():
                self._release_bytes(item)
                self._retire_done(item, RequestCancelled("the request was cancelled by its caller"), cancelled=True)
            else:
                live.append(item)
        if not live:
            return
        try:
            with torch.inference_mode():
                if self._cuda:
                    with torch.cuda.stream(self._decode_stream):
                        for item in live:
                            self._decode_stream.wait_event(item.done_event)
                        images = self._decode_many([i.state for i in live])
                else:
                    images = self._decode_many([i.state for i in live])
        except Exception as e:
            log.exception("decoding %d requests failed", len(live))
            for item in live:
                self._release_bytes(item)
                self._retire_done(item, e, failed=True)
            return
        now = time.perf_counter()
        for item, imgs in zip(live, images):
            item.decoded = now
            self._release_bytes(item)
            self._encode(item, imgs)

    def _decode_many(self, states: list[RequestState]) -> list[list]:
        """Decode requests of one image size in one family decode call; the images of each, in order.

        The states are merged into one (their latents concatenated along rows; a family's decode reads only
        the latents, the requested size and ``extras["size"]``), decoded, and split back by image counts.
        """
        if len(states) == 1:
            return [self.pipeline.model.decode(states[0])]
        merged = dataclasses.replace(states[0], latents=torch.cat([s.latents for s in states]))
        images = self.pipeline.model.decode(merged)
        out, a = [], 0
        for s in states:
            out.append(images[a : a + s.n])
            a += s.n
        return out

    def _release_bytes(self, item: _Request) -> None:
        with self._cv:
            self._bytes_in_flight -= item.nbytes
            item.nbytes = 0
            self._cv.notify_all()

    def _retire_done(self, item: _Request, error: BaseException, cancelled: bool = False, failed: bool = False):
        """A request that finished denoising but will not be answered with images."""
        with self._cv:
            st = self._stat(item.shape)
            st.cancelled += cancelled
            st.failed += failed
        self.meter.finish(item, 0)
        self._resolve(item, error)

    def _encode(self, item: _Request, images: list) -> None:
        """Encode ``images`` in the pool (the request's ``output_format``, :func:`~bcg_core.images.encode_image`);
        the last one done resolves the caller's future."""
        pngs: list[bytes | None] = [None] * len(images)
        fmt, compression = item.plan.request.output_format, item.plan.request.output_compression
        remaining = [len(images)]
        lock = threading.Lock()
        t0 = time.perf_counter()

        def one(i: int, image) -> None:
            try:
                pngs[i] = encode_image(image, fmt, compression)
            except Exception as e:  # noqa: BLE001
                pngs[i] = e  # type: ignore[assignment]
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._complete(item, pngs, t0)

        for i, image in enumerate(images):
            self._pool.submit(one, i, image)

    def _complete(self, item: _Request, pngs: list, png_t0: float) -> None:
        """Assemble the result, record the request's metrics and resolve its future."""
        failed = next((p for p in pngs if isinstance(p, BaseException)), None)
        if failed is not None:
            self._retire_done(item, failed, failed=True)
            return
        if item.cancel.is_set():  # its caller left while the images were decoded or encoded
            self._retire_done(item, RequestCancelled("the request was cancelled by its caller"), cancelled=True)
            return
        t_end = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1e3, 2)  # noqa: E731
        result = build_result(item.plan, pngs, item.first_key, item.first_share, item.company, self.pipeline.metrics, {
            "queue": ms(item.submitted, item.admitted), "encode": ms(item.admitted, item.started),
            "denoise": ms(item.started, item.denoised), "decode": ms(item.denoised, item.decoded),
            "image_encode": ms(png_t0, t_end), "total": ms(item.submitted, t_end)})
        with self._cv:
            self._stat(item.shape).completed += 1
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
            counts: Counter[str] = Counter()
            for i in self._waiting:
                if i.shape:
                    counts[i.shape] += 1
            for i in [*self._starting, *(i for g in self._running.values() for i in g), *self._finishing]:
                if i.shape:
                    counts[i.shape] += 1
        return dict(sorted(counts.items()))

    @property
    def oom_steps(self) -> int:
        """Steps that ran out of device memory since start (their requests were answered 503)."""
        return self._oom_steps

    def stats(self) -> dict:
        """``GET /v1/buckets``'s ``scheduler`` section (module docstring, Metrics): settings, totals,
        ``padded_token_waste`` over every forward, the cost model, and per shape its counters."""
        with self._cv:
            in_flight: Counter[str] = Counter()
            requests: Counter[str] = Counter()
            waiting: Counter[str] = Counter()
            for i in [*self._starting, *(i for g in self._running.values() for i in g)]:
                in_flight[i.shape or "miss"] += i.rows
                requests[i.shape or "miss"] += 1
            for i in self._waiting:
                waiting[i.shape or "miss"] += 1
            shapes = {}
            for name in sorted(set(self._stats) | set(in_flight) | set(waiting)):
                st = self._stats.get(name, _ShapeStats())
                waits = list(st.waits_ms)
                shapes[name] = {
                    "rows_in_flight": in_flight.get(name, 0), "requests_in_flight": requests.get(name, 0),
                    "waiting": waiting.get(name, 0), "steps": st.steps,
                    "forwards": {k: st.forwards.get(k, 0) for k in FORWARD_KINDS},
                    "decisions": {k: st.decisions.get(k, 0) for k in DECISIONS},
                    "fill": round(st.bucket_real_rows / st.bucket_rows, 4) if st.bucket_rows else None,
                    "real_tokens": st.real_tokens, "computed_tokens": st.computed_tokens,
                    "padded_token_waste": round(1 - st.real_tokens / st.computed_tokens, 4) if st.computed_tokens else 0.0,
                    "admitted": st.admitted, "completed": st.completed, "cancelled": st.cancelled, "failed": st.failed,
                    "cancelled_waiting": st.cancelled_waiting, "expired": st.expired,
                    "queue_wait_ms": {"sum": st.wait_ms_sum,
                                      "mean": round(st.wait_ms_sum / st.admitted, 2) if st.admitted else None,
                                      "p50": _percentile(waits, 50), "p99": _percentile(waits, 99),
                                      "max": round(st.wait_ms_max, 2)},
                }
            real = sum(s.real_tokens for s in self._stats.values())
            computed = sum(s.computed_tokens for s in self._stats.values())
            forwards = Counter()
            decisions = Counter()
            for s in self._stats.values():
                forwards.update(s.forwards)
                decisions.update(s.decisions)
            return {
                "kind": "step", "max_rows_in_flight": self.max_rows, "rows_in_flight": self._rows_in_flight,
                "bytes_in_flight": self._bytes_in_flight, "memory_budget_bytes": self.memory_budget_bytes,
                "waiting": len(self._waiting), "starting": len(self._starting),
                "running": sum(len(g) for g in self._running.values()), "finishing": len(self._finishing),
                "iterations": self._iterations, "busy_s": round(self._busy_s, 3), "oom_steps": self._oom_steps,
                "decode_batch_images": self.decode_batch_images, "fair_wait_s": self.fair_wait_s,
                "forwards": {k: forwards.get(k, 0) for k in FORWARD_KINDS},
                "decisions": {k: decisions.get(k, 0) for k in DECISIONS},
                "real_tokens": real, "computed_tokens": computed,
                "padded_token_waste": round(1 - real / computed, 4) if computed else 0.0,
                "costs": self.costs.describe(), "shapes": shapes, "previews": self._previews.describe(),
                "memory_trim": self._trimmer.describe() if self._trimmer is not None else None,
            }
