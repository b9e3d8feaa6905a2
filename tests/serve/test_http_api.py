"""End-to-end HTTP API tests against a local Ray Serve instance (see ``conftest.serve_apps``).

Every request uses 256x256 and 1-2 denoising steps so the file runs in well under a minute of model time
on a 2-core CPU machine.
"""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import pytest
from PIL import Image

pytestmark = pytest.mark.serve

GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def client(serve_apps):
    with httpx.Client(base_url=serve_apps.base_url, timeout=120.0, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def reject_client(serve_apps):
    with httpx.Client(base_url=serve_apps.reject_url, timeout=120.0, trust_env=False) as c:
        yield c


def _good(**overrides) -> dict:
    body = {"prompt": "a lighthouse at dusk", "n": 1, "size": "256x256", "num_inference_steps": 1,
            "guidance_scale": 0.0, "seed": 11}
    body.update(overrides)
    return body


def _pngs(payload: dict) -> list[Image.Image]:
    images = []
    for item in payload["data"]:
        raw = base64.b64decode(item["b64_json"], validate=True)
        assert raw.startswith(b"\x89PNG\r\n\x1a\n")
        img = Image.open(io.BytesIO(raw))
        img.load()
        images.append(img)
    return images


def _bucket_row(stats: dict, key: str) -> dict:
    rows = [row for row in stats["buckets"] if row["key"] == key]
    assert len(rows) == 1, f"bucket {key} not in {[row['key'] for row in stats['buckets']]}"
    return rows[0]


def test_good_request_returns_n_pngs_of_the_requested_size(client):
    r = client.post(GEN, json=_good(n=2, size="256x256"))
    assert r.status_code == 200, r.text
    payload = r.json()
    images = _pngs(payload)
    assert len(images) == 2
    assert all(img.size == (256, 256) for img in images)
    assert isinstance(payload["created"], int) and payload["created"] > 1_600_000_000
    bcg = payload["bcg"]
    assert bcg["hit"] is True and bcg["missed"] == []
    assert bcg["bucket"].startswith("b2_")  # 2 images, no CFG -> 2 transformer rows
    assert bcg["seed"] == 11
    assert bcg["timings_ms"]["total"] > 0


def test_same_seed_gives_identical_bytes_and_another_seed_does_not(client):
    a = client.post(GEN, json=_good(seed=1234)).json()
    b = client.post(GEN, json=_good(seed=1234)).json()
    c = client.post(GEN, json=_good(seed=1235)).json()
    assert a["data"][0]["b64_json"] == b["data"][0]["b64_json"]
    assert a["data"][0]["b64_json"] != c["data"][0]["b64_json"]


def test_omitted_seed_is_drawn_and_reported(client):
    body = _good()
    del body["seed"]
    r = client.post(GEN, json=body)
    assert r.status_code == 200, r.text
    seed = r.json()["bcg"]["seed"]
    again = client.post(GEN, json=_good(seed=seed)).json()
    assert again["data"][0]["b64_json"] == r.json()["data"][0]["b64_json"]


def test_bucket_counters_go_up_for_the_expected_key(client):
    key = "b1_i256_t256"  # 1 row (no CFG), 256x256 px = 16x16 tokens of 16 px, one 256-token text bucket
    before = _bucket_row(client.get("/v1/buckets").json(), key)
    r = client.post(GEN, json=_good(n=1))
    assert r.status_code == 200, r.text
    assert r.json()["bcg"]["bucket"] == key
    after = _bucket_row(client.get("/v1/buckets").json(), key)
    assert after["requests"] == before["requests"] + 1
    assert after["hits"] == before["hits"] + 1
    assert after["real_tokens"] > before["real_tokens"]


def test_cfg_doubles_rows_and_rows_above_the_largest_bucket_are_split_across_buckets(client):
    stats = client.get("/v1/buckets").json()
    misses_before = stats["misses"]["by_dim"].get("batch", 0)
    # 3 images with CFG = 6 transformer rows > largest batch bucket 4: the step scheduler runs the request in
    # its shape's buckets, split (e.g. 4 + 2), instead of alone as a batch miss
    r = client.post(GEN, json=_good(n=3, guidance_scale=2.0))
    assert r.status_code == 200, r.text
    payload = r.json()
    assert len(_pngs(payload)) == 3
    assert payload["bcg"]["hit"] is True and payload["bcg"]["missed"] == []
    assert payload["bcg"]["bucket"].endswith("_i256_t256")
    after = client.get("/v1/buckets").json()
    assert after["misses"]["by_dim"].get("batch", 0) == misses_before
    shape = after["scheduler"]["shapes"]["i256_t256"]
    assert shape["decisions"]["split"] + shape["decisions"]["eager"] >= 1


def test_buckets_endpoint_describes_the_table(client):
    stats = client.get("/v1/buckets").json()
    assert stats["table"]["batch_sizes"] == [1, 2, 4]
    assert stats["table"]["resolutions"] == ["256x256", "512x512"]
    assert stats["table"]["miss_policy"] == "eager"
    assert {"requests", "hits", "misses"} <= set(stats["totals"])
    assert isinstance(stats["model"]["name"], str)
    # where the replica's start went: its phases add up to no more than the whole
    start = stats["start"]
    assert set(start) == {"load_s", "join_s", "prepare_s", "costs_s", "shapes_left", "ready_s"}, start
    assert 0 < start["load_s"] and 0 <= start["costs_s"] <= start["prepare_s"]
    assert start["load_s"] + start["join_s"] + start["prepare_s"] <= start["ready_s"] + 0.01


def test_healthz(client, reject_client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert reject_client.get("/healthz").json() == {"status": "ok"}
    head = client.head("/healthz")  # a load balancer's probe
    assert head.status_code == 200 and head.content == b""


def test_metrics_on_the_api_port_answer_where_rays_exporter_is(client):
    import ray

    r = client.get("/metrics")
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    assert "served by Ray's exporter, not on the API port" in message and f":{port}/metrics" in message, message


def test_served_model_name_is_accepted(client):
    name = client.get("/v1/buckets").json()["model"]["name"]
    r = client.post(GEN, json=_good(model=name))
    assert r.status_code == 200, r.text


# (case id, body (dict, or raw bytes), expected status, expected param, fragments the message must contain)
LONG_CHARS = "a" * 4001
BAD_INPUTS = [
    ("n-string", {"prompt": "x", "n": "two"}, 422, "n", ["'n'", "1 to 10"]),
    ("n-float", {"prompt": "x", "n": 1.5}, 422, "n", ["'n'", "1 to 10"]),
    ("prompt-int", {"prompt": 123}, 422, "prompt", ["'prompt'", "4000 characters"]),
    ("n-zero", {"prompt": "x", "n": 0}, 422, "n", ["'n'", "1 to 10"]),
    ("n-eleven", {"prompt": "x", "n": 11}, 422, "n", ["'n'", "1 to 10"]),
    ("size-word", {"prompt": "x", "size": "big"}, 422, "size", ["'size'", "WxH"]),
    ("size-one-number", {"prompt": "x", "size": "512"}, 422, "size", ["'size'", "WxH"]),
    ("size-int", {"prompt": "x", "size": 512}, 422, "size", ["'size'", "WxH"]),
    ("size-not-multiple", {"prompt": "x", "size": "264x256"}, 422, "size", ["'size'", "multiple of 16"]),
    ("size-below", {"prompt": "x", "size": "128x128"}, 422, "size", ["'size'", "256 to 2048"]),
    ("size-above", {"prompt": "x", "size": "4096x256"}, 422, "size", ["'size'", "256 to 2048"]),
    ("prompt-empty", {"prompt": ""}, 422, "prompt", ["'prompt'", "non-empty"]),
    ("prompt-blank", {"prompt": "   "}, 422, "prompt", ["'prompt'", "non-empty"]),
    ("prompt-invisible", {"prompt": "\u202e\u200b\u0000"}, 422, "prompt", ["visible text"]),
    ("prompt-missing", {"n": 1}, 422, "prompt", ["'prompt'", "required"]),
    ("prompt-too-many-chars", {"prompt": LONG_CHARS}, 422, "prompt", ["'prompt'", "4000 characters"]),
    ("steps-zero", {"prompt": "x", "num_inference_steps": 0}, 422, "num_inference_steps", ["1 to 50"]),
    ("steps-over", {"prompt": "x", "num_inference_steps": 51}, 422, "num_inference_steps", ["1 to 50"]),
    ("work-over", {"prompt": "x", "size": "2048x2048", "n": 10, "num_inference_steps": 50}, 422, "n",
     ["2097 megapixel-steps", "limits.max_megapixel_steps 1000", "lower n, num_inference_steps or size"]),
    ("guidance-negative", {"prompt": "x", "guidance_scale": -1}, 422, "guidance_scale", ["0 to 30"]),
    ("guidance-over", {"prompt": "x", "guidance_scale": 30.5}, 422, "guidance_scale", ["0 to 30"]),
    ("guidance-string", {"prompt": "x", "guidance_scale": "high"}, 422, "guidance_scale", ["0 to 30"]),
    ("seed-negative", {"prompt": "x", "seed": -1}, 422, "seed", ["'seed'", "from 0"]),
    ("true-cfg-over", {"prompt": "x", "true_cfg_scale": 31}, 422, "true_cfg_scale",
     ["0 to 30", "FLUX.1, Qwen-Image and Qwen-Image 2.1 only"]),
    # the tiny default (BCGFluxPipeline) has no true CFG: a value the validator refuses, naming the field
    ("true-cfg-not-an-option", {"prompt": "x", "true_cfg_scale": 2.0, "size": "256x256"}, 422, "true_cfg_scale",
     ["true_cfg_scale is not an option of BCGFluxPipeline", "guidance_scale"]),
    ("response-format-url", {"prompt": "x", "response_format": "url"}, 422, "response_format", ["'b64_json'"]),
    ("unknown-field", {"prompt": "x", "complexity": "low"}, 422, "complexity",
     ["'complexity'", "allowed fields", "prompt", "output_format"]),
    ("format-gif", {"prompt": "x", "output_format": "gif"}, 422, "output_format", ["'png', 'jpeg', 'webp'", "'gif'"]),
    ("format-svg", {"prompt": "x", "output_format": "svg"}, 422, "output_format", ["'png', 'jpeg', 'webp'", "'svg'"]),
    ("format-upper", {"prompt": "x", "output_format": "PNG"}, 422, "output_format", ["'png', 'jpeg', 'webp'"]),
    ("compression-over", {"prompt": "x", "output_format": "webp", "output_compression": 101}, 422,
     "output_compression", ["0 to 100", "101"]),
    ("compression-negative", {"prompt": "x", "output_format": "jpeg", "output_compression": -1}, 422,
     "output_compression", ["0 to 100"]),
    ("compression-float", {"prompt": "x", "output_format": "jpeg", "output_compression": 50.5}, 422,
     "output_compression", ["0 to 100"]),
    ("compression-png", {"prompt": "x", "output_compression": 50}, 422, "output_compression",
     ["jpeg and webp only", "omit it for 'png'"]),
    ("quality-HD", {"prompt": "x", "quality": "HD"}, 422, "quality",
     ["'low', 'medium', 'high', 'auto', 'standard' (= 'medium'), 'hd' (= 'high')"]),
    ("quality-xhigh", {"prompt": "x", "quality": "xhigh"}, 422, "quality", ["'low', 'medium', 'high', 'auto'"]),
    ("background-transparent", {"prompt": "x", "background": "transparent"}, 422, "background",
     ["'auto', 'opaque'"]),
    ("moderation-strict", {"prompt": "x", "moderation": "strict"}, 422, "moderation", ["'auto', 'low'"]),
    ("style-natural", {"prompt": "x", "style": "natural"}, 422, "style", ["'vivid'"]),
    ("stream-string", {"prompt": "x", "stream": "yes"}, 422, "stream", ["true or false"]),
    ("partials-without-stream", {"prompt": "x", "partial_images": 2}, 422, "partial_images",
     ["stream: true", "0 to 3"]),
    ("partials-over", {"prompt": "x", "stream": True, "partial_images": 4}, 422, "partial_images", ["0 to 3"]),
    ("partials-negative", {"prompt": "x", "stream": True, "partial_images": -1}, 422, "partial_images", ["0 to 3"]),
    ("wrong-model", {"prompt": "x", "model": "dall-e-3"}, 422, "model", ["'model'", "dall-e-3"]),
    ("not-an-object", b"[1, 2]", 422, None, ["JSON object", "prompt"]),
    ("malformed-json", b'{"prompt": "x",', 400, None, ["not valid JSON", "prompt"]),
    ("oversized-body", {"prompt": "x" * 70_000}, 413, None, ["65536 bytes"]),
]


def _post(client: httpx.Client, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(GEN, content=body, headers={"content-type": "application/json"})
    return client.post(GEN, json=body)


def _check_error(r: httpx.Response, status: int, param: str | None, fragments: list[str]) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["code"] is None
    for fragment in fragments:
        assert fragment in err["message"], f"{fragment!r} not in {err['message']!r}"


@pytest.mark.parametrize("case,body,status,param,fragments", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_4xx_naming_the_field_and_allowed_values(client, case, body, status, param, fragments):
    _check_error(_post(client, body), status, param, fragments)


def test_prompt_with_too_many_tokens_is_rejected_by_the_validator(client):
    prompt = " ".join(["x"] * 1500)  # 2999 characters (under the 4000 limit), ~1500 tokens
    assert len(prompt) <= 4000
    r = client.post(GEN, json=_good(prompt=prompt))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt"
    assert "token" in err["message"]


def test_size_the_table_cannot_hold_is_rejected_under_the_reject_policy(reject_client):
    r = reject_client.post(GEN, json=_good(size="1024x1024"))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "size"
    assert "size" in err["message"] and "512x512" in err["message"]


def test_a_batch_above_the_table_is_split_not_rejected_under_the_reject_policy(reject_client):
    r = reject_client.post(GEN, json=_good(n=3, guidance_scale=2.0))  # 6 rows > 4: split across buckets
    assert r.status_code == 200, r.text
    assert r.json()["bcg"]["hit"] is True and r.json()["bcg"]["missed"] == []


def test_rejected_misses_are_counted_by_dimension(reject_client):
    before = reject_client.get("/v1/buckets").json()["misses"]
    r = reject_client.post(GEN, json=_good(n=3, guidance_scale=2.0, size="1024x1024"))  # above the largest tier
    assert r.status_code == 422 and r.json()["error"]["param"] == "size", r.text
    after = reject_client.get("/v1/buckets").json()["misses"]
    assert after["rejected"] == before["rejected"] + 1
    assert after["rejected_by_dim"]["image_tokens"] == before["rejected_by_dim"]["image_tokens"] + 1
    assert after["rejected_by_dim"]["batch"] == before["rejected_by_dim"]["batch"]  # the rows would be split


def test_reject_app_still_serves_what_its_table_holds(reject_client):
    r = reject_client.post(GEN, json=_good(n=2, guidance_scale=2.0))  # 4 rows: the largest bucket
    assert r.status_code == 200, r.text
    assert r.json()["bcg"]["bucket"].startswith("b4_")


def test_unknown_route_answers_in_the_openai_error_shape(client):
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_server_keeps_serving_after_every_bad_input(client):
    for _case, body, status, _param, _fragments in BAD_INPUTS:
        assert _post(client, body).status_code == status
    r = client.post(GEN, json=_good(seed=5))
    assert r.status_code == 200, r.text
    assert _pngs(r.json())[0].size == (256, 256)


def test_python_handle_returns_a_generation_result(serve_apps):
    """The application's handle (the ingress) validates a request or a dict of its fields, as HTTP does; the DiT
    deployment's own handle takes only a validated request."""
    from ray import serve

    from bcg_core.errors import RequestError
    from bcg_core.request import GenerationRequest, GenerationResult

    handle = serve.get_app_handle(serve_apps.app_name)
    request = GenerationRequest(prompt="a red cube", n=1, width=256, height=256, num_inference_steps=1,
                                guidance_scale=0.0, seed=3)
    result = handle.images.remote(request).result(timeout_s=120)
    assert isinstance(result, GenerationResult)
    assert len(result.image_bytes) == 1 and result.seed == 3 and result.hit
    with Image.open(io.BytesIO(result.image_bytes[0])) as img:
        assert img.size == (256, 256)
    as_dict = handle.images.remote(
        {"prompt": "a red cube", "width": 256, "height": 256, "num_inference_steps": 1, "guidance_scale": 0.0,
         "seed": 3}
    ).result(timeout_s=120)
    assert as_dict.image_bytes == result.image_bytes
    with pytest.raises(RequestError) as info:
        handle.images.remote(GenerationRequest(prompt="x", n=0, width=256, height=256)).result(timeout_s=120)
    assert info.value.field == "n"
    dit = serve.get_deployment_handle("DiTReplica", app_name=serve_apps.app_name)
    with pytest.raises(TypeError, match="ValidatedRequest"):
        dit.generate.remote(request).result(timeout_s=120)
    assert json.dumps(result.to_dict()["timings_ms"])  # JSON-friendly apart from the PNG bytes


def test_a_client_that_disconnects_frees_the_replica_within_a_few_steps(client):
    def forwards() -> int:
        stats = client.get("/v1/buckets").json()
        return sum(b["forwards"] for b in stats["buckets"]) + stats["misses"]["forwards"]

    before_requests = client.get("/v1/buckets").json()["totals"]["requests"]
    before = forwards()
    slow = _good(size="512x512", n=2, guidance_scale=3.0, num_inference_steps=50, seed=99)
    with pytest.raises(httpx.TimeoutException):
        client.post(GEN, json=slow, timeout=2.0)  # the client gives up after 2 s and closes the connection
    deadline = time.monotonic() + 30
    settled = forwards()
    while time.monotonic() < deadline:  # wait until the replica stops stepping (bounded)
        time.sleep(1.0)
        now = forwards()
        if now == settled:
            break
        settled = now
    assert settled - before < 50, "the replica ran all 50 steps for a client that was gone"
    assert client.get("/v1/buckets").json()["totals"]["requests"] == before_requests
    assert client.post(GEN, json=_good()).status_code == 200  # and it keeps serving
