"""The bucket planner (bcg_core/planning/table_search.py) on the whole krea sample: the searches that take seconds each
on 2 cores, and a masked-text family planned on the tests/tiny PixArt-Sigma checkpoint. The tiny default model, its
tokenizer only (no weights); the cost model is the token-count stand-in. The fast planner checks are
``tests/unit/test_bucket_plan.py``.
"""

from __future__ import annotations

import pytest

from bcg_core import BucketConfig
from bcg_core.config import EngineConfig
from bcg_core.planning.plan_costs import PlanCosts, evaluate
from bcg_core.planning.samples import krea_rows, planning_table, planning_validator, traffic_from_rows
from bcg_core.planning.table_search import search_table
from bcg_core.table import BucketTable


def _table(config: EngineConfig, batch, tiers, texts) -> BucketTable:
    validator = planning_validator(config)
    cfg = BucketConfig(**{**config.buckets.model_dump(), "batch_sizes": list(batch), "resolutions": list(tiers),
                          "text_lengths": list(texts)})
    side = -(-config.limits.min_side_px // validator.rules.pixels_per_token)
    return BucketTable(cfg, validator.rules, side * side)


def test_growing_the_budget_never_makes_the_expected_cost_worse():
    config = EngineConfig()
    traffic = traffic_from_rows(config, krea_rows()[:400], steps=20)
    costs = PlanCosts.token_count(config)
    by_graphs = [search_table(config, traffic, costs, max_graphs=g).score.ms_per_image for g in range(2, 25, 2)]
    assert all(b <= a + 1e-9 for a, b in zip(by_graphs, by_graphs[1:], strict=False)), by_graphs
    assert by_graphs[-1] < by_graphs[0]
    first = search_table(config, traffic, costs, max_graphs=2)
    mib = [first.score.pool_bytes / 2**20 * f for f in (1.0, 1.5, 2, 3, 5, 10)]
    by_mib = [search_table(config, traffic, costs, budget_mib=m, max_graphs=12).score.ms_per_image for m in mib]
    assert all(b <= a + 1e-9 for a, b in zip(by_mib, by_mib[1:], strict=False)), by_mib
    curve = [p.score.ms_per_image for p in search_table(config, traffic, costs, max_graphs=24).curve]
    assert curve == sorted(curve, reverse=True)  # the search path only adds buckets


def test_every_request_is_served_by_a_bucket_or_a_counted_planned_miss():
    config = EngineConfig()
    traffic = traffic_from_rows(config, krea_rows(), steps=20)
    plan = search_table(config, traffic, max_graphs=12)
    table = _table(config, plan.buckets.batch_sizes, plan.buckets.resolutions, plan.buckets.text_lengths)
    missed = sum(d.weight for d in traffic.demands
                 if not table.lookup(d.query.__class__(min(d.query.batch, table.batch_sizes[-1]), d.query.image_tokens,
                                                       d.query.text_tokens, d.query.latent_hw)).hit)
    assert plan.score.miss_share == pytest.approx(missed / traffic.requests)
    assert plan.score.shares.get("miss", {"share": 0.0})["share"] == pytest.approx(plan.score.miss_share)
    roomy = search_table(config, traffic, max_graphs=400)  # room for every size: nothing is left to eager
    assert roomy.score.miss_share == 0.0 and roomy.score.ms_per_image <= plan.score.ms_per_image
    assert sum(v["share"] for v in plan.score.shares.values()) == pytest.approx(1.0)


def test_with_compiled_kernels_misses_cost_more_so_the_plan_holds_more_of_the_traffic():
    """Misses run eager kernels, buckets compiled ones (``runner.kernels: auto`` on a GPU): the token-count model
    prices a miss's token :data:`~bcg_core.planning.plan_costs.COMPILED_HIT_GAIN` times a bucket's, so on the whole krea
    sample the 12-graph plan leaves fewer requests to eager misses than with eager kernels everywhere (8.7% against
    21.3% when this was written)."""
    from bcg_core.planning.plan_costs import COMPILED_HIT_GAIN

    compiled = EngineConfig()
    eager = EngineConfig.model_validate({"runner": {"kernels": "eager"}})
    traffic = traffic_from_rows(compiled, krea_rows())  # each request at its own steps, as `bcg plan` plans
    c_costs, e_costs = PlanCosts.token_count(compiled), PlanCosts.token_count(eager)
    assert c_costs.source == "token-count (compiled hits)" and e_costs.source == "token-count"
    assert c_costs.eager_ms(1000) - c_costs.eager_launch_ms == pytest.approx(1000 * 1e-3 * COMPILED_HIT_GAIN)
    key = planning_table(compiled).keys[0]
    assert e_costs.eager_ms_per_token is None and c_costs.graph_ms(key) == e_costs.graph_ms(key)
    on_cpu = EngineConfig.model_validate({"model": {"device": "cpu"}})
    assert PlanCosts.token_count(on_cpu).eager_ms_per_token is None  # eager kernels on a CPU: no compiled hits
    eager_runner = PlanCosts.token_count(EngineConfig.model_validate({"runner": {"mode": "eager"}}))
    assert eager_runner.source == "token-count (eager runner) (compiled hits)"  # its buckets still compile
    assert eager_runner.eager_ms_per_token == pytest.approx(1e-3 * COMPILED_HIT_GAIN)
    with_compiled = search_table(compiled, traffic, c_costs, max_graphs=12)
    with_eager = search_table(eager, traffic, e_costs, max_graphs=12)
    assert with_compiled.score.miss_share < with_eager.score.miss_share / 2, (
        with_compiled.score.miss_share, with_eager.score.miss_share)


def test_a_masked_text_family_gets_text_buckets_that_hold_its_longest_prompt_within_the_cap(tmp_path):
    """PixArt-Sigma at its 512 px bins (the tests/tiny checkpoint with ``sample_size`` 64), planned on the first
    half of the krea rows and scored on the second: the plan stays within 5% waste and 12 graphs on the held-out
    half (the issue's target; docs/PLANNER.md), and its largest text bucket holds the sample's longest prompt
    (capped at the encoder's cut), so none of its own traffic is a text miss (a longer prompt runs unpadded on
    eager kernels, ``RequestValidator.text_limit``; a table of ``[144]`` once refused a 173-token krea prompt with 422
    on the GPU, before text misses were served). Finer text buckets on the common tier only
    (``text_lengths_by_resolution``) pad less than the table without them, and the replica's table rounds that tier's
    text among its own buckets."""
    from tiny.pixart import build

    path = build(tmp_path / "pixart-512", sample_size=64)
    config = EngineConfig.model_validate({"model": {"path": str(path), "device": "cuda"},
                                         "buckets": {"resolutions": ["512x512", "416x608", "608x416"],
                                                     "text_lengths": [256]}})
    rows = krea_rows()
    first = traffic_from_rows(config, rows[:len(rows) // 2], steps=20)
    second = traffic_from_rows(config, rows[len(rows) // 2:], steps=20)
    costs = PlanCosts.token_count(config)
    plan = search_table(config, first, costs, max_graphs=12)
    table = planning_table(config.model_copy(update={"buckets": plan.buckets}))
    assert len(table) == plan.score.graphs <= 12
    held_out = evaluate(table, second, costs)
    assert held_out.waste <= 0.05, held_out.waste
    cap = planning_validator(config).spec.max_text_tokens
    longest = max(d.query.text_tokens for d in first.demands)
    assert plan.buckets.text_lengths[-1] >= min(cap or longest, longest), (plan.buckets.text_lengths, longest)
    # under a graph-memory budget too: the budget ladder starts from the smallest table at that text length
    budgeted = search_table(config, first, costs, budget_mib=50.0, max_graphs=12)
    assert budgeted.buckets.text_lengths[-1] == plan.buckets.text_lengths[-1]
    # per-tier text buckets: the common 512x512 bin with finer ones pads less than the same table without them
    texts = plan.buckets.text_lengths
    finer = sorted(set(texts) | {t + 16 for t in texts[:-1]} | {max(16, texts[0] - 32)})
    fine_cfg = plan.buckets.model_copy(update={"text_lengths_by_resolution": {"512x512": finer}})
    fine = planning_table(config.model_copy(update={"buckets": fine_cfg}))
    assert evaluate(fine, second, costs).waste < held_out.waste
    assert fine.texts_for(1024, (32, 32)) == tuple(finer) and fine.texts_for(988, (38, 26)) == tuple(texts)
