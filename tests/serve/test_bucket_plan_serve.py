"""The bucket planner end to end: plan a table for the first krea requests, serve it on the session's Serve
instance (``serve_apps``), replay them. The planner's own checks are ``tests/unit/test_bucket_plan.py``."""

from __future__ import annotations

import pytest

from bcg_core import GenerationRequest
from bcg_core.planning.table_search import search_table
from deployments.settings import ServeConfig


@pytest.mark.serve
@pytest.mark.long  # outside the default run (README, Tests)
def test_end_to_end_plan_serve_replay_and_the_measured_waste_is_the_predicted_one(serve_apps, tmp_path):
    """Plan a table for the first krea requests, serve it, replay them: the step scheduler's measured padded-token
    waste is within 2 points of the planner's prediction, the replica holds the planned number of buckets and
    the requests it served without a bucket are the planned misses.

    On a CPU the replica's cost model never pads (a padded forward is pure extra work on the eager runner), and
    the planner's eager-runner costs say so: both waste figures are 0 here, and the check that discriminates is
    which requests hit which shape."""
    import httpx
    from ray import serve

    from bcg_core.planning.samples import traffic_from_requests
    from deployments import build_app
    from deployments.cli.demo import load_requests, replay

    config = ServeConfig.model_validate({"model": {"device": "cpu"}})
    demo = load_requests(6)
    requests = [GenerationRequest(d.prompt, n=d.n, width=d.width, height=d.height, num_inference_steps=1, seed=0)
                for d in demo]
    plan = search_table(config, traffic_from_requests(config, requests), max_graphs=6)
    assert plan.costs["source"] == "token-count (eager runner)"
    planned = ServeConfig.model_validate({**config.model_dump(mode="json"),
                                          "buckets": plan.buckets.model_dump(mode="json")})
    serve.run(build_app({"config": planned.model_dump(mode="json")}), name="bcg-planned", route_prefix="/planned")
    try:
        url = f"{serve_apps.base_url}/planned"
        results = replay(url, demo, steps=1, concurrency=1, out_dir=tmp_path, timeout_s=300)
        assert all(r.ok for r in results), [r.error for r in results]
        stats = httpx.get(f"{url}/v1/buckets", timeout=60).json()
    finally:
        serve.delete("bcg-planned")
    sched = stats["scheduler"]
    assert sched["computed_tokens"] > 0
    assert abs(sched["padded_token_waste"] - plan.score.waste) <= 0.02, (sched["padded_token_waste"], plan.score.waste)
    assert len(stats["buckets"]) == plan.score.graphs
    misses = stats["totals"]["misses"] / stats["totals"]["requests"]
    assert 0 < plan.score.miss_share < 1 and misses == pytest.approx(plan.score.miss_share)
    served = {b["key"].split("_", 1)[1]: b["requests"] for b in stats["buckets"] if b["requests"]}
    planned = {k: v["share"] * len(demo) for k, v in plan.score.shares.items() if k != "miss"}
    assert served == pytest.approx(planned)
