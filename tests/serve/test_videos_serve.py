"""``/v1/videos`` end to end: the official ``openai`` client against a Wan application on the session's local Ray Serve
instance (``conftest.serve_apps``), serving the tiny Wan 2.1 checkpoint (``tests/tiny/wan.py``) on the CPU.

A job is created with ``videos.create`` (a multipart form, as the client always sends), polled with ``retrieve``
(bounded) until the ingress's worker has run it through the DiT replica (the shape-aware router, the step
scheduler, step progress) and encoded it; ``download_content`` gives an MP4 that PyAV decodes to the frames ``seconds``
asks for at the requested size, and the thumbnail and spritesheet with their content types. Then list, cancel,
delete, a size that is not served (422 listing the allowed sizes), the image route refused on the video model and
the video routes refused on the image model. Loopback only; every wait bounded in count and time.
"""

from __future__ import annotations

import io
import time

import httpx
import pytest

pytestmark = pytest.mark.serve

BUCKETS = {"batch_sizes": [1, 2], "resolutions": ["48x32"], "text_lengths": [512], "frames": [17, 33]}
"""One size; 1 s (17 frames) and 2 s (33 frames) at Wan's 16 fps."""


@pytest.fixture(scope="module")
def video_app(serve_apps, tmp_path_factory):
    """The Wan application at ``/videos``: its base URL, its job folder."""
    from ray import serve

    from deployments import build_app
    from tiny.wan import build

    root = tmp_path_factory.mktemp("videos")
    folder = build(root / "tiny-wan")
    config = {"model": {"path": str(folder), "device": "cpu", "dtype": "float32"}, "buckets": BUCKETS,
              "limits": {"min_side_px": 16, "default_steps": 2},
              "videos": {"folder": str(root / "jobs"), "poll_s": 0.1, "poll_after_ms": 100}}
    serve.run(build_app({"config": config}), name="videos", route_prefix="/videos")
    try:
        yield f"{serve_apps.base_url}/videos"
    finally:
        serve.delete("videos")


@pytest.fixture(scope="module")
def client(video_app):
    from openai import OpenAI

    with httpx.Client(trust_env=False, timeout=120.0) as http:
        yield OpenAI(base_url=f"{video_app}/v1", api_key="unused", max_retries=0, http_client=http)


def _until_finished(client, video_id: str, timeout_s: float = 60.0):
    """Retrieve the job until it is completed or failed: at most ``timeout_s`` seconds, 0.1 s apart."""
    deadline = time.monotonic() + timeout_s
    while True:
        raw = client.videos.with_raw_response.retrieve(video_id)
        video = raw.parse()
        if video.status in ("completed", "failed") or time.monotonic() > deadline:
            return video, raw.headers
        time.sleep(0.1)


def test_the_openai_client_creates_polls_and_downloads_an_mp4_of_the_asked_frames_and_size(client):
    import av

    created = client.videos.create(prompt="a paper boat on a pond", seconds="2", size="48x32")
    assert (created.status, created.seconds, created.size, created.model) == ("queued", "2", "48x32", "tiny-wan")
    first = client.videos.with_raw_response.retrieve(created.id)
    if first.parse().status != "completed":  # the client's poll() waits what the server says
        assert first.headers["openai-poll-after-ms"] == "100"
    video, _ = _until_finished(client, created.id)
    assert video.status == "completed" and video.progress == 100, video
    mp4 = client.videos.download_content(created.id)
    with av.open(io.BytesIO(mp4.content)) as container:  # PyAV 18.1.1: a stream is read only while it is open
        rate = container.streams.video[0].average_rate
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert (len(frames), frames[0].shape, rate) == (33, (32, 48, 3), 16)  # 1 + 2 s x 16 fps
    assert mp4.response.headers["content-type"] == "video/mp4"
    for variant, kind in (("thumbnail", "image/webp"), ("spritesheet", "image/jpeg")):
        got = client.videos.download_content(created.id, variant=variant)
        assert got.response.headers["content-type"] == kind and len(got.content) > 0
    assert created.id in [v.id for v in client.videos.list(limit=10)]
    assert client.videos.delete(created.id).deleted
    with pytest.raises(Exception) as gone:
        client.videos.retrieve(created.id)
    assert getattr(gone.value, "status_code", None) == 404


def test_a_job_is_cancelled_and_the_worker_goes_on_to_the_next(client, video_app):
    long = client.videos.create(prompt="a long one", seconds="1", extra_body={"num_inference_steps": 50})
    cancelled = client.post(f"/videos/{long.id}/cancel", cast_to=type(long), body={})
    assert cancelled.status == "failed" and cancelled.error.code == "cancelled"
    again = httpx.post(f"{video_app}/v1/videos/{long.id}/cancel", trust_env=False, timeout=30)
    assert again.status_code == 409 and again.json()["error"]["param"] == "video_id"
    short = client.videos.create(prompt="a short one", seconds="1")
    video, _ = _until_finished(client, short.id)
    assert video.status == "completed" and client.videos.retrieve(long.id).status == "failed"


def test_unserved_sizes_and_the_other_kind_of_route_are_refused_clearly(client, video_app, serve_apps):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as bad:
        client.videos.create(prompt="a cat", size="720x1280")
    assert "allowed: '48x32'" in bad.value.message and bad.value.body["param"] == "size"
    image = httpx.post(f"{video_app}/v1/images/generations", json={"prompt": "a cat"}, trust_env=False, timeout=30)
    assert image.status_code == 422 and "POST /v1/videos" in image.json()["error"]["message"]
    on_images = httpx.get(f"{serve_apps.base_url}/v1/videos", trust_env=False, timeout=30)  # the tiny image model
    assert on_images.status_code == 404 and on_images.json()["error"]["code"] == "unsupported_endpoint"
    card = httpx.get(f"{video_app}/v1/models", trust_env=False, timeout=30).json()["data"][0]["bcg"]["videos"]
    assert card["seconds"] == ["1", "2"] and card["sizes"] == ["48x32"] and card["fps"] == 16.0
