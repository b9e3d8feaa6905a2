"""Autoscaling the DiT replicas by bucket load: a Ray Serve custom ``AutoscalingPolicy``.

Ray's default policy counts requests: ``replicas = ongoing requests / target_ongoing_requests``. For a DiT
that is the wrong unit: a 1024x1024 request costs about four 512x512 ones, a request of 8 images eight of
one, and the step scheduler makes same-shape requests cheaper together (their rows share forwards). So each
replica measures, per bucket shape (``BucketKey.shape``, the unit of ownership), its arrivals and its
replica-seconds per request (:mod:`bcg_core.scheduler.load`), and reports them through
``record_autoscaling_stats`` every ``autoscaling.metrics_interval_s`` (1 s). The policy turns them into replicas:

For each shape ``s``, summed over the running replicas (``lambda_s`` requests per second arriving, ``T_s``
measured replica seconds per request, the inverse of the shape's measured capacity; ``L_s`` requests in
flight at the replicas)::

    load_s = max(lambda_s * T_s,  L_s * T_s / backlog_drain_s)     # replicas' worth of work
    queued = Q * T_mean / backlog_drain_s                          # Q: requests queued at the ingress handles,
                                                                   # counted only while the replicas are full
    need   = (sum_s load_s + queued) / target_utilization
    want   = ceil(need) + (warming replicas, once warming longer than capture_grace_s)

``lambda_s * T_s`` is the offered load (Little's law: the replicas kept busy by the arrivals); the backlog
term makes a queue at the replicas that builds up faster than the rate estimate count at once. A shape with
traffic but no measured service time yet (its first requests are still running) borrows one from the
measured shapes, scaled by tokens per row (``image + text`` tokens of the shape name), or, with nothing
measured at all, counts ``L_s / max_ongoing_per_replica`` replicas (a replica at its ``max_ongoing_requests``
is one replica's worth). ``Q`` is Ray's ``total_queued_requests``, an average over ``look_back_period_s``;
requests wait at a handle only while every replica is at its limit, so ``Q`` counts only then (otherwise it
is requests in transit, already counted at the replicas a moment later).

``warming`` is the number of running replicas that are capturing CUDA graphs (shapes they gained when a peer
left) or have not reported yet: **a replica that is capturing never counts as capacity**. While any replica
is warming the policy does not scale down (a downscale would move shapes and start more captures). A capture
normally ends within seconds, sooner than a new replica could start, so warming replicas are added on top
of what the load needs only after ``capture_grace_s`` of warming without a break; otherwise every downscale,
which makes the survivors capture the leaver's shapes, would trigger an upscale.

Delays and bounds: ``want`` must stay above the current target for ``upscale_delay_s`` before replicas are
added (then to the latest ``want``), and below it for ``downscale_delay_s`` before they are removed (then
to the largest ``want`` seen during that time); the result is clamped to Ray's capacity-adjusted
``[min_replicas, max_replicas]``. The delays are applied here, with the context's clock, so that the
policy is a pure function of its :class:`~ray.serve.config.AutoscalingContext`; :func:`deployments.build_app`
sets Ray's own delays to 0 so the two do not stack.

Ownership follows every scale event: a replica that starts joins the ownership coordinator, one that stops
leaves it, and the coordinator re-assigns shapes from the *measured* load per shape that replicas report in
their heartbeats (:meth:`router.membership.OwnershipTable.join`), so a replica added for a hot shape
co-owns that shape.

This module imports only the standard library: Ray's controller unpickles the policy (its module is
pickled by value) without importing torch or the rest of the project.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bcg_core.keys import BucketShape

__all__ = ["BucketLoadPolicy", "Decision", "ReplicaReport", "ShapeDemand", "decide", "metric_name", "parse_reports",
           "replica_metrics"]

CAPTURING = "bcg_capturing"
"""Metric: 1.0 while the replica captures graphs (at start or after gaining shapes), else 0.0."""
READY_SHAPES = "bcg_ready_shapes"
"""Metric: number of shapes the replica has captured and serves."""
_FIELDS = ("arrival_rps", "service_s", "inflight")
_STATE = "bcg"  # the policy's own key in Ray's policy_state

logger = logging.getLogger("ray.serve")
LOG_PREFIX = "BucketLoadPolicy:"
"""Start of the policy's log lines in the Serve controller's log (``logs/serve/controller_*.log``)."""


def metric_name(field_name: str, shape: str) -> str:
    """The ``record_autoscaling_stats`` key of one per-shape quantity, e.g. ``"bcg_arrival_rps:i1024_t256"``."""
    return f"bcg_{field_name}:{shape}"


def replica_metrics(loads: Mapping[str, Any], inflight: Mapping[str, int], capturing: bool,
                    ready_shapes: int) -> dict[str, float]:
    """What a DiT replica returns from ``record_autoscaling_stats``: a flat ``{name: float}`` (Ray's format).

    Args:
        loads: ``{shape: ShapeLoad}`` from :meth:`bcg_core.scheduler.load.LoadMeter.loads` (every shape of the table,
            so an idle shape reports zeros instead of its last busy value).
        inflight: requests waiting or running per shape (the step scheduler's queue).
        capturing: the replica is capturing graphs now.
        ready_shapes: shapes captured and served.

    Returns:
        ``bcg_capturing``, ``bcg_ready_shapes`` and, per shape, ``bcg_arrival_rps:<shape>`` (requests/s),
        ``bcg_service_s:<shape>`` (replica seconds per request, 0 while unmeasured), ``bcg_inflight:<shape>``.
    """
    out = {CAPTURING: 1.0 if capturing else 0.0, READY_SHAPES: float(ready_shapes)}
    for shape in sorted(set(loads) | set(inflight)):
        ld = loads.get(shape)
        out[metric_name("arrival_rps", shape)] = float(getattr(ld, "arrival_rps", 0.0))
        out[metric_name("service_s", shape)] = float(getattr(ld, "service_s", 0.0))
        out[metric_name("inflight", shape)] = float(inflight.get(shape, 0))
    return out


@dataclass
class ReplicaReport:
    """The latest report of one running replica (parsed from the context's metrics).

    Attributes:
        capturing: it is capturing graphs (not capacity).
        shapes: ``{shape: {"arrival_rps", "service_s", "inflight"}}``.
    """

    capturing: bool
    shapes: dict[str, dict[str, float]] = field(default_factory=dict)


def _latest(series: Any) -> float | None:
    """The newest value of a Ray time series (``[TimeStampedValue]``), or a plain number as is."""
    if isinstance(series, (int, float)):
        return float(series)
    if not series:
        return None
    newest = max(series, key=lambda p: p.timestamp)
    return float(newest.value)


def parse_reports(running: list, raw: Mapping[str, Mapping[Any, Any]] | None,
                  aggregated: Mapping[str, Mapping[Any, float]] | None = None) -> dict[Any, ReplicaReport | None]:
    """Per running replica, its latest report (None when it has not reported yet).

    Args:
        running: the running replica ids (``ctx.running_replicas``).
        raw: ``ctx.raw_metrics``: ``{metric: {replica_id: [TimeStampedValue]}}``; the newest point is used.
        aggregated: ``ctx.aggregated_metrics`` (``{metric: {replica_id: value}}``), read when ``raw`` has
            nothing for a replica.

    Values that are negative, NaN or infinite are dropped (a replica without a valid ``bcg_capturing``
    counts as not reported, i.e. warming).
    """
    out: dict[Any, ReplicaReport | None] = {}
    for rid in running:
        values: dict[str, float] = {}
        for source in (raw or {}, aggregated or {}):
            for name, per_replica in source.items():
                if name in values or rid not in per_replica:
                    continue
                v = _latest(per_replica[rid])
                if v is not None and math.isfinite(v) and v >= 0:  # a broken report is no report
                    values[name] = v
        if CAPTURING not in values:
            out[rid] = None
            continue
        report = ReplicaReport(capturing=values[CAPTURING] > 0.5)
        for name, v in values.items():
            if not name.startswith("bcg_") or ":" not in name:
                continue
            fld, shape = name[4:].split(":", 1)
            if fld in _FIELDS:
                report.shapes.setdefault(shape, {})[fld] = v
        out[rid] = report
    return out


def _tokens_per_row(shape: str) -> int | None:
    """Image + text tokens of one row of ``shape`` (``"i1024_m_t256"`` -> 1280, :class:`~bcg_core.keys.BucketShape`);
    None when it is not a shape."""
    try:
        return BucketShape.parse(shape).tokens_per_row
    except ValueError:
        return None


@dataclass(frozen=True)
class ShapeDemand:
    """One shape's demand, summed over the replicas.

    Attributes:
        arrival_rps: requests per second arriving.
        service_s: replica seconds per request used (measured, or estimated: see ``estimated``).
        inflight: requests in flight at the replicas.
        load: replicas' worth of work (the module docstring's ``load_s``).
        estimated: ``service_s`` was borrowed from other shapes (``"tokens"``), or there was none
            (``"ongoing"``: the load is ``inflight / max_ongoing_per_replica``); ``""`` when measured.
    """

    arrival_rps: float
    service_s: float
    inflight: float
    load: float
    estimated: str = ""


@dataclass(frozen=True)
class Decision:
    """What the policy computed in one tick (kept in the policy state as ``bcg.last`` for inspection).

    Attributes:
        want: replicas the load asks for right now (before delays and bounds).
        replicas: the decision (after delays and bounds).
        need: ``(sum of loads + queued) / target_utilization``, in replicas.
        warming: running replicas still capturing or not reported yet.
        queued: requests queued at the handles that were counted (``ctx.total_queued_requests`` while the
            replicas are full, else 0).
        shapes: per shape with traffic, its :class:`ShapeDemand`.
        reason: a short why (``"hold"``, ``"up after 3.0 s"``, ``"down after 30.0 s"``, ``"warming: no
            downscale"``, ``"waiting N s"``).
    """

    want: int
    replicas: int
    need: float
    warming: int
    queued: float
    shapes: dict[str, ShapeDemand]
    reason: str

    def as_dict(self) -> dict:
        """JSON-ready (``shapes`` as ``{shape: {arrival_rps, service_s, inflight, load, estimated}}``)."""
        return {"want": self.want, "replicas": self.replicas, "need": round(self.need, 3), "warming": self.warming,
                "queued": self.queued, "reason": self.reason,
                "shapes": {s: {"arrival_rps": round(d.arrival_rps, 3), "service_s": round(d.service_s, 4),
                               "inflight": d.inflight, "load": round(d.load, 3), "estimated": d.estimated}
                           for s, d in sorted(self.shapes.items())}}


def shape_demands(reports: Mapping[Any, ReplicaReport | None], backlog_drain_s: float,
                  max_ongoing_per_replica: float) -> dict[str, ShapeDemand]:
    """Sum the replicas' reports per shape and turn each into a load in replicas (module docstring)."""
    arrivals: dict[str, float] = {}
    inflight: dict[str, float] = {}
    weighted: dict[str, float] = {}  # sum of service_s * arrival weight, for an arrival-weighted mean
    weights: dict[str, float] = {}
    for rep in reports.values():
        if rep is None:
            continue
        for shape, f in rep.shapes.items():
            a, t, q = f.get("arrival_rps", 0.0), f.get("service_s", 0.0), f.get("inflight", 0.0)
            arrivals[shape] = arrivals.get(shape, 0.0) + a
            inflight[shape] = inflight.get(shape, 0.0) + q
            if t > 0:
                w = max(a, 1e-6)  # a replica with no arrivals still knows the shape's cost
                weighted[shape] = weighted.get(shape, 0.0) + t * w
                weights[shape] = weights.get(shape, 0.0) + w
    measured = {s: weighted[s] / weights[s] for s in weighted}
    # seconds per token-row from the measured shapes, for shapes not measured yet
    per_token = [(t, _tokens_per_row(s)) for s, t in measured.items()]
    per_token = [(t, n) for t, n in per_token if n]
    sec_per_token = sum(t for t, _ in per_token) / sum(n for _, n in per_token) if per_token else None
    out: dict[str, ShapeDemand] = {}
    for shape in sorted(set(arrivals) | set(inflight)):
        a, q = arrivals.get(shape, 0.0), inflight.get(shape, 0.0)
        if a <= 0 and q <= 0:
            continue
        t, how = measured.get(shape, 0.0), ""
        if t <= 0 and sec_per_token is not None and _tokens_per_row(shape):
            t, how = sec_per_token * _tokens_per_row(shape), "tokens"
        if t > 0:
            load = max(a * t, q * t / backlog_drain_s)
        else:
            how, load = "ongoing", q / max_ongoing_per_replica
        out[shape] = ShapeDemand(a, t, q, load, how)
    return out


def decide(reports: Mapping[Any, ReplicaReport | None], *, target: int, now: float, state: Mapping[str, Any],
           min_replicas: int, max_replicas: int, queued: float = 0.0, target_utilization: float = 0.75,
           backlog_drain_s: float = 10.0, upscale_delay_s: float = 3.0, downscale_delay_s: float = 30.0,
           max_ongoing_per_replica: float = 2.0, capture_grace_s: float = 30.0) -> tuple[Decision, dict]:
    """One autoscaling tick as a pure function (the formula and rules are in the module docstring).

    Args:
        reports: the latest report per running replica (:func:`parse_reports`; None: not reported yet).
        target: the current target replica count (``ctx.target_num_replicas``; starting replicas included).
        now: the clock in seconds (``ctx.current_time``).
        state: this policy's state from the previous tick (``{}`` at first).
        min_replicas, max_replicas: bounds (Ray's capacity-adjusted ones).
        queued: requests queued at the deployment handles, not yet at a replica.
        target_utilization: planned fraction of each replica's measured capacity (0..1].
        backlog_drain_s: seconds in which the in-flight work should be served.
        upscale_delay_s, downscale_delay_s: how long a wish to scale must hold before it is acted on.
        max_ongoing_per_replica: a replica's ``max_ongoing_requests``: in-flight requests that make one
            replica's worth of work for shapes with no measured service time, and the limit at which the
            replicas count as full (then handle-queued requests count).
        capture_grace_s: seconds of warming without a break after which warming replicas are added on top.

    Returns:
        ``(decision, new_state)``.

    Raises:
        ValueError: a utilisation outside (0, 1], a non-positive drain time or max_ongoing_per_replica, negative delays
            or grace, or ``min_replicas > max_replicas``.
    """
    if not 0 < target_utilization <= 1 or backlog_drain_s <= 0 or max_ongoing_per_replica <= 0:
        raise ValueError(f"need 0 < target_utilization <= 1, backlog_drain_s > 0, max_ongoing_per_replica > 0; "
                         f"got {target_utilization}, {backlog_drain_s}, {max_ongoing_per_replica}")
    if upscale_delay_s < 0 or downscale_delay_s < 0 or capture_grace_s < 0 or min_replicas > max_replicas:
        raise ValueError(f"need delays >= 0 and min_replicas <= max_replicas; got {upscale_delay_s}, "
                         f"{downscale_delay_s}, {capture_grace_s}, {min_replicas}, {max_replicas}")
    shapes = shape_demands(reports, backlog_drain_s, max_ongoing_per_replica)
    warming = sum(1 for r in reports.values() if r is None or r.capturing)
    total = sum(d.load for d in shapes.values())
    served = [(d.service_s, d.arrival_rps + d.inflight) for d in shapes.values() if d.service_s > 0]
    weight = sum(w for _, w in served)
    mean_t = sum(t * w for t, w in served) / weight if weight > 0 else 0.0
    queued = float(queued or 0.0)
    queued = queued if math.isfinite(queued) and queued > 0 else 0.0
    reported = [r for r in reports.values() if r is not None]
    in_flight = sum(f.get("inflight", 0.0) for r in reported for f in r.shapes.values())
    full = bool(reports) and in_flight >= len(reports) * (max_ongoing_per_replica - 1)  # <= 1 free slot each
    counted_queue = queued if full else 0.0
    queued_load = (counted_queue * mean_t / backlog_drain_s if mean_t > 0
                   else counted_queue / max_ongoing_per_replica)
    need = (total + queued_load) / target_utilization
    warming_since = state.get("warming_since")
    warming_since = (now if warming_since is None else warming_since) if warming else None
    added = warming if warming and now - warming_since + 1e-6 >= capture_grace_s else 0
    want = max(0, math.ceil(need - 1e-9)) + added
    want_bounded = min(max(want, min_replicas), max_replicas)
    target = int(target)
    up_since, down_since = state.get("up_since"), state.get("down_since")
    down_peak = state.get("down_peak", 0)
    decision, reason = target, "hold"
    if want_bounded > target:
        down_since = None
        up_since = now if up_since is None else up_since
        if now - up_since + 1e-6 >= upscale_delay_s:
            decision, reason, up_since = want_bounded, f"up after {now - up_since:.1f} s", None
        else:
            reason = f"waiting {upscale_delay_s - (now - up_since):.1f} s to scale up"
    elif want_bounded < target:
        up_since = None
        if warming:
            down_since, reason = None, "warming: no downscale"
        else:
            if down_since is None:
                down_since, down_peak = now, want_bounded
            down_peak = max(down_peak, want_bounded)
            if now - down_since + 1e-6 >= downscale_delay_s:
                decision, reason, down_since = down_peak, f"down after {now - down_since:.1f} s", None
            else:
                reason = f"waiting {downscale_delay_s - (now - down_since):.1f} s to scale down"
    else:
        up_since = down_since = None
    decision = min(max(decision, min_replicas), max_replicas)
    result = Decision(want=want, replicas=decision, need=need, warming=warming, queued=counted_queue,
                      shapes=shapes, reason=reason)
    new_state = {"up_since": up_since, "down_since": down_since, "down_peak": down_peak,
                 "warming_since": warming_since, "last": result.as_dict()}
    return result, new_state


class BucketLoadPolicy:
    """The Ray Serve autoscaling policy (deployment-level): ``policy_function`` of the DiT deployment's
    ``autoscaling_config.policy``; Ray instantiates it once with ``policy_kwargs`` and calls it every
    control-loop tick with the deployment's :class:`~ray.serve.config.AutoscalingContext`.

    Args (``policy_kwargs``, JSON values; defaults are those of ``deployments.settings.AutoscalingSettings``):
        target_utilization: planned fraction of each replica's measured capacity.
        backlog_drain_s: seconds in which in-flight work should be served.
        upscale_delay_s, downscale_delay_s: seconds a wish to scale must hold.
        max_ongoing_per_replica: the DiT replica's ``max_ongoing_requests`` (see :func:`decide`).
        capture_grace_s: seconds of warming after which warming replicas are added on top.

    Returns (per call): ``(replicas, policy_state)``; ``policy_state["bcg"]["last"]`` is the tick's
    :meth:`Decision.as_dict`. Each change of the wanted or decided count, or of the kind of reason, is logged
    (logger ``ray.serve``, in the controller's log) as one line starting with :data:`LOG_PREFIX`.
    """

    def __init__(self, target_utilization: float = 0.75, backlog_drain_s: float = 10.0,
                 upscale_delay_s: float = 3.0, downscale_delay_s: float = 30.0,
                 max_ongoing_per_replica: float = 2.0, capture_grace_s: float = 30.0):
        self.kwargs = dict(target_utilization=float(target_utilization), backlog_drain_s=float(backlog_drain_s),
                           upscale_delay_s=float(upscale_delay_s), downscale_delay_s=float(downscale_delay_s),
                           max_ongoing_per_replica=float(max_ongoing_per_replica),
                           capture_grace_s=float(capture_grace_s))
        decide({}, target=1, now=0.0, state={}, min_replicas=1, max_replicas=1, **self.kwargs)  # validate now

    def __call__(self, ctx) -> tuple[int, dict]:
        policy_state = dict(ctx.policy_state or {})
        mine = dict(policy_state.get(_STATE) or {})
        logged = tuple(mine.get("logged") or ())
        reports = parse_reports(list(ctx.running_replicas), ctx.raw_metrics, ctx.aggregated_metrics)
        try:
            queued = float(ctx.total_queued_requests or 0.0)
        except Exception:  # noqa: BLE001 - no handle metrics yet
            queued = 0.0
        now = ctx.current_time if ctx.current_time is not None else 0.0
        decision, mine = decide(reports, target=ctx.target_num_replicas, now=now, state=mine,
                                min_replicas=ctx.capacity_adjusted_min_replicas,
                                max_replicas=ctx.capacity_adjusted_max_replicas, queued=queued, **self.kwargs)
        kind = decision.reason.split(" ")[0]  # "hold", "waiting", "up", "down", "warming:"
        seen = (decision.want, decision.replicas, kind)
        if seen != logged:
            top = sorted(decision.shapes.items(), key=lambda kv: -kv[1].load)[:4]
            logger.info("%s %d -> %d replicas (%s): want %d, need %.2f, warming %d, queued %.0f; load %s", LOG_PREFIX,
                        ctx.target_num_replicas, decision.replicas, decision.reason, decision.want, decision.need,
                        decision.warming, decision.queued,
                        ", ".join(f"{s} {d.load:.2f} ({d.arrival_rps:.2f}/s x {d.service_s:.3f} s)" for s, d in top)
                        or "none")
        mine["logged"] = list(seen)
        policy_state[_STATE] = mine
        return decision.replicas, policy_state
