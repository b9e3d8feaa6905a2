"""Streaming over HTTP (``stream: true``): the official client's stream iterator, Server-Sent Event framing
for a slow reader, previews that are valid images of the requested size, and a disconnect mid-stream that
cancels the request (``conftest.serve_apps``)."""

from __future__ import annotations

import base64
import io
import time

import httpx
import pytest
from PIL import Image

from sse import parse_sse

pytestmark = pytest.mark.serve

GEN = "/v1/images/generations"
PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


@pytest.fixture(scope="module")
def openai_client(serve_apps):
    from openai import OpenAI

    with httpx.Client(trust_env=False, timeout=120.0) as http:
        yield OpenAI(base_url=f"{serve_apps.base_url}/v1", api_key="unused", max_retries=0, http_client=http)


def _check_image(b64: str, fmt: str, size: tuple[int, int]) -> None:
    """A browser-free check: the bytes decode fully as an RGB image of ``fmt`` and ``size``."""
    with Image.open(io.BytesIO(base64.b64decode(b64, validate=True))) as img:
        img.load()
        assert img.format == PIL_FORMAT[fmt] and img.size == size and img.mode == "RGB"


@pytest.mark.parametrize("partials,fmt,size", [(0, "png", "256x256"), (1, "jpeg", "256x256"),
                                               (2, "webp", "512x256"), (3, "png", "256x256")])
def test_openai_client_stream_iterator_gets_partials_then_completed(openai_client, partials, fmt, size):
    from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent

    width, height = map(int, size.split("x"))
    stream = openai_client.images.generate(
        prompt="a lighthouse at dusk", size=size, n=1, stream=True, partial_images=partials, output_format=fmt,
        extra_body={"num_inference_steps": 4, "seed": 8, "guidance_scale": 0.0})
    events = list(stream)
    partial = [e for e in events if isinstance(e, ImageGenPartialImageEvent)]
    completed = [e for e in events if isinstance(e, ImageGenCompletedEvent)]
    assert len(events) == len(partial) + len(completed) and len(completed) == 1
    assert events[-1] is completed[0]  # every preview comes before the final image
    assert [e.partial_image_index for e in partial] == list(range(partials))  # 4 steps: up to 3 previews
    for e in partial:
        assert e.type == "image_generation.partial_image" and e.output_format == fmt and e.size == size
        _check_image(e.b64_json, fmt, (width, height))
    done = completed[0]
    assert done.output_format == fmt and done.size == size and done.background == "opaque"
    _check_image(done.b64_json, fmt, (width, height))
    assert done.usage.input_tokens > 0 and done.usage.output_tokens == width * height // 256
    assert done.model_extra["bcg"]["steps"] == 4 and "queue" in done.model_extra["bcg"]["timings_ms"]


def test_streamed_final_image_equals_the_unstreamed_one(serve_apps):
    body = {"prompt": "a red cube", "size": "256x256", "num_inference_steps": 3, "seed": 4, "guidance_scale": 0.0}
    with httpx.Client(base_url=serve_apps.base_url, trust_env=False, timeout=120.0) as c:
        plain = c.post(GEN, json=body).json()["data"][0]["b64_json"]
        events = parse_sse(c.post(GEN, json={**body, "stream": True, "partial_images": 2}).content)
    assert events[-1][1]["b64_json"] == plain and [e for e, _ in events].count("image_generation.partial_image") == 2


def test_sse_framing_holds_for_a_slow_reader(serve_apps):
    """A client that waits before reading and then reads in small pieces, pausing: the server's writes are
    held back by TCP, and the reassembled stream still parses into whole events."""
    body = {"prompt": "a lighthouse", "size": "256x256", "n": 2, "num_inference_steps": 4, "seed": 2,
            "guidance_scale": 0.0, "stream": True, "partial_images": 3}
    chunks: list[bytes] = []
    deadline = time.monotonic() + 90
    with httpx.Client(base_url=serve_apps.base_url, trust_env=False, timeout=120.0) as c:
        with c.stream("POST", GEN, json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            time.sleep(1.0)  # let the whole generation happen while nothing is read
            for i, chunk in enumerate(r.iter_raw(chunk_size=4096)):
                chunks.append(chunk)
                if i % 16 == 0:
                    time.sleep(0.01)
                assert time.monotonic() < deadline
    assert len(chunks) > 20  # really read piecewise
    events = parse_sse(b"".join(chunks))
    names = [n for n, _ in events]
    assert names == ["image_generation.partial_image"] * 6 + ["image_generation.completed"] * 2
    assert sorted((d["partial_image_index"], d["image_index"]) for n, d in events if n.endswith("partial_image")) \
        == [(i, j) for i in range(3) for j in range(2)]
    for _, data in events:
        _check_image(data["b64_json"], "png", (256, 256))


def test_a_client_that_disconnects_mid_stream_cancels_the_request(serve_apps):
    with httpx.Client(base_url=serve_apps.base_url, trust_env=False, timeout=120.0) as c:
        def stats() -> dict:
            return c.get("/v1/buckets").json()

        def forwards(s: dict) -> int:
            return sum(b["forwards"] for b in s["buckets"]) + s["misses"]["forwards"]

        def cancelled(s: dict) -> int:
            return sum(v["cancelled"] for v in s["scheduler"]["shapes"].values())

        before = stats()
        steps = 40
        body = {"prompt": "a slow lighthouse", "size": "512x512", "n": 2, "guidance_scale": 3.0, "seed": 5,
                "num_inference_steps": steps, "stream": True, "partial_images": 3}  # first preview after step 10
        with c.stream("POST", GEN, json=body) as r:
            assert r.status_code == 200
            seen = b""
            for chunk in r.iter_raw():
                seen += chunk
                if b"\n\n" in seen:
                    break  # one whole event (the first preview) arrived: leave mid-stream
        assert seen.startswith(b"event: image_generation.partial_image")
        deadline = time.monotonic() + 30
        settled = forwards(stats())
        while time.monotonic() < deadline:  # wait until the replica stops stepping (bounded)
            time.sleep(1.0)
            now = forwards(stats())
            if now == settled:
                break
            settled = now
        after = stats()
    assert settled - forwards(before) < steps, "the replica ran every step for a client that was gone"
    assert cancelled(after) == cancelled(before) + 1
    assert after["totals"]["requests"] == before["totals"]["requests"]  # never completed
