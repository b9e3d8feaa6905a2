"""The step scheduler's asyncio front: submit, stream, close, stats (one per replica, no Ray).

:meth:`StepScheduler.submit` queues a validated request and awaits its answer; the work happens on threads: the
denoising loop (:mod:`bcg_core.scheduler.loop`: admission, steps, retirement), the edit-start thread of edits and
its start threads (:mod:`bcg_core.scheduler.edit_start`), the decode thread and encoding pool
(:mod:`bcg_core.scheduler.finish`) and the preview thread (:mod:`bcg_core.scheduler.previews`), all sharing the
requests in flight (:mod:`bcg_core.scheduler.flight`). Cancellation: a caller's ``asyncio.CancelledError`` sets
the request's cancel event; a waiting request leaves the queue at the next admission, a running one at the next
step boundary, a finished one is not decoded. An edit (a request with an ``image``) starts on the edit-start thread
(:mod:`bcg_core.scheduler.edit_start`: its image read, resized and VAE-encoded off the denoising thread, the images of
the edits admitted together encoded in one VAE call) and joins the running requests at the next step boundary.
:mod:`deployments.dit` owns one scheduler per replica.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch

from bcg_core.costs import CostModel, cuda_spare_bytes
from bcg_core.errors import RequestCancelled, RequestError
from bcg_core.keys import BucketKey
from bcg_core.pipeline import DiTPipeline, runner_mode
from bcg_core.preview import PartialImage, StepProgress, preview_steps
from bcg_core.request import GenerationResult, ValidatedRequest
from bcg_core.runners.background import BackgroundCompiles
from bcg_core.scheduler.admission import Admission, InFlight
from bcg_core.scheduler.finish import Finisher
from bcg_core.scheduler.flight import Flight
from bcg_core.scheduler.load import LoadMeter
from bcg_core.scheduler.loop import DenoisingLoop
from bcg_core.scheduler.memtrim import IdleTrimmer
from bcg_core.scheduler.previews import PreviewWorker, stream_events

__all__ = ["StepScheduler"]


class StepScheduler:
    """Continuous step-level batching for one replica's pipeline (see the module docstring).

    Args:
        pipeline: the replica's pipeline (validator, table, runner, family).
        costs: the cost model, given to the pipeline's decider (:class:`~bcg_core.costs.StepDecider`);
            None: the decider's own (the token-count stand-in until measured costs are set).
        max_rows: most transformer rows in flight (``scheduler.max_rows_in_flight``).
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
            free memory back to the OS (:class:`~bcg_core.scheduler.memtrim.IdleTrimmer`: glibc ``malloc_trim``; without
            it the resident memory at rest follows the largest requests served together). None: never.

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
        self.meter = meter if meter is not None else LoadMeter()
        self.retry_after_s = float(retry_after_s)
        self.decider = pipeline.decider
        if costs is not None:
            self.decider.set_costs(costs, merge=False)
        self._trimmer = None if trim_idle_s is None else IdleTrimmer(lambda: self.flight.idle(), trim_idle_s)
        self.flight = Flight(Admission(max_rows, memory_budget_bytes, fair_wait_s, max_queue_wait_s), self.meter,
                             on_idle=self._trimmer.notify if self._trimmer is not None else None)
        """The requests in flight and their counters."""
        self._device = pipeline.model.device
        self._cuda = torch.device(self._device).type == "cuda"
        if self._cuda:  # a miss then runs in one forward while it fits the memory the device can spare now
            self.decider.miss.spare_bytes = cuda_spare_bytes(self._device)
        self._finisher = Finisher(pipeline, decode_batch_images, encode_threads, self.flight.release_bytes,
                                  self.flight.retire_done, self.flight.answer)
        self._previews = PreviewWorker(pipeline.model, self._device, self.flight.preview_left,
                                       pipeline.capabilities.previews)
        self._loop = DenoisingLoop(self.flight, pipeline, self._finisher, self._previews, retry_after_s,
                                   edit_start_batch=decode_batch_images,
                                   # batching encodes pays on a GPU (1.35-1.6x for 4 images at 512-1024 px on an
                                   # H200), not on a CPU at real widths (0.77x at 512 px): there each image alone
                                   encode_batch_images=decode_batch_images if self._cuda else 1)
        self._miss_ids = itertools.count()
        self.compiles = BackgroundCompiles(pipeline.runner, self._compiled)
        """The buckets prepared on eager kernels for want of a cached compile, compiled and swapped in the background
        (:meth:`compile_in_background`)."""
        self._threads: list[threading.Thread] = []
        self._started = False
        self._start_lock = threading.Lock()

    @classmethod
    def from_pipeline(cls, pipeline: DiTPipeline, costs: CostModel | None = None, load_window_s: float = 10.0,
                      retry_after_s: float = 1.0) -> StepScheduler:
        """A scheduler configured by ``pipeline.config.scheduler`` (``max_rows_in_flight``, ``decode_batch_images``,
        ``encode_threads``, ``fair_wait_s``, ``max_queue_wait_s``, ``trim_idle_s``), its load meter's window
        ``load_window_s`` (the serving layer passes ``autoscaling.look_back_period_s``). On CUDA the memory budget
        of request tensors in flight is half of the device memory free now (after the weights, the graph pool and
        the cost measurement's forwards, whose activation peak the caching allocator keeps reserved)."""
        r = pipeline.config.scheduler
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
            with self.flight.cv:
                self.flight.admission.memory_budget_bytes = int(0.5 * free)

    def measure_costs(self, keys: list[BucketKey]) -> bool:
        """Where ``scheduler.measure_costs`` asks for it (``always``, or ``auto`` with CUDA graphs), time ``keys``'
        forwards and their shapes' eager ones (:meth:`DiTPipeline.measure_costs`) and use the times from now on, as
        a replica does after each capture; True if measured. Errors of the measurement are raised."""
        config = self.pipeline.config
        how = config.scheduler.measure_costs
        if how == "never" or (how == "auto" and runner_mode(config, self.pipeline.model.device) != "graph"):
            return False
        self.set_costs(self.pipeline.measure_costs(keys))
        return True

    @property
    def costs(self) -> CostModel:
        """The cost model the pipeline's decider uses now."""
        return self.decider.costs

    def set_costs(self, costs: CostModel) -> None:
        """Use ``costs`` from now on (merged over the current model: a shape captured later adds its times)."""
        self.decider.set_costs(costs)

    def compile_in_background(self) -> bool:
        """Start compiling the pipeline's pending buckets (prepared with ``defer_compiles``) on the background
        thread of :class:`~bcg_core.runners.background.BackgroundCompiles`; True if it runs. After each swap the cost
        model's time of that bucket is scaled by the measured replay ratio of its new graph over its old one."""
        return self.compiles.start()

    def _compiled(self, key: BucketKey, factor: float | None) -> None:
        """Bucket ``key`` now runs compiled kernels, its forward ``factor`` times as long: rescale its measured time."""
        costs = self.decider.costs
        if factor is None or key not in costs.bucket_ms:
            return
        lora = {key: costs.lora_ms[key] * factor} if key in costs.lora_ms else {}
        self.set_costs(CostModel({key: costs.bucket_ms[key] * factor}, source=costs.source, eager=costs.eager,
                                 lora_ms=lora))

    # -- the request path ---------------------------------------------------------------------------

    async def lease(self, validated: ValidatedRequest):
        """The slots of ``validated``'s LoRA adapters (:meth:`~bcg_core.lora.slots.AdapterSlots.lease_async`, waiting
        for their load off the denoising thread), or None for a request without adapters. A streamed request takes it
        before its stream is accepted (so an adapter that cannot be served is still a plain 422 or 503) and hands
        it to :meth:`submit`.

        Raises:
            RequestError: an adapter that cannot be served, or adapters on a pipeline without ``lora.dir``.
            ServiceUnavailable: its adapters did not load within ``lora.load_timeout_s`` (``Retry-After``:
                this scheduler's ``retry_after_s``).
        """
        if not validated.request.lora:
            return None
        lora = self.pipeline.lora
        if lora is None:
            raise RequestError("lora", "lora: this deployment serves no LoRA adapters (lora.dir is unset)")
        adapters = validated.request.lora
        return await lora.lease_async(tuple(n for n, _ in adapters), tuple(s for _, s in adapters),
                                      retry_after_s=self.retry_after_s)

    async def submit(self, validated: ValidatedRequest, on_preview: Callable[[PartialImage], None] | None = None,
                     lease=None, on_step: Callable[[StepProgress], None] | None = None) -> GenerationResult:
        """Queue a request, wait for its images, and return its result.

        With ``on_preview`` and the request's ``partial_images`` > 0, a copy of its latents is taken after each
        step :func:`~bcg_core.preview.preview_steps` picks and drawn by the preview thread (the family's
        ``preview`` hook, resized to the requested size, encoded in its ``output_format``); ``on_preview`` is
        called there, once per image of each preview, with a :class:`~bcg_core.preview.PartialImage`.

        ``timings_ms`` of the result: ``queue`` (submission to admission), ``encode`` (text encoding and noise),
        ``denoise`` (its steps, sharing forwards), ``decode`` (waiting for and running the batched VAE decode),
        ``image_encode`` (PNG, JPEG or WebP encoding) and ``total``, milliseconds; with LoRA adapters,
        ``lora_load``: the part of ``queue`` spent waiting for them to load (0 when every one was resident); for an
        edit, ``edit_encode``: the part of ``encode`` spent in its image's VAE encode on the edit-start thread
        (waiting for and running the VAE calls it shared with the edits started together).

        Args:
            validated: the request as the validator made it (trusted: it is not validated again).
            lease: its adapters' lease from :meth:`lease` (None: taken here when it has adapters); released once
                the request is answered, or here if it never queues.
            on_step: called on the denoising thread after each of its steps with a
                :class:`~bcg_core.preview.StepProgress`: keep it to a thread-safe hand-off (``call_soon_threadsafe``),
                as :meth:`submit_stream`'s is; None: no progress.

        Raises:
            TypeError: ``validated`` is not a :class:`~bcg_core.request.ValidatedRequest` (nothing is queued).
            RequestCancelled: its cancel event was set.
            RequestError: an adapter of its ``lora`` that cannot be served (HTTP 422, naming it and why).
            ServiceUnavailable: its adapters did not load within ``lora.load_timeout_s`` (HTTP 503).
            asyncio.CancelledError: the caller was cancelled; the request leaves at the next step boundary.
            Exception: whatever broke its start or a forward it took part in.
        """
        if not isinstance(validated, ValidatedRequest):
            if lease is not None:
                lease.release()
            raise TypeError(f"the step scheduler takes a ValidatedRequest (RequestValidator.validate), "
                            f"got {type(validated).__name__}")
        shape = validated.shape
        # requests share forwards only within one bucket shape, token grid and reference layout (FLUX.2's reference
        # images: its transformer takes one set of image position ids for every row); a miss runs alone
        group = (shape, validated.grid, validated.references) if shape is not None else ("miss", next(self._miss_ids))
        loop = asyncio.get_running_loop()
        item = InFlight(validated, validated.lookup.query.batch, group, shape, threading.Event(), loop.create_future(),
                        loop, time.perf_counter())
        if on_preview is not None and self._previews.available and validated.request.partial_images > 0:
            item.on_preview = on_preview
            item.preview_at = preview_steps(validated.steps_run, validated.request.partial_images)
        item.on_step = on_step
        # its adapters are resident before it queues: the denoising thread never waits for a load
        item.lease = lease if lease is not None else await self.lease(validated)
        self._ensure_started()
        self.meter.arrive(shape)
        with self.flight.cv:
            if self.flight.closed:
                if item.lease is not None:
                    item.lease.release()
                raise RuntimeError("the step scheduler is closed")
            self.flight.admission.waiting.append(item)
            self.flight.live.add(item)
            self.flight.cv.notify_all()
        try:
            return await item.future
        except asyncio.CancelledError:
            item.cancel.set()
            with self.flight.cv:
                self.flight.cv.notify_all()
            raise

    async def submit_stream(self, validated: ValidatedRequest, lease=None,
                            progress: bool = False) -> AsyncIterator[PartialImage | StepProgress | GenerationResult]:
        """:meth:`submit` as an async iterator: the request's previews (:class:`~bcg_core.preview.PartialImage`,
        as they are drawn), then its :class:`GenerationResult`: the result waits for the request's own previews
        that were queued before its last step (so every preview taken comes first; one dropped because the
        preview queue was full never comes). Closing the iterator early (its caller went away) cancels the
        request, as cancelling :meth:`submit` does.

        ``lease``: as :meth:`submit` (a stream closed before its request queued releases it). ``progress``: a
        :class:`~bcg_core.preview.StepProgress` after each denoising step too, in step order, all before the result
        (a video job's progress).

        Raises:
            As :meth:`submit`.
        """
        queued = False

        def submit(emit):
            nonlocal queued
            queued = True
            return self.submit(validated, on_preview=emit, lease=lease, on_step=emit if progress else None)

        try:
            async for event in stream_events(submit):
                yield event
        finally:
            if not queued and lease is not None:
                lease.release()

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._started:
                return
            self._started = True
            self._previews.start()
            self._finisher.start()
            self._loop.edit_starter.start()
            t = threading.Thread(target=self._loop.run, name="bcg-step", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the threads; every request not answered yet (waiting, starting, running, decoding or encoding) gets
        :class:`RequestCancelled`."""
        with self.flight.cv:
            self.flight.closed = True
            self.flight.cv.notify_all()
        self._previews.close(timeout_s)
        self.compiles.stop(timeout_s)
        for t in self._threads:
            t.join(timeout_s)
        self._loop.edit_starter.close(timeout_s)
        self._finisher.close(timeout_s)
        if self._trimmer is not None:
            self._trimmer.close(timeout_s)
        with self.flight.cv:
            left = list(self.flight.live)
            self.flight.rows = self.flight.bytes = 0
        for item in left:
            self.flight.resolve(item, RequestCancelled("the replica is shutting down"))

    # -- introspection ------------------------------------------------------------------------------

    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting, starting, running, decoding or encoding per bucket shape (misses left out), for
        routing stats, the ``bcg_queue_length`` gauge and autoscaling's in-flight count."""
        return self.flight.queue_lengths()

    @property
    def oom_steps(self) -> int:
        """Steps that ran out of device memory since start (their requests were answered 503)."""
        return self._loop.oom_steps

    def stats(self) -> dict:
        """``GET /v1/buckets``'s ``scheduler`` section (:mod:`bcg_core.scheduler.stats`): settings, totals,
        ``padded_token_waste`` over every forward, the cost model, a miss's memory bound (``miss_memory``:
        :meth:`~bcg_core.costs.MissMemory.describe`), and per shape its counters."""
        with self.flight.cv:
            in_flight = self.flight.in_flight()
            out = self.flight.stats.describe(in_flight, list(self.flight.admission.waiting))
            return {
                "kind": "step", "max_rows_in_flight": self.flight.admission.max_rows,
                "rows_in_flight": self.flight.rows, "bytes_in_flight": self.flight.bytes,
                "memory_budget_bytes": self.flight.admission.memory_budget_bytes,
                "waiting": len(self.flight.admission.waiting), "starting": len(self.flight.starting),
                "encoding": len(self.flight.encoding), "encoded": len(self.flight.encoded),
                "running": sum(len(g) for g in self.flight.running.values()), "finishing": len(self.flight.finishing),
                "iterations": self._loop.iterations, "busy_s": round(self._loop.busy_s, 3),
                "oom_steps": self._loop.oom_steps, "adapter_splits": self._loop.adapter_splits,
                "expert_splits": self._loop.expert_splits,
                "decode_batch_images": self._finisher.decode_batch_images,
                "fair_wait_s": self.flight.admission.fair_wait_s,
                **out, "costs": self.costs.describe(), "miss_memory": self.decider.miss.describe(),
                "previews": self._previews.describe(),
                "memory_trim": self._trimmer.describe() if self._trimmer is not None else None,
                "background_compiles": self.compiles.describe(),
                "edit_start": self._loop.edit_starter.describe(),
            }

