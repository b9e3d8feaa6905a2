"""The traffic histogram of a served replica over HTTP (``serve_apps``); the histogram itself, its merge, its
exporter series and its config are ``tests/unit/test_traffic.py``."""

from __future__ import annotations

import pytest

from bcg_core import GenerationRequest, RequestValidator, TrafficHistogram
from bcg_core.planning.traffic import TrafficKey
from deployments.settings import ServeConfig


def _shapes(snap: dict) -> dict[tuple, int]:
    return {tuple(s[f] for f in TrafficKey._fields): s["count"] for s in snap["shapes"]}


def _count(snap: dict, key: tuple) -> int:
    return _shapes(snap).get(key, 0)


@pytest.mark.serve
def test_the_replica_records_what_it_accepts_and_buckets_shows_it(serve_apps):
    import httpx
    from ray import serve

    validator = RequestValidator.from_config(ServeConfig.model_validate({"buckets": {"batch_sizes": [1, 2, 4],
                                                                          "resolutions": ["256x256", "512x512"],
                                                                          "text_lengths": [256]}}))
    prompt = "a traffic histogram test prompt"
    tokens = validator.count_tokens(prompt)
    one, two = (256, 256, 1, tokens, 1), (256, 256, 2, tokens, 1)
    body = {"prompt": prompt, "size": "256x256", "num_inference_steps": 1, "guidance_scale": 0.0, "seed": 5}
    with httpx.Client(base_url=serve_apps.base_url, timeout=120.0, trust_env=False) as client:
        before = client.get("/v1/buckets").json()["traffic"]
        assert client.post("/v1/images/generations", json={**body, "n": 1}).status_code == 200
        assert client.post("/v1/images/generations", json={**body, "n": 2}).status_code == 200
        bad = client.post("/v1/images/generations", json={**body, "n": 99})  # refused: never reaches a replica
        assert bad.status_code == 422
        # a request a Python caller validated and sent straight to the DiT deployment is counted too
        app_config = {"buckets": {"batch_sizes": [1, 2, 4], "resolutions": ["256x256", "512x512"],
                                  "text_lengths": [256], "miss_policy": "eager"}}  # the serve_apps "/" app's
        validated = RequestValidator.from_config(ServeConfig.model_validate(app_config)).validate(GenerationRequest(
            prompt, n=1, width=256, height=256, num_inference_steps=1, guidance_scale=0.0, seed=6))
        dit = serve.get_deployment_handle("DiTReplica", app_name=serve_apps.app_name)
        dit.generate.remote(validated).result(timeout_s=120)
        answer = client.get("/v1/buckets").json()
    after = answer["traffic"]
    assert _count(after, one) == _count(before, one) + 2 and _count(after, two) == _count(before, two) + 1
    assert after["total"] == before["total"] + 3 and after["dropped"] == 0
    assert TrafficHistogram.from_snapshot(after).total == after["total"]  # a valid snapshot
    for replica in answer["ownership"]["replicas"].values():  # merged once, not repeated per replica
        assert "traffic" not in replica["stats"]
