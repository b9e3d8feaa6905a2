"""The ingress without Ray, for the tests that call its routes as plain methods: :func:`bare_ingress` (the class under
``serve.ingress``'s ASGI wrapper), :class:`FakeDiT` (a DiT deployment handle that records the validated requests
sent) and :func:`http_request` (a Starlette request holding a JSON body)."""

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
    assert user_class.__module__ == "deployments.ingress" and "generate" in vars(user_class)
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
