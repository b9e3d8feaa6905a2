"""Drift of recorded traffic from the plan a table was written with (``buckets.plan``).

:func:`plan_matches` says whether ``buckets.plan`` describes a table; :func:`drift_report` scores a replica's
recorded shape histogram on the config's table against the planned waste and miss share, and, when it has
drifted, what a fresh :func:`~bcg_core.planning.table_search.search_table` of it would save. Advice only: nothing
here changes a table.
"""

from __future__ import annotations

from collections.abc import Mapping

from bcg_core.config import EngineConfig, PlannedTraffic
from bcg_core.planning.plan_costs import PlanCosts, evaluate
from bcg_core.planning.samples import planning_table, traffic_from_histogram
from bcg_core.planning.table_search import search_table
from bcg_core.table import BucketTable

__all__ = ["DRIFT_POINTS", "DRIFT_RATIO", "drift_report", "plan_matches"]


DRIFT_RATIO = 1.5
"""Recorded traffic has drifted from the plan when the table would serve it with more than 1.5x the planned
padded-token waste (the issue's threshold) and at least :data:`DRIFT_POINTS` above it (so a plan of 0% waste does
not warn on a single padded request)."""

DRIFT_POINTS = 0.01


def plan_matches(plan_info: PlannedTraffic, table: BucketTable) -> bool:
    """Whether ``buckets.plan`` was written for this table: every shape it weighs is one of the table's."""
    shapes = {k.shape for k in table.keys}
    planned = {s for s, v in plan_info.work.items() if s != "miss" and v > 0}
    return bool(planned) and planned <= shapes


def drift_report(config: EngineConfig, snapshot: Mapping, max_graphs: int | None = None) -> dict:
    """How recorded traffic (a :meth:`~bcg_core.planning.traffic.TrafficHistogram.snapshot`) fares on ``config``'s table
    against what ``buckets.plan`` expected, and what a new plan of it would gain. Advice only.

    Drifted: over :data:`DRIFT_RATIO` x the planned waste and :data:`DRIFT_POINTS` above it, or over 1.5x the
    planned share of misses and 5 points above it (requests that moved outside the table).

    Returns:
        ``{"planned_waste", "recorded_waste", "recorded_miss_share", "ratio", "drifted", "requests", "gain",
        "new_buckets", "note"}``:
        ``gain`` is the expected GPU time per image a plan of the recorded traffic saves, 0..1 (None unless
        drifted); ``new_buckets`` that plan's buckets section. Without ``buckets.plan`` only the recorded waste.

    Raises:
        ValueError: a snapshot that does not validate.
    """
    traffic = traffic_from_histogram(config, snapshot)
    plan_info = config.buckets.plan
    out = {"requests": round(traffic.requests, 3), "planned_waste": None if plan_info is None else plan_info.waste,
           "recorded_waste": None, "ratio": None, "drifted": False, "gain": None, "new_buckets": None, "note": ""}
    if not traffic.demands:
        out["note"] = "no recorded request the limits allow"
        return out
    # the plan's own costs (a profile's lines where it had one), so planned and recorded waste compare alike
    costs = (PlanCosts.from_lines(plan_info.cost_lines, plan_info.costs)
             if plan_info is not None and plan_info.cost_lines else PlanCosts.token_count(config))
    table = planning_table(config)
    now = evaluate(table, traffic, costs)
    out["recorded_waste"] = round(now.waste, 6)
    out["recorded_miss_share"] = round(now.miss_share, 6)
    if plan_info is None:
        out["note"] = "buckets.plan is not set (the table was not written by bcg plan): nothing to compare with"
        return out
    if not plan_matches(plan_info, table):
        out["note"] = ("buckets.plan does not describe this table (its shapes were edited after bcg plan wrote it): "
                       "plan again with bcg plan --write, or delete buckets.plan")
        return out
    planned = plan_info.waste
    out["ratio"] = round(now.waste / planned, 3) if planned > 0 else None
    waste_drift = now.waste > DRIFT_RATIO * planned and now.waste - planned > DRIFT_POINTS
    # requests moving outside the table run eager without padding: a drift the waste alone cannot show
    miss_drift = now.miss_share > DRIFT_RATIO * plan_info.miss_share and now.miss_share - plan_info.miss_share > 0.05
    out["drifted"] = waste_drift or miss_drift
    if out["drifted"]:
        graphs = max_graphs or max(len(planning_table(config)), 1)
        fresh = search_table(config, traffic, costs, max_graphs=graphs)
        out["gain"] = round(max(0.0, 1 - fresh.score.ms_per_image / now.ms_per_image), 4) if now.ms_per_image else 0.0
        out["new_buckets"] = fresh.buckets.model_dump(mode="json")
        out["note"] = (f"recorded traffic is served with {now.waste:.1%} padded-token waste against the planned "
                       f"{planned:.1%}, and {now.miss_share:.1%} of it misses every bucket against the planned "
                       f"{plan_info.miss_share:.1%}; a plan of it (bcg plan --from this server) would save "
                       f"{out['gain']:.1%} of the GPU time per image with {fresh.score.graphs} graphs")
    return out
