"""The bucket planner (bcg_core/planning/table_search.py) and ``bcg plan``, on synthetic traffic and the packaged
samples.

The tiny default model (FLUX layout, token-count keyed, native text 256), its tokenizer only (no weights). The
cost model is the token-count stand-in unless a test scripts one. The searches over the whole krea sample (seconds
each) are ``tests/engine/test_bucket_plan_krea.py``; the end-to-end run ``tests/serve/test_bucket_plan_serve.py``.
"""

from __future__ import annotations

import itertools
import json

import pytest

from bcg_core import BucketConfig, GenerationRequest, LimitsConfig
from bcg_core.planning.plan_costs import PlanCosts, costs_from_profile, evaluate
from bcg_core.planning.samples import (
    Traffic,
    krea_rows,
    planning_table,
    planning_validator,
    traffic_from_gentd26,
    traffic_from_histogram,
    traffic_from_rows,
)
from bcg_core.planning.table_search import search_table
from bcg_core.planning.traffic import TrafficHistogram
from bcg_core.table import BucketTable
from deployments.settings import ServeConfig

EXACT = ServeConfig(buckets=BucketConfig(image_padding="exact"))


def _rows(*specs) -> list[dict[str, str]]:
    """krea-format rows: (width, height, n, count) -> count requests, each as n image rows, no CFG."""
    out = []
    for w, h, n, count in specs:
        for _ in range(count * n):
            out.append({"prompt": "a red cube on a table", "width": str(w), "height": str(h),
                        "num_generations": str(n), "num_step": "10", "cfg_scale": "1.0"})
    return out


def _table(config: ServeConfig, batch, tiers, texts) -> BucketTable:
    validator = planning_validator(config)
    cfg = BucketConfig(**{**config.buckets.model_dump(), "batch_sizes": list(batch), "resolutions": list(tiers),
                          "text_lengths": list(texts)})
    side = -(-config.limits.min_side_px // validator.rules.pixels_per_token)
    return BucketTable(cfg, validator.rules, side * side)


def test_one_exact_size_gets_one_exact_tier_and_no_waste():
    traffic = traffic_from_rows(EXACT, _rows((512, 512, 1, 10)))
    plan = search_table(EXACT, traffic)
    assert plan.buckets.resolutions == ["512x512"] and plan.buckets.batch_sizes == [1]
    assert plan.score.waste == 0.0 and plan.score.miss_share == 0.0 and plan.score.graphs == 1
    assert plan.score.shares == {"i1024_t256": {"share": 1.0, "waste": 0.0, "work": 1.0}}


def test_a_budget_of_one_graph_picks_the_best_single_bucket():
    traffic = traffic_from_rows(EXACT, _rows((512, 512, 1, 6), (512, 768, 2, 3), (768, 768, 4, 1)))
    costs = PlanCosts.token_count(EXACT)
    plan = search_table(EXACT, traffic, costs, max_graphs=1)
    validator = planning_validator(EXACT)
    tiers = sorted({d.size for d in traffic.demands})
    brute = min(evaluate(_table(EXACT, [b], [f"{w}x{h}"], [256]), traffic, costs).ms_per_image
                for b, (w, h) in itertools.product(range(1, 9), tiers))
    assert plan.score.graphs == 1 and plan.score.ms_per_image == pytest.approx(brute)
    assert validator.rules.native_text_tokens == 256 and plan.buckets.text_lengths == [256]


def test_the_planned_table_beats_a_coarse_batch_bucket():
    """3-image requests against a 16-row bucket: padding 13 rows costs more than an unpadded eager forward, so
    that table serves them eager (no waste, no graph); the planner gives them a bucket that holds 3 rows."""
    traffic = traffic_from_rows(EXACT, _rows((512, 512, 3, 10)))
    costs = PlanCosts.token_count(EXACT)
    coarse = evaluate(_table(EXACT, [16], ["512x512"], [256]), traffic, costs)
    assert coarse.waste == 0.0 and coarse.ms_per_image == pytest.approx(10 * costs.eager_ms(3 * 1280) / 3)
    plan = search_table(EXACT, traffic, costs, max_graphs=2)
    assert plan.buckets.batch_sizes == [3] and plan.score.waste == 0.0
    assert plan.score.ms_per_image == pytest.approx(10 * costs.graph_ms(plan_table_key(3)) / 3)
    assert plan.score.ms_per_image < coarse.ms_per_image


def plan_table_key(rows: int):
    from bcg_core.keys import BucketKey

    return BucketKey(rows, 1024, 256)


def test_bad_inputs_get_errors_that_name_the_fix():
    with pytest.raises(ValueError, match="no request the limits allow .*size: 2.*widen limits"):
        search_table(EXACT, traffic_from_rows(EXACT, _rows((4096, 4096, 1, 2))))
    with pytest.raises(ValueError, match=r"\(empty\) holds no request: nothing to plan for; plan once the server"):
        search_table(EXACT, Traffic([], "empty"))  # a server's histogram before its first request
    traffic = traffic_from_rows(EXACT, _rows((512, 512, 1, 4)))
    with pytest.raises(ValueError, match=r"smallest graph needs [0-9.]+ MiB; raise the budget"):
        search_table(EXACT, traffic, budget_mib=0.001)
    with pytest.raises(ValueError, match="max_graphs 1 is below the 2 graphs .* image_padding: exact"):
        search_table(ServeConfig(), traffic_from_rows(ServeConfig(), _rows((768, 512, 1, 4))), max_graphs=1)
    with pytest.raises(ValueError, match="max_graphs must be at least 1"):
        search_table(EXACT, traffic, max_graphs=0)
    mixed = traffic_from_rows(EXACT, _rows((512, 512, 1, 3), (100, 512, 1, 2)))
    # counted, not planned
    assert mixed.refused == {"size": pytest.approx(2.0)} and mixed.requests == pytest.approx(3.0)
    with pytest.raises(ValueError, match="row 0: width and height are required"):
        traffic_from_rows(EXACT, [{"prompt": "x", "width": "", "height": "512"}])


def test_costs_fitted_from_a_profile():
    fallback = PlanCosts.token_count(EXACT)
    rows = [{"key": "b1_i1024_t256", "graph_ms": 2.0, "eager_ms": 6.0, "pool_bytes": 1280 * 1000},
            {"key": "b4_i1024_t256", "graph_ms": 6.0, "eager_ms": 9.0, "pool_bytes": 5120 * 1000}]
    costs = costs_from_profile(rows, fallback)
    assert costs.source == "profile" and costs.bytes_per_token == pytest.approx(1000)
    assert costs.graph_launch_ms == pytest.approx(2.0 - 4.0 / 3840 * 1280)
    assert costs.ms_per_token == pytest.approx(4.0 / 3840) and costs.eager_ms_per_token == pytest.approx(3.0 / 3840)
    assert costs.eager_ms(1280) == pytest.approx(6.0) and costs.graph_ms(plan_table_key(4)) == pytest.approx(6.0)
    grown = costs_from_profile([{**rows[0], "pool_bytes": 100}, rows[1]], fallback)  # a small bucket reusing the pool
    assert grown.bytes_per_token == pytest.approx(1000)
    with pytest.raises(ValueError, match="at least two token counts"):
        costs_from_profile(rows[:1], fallback)
    with pytest.raises(ValueError, match="profile row 0: needs key, graph_ms and eager_ms"):
        costs_from_profile([{"key": "b1_i1024_t256"}], fallback)


def test_gentd26_counts_joined_with_krea_sizes_and_a_recorded_histogram():
    config = ServeConfig()
    trace = [{"predict_type": "TXT_2_IMG", "num_images_per_prompt": "4.0", "num_inference_steps": "30.0",
              "prompt_length": "120.0"},
             {"predict_type": "IMG_2_IMG", "num_images_per_prompt": "1.0", "num_inference_steps": "30.0",
              "prompt_length": "10.0"},
             {"predict_type": "TXT_2_IMG", "num_images_per_prompt": "1.0", "num_inference_steps": "20.0",
              "prompt_length": "40.0"}]
    traffic = traffic_from_gentd26(config, trace, [(512, 512), (768, 512)])
    # the image-to-image row (the tiny default edits: strength 0.6) runs 18 of its 30 steps
    assert sorted((d.images, d.steps, d.size) for d in traffic.demands) == [(1, 18, (768, 512)), (1, 20, (512, 512)),
                                                                           (4, 30, (512, 512))]
    assert search_table(config, traffic).score.graphs >= 1
    with pytest.raises(ValueError, match="at least one"):
        traffic_from_gentd26(config, trace, [])
    validator = planning_validator(config)
    hist = TrafficHistogram()
    for req in (GenerationRequest("a cat", n=2, width=512, height=512, num_inference_steps=8, guidance_scale=1.0,
                                  seed=0),) * 3 + (GenerationRequest("a dog", n=1, width=768, height=512,
                                                                      num_inference_steps=8, seed=0),):
        hist.record(validator.validate(req))
    traffic = traffic_from_histogram(config, hist.snapshot())
    rows = sorted((d.query.batch, d.images, d.weight) for d in traffic.demands)
    assert rows == [(2, 1, 1.0), (2, 2, 3.0)]  # the default guidance 3.5 adds uncond rows to the dog
    assert search_table(config, traffic).score.miss_share == 0.0


def test_bcg_plan_writes_a_config_that_serves_a_report_and_a_plot(tmp_path, capsys):
    from deployments.cli.main import main

    out, report, png = tmp_path / "planned.yaml", tmp_path / "plan.json", tmp_path / "plan.png"
    # on this sample the default table is expected to be cheaper (tests/unit/test_cli_dead_ends.py): --force writes
    assert main(["plan", "--steps", "20", "--max-graphs", "8", "--write", str(out), "--json", str(report),
                 "--plot", str(png), "--force"]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out} (--force: the current table is expected to be as good or better)" in text
    assert "bcg plan: krea traffic" in text and "costs: token-count" in text and "current table: 63 graphs" in text
    from deployments.settings import load_config

    planned = load_config(config_path=str(out))
    data = json.loads(report.read_text())
    assert planned.buckets.model_dump(mode="json") == data["buckets"] and data["chosen"]["graphs"] <= 8
    assert [p["graphs"] for p in data["curve"]] == sorted(p["graphs"] for p in data["curve"])
    assert data["costs"]["source"] == "token-count (compiled hits)" and data["current"]["graphs"] == 63
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from bcg_core.planning.samples import planning_table

    assert len(planning_table(planned)) == data["chosen"]["graphs"]  # the replica builds the planned table
    with pytest.raises(SystemExit):
        main(["plan", "--max-graphs", "0"])
    assert main(["plan", "--from", str(tmp_path / "missing.json")]) == 2
    assert "bcg plan: error:" in capsys.readouterr().err


def test_validator_limits_shape_the_traffic():
    config = ServeConfig(limits=LimitsConfig(max_images=4), buckets=BucketConfig(batch_sizes=[1, 2, 4, 8]))
    traffic = traffic_from_rows(config, _rows((512, 512, 9, 2), (512, 512, 1, 1)))
    assert traffic.refused == {"n": pytest.approx(2.0)} and traffic.requests == pytest.approx(1.0)


def _histogram(config: ServeConfig, requests) -> dict:
    validator = planning_validator(config)
    hist = TrafficHistogram()
    for r in requests:
        hist.record(validator.validate(r))
    return hist.snapshot()


def test_drift_from_the_plan_is_reported_with_what_a_new_plan_saves():
    from bcg_core.planning.drift import drift_report

    plan = search_table(EXACT, traffic_from_rows(EXACT, _rows((512, 512, 1, 20))), max_graphs=4)
    planned = EXACT.model_copy(update={"buckets": plan.buckets})
    assert planned.buckets.plan.waste == 0.0 and planned.buckets.plan.work == {"i1024_t256": 1.0}
    same = _histogram(planned, [GenerationRequest("a cat", n=1, width=512, height=512, num_inference_steps=10,
                                                  guidance_scale=1.0, seed=0)] * 30)
    report = drift_report(planned, same)
    assert report["recorded_waste"] == 0.0 and not report["drifted"] and report["gain"] is None
    # 4-image 512x768 requests on a 4-row 768x768 masked table planned (as far as it says) for 0% waste
    drifted = _histogram(planned, [GenerationRequest("a cat", n=4, width=512, height=768, num_inference_steps=10,
                                                     guidance_scale=1.0, seed=0)] * 30)
    wide = EXACT.model_copy(update={"buckets": BucketConfig(image_padding="masked", resolutions=["768x768"],
                                                            batch_sizes=[4])})
    work = {k.shape: 0.5 for k in planning_table(wide).keys}  # a plan of this very table, expecting 0% waste
    wide = wide.model_copy(update={"buckets": wide.buckets.model_copy(
        update={"plan": planned.buckets.plan.model_copy(update={"work": work})})})
    report = drift_report(wide, drifted)
    assert report["drifted"] and report["recorded_waste"] == pytest.approx(1 - 1792 / 2560) and 0 < report["gain"] <= 1
    assert report["new_buckets"]["resolutions"] == ["768x512"] and "would save" in report["note"]
    profiled = costs_from_profile([{"key": "b1_i1024_t256", "graph_ms": 2.0, "eager_ms": 6.0},
                                   {"key": "b4_i1024_t256", "graph_ms": 6.0, "eager_ms": 9.0}],
                                  PlanCosts.token_count(EXACT))
    by_profile = search_table(EXACT, traffic_from_rows(EXACT, _rows((512, 512, 1, 20))), profiled, max_graphs=4)
    assert by_profile.buckets.plan.costs == "profile"
    assert PlanCosts.from_lines(by_profile.buckets.plan.cost_lines, "profile") == profiled  # drift scores alike
    unplanned = drift_report(EXACT, same)
    assert unplanned["planned_waste"] is None and "buckets.plan is not set" in unplanned["note"]


def test_ownership_takes_the_plans_work_shares_over_the_krea_prior():
    from router.ownership import demands_for_config

    plan = search_table(EXACT, traffic_from_rows(EXACT, _rows((512, 512, 1, 3), (768, 768, 1, 1))), max_graphs=4)
    planned = EXACT.model_copy(update={"buckets": plan.buckets})
    demands = demands_for_config(planned)
    work = {k: v for k, v in plan.buckets.plan.work.items() if k != "miss"}
    assert set(demands) == {k.shape for k in planning_table(planned).keys}
    assert {s: d.share for s, d in demands.items()} == pytest.approx({s: work.get(s, 0.0) / sum(work.values())
                                                                      for s in demands})
    krea = demands_for_config(EXACT)  # no plan: the krea prior
    assert {s: d.share for s, d in krea.items()} != {s: d.share for s, d in demands.items()}


def test_the_exporter_sets_the_drift_gauges():
    from test_prometheus import FakeBackend

    from bcg_core import BucketMetrics
    from deployments.metrics import BucketExporter

    table = planning_table(EXACT)
    metrics = BucketMetrics(table.keys)
    backend = FakeBackend()
    report = {"recorded_waste": 0.42, "gain": 0.25}
    exporter = BucketExporter(metrics.snapshot, metrics, backend=backend, drift=lambda: report)
    exporter.push()
    assert backend.m["bcg_plan_recorded_waste"].total() == 0.42 and backend.m["bcg_plan_drift_gain"].total() == 0.25


def test_review_findings_stale_plan_reject_policy_budgets_and_recorded_cfg(tmp_path, capsys):
    """A plan that no longer matches its table, miss_policy reject, an infinite or generous budget, recorded CFG
    traffic under a low guidance limit, traffic that moves outside the table, and bad --profile/--trace files."""
    from bcg_core.planning.drift import drift_report
    from deployments.cli.main import main
    from router.ownership import demands_for_config

    config = ServeConfig()
    traffic = traffic_from_rows(config, krea_rows()[:300], steps=20)
    plan = search_table(config, traffic, max_graphs=12)
    stale = config.model_copy(update={"buckets": plan.buckets.model_copy(update={"resolutions": ["256x256"]})})
    assert set(demands_for_config(stale)) == {k.shape for k in planning_table(stale).keys}  # the krea prior, no crash
    hist = _histogram(config, [GenerationRequest("a cat", n=1, width=512, height=512, num_inference_steps=8,
                                                 guidance_scale=1.0, seed=0)] * 5)
    assert "does not describe this table" in drift_report(stale, hist)["note"]
    # miss_policy reject: a miss would be refused, so the planned table holds every request (or says it cannot)
    strict = ServeConfig(buckets=BucketConfig(miss_policy="reject"))
    held = search_table(strict, traffic_from_rows(strict, krea_rows()[:300], steps=20), max_graphs=64)
    assert held.score.miss_share == 0.0 and held.buckets.miss_policy == "reject"
    exact = ServeConfig(buckets=BucketConfig(miss_policy="reject", image_padding="exact"))
    with pytest.raises(ValueError, match=r"under miss_policy reject every request .* \(--max-graphs\)"):
        search_table(exact, traffic_from_rows(exact, krea_rows()[:300], steps=20), max_graphs=2)
    # budgets: infinite is refused; one the unbudgeted plan fits in plans as well as no budget
    with pytest.raises(ValueError, match="positive finite"):
        search_table(config, traffic, budget_mib=float("inf"))
    with pytest.raises(SystemExit):
        main(["plan", "--budget-mib", "inf"])
    roomy = search_table(config, traffic, budget_mib=plan.score.pool_bytes / 2**20 * 1.01, max_graphs=12)
    assert roomy.score.ms_per_image <= plan.score.ms_per_image + 1e-9
    # recorded CFG requests under a guidance limit below 4.5 are still planned
    low = ServeConfig(limits=LimitsConfig(max_guidance_scale=3.0, default_guidance_scale=3.0))
    cfg_hist = _histogram(low, [GenerationRequest("a cat", n=1, width=512, height=512, num_inference_steps=8,
                                                  guidance_scale=3.0, seed=0)] * 4)
    assert traffic_from_histogram(low, cfg_hist).demands[0].query.batch == 2
    # traffic that moves outside the table drifts even without padding
    planned = config.model_copy(update={"buckets": plan.buckets})
    big = _histogram(config, [GenerationRequest("a cat", n=1, width=2048, height=2048, num_inference_steps=8,
                                                guidance_scale=1.0, seed=0)] * 60)
    report = drift_report(planned, big)
    assert report["recorded_miss_share"] == 1.0 and report["drifted"] and "misses every bucket" in report["note"]
    # bad files name themselves
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x"}')
    assert main(["plan", "--profile", str(bad)]) == 2
    trace = tmp_path / "trace.csv"
    trace.write_text("a,b,c\n1,2,3\n")
    assert main(["plan", "--traffic", "gentd26", "--trace", str(trace)]) == 2
    assert main(["plan", "--trace", str(trace)]) == 2
    assert main(["plan", "--from", "127.0.0.1:8011"]) == 2
    err = capsys.readouterr().err
    assert f"--profile {bad}: expected `bcg profile --json` output" in err
    assert "missing ['num_images_per_prompt', 'num_inference_steps', 'prompt_length']" in err
    assert "give it with --traffic gentd26" in err and "e.g. http://127.0.0.1:8011" in err


def test_the_planners_own_profile_spans_the_sample_and_needs_a_gpu(tmp_path, capsys):
    """``bcg plan --measure``'s buckets: the smallest, most requested and largest tier at 1 row and the most rows,
    so that the fitted lines cover every token count the plan prices. Without CUDA it says what to do instead."""
    import torch

    from bcg_core.planning.table_search import profile_buckets
    from deployments.cli.main import main

    config = ServeConfig()
    traffic = traffic_from_rows(config, krea_rows(), steps=20)
    b = profile_buckets(config, traffic)
    table = _table(config, b.batch_sizes, b.resolutions, b.text_lengths)
    tokens = [d.query.image_tokens for d in traffic.demands]
    assert b.batch_sizes == [1, max(d.query.batch for d in traffic.demands)]
    assert table.image_tiers[0] == min(tokens) and table.image_tiers[-1] == max(tokens) and "512x512" in b.resolutions
    assert b.image_padding == "exact" and b.text_lengths == [256] and b.plan is None
    if not torch.cuda.is_available():
        assert main(["plan", "--measure"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    assert main(["plan", "--measure", "--profile", str(profile)]) == 2
    assert "not both" in capsys.readouterr().err
