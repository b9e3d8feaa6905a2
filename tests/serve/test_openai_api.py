"""OpenAI Images API fields over HTTP (``conftest.serve_apps``): output formats, quality, the no-op fields,
``usage``, the ingress timings, the step cache's ``bcg.cache``, and ``GET /v1/models``."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

pytestmark = pytest.mark.serve

GEN = "/v1/images/generations"
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff", "webp": b"RIFF"}


@pytest.fixture(scope="module")
def client(serve_apps):
    with httpx.Client(base_url=serve_apps.base_url, timeout=120.0, trust_env=False) as c:
        yield c


def _body(**overrides) -> dict:
    body = {"prompt": "a lighthouse at dusk", "size": "256x256", "num_inference_steps": 1, "guidance_scale": 0.0,
            "seed": 21}
    body.update(overrides)
    return body


def _image(b64: str) -> tuple[bytes, Image.Image]:
    raw = base64.b64decode(b64, validate=True)
    img = Image.open(io.BytesIO(raw))
    img.load()
    return raw, img


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_each_output_format_is_encoded_as_asked_and_said_in_the_answer(client, fmt):
    r = client.post(GEN, json=_body(output_format=fmt, n=2))
    assert r.status_code == 200, r.text
    payload = r.json()
    assert payload["output_format"] == fmt and payload["size"] == "256x256" and payload["background"] == "opaque"
    for item in payload["data"]:
        raw, img = _image(item["b64_json"])
        assert raw.startswith(MAGIC[fmt])
        assert img.format == {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt]
        assert img.size == (256, 256) and img.mode == "RGB"
    assert "image_encode" in payload["bcg"]["timings_ms"]


def test_lower_compression_gives_smaller_lossy_files(client):
    sizes = {}
    for fmt in ("jpeg", "webp"):
        for q in (5, 95):
            r = client.post(GEN, json=_body(output_format=fmt, output_compression=q))
            assert r.status_code == 200, r.text
            sizes[fmt, q] = len(base64.b64decode(r.json()["data"][0]["b64_json"]))
    assert sizes["jpeg", 5] < sizes["jpeg", 95] and sizes["webp", 5] < sizes["webp", 95], sizes


def test_png_with_compression_100_is_accepted(client):
    r = client.post(GEN, json=_body(output_compression=100))
    assert r.status_code == 200, r.text and r.json()["output_format"] == "png"


def test_the_format_changes_the_file_not_the_image(client):
    # the tiny model's images are noise, the hardest case for lossy coders: a quality-100 WebP of a seed decodes
    # far closer to that seed's PNG than another seed's image is
    def pixels(**kw) -> bytes:
        return _image(client.post(GEN, json=_body(**kw)).json()["data"][0]["b64_json"])[1].tobytes()

    def mean_abs(a: bytes, b: bytes) -> float:
        return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)

    png = pixels(seed=5)
    assert mean_abs(png, pixels(seed=5, output_format="webp")) < 0.5 * mean_abs(png, pixels(seed=6))


def test_quality_maps_to_the_family_steps_and_steps_win(client):
    card = client.get("/v1/models").json()["data"][0]
    steps = card["bcg"]["quality_steps"]
    assert steps == {"low": 2, "medium": 4, "high": 8, "auto": 4}  # the tiny default's (QUALITY_STEPS["bcg-tiny"])
    assert card["bcg"]["defaults"] == {"num_inference_steps": 4, "guidance_scale": 3.5}  # the tiny default's own
    for q in ("low", "auto"):
        body = _body(quality=q)
        del body["num_inference_steps"]
        r = client.post(GEN, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["bcg"]["steps"] == steps[q]
        assert r.json()["quality"] == (None if q == "auto" else q)
    r = client.post(GEN, json=_body(quality="high", num_inference_steps=1))
    assert r.json()["bcg"]["steps"] == 1


def test_no_op_values_are_accepted(client):
    r = client.post(GEN, json=_body(background="opaque", moderation="low", style="vivid", user="u1",
                                    safety_identifier="s1", stream=False))
    assert r.status_code == 200, r.text


def test_usage_counts_prompt_tokens_in_and_image_tokens_out(client):
    from transformers import AutoTokenizer

    from bcg_core.text import minilm_path

    r = client.post(GEN, json=_body(n=3, size="256x256"))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    tok = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)
    prompt_tokens = len(tok("a lighthouse at dusk")["input_ids"])  # [CLS] + words + [SEP]
    assert usage["input_tokens"] == usage["input_tokens_details"]["text_tokens"] == prompt_tokens
    assert usage["input_tokens_details"]["image_tokens"] == 0
    assert usage["output_tokens"] == usage["output_tokens_details"]["image_tokens"] == 3 * 16 * 16
    assert usage["total_tokens"] == prompt_tokens + 3 * 256 and usage["images"] == 3


def test_timings_include_queue_wait_and_the_route_through_ray(client):
    t = client.post(GEN, json=_body()).json()["bcg"]["timings_ms"]
    assert {"queue", "encode", "denoise", "decode", "image_encode", "total", "route", "ingress"} <= set(t)
    assert t["ingress"] >= t["total"] - 1 and t["route"] >= 0 and t["queue"] >= 0


def test_a_step_cache_is_served_through_ray_and_reported_in_bcg(client):
    """``cache`` crosses the ingress, Ray and the replica's step scheduler; ``bcg.cache`` comes back from its finish
    path (threshold 10: every step after the first reuses; threshold 0: every step computes)."""
    steps = 3
    for threshold, computed in ((10.0, 1), (0.0, steps)):
        r = client.post(GEN, json=_body(num_inference_steps=steps, cache={"method": "first_block",
                                                                           "threshold": threshold}))
        assert r.status_code == 200, r.text
        assert r.json()["bcg"]["cache"] == {"method": "first_block", "threshold": threshold,
                                            "steps": {"cond": {"computed": computed, "reused": steps - computed}}}
    assert client.post(GEN, json=_body(cache=None)).json()["bcg"]["cache"] is None
    assert "first_block" in client.get("/v1/models").json()["data"][0]["bcg"]["cache_methods"]


def test_models_lists_the_served_model_with_its_bucket_table(client):
    r = client.get("/v1/models")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    stats = client.get("/v1/buckets").json()
    assert card["id"] == stats["model"]["name"] and card["object"] == "model" and card["owned_by"] == "bcg-serve"
    assert isinstance(card["created"], int)
    buckets = card["bcg"]["buckets"]
    assert buckets["batch_sizes"] == [1, 2, 4] and buckets["resolutions"] == ["256x256", "512x512"]
    assert buckets["count"] == len(stats["buckets"])
    assert card["bcg"]["output_formats"] == ["png", "jpeg", "webp"]
    one = client.get(f"/v1/models/{card['id']}")
    assert one.status_code == 200 and one.json()["id"] == card["id"]
    missing = client.get("/v1/models/dall-e-3")
    assert missing.status_code == 404 and "dall-e-3" in missing.json()["error"]["message"]
