"""DiT replica deployment: one :class:`~bcg_core.pipeline.DiTPipeline` per replica (one GPU each).

Start-up: the model is loaded, the replica joins the ownership coordinator (when the application routes
by shape) and captures only the bucket shapes it owns (every batch bucket of each owned resolution tier and
text bucket), largest shape first, then reports ready. Without a coordinator it captures every bucket. Once
``runner.ready_after_s`` has passed (and at least one shape is ready) it reports ready at once and captures the
shapes left in the background, as it does shapes it gains later: a request of a shape not captured yet runs as one
unpadded eager forward per step meanwhile (:meth:`~bcg_core.runners.cuda_graph.CudaGraphRunner.run`). With compiled kernels
(``runner.compile_in_background``) a bucket whose blocks are not in the compile cache is captured with eager kernels
and compiled after the replica is ready, then swapped in between steps (:mod:`bcg_core.runners.background`).

Serving: a request arrives as the ingress's :class:`~bcg_core.request.PlannedRequest` (validated, seed filled in,
bucket looked up) and is trusted as it is: the replica accepts nothing else and never plans it again. Requests
go through the replica's :class:`~bcg_core.scheduler.step_scheduler.StepScheduler` (requests join and leave at step
boundaries; each iteration runs one step of every request in flight, in the bucket forwards its measured cost
model chooses). Generation is blocking torch work in worker threads, so the replica's event loop keeps answering ``stats``, health checks
and ``record_routing_stats``; a cancelled call (its client went away) stops at the next denoising step.
A streamed request (``stream: true`` at the ingress) comes through ``generate_stream``, an async generator
called with ``handle.options(stream=True)``: its previews, then its result (:meth:`StepScheduler.submit_stream`).

Cost model: with ``runner.measure_costs`` (``auto``: where graphs are captured), each
shape's buckets are timed right after
they are prepared (graph replays on CUDA) together with the shape's unpadded eager forward against row
count (:meth:`~bcg_core.pipeline.DiTPipeline.measure_costs`); the scheduler's memory budget is then set from
the device memory left.

Routing stats (read by :class:`router.shape_router.ShapeAwareRouter`, refreshed every
``routing.stats_period_s``): ``{"owned": [...], "ready": [...], "queue": {shape: n}, "capturing": bool}``, plus
``"adapters": [...]`` (the LoRA adapters resident in its slots) with ``lora.dir``; a request's routing key carries its
adapters after its shape (``i1024_t256|lora=ink``), so the router prefers replicas that hold them.
A background task heartbeats the coordinator at the same period (from the moment the replica joined, so a
long capture never lets its lease expire); shapes it newly assigns (a peer left) are captured in the
background and listed as owned-but-not-ready (warming) until done.

Autoscaling stats (read by :class:`router.autoscaling.BucketLoadPolicy` in Ray's controller, every
``autoscaling.metrics_interval_s`` when the deployment autoscales): per bucket shape the arrival rate, the
measured replica seconds per request and the requests in flight, plus whether the replica is capturing
(:func:`router.autoscaling.replica_metrics`). The heartbeat carries the same per-shape load (``offered``:
arrival rate x service time) to the coordinator, which re-assigns ownership by it on scale events.

Traffic: with ``traffic.record`` (the default) every accepted request is counted by its shape (requested size,
n, prompt tokens, steps) in a bounded :class:`~bcg_core.planning.traffic.TrafficHistogram`, shown under ``traffic`` in
``stats()``, sent with each heartbeat (so the ingress can merge every replica's) and exported as
``ray_bcg_traffic_requests_total``. With ``buckets.plan`` (a table written by ``bcg plan``) it is scored on the
table every ``traffic.drift_check_s`` (``plan_drift`` in ``stats()``, ``ray_bcg_plan_*``): over 1.5x the planned
padded-token waste logs a warning naming what a new plan would save. Advice only.

Metrics: once ready, a background task pushes the bucket counters, step latencies and queue lengths into
Ray's metrics every second (:mod:`deployments.metrics`, exported to Prometheus by Ray's metrics agent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import Counter

from ray import serve

from bcg_core import failpoints
from bcg_core.keys import BucketKey
from .settings import ServeConfig
from bcg_core.errors import RequestError
from bcg_core.models import load_model
from bcg_core.pipeline import DiTPipeline
from bcg_core.request import GenerationRequest, GenerationResult, PlannedRequest
from bcg_core.scheduler.step_scheduler import StepScheduler
from bcg_core.planning.traffic import TrafficHistogram
from router.autoscaling import replica_metrics
from router.routing_key import RoutingKey

from .memory import configure_heap
from .metrics import BucketExporter

__all__ = ["DiTReplica", "as_generation_request"]

logger = logging.getLogger("ray.serve")

_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest))

_NO_BUDGET = 1 << 62
"""Graph budget reported to the coordinator when neither the config nor a GPU bounds it (CPU replicas)."""


def as_generation_request(request: GenerationRequest | dict) -> GenerationRequest:
    """Accept a :class:`GenerationRequest` or a mapping of its fields. A mapping's ``lora`` entries may be
    ``(name, scale)`` pairs or, as over HTTP, ``{"name": ..., "scale": ...}`` mappings (scale omitted: 1.0); the
    planner checks them.

    Raises:
        RequestError: a mapping with an unknown field or without ``prompt`` (field ``"request"``).
    """
    if isinstance(request, GenerationRequest):
        return request
    if not isinstance(request, dict):
        raise RequestError("request", f"request must be a GenerationRequest or a dict with the fields "
                           f"{', '.join(_REQUEST_FIELDS)}; got {type(request).__name__}")
    unknown = sorted(set(request) - set(_REQUEST_FIELDS))
    if unknown:
        raise RequestError("request", f"unknown request field(s) {unknown}; allowed: {', '.join(_REQUEST_FIELDS)}")
    if "prompt" not in request:
        raise RequestError("prompt", "prompt is required: a non-empty string")
    lora = request.get("lora")
    if isinstance(lora, (list, tuple)) and any(isinstance(e, dict) for e in lora):
        request = {**request, "lora": tuple(_lora_pair(e) for e in lora)}
    return GenerationRequest(**request)


def _lora_pair(entry):
    """A ``{"name", "scale"}`` mapping as ``(name, scale)``; anything else as it is (the planner refuses it)."""
    if not isinstance(entry, dict) or set(entry) - {"name", "scale"} or "name" not in entry:
        return entry
    scale = entry.get("scale")
    return (entry["name"], 1.0 if scale is None else scale)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (tests constructing the class directly)
        return f"local-{id(object())}"


@serve.deployment(name="DiTReplica")
class DiTReplica:
    """Ray Serve deployment owning one DiT pipeline.

    Args:
        config: a ``ServeConfig`` as a mapping (``ServeConfig.model_dump(mode="json")``).
        coordinator: handle of :class:`~deployments.coordinator.BucketCoordinator`, or None to own (and
            capture) every bucket.

    Raises:
        pydantic.ValidationError: on a bad config; ``ValueError`` on a bad bucket table (at start).
    """

    async def __init__(self, config: dict, coordinator=None):
        self._config = ServeConfig.model_validate(config)
        configure_heap(self._config.runner)  # before the weights: large buffers get their own mmap
        self._id = _replica_id()
        model = await asyncio.to_thread(load_model, self._config.model)
        self._pipeline = DiTPipeline(self._config, model, prepare=False)
        self._by_shape: dict[str, list[BucketKey]] = {}
        for k in self._pipeline.table.keys:
            self._by_shape.setdefault(k.shape, []).append(k)
        self._coord = coordinator
        self._budget = self._graph_budget()
        self._owned: set[str] = set()
        self._ready: set[str] = set()
        self._capture_lock = threading.Lock()
        self._capture_task: asyncio.Task | None = None
        self._capturing_since: float | None = None  # time.monotonic() when the running capture began
        self._served: Counter[str] = Counter()  # "owner", "non_owner", "unkeyed"
        self._served_by_shape: Counter[str] = Counter()
        self._scheduler = StepScheduler.from_pipeline(
            self._pipeline, load_window_s=self._config.autoscaling.look_back_period_s,
            retry_after_s=self._config.routing.retry_after_s)
        self._traffic: TrafficHistogram | None = (
            TrafficHistogram(self._config.traffic.max_shapes) if self._config.traffic.record else None)
        self._heartbeat_task: asyncio.Task | None = None
        self._exporter: BucketExporter | None = None
        self._metrics_task: asyncio.Task | None = None
        self._drift_task: asyncio.Task | None = None
        self._drift: dict | None = None
        if coordinator is None:
            owned = sorted(self._by_shape)
        else:
            owned = await coordinator.join.remote(self._id, self._budget)
        self._owned = set(owned)
        if coordinator is not None:
            # heartbeats start now, so a long capture below never lets the lease expire
            period = self._config.routing.stats_period_s
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat_loop(period))
        t0 = time.perf_counter()
        rest = await asyncio.to_thread(self._prepare_shapes, sorted(self._owned), True,
                                       self._config.runner.ready_after_s)
        logger.info("replica %s owns %d of %d shapes %s, %d prepared in %.1f s%s", self._id, len(self._owned),
                    len(self._by_shape), sorted(self._owned), len(self._owned) - len(rest), time.perf_counter() - t0,
                    f" (runner.ready_after_s; capturing {rest} in the background)" if rest else "")
        if rest:  # runner.ready_after_s passed: ready now, the rest captured as gained shapes are
            self._start_capture(rest)
        self._exporter, self._metrics_task = self._start_metrics_export()
        if self._traffic is not None and self._config.buckets.plan is not None:
            self._drift_task = asyncio.get_running_loop().create_task(self._drift_loop())

    def _start_metrics_export(self) -> tuple[BucketExporter | None, asyncio.Task | None]:
        """Start pushing the bucket counters into Ray's metrics every second (:mod:`deployments.metrics`); a
        replica whose exporter cannot be made serves without it (logged)."""
        try:
            exporter = BucketExporter.for_replica(self._pipeline, self._scheduler, traffic=self._traffic,
                                                  drift=lambda: self._drift)
        except Exception:
            logger.exception("replica %s: Prometheus metrics export is off", self._id)
            return None, None
        return exporter, asyncio.get_running_loop().create_task(exporter.run())

    def _graph_budget(self) -> int:
        mib = self._config.runner.graph_memory_budget_mib
        if mib is not None:
            return int(mib * 2**20)
        if self._pipeline.model.device.type == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(self._pipeline.model.device)
            return int(0.9 * free)
        return _NO_BUDGET

    def _prepare_shapes(self, shapes: list[str], initial: bool = False,
                        ready_after_s: float | None = None) -> list[str]:
        """Prepare (capture on CUDA) every batch bucket of ``shapes``, largest shape first; each shape is
        ready as soon as its buckets are. Runs in a worker thread. ``initial``: the capture at start (where the
        ``capture_stall`` failpoint of :mod:`bcg_core.failpoints` can fire). ``ready_after_s``: stop once this many
        seconds have passed and at least one shape is ready (None: prepare every shape).

        Returns:
            The shapes left unprepared (empty unless ``ready_after_s`` passed), largest first. Background compiles
            start only once none is left (a capture and a compile would share the CPUs and the GPU)."""
        left: list[str] = []
        with self._capture_lock:
            self._capturing_since = started = time.monotonic()
            try:
                if initial:
                    failpoints.capture_stall()
                order = sorted(shapes,
                               key=lambda s: -max(k.tokens for k in self._by_shape.get(s, [BucketKey(0, 0, 0)])))
                for i, s in enumerate(order, 1):
                    keys = self._by_shape.get(s)
                    if not keys:
                        logger.warning("replica %s was assigned unknown shape %r; ignored", self._id, s)
                        continue
                    if ready_after_s is not None and self._ready and time.monotonic() - started >= ready_after_s:
                        left = order[i - 1:]
                        break
                    t0 = time.perf_counter()
                    self._pipeline.prepare(keys, defer_compiles=self._config.runner.compile_in_background)
                    self._measure_costs(s, keys)
                    self._ready.add(s)
                    logger.info("replica %s: shape %s ready (%d buckets, %.1f s), %d of %d shapes", self._id, s,
                                len(keys), time.perf_counter() - t0, i, len(order))
                self._scheduler.measure_memory_budget()  # after capture and cost measurement
                if not left:
                    # buckets on eager kernels for want of a cached compile: compiled, checked and swapped in now
                    self._scheduler.compile_in_background()
            finally:
                self._capturing_since = None
        return left

    def _measure_costs(self, shape: str, keys: list[BucketKey]) -> None:
        """Time ``shape``'s prepared buckets and its eager forwards for the step scheduler's cost model; a
        failed measurement leaves the shape on the token-count stand-in (logged). ``runner.measure_costs`` says
        whether to measure (:meth:`~bcg_core.scheduler.StepScheduler.measure_costs`)."""
        try:
            self._scheduler.measure_costs(keys)
        except Exception:
            logger.exception("replica %s: measuring the costs of shape %s failed", self._id, shape)

    # -- serving ------------------------------------------------------------------------------------

    async def generate(self, request: PlannedRequest) -> GenerationResult:
        """Generate images for one planned request (its steps share forwards with concurrent requests of its
        shape); it is counted in the traffic histogram, when ``traffic.record`` is on.

        Args:
            request: the ingress's :class:`~bcg_core.request.PlannedRequest`, trusted as it is (not planned
                again). The caller should route it with ``handle.options(multiplexed_model_id=<bucket shape>)``
                (see :mod:`deployments.routing`); a caller with a raw request sends it to the ingress instead,
                or plans it first (``Planner.from_config(config).plan(request)``).

        Returns:
            The :class:`GenerationResult`; ``replica`` names this replica and ``owner`` says whether it
            owns the request's shape (None for requests that have no bucket).

        Raises:
            TypeError: ``request`` is not a planned request.
        """
        planned = self._accept(request)
        key = RoutingKey.parse(serve.get_multiplexed_model_id())
        return self._served_result(await self._scheduler.submit(planned), key)

    async def generate_stream(self, request: PlannedRequest):
        """:meth:`generate` for a streamed request (``handle.options(stream=True)``): yields
        :data:`~deployments.routing.ACCEPTED` once the request is planned, counted and its LoRA adapters are
        resident (:meth:`StepScheduler.lease`: one it cannot serve is a plain 422 or 503), then its previews
        (:class:`~bcg_core.preview.PartialImage`, ``partial_images`` of them per image at most) as the step
        scheduler draws them, then its :class:`GenerationResult`. A caller that stops reading (Ray cancels the
        generator) cancels the request at its next step.

        Raises:
            TypeError: as :meth:`generate`.
        """
        from .routing import ACCEPTED

        planned = self._accept(request)
        key = RoutingKey.parse(serve.get_multiplexed_model_id())
        lease = await self._scheduler.lease(planned)  # an adapter it cannot serve is refused before ACCEPTED
        handed = False
        try:
            yield ACCEPTED
            handed = True
            async for event in self._scheduler.submit_stream(planned, lease=lease):
                yield self._served_result(event, key) if isinstance(event, GenerationResult) else event
        finally:
            if not handed and lease is not None:  # the caller left before the stream began
                lease.release()

    def _accept(self, planned: PlannedRequest) -> PlannedRequest:
        """``planned``, counted in the traffic histogram; anything else is refused (validated once, at the
        ingress: the replica and its scheduler trust the plan)."""
        if not isinstance(planned, PlannedRequest):
            raise TypeError(f"the DiT replica takes a PlannedRequest, got {type(planned).__name__}: send requests "
                            f"to the ingress, or plan them first (Planner.from_config(config).plan(request))")
        if self._traffic is not None:
            self._traffic.record(planned)
        return planned

    def _served_result(self, result: GenerationResult, key: RoutingKey) -> GenerationResult:
        """Count who served ``result`` (owner or not) and name this replica in it; ``key`` is the routing key it
        came with."""
        shape = key.shape
        actual = result.bucket.shape if result.bucket is not None else ""
        if actual:
            owner = actual in self._owned
            self._served["owner" if owner else "non_owner"] += 1
            self._served_by_shape[actual] += 1
        else:
            owner = None
            self._served["unkeyed"] += 1
        if shape and actual and shape != actual:
            logger.warning("request routed with shape %s but served in bucket %s", shape, result.bucket)
        return dataclasses.replace(result, replica=self._id, owner=owner)

    # -- routing and ownership ----------------------------------------------------------------------

    def _routing_view(self) -> dict:
        view = {
            "owned": sorted(self._owned),
            "ready": sorted(self._ready & self._owned),
            "queue": self._scheduler.queue_lengths(),
            "capturing": self._capture_task is not None and not self._capture_task.done(),
        }
        if self._pipeline.lora is not None:  # the router prefers replicas holding a request's adapters
            view["adapters"] = sorted(self._pipeline.lora.resident())
        return view

    def _loads(self) -> dict:
        """``{shape: ShapeLoad}`` over the load meter's window, every shape of the table included."""
        return self._scheduler.meter.loads(sorted(self._by_shape))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Called by Serve every ``autoscaling.metrics_interval_s`` when the deployment autoscales: per bucket
        shape ``bcg_arrival_rps:<shape>`` (requests/s over ``autoscaling.look_back_period_s``),
        ``bcg_service_s:<shape>`` (measured replica seconds per request) and ``bcg_inflight:<shape>``, plus
        ``bcg_capturing`` (1.0 while capturing: not capacity) and ``bcg_ready_shapes``
        (:func:`router.autoscaling.replica_metrics`)."""
        view = self._routing_view()
        return replica_metrics(self._loads(), view["queue"], view["capturing"], len(view["ready"]))

    async def record_routing_stats(self) -> dict:
        """Called by Serve every ``routing.stats_period_s``: the routing view (``owned``, ``ready``, ``queue``,
        ``capturing``, and with ``lora.dir`` ``adapters``: the names resident in its slots) for
        :class:`~router.shape_router.ShapeAwareRouter`."""
        return self._routing_view()

    async def _heartbeat_loop(self, period_s: float) -> None:
        """Heartbeat the coordinator every ``period_s``: renew the lease, report ready shapes, queue and owner
        hits, and adopt shapes it newly assigns (captured in the background: warming until ready)."""
        while True:
            await asyncio.sleep(period_s)
            view = self._routing_view()
            try:
                owned = await self._coord.heartbeat.remote(
                    self._id, self._budget, view["owned"], view["ready"], view["queue"], self._heartbeat_stats())
            except Exception:
                logger.exception("ownership heartbeat failed; keeping %d owned shapes", len(self._owned))
                continue
            if owned is not None:
                new = set(owned) - self._owned
                self._owned = set(owned)
                if new:
                    logger.info("replica %s gained shapes %s; capturing them in the background", self._id, sorted(new))
                    self._start_capture(sorted(new))

    def _start_capture(self, shapes: list[str]) -> None:
        previous = self._capture_task

        async def run() -> None:
            if previous is not None:
                await asyncio.shield(previous)
            await asyncio.to_thread(self._prepare_shapes, shapes)

        self._capture_task = asyncio.get_running_loop().create_task(run())

    def _served_totals(self, loads: dict | None = None) -> dict:
        """Owner hits, requests per shape, and the measured load per shape (``load``: arrival rate x
        service time, in replicas; what the coordinator re-assigns ownership by on scale events). ``loads``:
        :meth:`_loads` when the caller has it already."""
        loads = self._loads() if loads is None else loads
        load = {s: round(v.offered, 6) for s, v in loads.items() if v.offered > 0}
        return {"served": dict(self._served), "by_shape": dict(self._served_by_shape), "load": load}

    def _heartbeat_stats(self) -> dict:
        """What a heartbeat reports: :meth:`_served_totals`, ``capturing_s`` (seconds the running capture has
        taken, None when none runs: the coordinator takes a replica stalled past ``routing.capture_stall_s`` out
        of the assignment), ``bucket_faults`` (``{bucket: runtime errors}``, buckets demoted to eager),
        ``oom_steps`` (step scheduler: steps that ran out of device memory) and, when recorded, the ``traffic``
        snapshot (the ingress merges every replica's into ``traffic`` of ``/v1/buckets``); with ``lora.dir``,
        ``lora``: the adapters resident in its slots (``{name: slot}``), so ``ownership`` in ``/v1/buckets`` shows
        where each adapter is loaded."""
        out = self._served_totals()
        since = self._capturing_since
        out["capturing_s"] = None if since is None else round(time.monotonic() - since, 3)
        out["bucket_faults"] = self._pipeline.metrics.faults()
        out["oom_steps"] = self._scheduler.oom_steps
        if self._traffic is not None:
            out["traffic"] = self._traffic.snapshot()
        if self._pipeline.lora is not None:
            out["lora"] = {"resident": self._pipeline.lora.resident()}
        return out

    async def _drift_loop(self) -> None:
        """Every ``traffic.drift_check_s``, once ``traffic.drift_min_requests`` are recorded: score the recorded
        traffic on this table against ``buckets.plan`` (:func:`bcg_core.planning.drift.drift_report`, in a worker
        thread). A drift logs one warning (again only after the traffic was back within the plan) and sets
        ``ray_bcg_plan_drift_gain``; the table is never changed. A failing check is logged and retried."""
        from bcg_core.planning.drift import drift_report

        cfg = self._config.traffic
        warned = False
        while True:
            await asyncio.sleep(cfg.drift_check_s)
            if self._traffic.total < cfg.drift_min_requests:
                continue
            try:
                report = await asyncio.to_thread(drift_report, self._config, self._traffic.snapshot(),
                                                 len(self._pipeline.table))
            except Exception:
                logger.exception("replica %s: the drift check failed", self._id)
                continue
            self._drift = report
            if report["drifted"] and not warned:
                logger.warning("replica %s: traffic drifted from the bucket plan: %s", self._id, report["note"])
            warned = report["drifted"]

    def __del__(self):
        """Graceful shutdown: tell the coordinator (fire and forget) so the survivors take this replica's
        shapes at once (a replica that dies without it is removed when its lease expires), and close the step
        scheduler, whose threads would otherwise outlive the replica."""
        task, coord = getattr(self, "_heartbeat_task", None), getattr(self, "_coord", None)  # __init__ may have failed
        if task is not None:
            task.cancel()
        for name in ("_metrics_task", "_drift_task"):
            other = getattr(self, name, None)
            if other is not None:
                other.cancel()
        if coord is not None:
            try:
                traffic = getattr(self, "_traffic", None)
                coord.leave.remote(self._id, traffic.snapshot() if traffic is not None else None)
            except Exception:  # noqa: BLE001 - the lease expiry covers a failed leave
                pass
        scheduler = getattr(self, "_scheduler", None)
        if scheduler is not None:  # its threads stop; a request still in flight gets RequestCancelled
            scheduler.close(timeout_s=5.0)

    def stats(self) -> dict:
        """Per-bucket counters (:meth:`DiTPipeline.stats`) plus this replica's id, routing view, owner
        hits, the step scheduler's counters, the state of its Prometheus export (``metrics_export``: pushes, errors,
        ``None`` when the exporter is off), ``device_memory`` (CUDA bytes allocated and reserved, None on a CPU) and the request shapes it accepted (``traffic``: a
        :meth:`~bcg_core.planning.traffic.TrafficHistogram.snapshot`, ``None`` with ``traffic.record`` off)."""
        out = self._pipeline.stats()
        out["replica"] = self._id
        loads = self._loads()
        out["routing"] = {**self._routing_view(), **self._served_totals(loads)}
        out["scheduler"] = self._scheduler.stats()
        out["load"] = {s: {"arrival_rps": round(v.arrival_rps, 4), "completion_rps": round(v.completion_rps, 4),
                           "busy": round(v.busy, 4), "service_s": round(v.service_s, 4), "offered": round(v.offered, 4)}
                       for s, v in loads.items()}
        out["metrics_export"] = self._exporter.status() if self._exporter is not None else None
        out["device_memory"] = self._device_memory()
        out["traffic"] = self._traffic.snapshot() if self._traffic is not None else None
        out["plan_drift"] = self._drift
        return out

    def _device_memory(self) -> dict | None:
        """``{"allocated_bytes", "reserved_bytes"}`` of the model's CUDA device (torch's caching allocator: tensors
        alive, and what the allocator holds, graph pools included); None on a CPU."""
        device = self._pipeline.model.device
        if device.type != "cuda":
            return None
        import torch

        return {"allocated_bytes": torch.cuda.memory_allocated(device),
                "reserved_bytes": torch.cuda.memory_reserved(device)}

    def ping(self) -> str:
        """This replica's id: a no-op for measuring routing overhead (``benchmarks/bench_router.py``)."""
        return self._id
