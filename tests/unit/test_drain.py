"""The ingress's drain before the local server deletes its application (``deployments/drain.py``): a request that
arrives while draining is answered 503 with ``Retry-After`` in OpenAI's error shape, which the ``openai`` client
raises as ``InternalServerError`` with the code; the requests in flight are served to the end and counted until
then; :func:`drain_ingress` hears from every ingress replica; the ingress's app has the gate outermost.
The server itself, stopped by Ctrl-C mid-stream: ``tests/serve/test_ctrl_c_serve.py``."""

import asyncio
import time

import httpx
import openai
import pytest

from deployments import drain
from deployments.drain import DrainGate, DrainMiddleware, drain_ingress, drain_replica


def _held_app(release: asyncio.Event, entered: asyncio.Event):
    """An ASGI app answering 200 ``{"ok": true}`` once ``release`` is set (``entered``: set when one arrives)."""

    async def app(scope, receive, send):
        entered.set()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"ok": true}', "more_body": False})

    return app


def test_a_request_arriving_while_draining_gets_503_while_the_one_in_flight_completes():
    async def scenario():
        gate, release, entered = DrainGate(), asyncio.Event(), asyncio.Event()
        transport = httpx.ASGITransport(app=DrainMiddleware(_held_app(release, entered), gate))
        async with httpx.AsyncClient(transport=transport, base_url="http://bcg") as client:
            in_flight = asyncio.create_task(client.post("/v1/images/generations", json={"prompt": "x"}))
            await asyncio.wait_for(entered.wait(), 5)
            assert gate.in_flight.count == 1 and not gate.draining
            gate.start(2.6)
            refused = await client.get("/v1/models")
            assert refused.status_code == 503 and refused.headers["retry-after"] == "3"
            assert refused.headers["content-type"] == "application/json"
            error = refused.json()["error"]
            assert error["code"] == "server_stopping" and error["type"] == "server_error" and error["param"] is None
            assert "server is stopping" in error["message"] and "again in 3 s" in error["message"]
            assert gate.in_flight.count == 1  # the refused one is not left counted
            assert await gate.wait_idle(0.05) == 1  # still serving the first: the wait runs out
            release.set()
            served = await in_flight
            assert served.status_code == 200 and served.json() == {"ok": True}
            assert await gate.wait_idle(1.0) == 0 and gate.in_flight.count == 0

    asyncio.run(scenario())


def test_the_openai_client_raises_the_refusal_as_a_503_naming_the_server_stopping():
    async def scenario():
        gate, release, entered = DrainGate(), asyncio.Event(), asyncio.Event()
        release.set()
        gate.start(1)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=DrainMiddleware(_held_app(release, entered), gate)))
        client = openai.AsyncOpenAI(api_key="k", base_url="http://bcg/v1", http_client=http, max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            await client.images.generate(prompt="x", model="bcg-tiny-flux")
        await http.aclose()
        return caught.value

    err = asyncio.run(scenario())
    assert err.status_code == 503 and err.code == "server_stopping" and err.type == "server_error"
    assert err.response.headers["retry-after"] == "1" and "server is stopping" in err.message


def test_drain_replica_starts_this_processs_gate_and_reports_its_requests_in_flight(monkeypatch):
    gate = DrainGate()
    monkeypatch.setattr(drain, "INGRESS_DRAIN", gate)  # not the process's own: other tests share it
    gate.in_flight.enter()
    t0 = time.monotonic()
    assert asyncio.run(drain_replica(4.0, 0.1)) == {"replica": gate.id, "in_flight": 1}
    assert 0.09 <= time.monotonic() - t0 < 2 and gate.draining and gate.retry_after_s == 4.0
    gate.in_flight.leave()
    assert asyncio.run(drain_replica(4.0, 5.0)) == {"replica": gate.id, "in_flight": 0}


class _FakeServe:
    """``serve.status()`` and ``serve.get_app_handle(name)`` of an app whose ingress has the replicas ``script``
    (replica id -> its in-flight counts, answered in turn); each ``drain.remote`` goes to the next replica."""

    def __init__(self, script: dict[str, list[int]], running: int):
        self.script, self.calls, self.waits = {k: list(v) for k, v in script.items()}, [], []
        overview = type("Dep", (), {"replica_states": {"RUNNING": running}})()
        self.app = type("App", (), {"deployments": {"Ingress": overview}})()
        self.drain = self

    def status(self):
        return type("Status", (), {"applications": {"bcg": self.app}})()

    def get_app_handle(self, name):
        assert name == "bcg"
        return self

    def remote(self, wait_s):
        replica = sorted(self.script)[len(self.calls) % len(self.script)]
        counts = self.script[replica]
        self.calls.append(replica)
        self.waits.append(wait_s)
        answer = {"replica": replica, "in_flight": counts.pop(0) if len(counts) > 1 else counts[0]}
        return type("Ref", (), {"result": lambda _self, timeout_s: answer})()


def test_drain_ingress_waits_for_every_running_replica_to_report_nothing_in_flight(monkeypatch):
    from ray import serve

    fake = _FakeServe({"a": [2, 1, 0], "b": [0]}, running=2)
    monkeypatch.setattr(serve, "status", fake.status)
    monkeypatch.setattr(serve, "get_app_handle", fake.get_app_handle)
    report = drain_ingress("bcg", timeout_s=10.0, poll_s=0.5)
    assert report.drained and report.replicas == {"a": 0, "b": 0} and report.expected == 2
    assert fake.calls == ["a", "b", "a", "b", "a"] and all(0 < w <= 0.5 for w in fake.waits)

    stuck = _FakeServe({"a": [1]}, running=1)  # a request that never ends: the wait runs out
    monkeypatch.setattr(serve, "status", stuck.status)
    monkeypatch.setattr(serve, "get_app_handle", stuck.get_app_handle)
    t0 = time.monotonic()
    report = drain_ingress("bcg", timeout_s=0.05, poll_s=0.01)
    assert not report.drained and report.replicas == {"a": 1} and time.monotonic() - t0 < 5


def test_the_ingress_app_has_the_drain_gate_outermost_and_a_drain_handle_method():
    from deployments.ingress import Ingress, app

    assert app.user_middleware[0].cls is DrainMiddleware  # outermost: a refused request reaches nothing else
    assert callable(getattr(Ingress.func_or_class, "drain", None))  # the handle method drain_ingress calls
