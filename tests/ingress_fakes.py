"""The ingress without Ray, for the tests that call its routes as plain methods: :func:`bare_ingress` (the class under
``serve.ingress``'s ASGI wrapper), :class:`FakeDiT` (a DiT deployment handle that records the validated requests
sent), :class:`FakeVideoDiT` (one that streams video jobs' steps and frames), :func:`http_request` (a Starlette request
holding a JSON body) and :func:`asgi_request` (any request)."""

from __future__ import annotations

import json
import pickle

from ray.exceptions import RayActorError
from starlette.requests import Request

from bcg_core.request import GenerationResult


class FakeDiT:
    """A DiT deployment handle: records what ``options(...).generate.remote`` was sent as ``(shape, validated)``; the
    first ``fail`` calls raise RayActorError (the replica died), then each answers with one image; ``stats`` must
    never be called."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.sent: list[tuple[str, object]] = []
        self._shape = ""

    def options(self, multiplexed_model_id: str = ""):
        self._shape = multiplexed_model_id
        return self

    @property
    def generate(self):
        return self

    @property
    def stats(self):
        raise AssertionError("the ingress asked a DiT replica for its stats")

    async def remote(self, validated):
        validated = pickle.loads(pickle.dumps(validated))  # what Ray does to it on the way
        self.sent.append((self._shape, validated))
        if len(self.sent) <= self.fail:
            raise RayActorError()
        return GenerationResult(image_bytes=[b"\x89PNG\r\n\x1a\n"], seed=validated.request.seed,
                                bucket=str(validated.lookup.key), hit=True, missed=[], real_tokens=1,
                                padded_tokens=1, steps=1, timings_ms={})


def bare_ingress(dit, config):
    """The :class:`~deployments.ingress.Ingress` class outside Serve (its routes as plain methods) over the DiT
    handle ``dit``, configured by ``config`` (a ``ServeConfig``)."""
    from deployments.ingress import Ingress

    user_class = Ingress.func_or_class.__mro__[1]
    assert user_class.__module__ == "deployments.ingress" and user_class.__name__ == "Ingress", user_class
    assert callable(getattr(user_class, "generate", None))  # a route of its image group (deployments.ingress_images)
    return user_class(dit, config.model_dump(mode="json"))


def http_request(body: dict) -> Request:
    """``POST /v1/images/generations`` holding ``body`` as JSON, delivered in one message."""
    raw = json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/images/generations", "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    return Request(scope, receive)


class _FakeStream:
    """What ``handle.options(stream=True).generate_stream.remote(...)`` returns: an async iterator with ``cancel``."""

    def __init__(self, events):
        self._events = events
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._events.__anext__()

    def cancel(self):
        self.cancelled = True


class FakeVideoDiT:
    """A DiT deployment handle for video jobs: ``options(...).generate_stream.remote(validated, progress=True)``
    streams the acceptance, a :class:`~bcg_core.preview.StepProgress` per step and a result with one video of the
    request's frames and size, every pixel ``seed % 256`` (so a test can tell which request made it). With ``hold``
    set (an ``asyncio.Event`` cleared), it waits after its first step until the event is set. Records the validated
    requests sent and the streams given (``streams[i].cancelled``: the caller cancelled it)."""

    def __init__(self, hold=None):
        self.hold = hold
        self.sent: list[tuple[str, object]] = []
        self.streams: list[_FakeStream] = []
        self._shape = ""

    def options(self, multiplexed_model_id: str = "", stream: bool = False):
        assert stream, "video jobs are streamed"
        self._shape = multiplexed_model_id
        return self

    @property
    def generate_stream(self):
        return self

    def remote(self, validated, progress: bool = False):
        import asyncio

        import numpy as np

        from bcg_core.preview import StepProgress
        from deployments.routing import ACCEPTED

        assert progress, "video jobs ask for their step progress"
        validated = pickle.loads(pickle.dumps(validated))  # what Ray does to it on the way
        self.sent.append((self._shape, validated))
        r = validated.request

        async def events():
            yield ACCEPTED
            for step in range(1, r.num_inference_steps + 1):
                await asyncio.sleep(0)
                yield StepProgress(step, r.num_inference_steps)
                if step == 1 and self.hold is not None:
                    await self.hold.wait()
            frames = np.full((r.num_frames, r.height, r.width, 3), r.seed % 256, np.uint8)
            yield GenerationResult(image_bytes=[], seed=r.seed, bucket=str(validated.lookup.key), hit=True, missed=[],
                                   real_tokens=1, padded_tokens=1, steps=r.num_inference_steps, timings_ms={},
                                   videos=[frames])

        self.streams.append(_FakeStream(events()))
        return self.streams[-1]


def asgi_request(method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] = (),
                 query: str = "") -> Request:
    """A Starlette request: ``method`` ``path?query`` with ``body`` (delivered in one message) and ``headers``."""
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    raw = [(k.lower().encode(), v.encode()) for k, v in headers] + [(b"content-length", str(len(body)).encode())]
    return Request({"type": "http", "method": method, "path": path, "headers": raw, "query_string": query.encode()},
                   receive)
