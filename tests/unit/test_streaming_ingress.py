"""Streaming without Ray: the ingress's Server-Sent Events when the replica fails mid-stream (one ``error`` event
the official client raises) or refuses before accepting (a plain 503 with ``Retry-After``), with a fake DiT handle.
Streaming over HTTP on the session's Serve instance is ``tests/serve/test_streaming.py``."""

from __future__ import annotations

import json

import httpx
import pytest

from sse import parse_sse


class _FailingStreamDit:
    """A DiT handle whose stream yields its acceptance and one preview, then fails as a replica giving up on
    the request would; with ``refuse``, it fails before accepting (a full queue)."""

    def __init__(self, refuse: bool = False, backpressure: bool = False):
        self.cancelled = False
        self.refuse = refuse
        self.backpressure = backpressure

    def options(self, **kwargs):
        assert kwargs.get("stream") is True
        return self

    @property
    def generate_stream(self):
        return self

    def remote(self, validated):
        return self

    def __aiter__(self):
        return self._events()

    async def _events(self):
        from bcg_core.errors import RequestError
        from bcg_core.preview import PartialImage
        from deployments.routing import ACCEPTED, Overloaded

        if self.refuse:
            raise Overloaded("request", "the server is at capacity; retry after 3 s", retry_after_s=3.0)
        if self.backpressure:
            from ray.serve.exceptions import BackPressureError

            raise BackPressureError(num_queued_requests=24, max_queued_requests=16)
        yield ACCEPTED
        yield PartialImage(0, 0, 1, b"not-an-image")
        raise RequestError("request", "the replica gave up on this request", status=503)

    def cancel(self):
        self.cancelled = True
        if self.backpressure:  # Ray's generator raises its refusal again when a refused call is cancelled
            from ray.serve.exceptions import BackPressureError

            raise BackPressureError(num_queued_requests=24, max_queued_requests=16)


def _ingress(dit):
    """A bare ingress (no Ray) in front of ``dit``, on a one-bucket table without shape-aware routing."""
    from deployments.settings import ServeConfig
    from ingress_fakes import bare_ingress

    config = ServeConfig.model_validate({"buckets": {"batch_sizes": [1], "resolutions": ["256x256"],
                                                     "text_lengths": [256]}, "routing": {"shape_aware": False}})
    return bare_ingress(dit, config)


def _streamed_answer(dit):
    """The ingress's answer to one streamed generation request that ``dit`` serves."""
    import asyncio

    from ingress_fakes import http_request

    request = http_request({"prompt": "x", "size": "256x256", "stream": True, "partial_images": 1})
    return asyncio.run(_ingress(dit).generate(request))


def test_a_failure_mid_stream_is_one_error_event_the_official_client_raises():
    import asyncio

    import openai
    from openai import OpenAI

    from bcg_core.request import GenerationRequest
    from deployments.schemas import ImageGenerationRequest

    dit = _FailingStreamDit()
    ingress = _ingress(dit)
    req = ImageGenerationRequest(prompt="x", size="256x256", stream=True, partial_images=1)
    validated = ingress._validator.validate(GenerationRequest("x", width=256, height=256, partial_images=1))

    async def body() -> bytes:
        from deployments.routing import stream_dit

        events = stream_dit(dit, validated)
        assert await anext(events) == "bcg:accepted"
        return b"".join([chunk async for chunk in ingress._events(validated, req, events, 0.0)])

    raw = asyncio.run(body())
    events = parse_sse(raw)
    assert [name for name, _ in events] == ["image_generation.partial_image", "error"]
    assert events[1][1]["error"] == {"message": "the replica gave up on this request", "type": "server_error",
                                     "param": "request", "code": None}
    assert dit.cancelled  # the stream did not finish: the replica call is cancelled

    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, content=raw, headers={"content-type": "text/event-stream"}))
    client = OpenAI(base_url="http://bcg.test/v1", api_key="unused", max_retries=0,
                    http_client=httpx.Client(transport=transport))
    stream = client.images.generate(prompt="x", stream=True, partial_images=1)
    first = next(iter(stream))
    assert first.type == "image_generation.partial_image" and first.partial_image_index == 0
    with pytest.raises(openai.APIError, match="gave up"):
        list(stream)


def test_a_stream_refused_before_acceptance_is_a_plain_503_with_retry_after():
    answer = _streamed_answer(_FailingStreamDit(refuse=True))
    assert answer.status_code == 503 and answer.headers["retry-after"] == "3"
    assert json.loads(answer.body)["error"]["message"] == "the server is at capacity; retry after 3 s"


def test_a_stream_the_dit_handle_refuses_for_back_pressure_is_a_503_with_retry_after_not_a_500():
    """Ray's handle refuses a call past ``max_queued_requests`` with ``BackPressureError``, and raises it again when
    the refused call is cancelled: the 503 must survive that second raise (it once became a 500)."""
    dit = _FailingStreamDit(backpressure=True)
    answer = _streamed_answer(dit)
    assert answer.status_code == 503 and answer.headers["retry-after"], answer.body
    message = json.loads(answer.body)["error"]["message"]
    assert message.startswith("the server is at capacity") and "num_queued" not in message, message
    assert dit.cancelled
