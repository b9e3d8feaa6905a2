"""The bucket-load autoscaling policy as a pure function on scripted contexts, and the load meter behind it.

The contexts are Ray's own :class:`~ray.serve.config.AutoscalingContext`, with per-replica metrics in the
format Ray's controller hands to a policy (``raw_metrics``: ``{name: {replica: [TimeStampedValue]}}``), and
the clock in ``current_time``.
"""

from __future__ import annotations

import pytest
from ray.serve._private.common import TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from bcg_core.scheduler.load import LoadMeter
from deployments.app import autoscaling_config
from deployments.settings import ServeConfig, backpressure_limits
from router.autoscaling import BucketLoadPolicy, decide, parse_reports, replica_metrics
from router.membership import OwnershipTable
from router.ownership import BucketDemand

HOT, COLD, BIG = "i1024_t256", "i256_t256", "i4096_t256"


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def metrics(shapes: dict[str, tuple[float, float, float]], capturing: bool = False) -> dict[str, float]:
    """A replica's record_autoscaling_stats answer: ``{shape: (arrival_rps, service_s, inflight)}``."""
    from bcg_core.scheduler.load import ShapeLoad

    loads = {s: ShapeLoad(a, a, min(1.0, a * t), t) for s, (a, t, _) in shapes.items()}
    return replica_metrics(loads, {s: int(q) for s, (_, _, q) in shapes.items()}, capturing, len(shapes))


def context(per_replica: dict[str, dict[str, float] | None], *, target: int, now: float, state: dict | None = None,
            lo: int = 1, hi: int = 8, queued: float = 0.0) -> AutoscalingContext:
    """A scripted context: each running replica's latest report (None: not reported yet)."""
    raw: dict[str, dict[str, list[TimeStampedValue]]] = {}
    for rid, m in per_replica.items():
        for name, v in (m or {}).items():
            raw.setdefault(name, {})[rid] = [TimeStampedValue(now - 2, -1.0), TimeStampedValue(now - 1, v)]
    return AutoscalingContext(
        deployment_id=None, deployment_name="DiTReplica", app_name="bcg", current_num_replicas=len(per_replica),
        target_num_replicas=target, running_replicas=list(per_replica), total_num_requests=0.0,
        total_queued_requests=queued, aggregated_metrics={}, raw_metrics=raw, capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi, policy_state=state or {}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now, config=AutoscalingConfig(min_replicas=lo, max_replicas=hi))


POLICY = dict(target_utilization=0.75, backlog_drain_s=10.0, upscale_delay_s=3.0, downscale_delay_s=30.0,
              max_ongoing_per_replica=2.0, capture_grace_s=30.0)


def run(policy, reports_by_time, target: int, **kw) -> list[tuple[float, int, dict]]:
    """Drive the policy through ``[(t, {replica: metrics})]``, feeding back its state and decisions."""
    state: dict = {}
    out = []
    for t, reps in reports_by_time:
        n, state = policy(context(reps, target=target, now=t, state=state, **kw))
        out.append((t, n, state["bcg"]["last"]))
        target = n
    return out


# -- the policy ------------------------------------------------------------------------------------------


def test_scales_up_on_a_hot_bucket_after_the_upscale_delay():
    policy = BucketLoadPolicy(**POLICY)
    # 6 req/s of 512x512 at 0.25 s of replica time each: 1.5 replicas' worth, plus a trickle of 256x256
    hot = {"a": metrics({HOT: (3.0, 0.25, 4), COLD: (0.2, 0.1, 0)}), "b": metrics({HOT: (3.0, 0.25, 4)})}
    steps = run(policy, [(t, hot) for t in (0.0, 1.0, 2.0, 3.0, 4.0)], target=2)
    assert [n for _, n, _ in steps] == [2, 2, 2, 3, 3]
    last = steps[-1][2]
    assert last["shapes"][HOT]["load"] == pytest.approx(1.5)
    assert last["need"] == pytest.approx((1.5 + 0.02) / 0.75, rel=1e-3)
    assert last["want"] == 3 and last["warming"] == 0


def test_the_same_request_rate_costs_more_replicas_at_a_bigger_bucket():
    # what Ray's default policy cannot see: equal request counts, 4x the replica time per request
    small = decide(parse_reports(["a"], {k: {"a": v} for k, v in metrics({HOT: (2.0, 0.25, 1)}).items()}),
                   target=1, now=0, state={}, min_replicas=1, max_replicas=8, upscale_delay_s=0)[0]
    big = decide(parse_reports(["a"], {k: {"a": v} for k, v in metrics({BIG: (2.0, 1.0, 1)}).items()}),
                 target=1, now=0, state={}, min_replicas=1, max_replicas=8, upscale_delay_s=0)[0]
    assert (small.want, big.want) == (1, 3)


def test_scales_down_only_after_the_downscale_delay_and_to_the_peak_of_that_time():
    policy = BucketLoadPolicy(**POLICY)
    quiet = {r: metrics({HOT: (0.2, 0.25, 0)}) for r in "abc"}
    # loads summed over the three replicas, / 0.75 utilisation: quiet 0.15 -> 1, mid 1.2 -> 2, some 1.8 -> 3
    some = {r: metrics({HOT: (2.4, 0.25, 1)}) for r in "abc"}
    mid = {r: metrics({HOT: (1.6, 0.25, 0)}) for r in "abc"}
    steps = run(policy, [(0.0, quiet), (10.0, mid), (29.0, quiet), (30.0, quiet), (31.0, quiet)], target=3)
    assert [n for _, n, _ in steps] == [3, 3, 3, 2, 2]  # the peak within the 30 s (2), not the latest (1)
    assert steps[3][2]["reason"].startswith("down after 30")
    # a wish to scale up in between restarts the downscale timer
    steps = run(policy, [(0.0, quiet), (20.0, some), (29.0, quiet), (45.0, quiet), (59.0, quiet)], target=3)
    assert [n for _, n, _ in steps] == [3, 3, 3, 3, 1]


def test_respects_the_bounds():
    policy = BucketLoadPolicy(**{**POLICY, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0})
    flood = {"a": metrics({HOT: (40.0, 0.25, 16)})}
    assert run(policy, [(0.0, flood)], target=1, lo=1, hi=4)[-1][1] == 4
    idle = {r: metrics({}) for r in "ab"}
    assert run(policy, [(0.0, idle)], target=2, lo=2, hi=4)[-1][1] == 2
    assert run(policy, [(0.0, idle)], target=4, lo=1, hi=4)[-1][1] == 1


def test_a_capturing_replica_is_not_capacity_and_blocks_downscale():
    policy = BucketLoadPolicy(**{**POLICY, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "capture_grace_s": 10.0})
    # load 1.2 replicas -> 2 ready replicas needed; one of the two running replicas is capturing
    busy = metrics({HOT: (4.8, 0.25, 2)})
    reps = {"a": busy, "b": metrics({}, capturing=True)}
    steps = run(policy, [(0.0, reps), (5.0, reps), (10.0, reps), (11.0, {"a": busy, "b": metrics({})})], target=2)
    # within the grace the capture is expected to end (a new replica would take longer): hold ...
    assert [(s[2]["warming"], s[2]["want"], s[1]) for s in steps[:2]] == [(1, 2, 2), (1, 2, 2)]
    # ... still capturing after it: the replica is not capacity, and one more is asked for
    assert (steps[2][2]["want"], steps[2][1]) == (3, 3)
    # a replica that has not reported yet counts as warming too
    assert run(policy, [(0.0, {"a": busy, "b": None})], target=2)[-1][2]["warming"] == 1
    # idle, but a replica is capturing: no downscale
    reps = {"a": metrics({}), "b": metrics({}), "c": metrics({}, capturing=True)}
    t, n, last = run(policy, [(0.0, reps)], target=3)[-1]
    assert n == 3 and last["reason"] == "warming: no downscale"


def test_a_downscale_does_not_bounce_back_while_the_survivor_captures():
    # 2 -> 1, then the survivor captures the leaver's shapes for 8 s while light traffic goes on
    policy = BucketLoadPolicy(**{**POLICY, "upscale_delay_s": 3.0, "downscale_delay_s": 10.0})
    light = metrics({HOT: (0.3, 0.25, 0)})
    ticks = [(float(t), {"a": light, "b": light}) for t in range(11)]
    ticks += [(float(t), {"a": metrics({HOT: (0.3, 0.25, 0)}, capturing=True)}) for t in range(11, 20)]
    ticks += [(float(t), {"a": light}) for t in range(20, 30)]
    counts = [n for _, n, _ in run(policy, ticks, target=2)]
    assert counts[10] == 1 and set(counts[10:]) == {1}, counts


def test_unmeasured_shape_at_the_replica_limit_is_one_replica():
    # a fresh replica at its max_ongoing_requests on a shape with no measured service time yet
    m = metrics({HOT: (2.0, 0.0, 16)})
    d, _ = decide(parse_reports(["a"], {k: {"a": v} for k, v in m.items()}), target=1, now=0, state={},
                  min_replicas=1, max_replicas=8, max_ongoing_per_replica=16, target_utilization=1.0)
    assert d.shapes[HOT].estimated == "ongoing" and d.shapes[HOT].load == pytest.approx(1.0) and d.want == 1


def test_backlog_and_handle_queue_count_before_the_rate_catches_up():
    d, _ = decide(parse_reports(["a"], {k: {"a": v} for k, v in metrics({HOT: (0.5, 0.5, 40)}).items()}),
                  target=1, now=0, state={}, min_replicas=1, max_replicas=8, upscale_delay_s=0,
                  max_ongoing_per_replica=64)
    assert d.shapes[HOT].load == pytest.approx(40 * 0.5 / 10)  # backlog term 2.0 > rate term 0.25
    # handle-queued requests count only while the replicas are full (otherwise they are in transit)
    spare = parse_reports(["a"], {k: {"a": v} for k, v in metrics({HOT: (0.5, 0.5, 4)}).items()})
    d2, _ = decide(spare, target=1, now=0, state={}, min_replicas=1, max_replicas=8, queued=60,
                   max_ongoing_per_replica=16)
    assert d2.queued == 0 and d2.need == pytest.approx(0.25 / 0.75)
    full = parse_reports(["a"], {k: {"a": v} for k, v in metrics({HOT: (0.5, 0.5, 16)}).items()})
    d3, _ = decide(full, target=1, now=0, state={}, min_replicas=1, max_replicas=8, queued=60,
                   max_ongoing_per_replica=16)
    assert d3.queued == 60 and d3.need == pytest.approx((16 * 0.5 / 10 + 60 * 0.5 / 10) / 0.75)
    d4, _ = decide(full, target=1, now=0, state={}, min_replicas=1, max_replicas=8, queued=float("inf"),
                   max_ongoing_per_replica=16)
    assert d4.queued == 0  # not a number of requests: ignored


def test_unmeasured_shapes_borrow_a_service_time_by_tokens_or_fall_back_to_ongoing():
    m = metrics({HOT: (2.0, 0.25, 1), BIG: (1.0, 0.0, 2)})
    d, _ = decide(parse_reports(["a"], {k: {"a": v} for k, v in m.items()}), target=1, now=0, state={},
                  min_replicas=1, max_replicas=8)
    assert d.shapes[BIG].estimated == "tokens"
    assert d.shapes[BIG].service_s == pytest.approx(0.25 / 1280 * (4096 + 256))
    m = metrics({BIG: (1.0, 0.0, 3)})
    d, _ = decide(parse_reports(["a"], {k: {"a": v} for k, v in m.items()}), target=1, now=0, state={},
                  min_replicas=1, max_replicas=8, max_ongoing_per_replica=2.0, capture_grace_s=30.0)
    assert d.shapes[BIG].estimated == "ongoing" and d.shapes[BIG].load == pytest.approx(1.5)


def test_through_rays_wrapper_with_the_config_build_app_makes():
    cfg = ServeConfig.model_validate({"autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 3,
                                                      "upscale_delay_s": 0}})
    ac = AutoscalingConfig(**autoscaling_config(cfg))
    assert ac.upscale_delay_s == 0 and ac.downscale_delay_s == 0  # the policy applies the delays
    assert ac.policy.policy_kwargs["max_ongoing_per_replica"] == backpressure_limits(cfg).dit_max_ongoing
    from ray.serve._private.autoscaling_state import _resolve_policy_callable

    wrapped = _apply_autoscaling_config(_resolve_policy_callable(ac.policy))
    ctx = context({"a": metrics({HOT: (8.0, 0.25, 8)})}, target=1, now=5.0, hi=3)
    ctx.config = ac
    n, state = wrapped(ctx)
    assert n == 3 and state["bcg"]["last"]["want"] == 3


def test_bad_policy_arguments_are_refused():
    with pytest.raises(ValueError, match="target_utilization"):
        BucketLoadPolicy(target_utilization=0)
    with pytest.raises(ValueError, match="delays"):
        BucketLoadPolicy(downscale_delay_s=-1)
    with pytest.raises(ValueError, match="delays"):
        BucketLoadPolicy(capture_grace_s=-1)


# -- the load meter --------------------------------------------------------------------------------------


def test_load_meter_rates_busy_time_and_service_time():
    clock = Clock(0.0)
    meter = LoadMeter(window_s=10.0, snapshot_s=0.5, clock=clock)
    for i in range(20):  # 2 req/s of HOT for 10 s, each batch 0.25 s alone (the first, cold one 0.45 s)
        clock.t = i * 0.5
        meter.arrive(HOT)
        meter.start(i, HOT)
        clock.t += 0.45 if i == 0 else 0.25
        meter.finish(i, 1)
    clock.t = 10.0
    ld = meter.loads([COLD])[HOT]
    assert ld.arrival_rps == pytest.approx(2.0, rel=0.06)
    assert ld.service_s == pytest.approx(0.25)  # the cold first batch is not a service time ...
    assert ld.busy == pytest.approx(0.52, rel=0.06)  # ... but it kept the replica busy
    assert ld.offered == pytest.approx(0.5, rel=0.06)
    assert meter.loads([COLD])[COLD].arrival_rps == 0.0  # idle shapes are reported, as zeros
    # the window slides: 20 s later the rate is gone, the measured service time stays
    clock.t = 30.0
    ld = meter.loads()[HOT]
    assert ld.arrival_rps == 0.0 and ld.service_s == pytest.approx(0.25)


def test_load_meter_shares_time_between_concurrent_batches():
    clock = Clock(0.0)
    meter = LoadMeter(window_s=10.0, snapshot_s=0.5, clock=clock)
    for first in ("x0", "y0"):  # each shape's first (cold) batch is left out of its service time
        meter.start(first, HOT if first == "x0" else COLD)
        clock.t += 5.0
        meter.finish(first, 1)
    meter.start("x", HOT)
    meter.start("y", COLD)
    clock.t += 2.0
    meter.finish("x", 2)
    meter.finish("y", 1)
    loads = meter.loads()
    assert loads[HOT].service_s == pytest.approx(0.5)  # 1 s of the 2 s, for 2 requests
    assert loads[COLD].service_s == pytest.approx(1.0)
    assert loads[HOT].busy + loads[COLD].busy <= 1.0 + 1e-9


def test_load_meter_rates_of_a_young_replica_do_not_double_count_after_a_scale_up():
    # 5 req/s in all; a replica added at t=7 takes half of them: summed over both replicas the rate at t=10
    # must stay 5 req/s although the old replica's 10 s window still holds 7 s of the full rate
    clock = Clock(0.0)
    old, new = LoadMeter(window_s=10.0, clock=clock), None
    for i in range(50):
        clock.t = i * 0.2
        if clock.t >= 7.0 and new is None:
            new = LoadMeter(window_s=10.0, clock=clock)
        (new if new is not None and i % 2 else old).arrive(HOT)
    clock.t = 10.0
    total = old.loads()[HOT].arrival_rps + new.loads()[HOT].arrival_rps
    assert total == pytest.approx(5.0, rel=0.05)


def test_load_meter_refuses_a_bad_window():
    with pytest.raises(ValueError, match="window_s"):
        LoadMeter(window_s=0.1, snapshot_s=0.5)


# -- ownership follows the measured load on scale events ---------------------------------------------------


def test_a_replica_added_for_a_hot_shape_co_owns_it():
    clock = Clock()
    prior = {HOT: BucketDemand(0.05, 1), COLD: BucketDemand(0.9, 1), BIG: BucketDemand(0.05, 1)}
    table = OwnershipTable(prior, expected=2, join_window_s=60, lease_s=5, hot_share=0.5, clock=clock)
    table.join("a", 1 << 40)
    table.join("b", 1 << 40)
    owners = table.assignment.owners
    assert len(owners[COLD]) == 2 and len(owners[HOT]) == 1  # the prior thinks COLD is hot
    # measured: HOT carries almost all the work
    for r in "ab":
        table.heartbeat(r, 1 << 40, table.owned(r), table.owned(r), stats={"load": {HOT: 0.9, COLD: 0.05}})
    table.join("c", 1 << 40)  # a scale-up
    assert table.snapshot()["demand"]["source"] == "measured"
    assert "c" in table.assignment.owners[HOT]
    assert len(table.assignment.owners[HOT]) >= 2


# -- backpressure limits and the autoscaling config ------------------------------------------------------


def test_backpressure_limits_follow_the_scheduler_capacity():
    default = backpressure_limits(ServeConfig())
    # step scheduler: 64 rows in flight, 2 rows per default request (guidance 3.5 > 1)
    assert (default.batch_capacity, default.dit_max_ongoing, default.dit_max_queued) == (32, 64, 64)
    assert default.ingress_max_ongoing == 64 + 64 + 8
    scaled = backpressure_limits(ServeConfig.model_validate({"autoscaling": {"enabled": True, "max_replicas": 4}}))
    assert scaled.dit_max_queued == 64 * 4 and scaled.ingress_max_ongoing == 64 * 4 + 256 + 8
    fixed = backpressure_limits(ServeConfig(), dit_replicas=3)
    assert fixed.dit_max_queued == 192
    no_cfg = backpressure_limits(ServeConfig.model_validate({"limits": {"default_guidance_scale": 1.0}}))
    assert no_cfg.batch_capacity == 64
    explicit = backpressure_limits(ServeConfig.model_validate(
        {"routing": {"max_ongoing_requests": 1, "max_queued_requests": 1}}))
    assert (explicit.dit_max_ongoing, explicit.dit_max_queued, explicit.ingress_max_ongoing) == (1, 1, 10)


def test_the_deployments_get_the_limits_and_the_policy():
    from ray.serve._private.build_app import build_app as serve_build_app

    from deployments import build_app

    app = build_app({"config": {"autoscaling": {"enabled": True, "min_replicas": 2, "max_replicas": 5}}})
    built = {d.name: d for d in serve_build_app(app, name="bcg").deployments}
    dit = built["DiTReplica"]._deployment_config
    assert dit.max_ongoing_requests == 64 and dit.max_queued_requests == 64 * 5
    assert (dit.autoscaling_config.min_replicas, dit.autoscaling_config.max_replicas) == (2, 5)
    assert dit.autoscaling_config.policy.policy_function == "router.autoscaling.BucketLoadPolicy"
    assert built["Ingress"]._deployment_config.max_ongoing_requests == 64 * 5 + 320 + 8
    with pytest.raises(ValueError, match="dit_replicas=2 conflicts with autoscaling.enabled"):
        build_app({"dit_replicas": 2, "config": {"autoscaling": {"enabled": True}}})
    fixed = {d.name: d for d in serve_build_app(build_app({"dit_replicas": 3}), name="bcg").deployments}
    assert fixed["DiTReplica"]._deployment_config.num_replicas == 3
    assert fixed["DiTReplica"]._deployment_config.autoscaling_config is None


@pytest.mark.parametrize("bad, match", [({"min_replicas": 3, "max_replicas": 2}, "exceeds max_replicas"),
                                        ({"look_back_period_s": 0.5, "metrics_interval_s": 2}, "shorter than"),
                                        ({"initial_replicas": 9, "max_replicas": 4}, "initial_replicas 9"),
                                        ({"target_utilization": 1.5}, "target_utilization")])
def test_a_bad_autoscaling_section_is_refused(bad, match):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        ServeConfig.model_validate({"autoscaling": bad})


def test_broken_metric_values_are_ignored():
    m = metrics({HOT: (2.0, 0.25, 1)})
    m[f"bcg_service_s:{HOT}"] = float("nan")
    m[f"bcg_arrival_rps:{COLD}"] = float("inf")
    reports = parse_reports(["a", "b"], {k: {"a": v, "b": v} for k, v in m.items()}
                            | {"bcg_capturing": {"a": 0.0, "b": float("nan")}})
    assert reports["b"] is None  # no valid capturing flag: not reported, counts as warming
    assert HOT in reports["a"].shapes and "service_s" not in reports["a"].shapes[HOT]
    d, _ = decide(reports, target=2, now=0, state={}, min_replicas=1, max_replicas=4)
    assert d.warming == 1 and all(x.load >= 0 for x in d.shapes.values())
