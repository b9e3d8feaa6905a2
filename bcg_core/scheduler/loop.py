"""The denoising loop of the step scheduler: continuous batching of denoising steps into bucket forwards, per replica.

Requests join and leave at step boundaries. One denoising thread runs *iterations*; each iteration:

1. **Admits** waiting requests (:mod:`bcg_core.scheduler.admission`) and starts them
   (:meth:`~bcg_core.pipeline.DiTPipeline.start`: text encoded, noise drawn, its own scheduler set up). With
   requests in flight, the starts of one boundary stop once they took as long as the last iteration's steps (at
   least one starts), so a burst of arrivals delays the requests in flight by about one iteration per boundary.
   An edit (a request with an ``image``) is not started here: its start, with its image's VAE encode, runs on the
   edit-start thread (:mod:`bcg_core.scheduler.edit_start`, the edits of a boundary encoded together), which hands the
   started request back; it joins the running requests at the next boundary.
2. **Steps every group** in flight (one bucket shape and token grid; a request with more rows than the largest
   batch bucket belongs to its shape's group), oldest group first: one denoising step of every request of the
   group, each at its own step and timestep, in the forwards the pipeline's
   :class:`~bcg_core.costs.StepDecider` chooses (``fill``, ``pad``, ``split`` or ``eager``); where
   requests with and without LoRA adapters mix, as two steps when the measured costs say that is cheaper; on a
   model of several experts (Wan 2.2), the requests at each expert as a step of its own (:mod:`bcg_core.experts`). Every
   group steps once per iteration, so a rare shape waits at most one step of each other group.
3. **Retires** finished requests (to the :class:`~bcg_core.scheduler.finish.Finisher`: decode thread and
   encoding pool) and cancelled ones (their rows leave at this step boundary).

Streamed requests hand a latent copy to the preview thread after the steps
:func:`~bcg_core.preview.preview_steps` picks (:mod:`bcg_core.scheduler.previews`); a result is held until the
request's queued previews are drawn, so they reach the caller first. A request with an ``on_step`` (a video job's
progress) gets a :class:`~bcg_core.preview.StepProgress` after each of its steps, handed off on this thread.

A cancelled request leaves the queue at the next admission, a running one at the next step boundary. Errors: a
request whose start raises gets that error alone; a forward that raises fails the requests of that step only (an
out-of-memory step is answered 503 with ``Retry-After``), and the thread goes on serving. The requests and their
counters live in :class:`~bcg_core.scheduler.flight.Flight`; :class:`~bcg_core.scheduler.StepScheduler` is the
asyncio front. docs/DESIGN.md section 12.
"""

from __future__ import annotations

import logging
import time

import torch

from bcg_core import failpoints
from bcg_core.devices import timing_mark
from bcg_core.errors import RequestCancelled, ServiceUnavailable
from bcg_core.metrics import token_shares
from bcg_core.pipeline import DiTPipeline
from bcg_core.preview import StepProgress
from bcg_core.runners.base import is_out_of_memory
from bcg_core.scheduler.admission import InFlight, tensor_bytes
from bcg_core.scheduler.edit_start import EditStarter, is_edit, use_on_stream
from bcg_core.scheduler.finish import Finisher
from bcg_core.scheduler.flight import Flight
from bcg_core.scheduler.previews import PreviewWorker
from bcg_core.scheduler.stats import StepTimes
from bcg_core.step_cache.step import request_cache

__all__ = ["DenoisingLoop"]

log = logging.getLogger(__name__)


class DenoisingLoop:
    """The denoising thread's work (module docstring): admit, start, step every group, retire.

    Args:
        flight: the requests in flight (shared with the front, the finisher and the preview worker).
        pipeline: the replica's pipeline; its decider chooses each step's forwards.
        finisher: takes requests whose last step is queued.
        previews: takes latent copies of streamed requests.
        retry_after_s: the ``Retry-After`` seconds of a 503 (an expired wait, an out-of-memory step).
        edit_start_batch: most edits started together on the edit-start thread (one round).
        encode_batch_images: most images of one VAE encode call there.

    Attributes:
        edit_starter: the edit-start stage (:class:`~bcg_core.scheduler.edit_start.EditStarter`), started and closed
            by the scheduler.
        iterations: iterations run; busy_s: seconds spent starting and stepping; oom_steps: steps that ran out of
            device memory (their requests answered 503); adapter_splits: steps run as two, without and with LoRA
            adapters (:meth:`_step_group`); expert_splits: steps run as several, one per expert (its rows at
            different experts).
    """

    def __init__(self, flight: Flight, pipeline: DiTPipeline, finisher: Finisher, previews: PreviewWorker,
                 retry_after_s: float, edit_start_batch: int = 8, encode_batch_images: int = 8):
        self._flight = flight
        self.pipeline = pipeline
        self.decider = pipeline.decider
        self._finisher = finisher
        self._previews = previews
        self.retry_after_s = float(retry_after_s)
        self._device = pipeline.model.device
        self._cuda = torch.device(self._device).type == "cuda"
        self._step_times = StepTimes(pipeline.metrics)
        self._last_steps_s = 0.0  # seconds the last iteration's steps took (bounds the starts of the next)
        self.iterations = 0
        self.busy_s = 0.0
        self.oom_steps = 0
        self.adapter_splits = 0
        self.expert_splits = 0
        self.edit_starter = EditStarter(pipeline, edit_start_batch, encode_batch_images, self._encoded,
                                        lambda: self._flight.closed)

    def run(self) -> None:
        """The denoising thread: wait for work, then iterate (module docstring) until the scheduler closes."""
        while True:
            with self._flight.cv:
                while (not self._flight.closed and not self._flight.admission.waiting and not self._flight.starting
                       and not self._flight.running and not self._flight.encoded):
                    self._flight.cv.wait()
                if self._flight.closed:
                    leftover = [*self._flight.admission.waiting, *self._flight.starting, *self._flight.encoded,
                                *(i for g in self._flight.running.values() for i in g)]
                    self._flight.admission.waiting.clear()
                    self._flight.starting.clear()
                    self._flight.encoded.clear()
                    self._flight.running.clear()
                    break
                self._flight.starting.extend(self._admit_locked())
            t0 = time.perf_counter()
            with torch.inference_mode():
                self._start_some()
                t1 = time.perf_counter()
                self._iterate()
            t2 = time.perf_counter()
            self._last_steps_s = t2 - t1
            self.busy_s += t2 - t0
        for item in leftover:
            self._flight.resolve(item, RequestCancelled("the replica is shutting down"))

    def _start_some(self) -> None:
        """Adopt the edits the edit-start thread has started, hand it the edits admitted now (all together), and
        start the other admitted requests (text encoding, noise): with nothing running, all of them; else while
        the starts of this boundary took less than the last iteration's steps (at least one), so a burst of
        arrivals delays the requests in flight by about one iteration, not by every start at once."""
        self._adopt_encoded()
        with self._flight.cv:
            edits = [i for i in self._flight.starting if is_edit(i)]
            for item in edits:
                self._flight.starting.remove(item)
        self._hand_over([i for i in edits if self._admitted(i)])
        t0 = time.perf_counter()
        first = True
        with self._flight.cv:
            busy = bool(self._flight.running)  # requests in flight before these starts: they must not wait long
        while True:
            with self._flight.cv:
                if not self._flight.starting:
                    return
                if busy and not first and time.perf_counter() - t0 >= self._last_steps_s:
                    return
                item = self._flight.starting.popleft()
            first = False
            self._start(item)

    def _admit_locked(self) -> list[InFlight]:
        """The requests to start now (:class:`~bcg_core.scheduler.admission.Admission`); the cancelled and expired
        ones are answered. Called with the lock held."""
        now = time.perf_counter()
        out = self._flight.admission.admit(self._flight.rows, self._flight.bytes, now)
        for item in out.cancelled:
            self._flight.stats.shape(item.shape).cancelled_waiting += 1
            self._flight.resolve(item, RequestCancelled("the request was cancelled by its caller"))
        for item in out.expired:
            self._flight.stats.shape(item.shape).expired += 1
            retry = self.retry_after_s
            self._flight.resolve(item, ServiceUnavailable(
                "request", f"the request waited {now - item.submitted:.0f} s in the replica's queue without "
                f"starting, past scheduler.max_queue_wait_s {self._flight.admission.max_queue_wait_s:g}; retry after "
                f"{retry:g} s", retry_after_s=retry))
        self._flight.rows = out.rows
        return out.start

    def _admitted(self, item: InFlight) -> bool:
        """An admitted request's queue wait ends here (submission to start), counted; False (and it is answered)
        when its caller has cancelled it."""
        item.admitted = time.perf_counter()
        wait_ms = (item.admitted - item.submitted) * 1e3
        with self._flight.cv:
            st = self._flight.stats.shape(item.shape)
            st.admitted += 1
            st.waits_ms.append(wait_ms)
            st.wait_ms_sum += wait_ms
            st.wait_ms_max = max(st.wait_ms_max, wait_ms)
        if item.cancel.is_set():
            with self._flight.cv:  # its group's next request may be admitted unmeasured again (as after a failure)
                self._flight.admission.failed(item)
            self._flight.retire(item, RequestCancelled("the request was cancelled by its caller"), cancelled=True)
            return False
        return True

    def _hand_over(self, edits: list[InFlight]) -> None:
        """Give admitted edits to the edit-start thread; each holds its group's estimated bytes until it is adopted."""
        if not edits:
            return
        with self._flight.cv:
            for item in edits:
                item.nbytes = self._flight.admission.estimate(item)
                self._flight.bytes += item.nbytes
                self._flight.encoding.add(item)
        self.edit_starter.put_many(edits)

    def _encoded(self, item: InFlight, state, error: BaseException | None) -> None:
        """On the edit-start thread: an edit's start finished; its state waits for the next boundary, or its error
        is its own (as a start on this thread). Once the scheduler is closing, its ``close`` answers it."""
        with self._flight.cv:
            if self._flight.closed:
                return
            self._flight.encoding.discard(item)
            if error is None:
                item.state = state
                item.started = time.perf_counter()
                self._flight.encoded.append(item)
                self._flight.cv.notify_all()
                return
            self._flight.admission.failed(item)
        self._flight.retire(item, error, failed=True)

    def _adopt_encoded(self) -> None:
        """The edits started on the edit-start thread join the running requests (their measured bytes replace their
        estimate); on CUDA their tensors are marked used on this thread's stream first."""
        with self._flight.cv:
            ready = list(self._flight.encoded)
            self._flight.encoded.clear()
        for item in ready:
            if self._cuda:
                use_on_stream(item.state, torch.cuda.current_stream(self._device))
            nbytes = tensor_bytes(item.state)
            with self._flight.cv:
                self._flight.bytes += nbytes - item.nbytes
                item.nbytes = nbytes
                self._flight.admission.measured(item)
                self._flight.running.setdefault(item.group, []).append(item)
            self._flight.meter.start(item, item.shape)

    def _start(self, item: InFlight) -> None:
        """Start an admitted request (text, noise, its scheduler); a failure is its own error."""
        if not self._admitted(item):
            return
        try:
            item.state = self.pipeline.start(item.validated, item.cancel, item.lease)
        except Exception as e:  # noqa: BLE001 - this request's own error
            with self._flight.cv:
                self._flight.admission.failed(item)
            self._flight.retire(item, e, failed=True)
            return
        item.started = time.perf_counter()
        item.nbytes = tensor_bytes(item.state)
        with self._flight.cv:
            self._flight.bytes += item.nbytes
            self._flight.admission.measured(item)
            self._flight.running.setdefault(item.group, []).append(item)
        self._flight.meter.start(item, item.shape)

    def _iterate(self) -> None:
        """Step every group in flight once (oldest group first), then retire what finished or left."""
        with self._flight.cv:
            groups = sorted(self._flight.running.items(), key=lambda kv: min(i.submitted for i in kv[1]))
        self.iterations += 1
        for group, items in groups:
            live = []
            for item in items:
                if item.cancel.is_set():
                    self._flight.retire(item, RequestCancelled("the request was cancelled by its caller"),
                                        cancelled=True)
                else:
                    live.append(item)
            if live:
                self._step_group(group, live)

    def _step_group(self, group: tuple, items: list[InFlight]) -> None:
        """One step of a group's requests: for a model of several experts (:mod:`bcg_core.experts`), the requests
        at each expert apart (counted in ``expert_splits`` where a step has several), each as below.

        In one step, or, where rows with and without LoRA adapters mix and the cost model expects it to be cheaper
        (:meth:`~bcg_core.costs.StepDecider.split_adapters`), in two: the requests without adapters on the plain
        graphs, those with adapters on the LoRA graphs."""
        if len(self.pipeline.runners) > 1:
            experts: dict[int, list[InFlight]] = {}
            for item in items:
                experts.setdefault(self.pipeline.expert_of(item.state), []).append(item)
            self.expert_splits += len(experts) > 1
            for expert in sorted(experts):
                self._step_adapters(experts[expert])
        else:
            self._step_adapters(items)

    def _step_adapters(self, items: list[InFlight]) -> None:
        """One step of requests at one expert: one step, or two where LoRA rows split (:meth:`_step_group`)."""
        adapters = [i for i in items if i.validated.request.lora]
        plain = [i for i in items if not i.validated.request.lora]
        if adapters and plain and self.decider.split_adapters(items[0].shape, sum(i.rows for i in plain),
                                                              sum(i.rows for i in adapters)):
            self.adapter_splits += 1
            self._step_items(plain)
            self._step_items(adapters)
        else:
            self._step_items(items)

    def _step_items(self, items: list[InFlight]) -> None:
        states = [i.state for i in items]
        shape = items[0].shape
        rows = sum(s.rows for s in states)
        # one token grid per group: every row has the first request's real tokens
        forwards = self.decider.decide(shape, rows, items[0].validated.lookup.query.tokens_per_row)
        begin = timing_mark(self._device)
        try:
            failpoints.step_oom()
            self.pipeline.step(states, forwards)
        except Exception as e:
            if is_out_of_memory(e):
                # the requests of this step are answered 503 with Retry-After; the replica goes on serving
                self.oom_steps += 1
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
                self._flight.retire(item, e, failed=True)
            return
        with self._flight.cv:
            queries = [(i.rows, i.validated.lookup.query) for i in items]
            computed = self._flight.stats.count_step(shape, forwards, queries)
        key = forwards.counted_key
        self._step_times.add(begin, timing_mark(self._device), key, states)
        for item, share in zip(items, token_shares(computed, [s.rows for s in states]), strict=True):
            if item.first_key is None and item.state.step_index == 1:
                item.first_key = key if key is not None else item.validated.lookup.key
                item.first_share = share
            item.company = max(item.company, len(items))
        for item in items:
            if item.on_step is not None:
                self._report_step(item)
            if item.preview_at and item.state.step_index in item.preview_at:
                self._take_preview(item)
        for item in items:
            if item.state.done:
                self._finish_denoise(item)

    def _finish_denoise(self, item: InFlight) -> None:
        """A request's last step is queued: its step cache dropped, its event recorded, and it is handed to the
        decode thread."""
        item.denoised = time.perf_counter()
        cache = request_cache(item.state)
        if cache is not None:
            cache.free()
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self._device))
            item.done_event = ev
        with self._flight.cv:
            self._flight.leave_running(item)
            self._flight.finishing.add(item)
            self._flight.cv.notify_all()
        self._finisher.put(item)

    @staticmethod
    def _report_step(item: InFlight) -> None:
        """Hand the request's :class:`~bcg_core.preview.StepProgress` to its ``on_step`` (a thread-safe hand-off to
        its caller); a hand-off that fails (its caller's loop closed) is logged, never fails the step."""
        try:
            item.on_step(StepProgress(item.state.step_index, len(item.state.timesteps)))
        except Exception:  # noqa: BLE001 - progress is a courtesy; the step's requests go on
            log.debug("reporting a step of a request of shape %s failed", item.shape, exc_info=True)

    def _take_preview(self, item: InFlight) -> None:
        """On the denoising thread: hand a copy of the request's latents to the preview worker (a latent copy and
        a queue put, timed there); counted pending until it leaves the worker's queue."""
        with self._flight.cv:
            item.previews_pending += 1
        if not self._previews.take(item):
            with self._flight.cv:
                item.previews_pending -= 1
