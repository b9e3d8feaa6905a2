"""DiT replica deployment: one :class:`~bcg_core.pipeline.DiTPipeline` per replica (one GPU each).

Start-up: the model is loaded, the replica joins the ownership coordinator (when the application routes
by shape) and captures only the bucket shapes it owns (every batch bucket of each owned resolution tier and
text bucket), largest shape first, then reports ready. Without a coordinator it captures every bucket. Once
``runner.ready_after_s`` has passed (and at least one shape is ready) it reports ready at once and captures the
shapes left in the background, as it does shapes it gains later: a request of a shape not captured yet runs as one
unpadded eager forward per step meanwhile (:meth:`~bcg_core.runners.cuda_graph.CudaGraphRunner.run`). With compiled
kernels (``runner.compile_in_background``) a bucket whose blocks are not in the compile cache is captured with eager
kernels and compiled after the replica is ready, then swapped in between steps (:mod:`bcg_core.runners.background`).

Serving: a request arrives as the ingress's :class:`~bcg_core.request.ValidatedRequest` (validated, seed filled in,
bucket looked up) and is trusted as it is: the replica accepts nothing else and never validates it again. Requests
go through the replica's :class:`~bcg_core.scheduler.step_scheduler.StepScheduler` (requests join and leave at step
boundaries; each iteration runs one step of every request in flight, in the bucket forwards its measured cost
model chooses). Generation is blocking torch work in worker threads, so the replica's event loop keeps answering
``stats``, health checks and ``record_routing_stats``; a cancelled call (its client went away) stops at the next
denoising step. A streamed request (``stream: true`` at the ingress) comes through ``generate_stream``, an async
generator called with ``handle.options(stream=True)``: its previews, then its result
(:meth:`StepScheduler.submit_stream`).

Cost model: with ``scheduler.measure_costs`` (``auto``: where graphs are captured), each
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

Parts (:mod:`deployments.replica`): :class:`~deployments.replica.model.ReplicaModel` (the model, its pipeline and
step scheduler, captures), :class:`~deployments.replica.membership.Membership` (join, heartbeats, leave) and
:class:`~deployments.replica.background.DriftWatch` and :class:`~deployments.replica.background.MetricsPush` (the
background tasks). :class:`DiTReplica` composes them, serves, counts who served what and reports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter

from ray import serve

from bcg_core.planning.traffic import TrafficHistogram
from bcg_core.request import GenerationResult, ValidatedRequest
from router.autoscaling import replica_metrics
from router.routing_key import RoutingKey

from .memory import configure_heap
from .replica.background import DriftWatch, MetricsPush
from .replica.membership import Membership
from .replica.model import ReplicaModel
from .settings import ServeConfig

__all__ = ["DiTReplica"]

logger = logging.getLogger("ray.serve")


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
        begin = time.perf_counter()
        self._config = ServeConfig.model_validate(config)
        configure_heap(self._config.runner)  # before the weights: large buffers get their own mmap
        self._id = _replica_id()
        self._model = model = await ReplicaModel.load(self._config, self._id)
        self._start = {"load_s": round(time.perf_counter() - begin, 3)}
        self._pipeline, self._scheduler = model.pipeline, model.scheduler
        self._served: Counter[str] = Counter()  # "owner", "non_owner", "unkeyed"
        self._served_by_shape: Counter[str] = Counter()
        self._traffic: TrafficHistogram | None = (
            TrafficHistogram(self._config.traffic.max_shapes) if self._config.traffic.record else None)
        self._drift = DriftWatch(self._config, self._traffic, len(self._pipeline.table), self._id)
        self._membership = Membership(coordinator, self._id, model.graph_budget_bytes)
        t0 = time.perf_counter()
        owned = await self._membership.join(model.shapes)
        self._start["join_s"] = round(time.perf_counter() - t0, 3)
        # heartbeats start now, so a long capture below never lets the lease expire
        self._membership.start_heartbeats(self._config.routing.stats_period_s, self._routing_view,
                                          self._heartbeat_stats, model.capture_in_background)
        t0 = time.perf_counter()
        rest = await asyncio.to_thread(model.prepare, sorted(owned), True, self._config.runner.ready_after_s)
        self._start.update(prepare_s=round(time.perf_counter() - t0, 3), costs_s=round(model.costs_s, 3),
                           shapes_left=len(rest), ready_s=round(time.perf_counter() - begin, 3))
        logger.info("replica %s owns %d of %d shapes %s, %d prepared in %.1f s%s", self._id, len(owned),
                    len(model.by_shape), sorted(owned), len(owned) - len(rest), time.perf_counter() - t0,
                    f" (runner.ready_after_s; capturing {rest} in the background)" if rest else "")
        if rest or model.unmeasured:  # runner.ready_after_s: ready now; costs timed and the rest captured after
            model.capture_in_background(rest)
        self._metrics = MetricsPush.start(self._pipeline, self._scheduler, self._traffic, self._drift, self._id)
        self._drift.start()

    # -- serving ------------------------------------------------------------------------------------

    async def generate(self, request: ValidatedRequest) -> GenerationResult:
        """Generate images for one validated request (its steps share forwards with concurrent requests of its
        shape); it is counted in the traffic histogram, when ``traffic.record`` is on.

        Args:
            request: the ingress's :class:`~bcg_core.request.ValidatedRequest`, trusted as it is (not validated
                again). The caller should route it with ``handle.options(multiplexed_model_id=<bucket shape>)``
                (see :mod:`deployments.routing`); a caller with a raw request sends it to the ingress instead,
                or validates it first (``RequestValidator.from_config(config).validate(request)``).

        Returns:
            The :class:`GenerationResult`; ``replica`` names this replica and ``owner`` says whether it
            owns the request's shape (None for requests that have no bucket).

        Raises:
            TypeError: ``request`` is not a validated request.
        """
        validated = self._accept(request)
        key = RoutingKey.parse(serve.get_multiplexed_model_id())
        return self._served_result(await self._scheduler.submit(validated), key)

    async def generate_stream(self, request: ValidatedRequest, progress: bool = False):
        """:meth:`generate` for a streamed request (``handle.options(stream=True)``): yields
        :data:`~deployments.routing.ACCEPTED` once the request is validated, counted and its LoRA adapters are
        resident (:meth:`StepScheduler.lease`: one it cannot serve is a plain 422 or 503), then its previews
        (:class:`~bcg_core.preview.PartialImage`, ``partial_images`` of them per image at most) as the step
        scheduler draws them and, with ``progress``, a :class:`~bcg_core.preview.StepProgress` after each denoising
        step (a video job's progress), then its :class:`GenerationResult`. A caller that stops reading (Ray cancels
        the generator) cancels the request at its next step.

        Raises:
            TypeError: as :meth:`generate`.
        """
        from .routing import ACCEPTED

        validated = self._accept(request)
        key = RoutingKey.parse(serve.get_multiplexed_model_id())
        lease = await self._scheduler.lease(validated)  # an adapter it cannot serve is refused before ACCEPTED
        handed = False
        try:
            yield ACCEPTED
            handed = True
            async for event in self._scheduler.submit_stream(validated, lease=lease, progress=progress):
                yield self._served_result(event, key) if isinstance(event, GenerationResult) else event
        finally:
            if not handed and lease is not None:  # the caller left before the stream began
                lease.release()

    def _accept(self, validated: ValidatedRequest) -> ValidatedRequest:
        """``validated``, counted in the traffic histogram; anything else is refused (validated once, at the
        ingress: the replica and its scheduler trust it)."""
        if not isinstance(validated, ValidatedRequest):
            raise TypeError(f"the DiT replica takes a ValidatedRequest, got {type(validated).__name__}: send requests "
                            f"to the ingress, or validate them first "
                            f"(RequestValidator.from_config(config).validate(request))")
        if self._traffic is not None:
            self._traffic.record(validated)
        return validated

    def _served_result(self, result: GenerationResult, key: RoutingKey) -> GenerationResult:
        """Count who served ``result`` (owner or not) and name this replica in it; ``key`` is the routing key it
        came with."""
        shape = key.shape
        actual = result.bucket.shape if result.bucket is not None else ""
        if actual:
            owner = actual in self._membership.owned
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
        owned = self._membership.owned
        view = {
            "owned": sorted(owned),
            "ready": sorted(self._model.ready & owned),
            "queue": self._scheduler.queue_lengths(),
            "capturing": self._model.capturing,
        }
        if self._pipeline.lora is not None:  # the router prefers replicas holding a request's adapters
            view["adapters"] = sorted(self._pipeline.lora.resident())
        return view

    def _loads(self) -> dict:
        """``{shape: ShapeLoad}`` over the load meter's window, every shape of the table included."""
        return self._scheduler.meter.loads(self._model.shapes)

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
        out["capturing_s"] = self._model.capturing_s()
        out["bucket_faults"] = self._pipeline.metrics.faults()
        out["oom_steps"] = self._scheduler.oom_steps
        if self._traffic is not None:
            out["traffic"] = self._traffic.snapshot()
        if self._pipeline.lora is not None:
            out["lora"] = {"resident": self._pipeline.lora.resident()}
        return out

    def __del__(self):
        """Graceful shutdown: tell the coordinator (fire and forget) so the survivors take this replica's
        shapes at once (a replica that dies without it is removed when its lease expires), and close the step
        scheduler, whose threads would otherwise outlive the replica."""
        membership = getattr(self, "_membership", None)  # __init__ may have failed
        if membership is not None:
            membership.stop_heartbeats()
        for name in ("_metrics", "_drift"):
            other = getattr(self, name, None)
            if other is not None:
                other.stop()
        if membership is not None:
            traffic = getattr(self, "_traffic", None)
            membership.leave(traffic.snapshot() if traffic is not None else None)
        model = getattr(self, "_model", None)
        if model is not None:  # its threads stop; a request still in flight gets RequestCancelled
            model.close()

    def stats(self) -> dict:
        """Per-bucket counters (:meth:`DiTPipeline.stats`) plus this replica's id, routing view, owner
        hits, the step scheduler's counters, the state of its Prometheus export (``metrics_export``: pushes, errors,
        ``None`` when the exporter is off), ``device_memory`` (CUDA bytes allocated and reserved, None on a CPU) and the
        request shapes it accepted (``traffic``: a :meth:`~bcg_core.planning.traffic.TrafficHistogram.snapshot`,
        ``None`` with ``traffic.record`` off), and ``start``: where the replica's start went, in seconds from its
        constructor's first line: ``load_s`` (config, weights, pipeline and scheduler built), ``join_s`` (ownership
        joined), ``prepare_s`` (the capture before ready, ``runner.ready_after_s`` bounding it; ``costs_s`` of it
        timing the cost model's forwards), ``shapes_left`` (captured after ready) and ``ready_s`` (the whole start;
        what ``bcg serve`` waits for beyond it is Ray's and Serve's own start)."""
        out = self._pipeline.stats()
        out["replica"] = self._id
        loads = self._loads()
        out["routing"] = {**self._routing_view(), **self._served_totals(loads)}
        out["scheduler"] = self._scheduler.stats()
        out["load"] = {s: {"arrival_rps": round(v.arrival_rps, 4), "completion_rps": round(v.completion_rps, 4),
                           "busy": round(v.busy, 4), "service_s": round(v.service_s, 4), "offered": round(v.offered, 4)}
                       for s, v in loads.items()}
        out["metrics_export"] = self._metrics.status()
        out["device_memory"] = self._model.device_memory()
        out["traffic"] = self._traffic.snapshot() if self._traffic is not None else None
        out["plan_drift"] = self._drift.report
        out["start"] = self._start
        return out

    def ping(self) -> str:
        """This replica's id: a no-op for measuring routing overhead (``benchmarks/bench_router.py``)."""
        return self._id
