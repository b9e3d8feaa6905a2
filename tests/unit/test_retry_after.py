"""Clients honour ``503`` + ``Retry-After``: wait as the header says, resend, bounded, counted apart from failures.

No Ray and no server: ``httpx.MockTransport`` answers 503 with ``Retry-After`` a scripted number of times, then
200 with a body shaped like the ingress's (``data[].b64_json`` PNGs and the ``bcg`` info). ``sleep`` is a
recorder, so nothing waits (except the benchmark scripts' own ``asyncio.sleep`` of the 0.05 s minimum).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import sys
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from deployments.cli.demo import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    DemoRequest,
    DemoResult,
    apost_honouring_retry_after,
    parse_retry_after,
    post_honouring_retry_after,
    render_report,
    retry_after_delay,
    send_request,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import autoscale_replay  # from benchmarks/, put on the path just above
import bench_router

URL = "http://bcg.test"
PNG = b"\x89PNG\r\n\x1a\n" + b"not really the rest of a PNG"
REQ = DemoRequest(number=7, row=3, prompt="a fox", width=256, height=256, n=2, seed=11)


def _ok_body(n: int) -> dict:
    return {"created": 1, "data": [{"b64_json": base64.b64encode(PNG).decode("ascii")} for _ in range(n)],
            "bcg": {"bucket": "b2_i256_t256", "hit": True, "missed": [], "seed": 11,
                    "timings_ms": {"encode": 1.0, "denoise": 2.0, "decode": 3.0, "total": 6.0},
                    "replica": "r1", "owner": True, "batch_size": 2, "retries": 0}}


def _busy(retry_after: str | None, status: int = 503) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return httpx.Response(status, headers=headers, json={"error": {"message": "every replica is busy",
                                                                   "type": "server_error", "param": None}})


class Server:
    """A MockTransport handler: the scripted answers first, then 200 with ``n`` images; records the bodies."""

    def __init__(self, script: list, n: int = 2, then=None):
        self.script = list(script)
        self.n = n
        self.then = then
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/images/generations"
        self.bodies.append(json.loads(request.content))
        if self.script:
            answer = self.script.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer
        if self.then is not None:
            return self.then()
        return httpx.Response(200, json=_ok_body(self.n))

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self))

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self))


class Sleeps(list):
    """A ``sleep`` that records its seconds and moves a fake clock on by them."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def __call__(self, seconds: float) -> None:
        self.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


# -- the demo's send_request -----------------------------------------------------------------------------------


def test_503_with_retry_after_is_waited_out_resent_and_counted(tmp_path):
    server = Server([_busy("2"), _busy("1.5"), _busy("1")])
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=3, out_dir=tmp_path, sleep=sleeps)
    assert result.ok, result.error
    assert (result.status, result.retries, result.retry_wait_s) == (200, 3, 4.5)
    assert sleeps == [2.0, 1.5, 1.0]
    assert len(server.bodies) == 4 and all(b == REQ.body(3) for b in server.bodies)  # the same body resent
    assert [p.name for p in result.files] == ["req007_img1.png", "req007_img2.png"]
    assert all(p.read_bytes() == PNG for p in result.files)
    assert (str(result.bucket), result.hit) == ("b2_i256_t256", True)
    assert result.latency_ms > 0


def test_first_answer_200_is_not_a_retry(tmp_path):
    sleeps = Sleeps()
    with Server([]).client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, sleep=sleeps)
    assert result.ok and (result.retries, result.retry_wait_s) == (0, 0.0) and sleeps == []


def test_retry_bound_hit_is_a_failure_saying_how_many_retries(tmp_path):
    server = Server([], then=lambda: _busy("1"))
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, max_retries=3, sleep=sleeps)
    assert not result.ok
    assert (result.status, result.retries, result.retry_wait_s) == (503, 3, 3.0)
    assert len(server.bodies) == 4 and sleeps == [1.0, 1.0, 1.0]
    assert result.error.startswith("HTTP 503: every replica is busy")
    assert "gave up after 3 retries honouring Retry-After" in result.error
    assert result.files == [] and list(tmp_path.iterdir()) == []


def test_deadline_stops_the_resends_before_a_wait_that_would_pass_it():
    server = Server([], then=lambda: _busy("2"))
    sleeps = Sleeps()
    with server.client() as client:
        response, retries, waited = post_honouring_retry_after(
            client, f"{URL}/v1/images/generations", {"prompt": "p"}, max_retries=100, deadline_s=5.0,
            sleep=sleeps, clock=sleeps.clock)
    # t=0 wait 2 -> t=2 wait 2 -> t=4: a third wait would end at 6 > 5
    assert (response.status_code, retries, waited) == (503, 2, 4.0)
    assert sleeps == [2.0, 2.0] and len(server.bodies) == 3


def test_max_retries_zero_sends_once(tmp_path):
    server = Server([_busy("1")])
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, max_retries=0, sleep=sleeps)
    assert (result.ok, result.status, result.retries) == (False, 503, 0)
    assert "gave up after 0 retries" in result.error and sleeps == [] and len(server.bodies) == 1


def test_503_without_retry_after_is_not_retried(tmp_path):
    server = Server([_busy(None)])
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, sleep=sleeps)
    assert (result.ok, result.status, result.retries, result.retry_wait_s) == (False, 503, 0, 0.0)
    assert result.error == "HTTP 503: every replica is busy"
    assert sleeps == [] and len(server.bodies) == 1


@pytest.mark.parametrize("status", [400, 422, 429, 500])
def test_other_statuses_are_not_retried_even_with_retry_after(tmp_path, status):
    server = Server([_busy("1", status=status)])
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, sleep=sleeps)
    assert (result.ok, result.status, result.retries) == (False, status, 0)
    assert result.error == f"HTTP {status}: every replica is busy"
    assert sleeps == [] and len(server.bodies) == 1


def test_unparseable_retry_after_is_final(tmp_path):
    server = Server([_busy("soon")])
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, sleep=sleeps)
    assert (result.status, result.retries) == (503, 0) and sleeps == []


def test_waits_are_clamped(tmp_path):
    server = Server([_busy("0"), _busy("600"), _busy("-4")])
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, sleep=sleeps)
    assert result.ok and result.retries == 3
    assert sleeps == [RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S] == [0.05, 30.0, 0.05]
    assert result.retry_wait_s == pytest.approx(30.1)


def test_http_date_retry_after_waits_until_that_date(tmp_path):
    when = datetime.now(timezone.utc) + timedelta(seconds=4)
    server = Server([_busy(format_datetime(when, usegmt=True))])
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, sleep=sleeps)
    assert result.ok and result.retries == 1
    assert 2.0 < sleeps[0] <= 4.0  # the date has whole seconds; the test itself takes a little


def test_parse_retry_after():
    now = datetime(2015, 10, 21, 7, 28, 0, tzinfo=timezone.utc)
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 1.25 ") == 1.25
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=now) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:27:58 GMT", now=now) == -2.0
    for bad in (None, "", "soon", "nan", "inf", "Wed, 99 Foo 2015"):
        assert parse_retry_after(bad, now=now) is None, bad
    past = httpx.Response(503, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert retry_after_delay(past) == RETRY_AFTER_MIN_S
    assert retry_after_delay(httpx.Response(503)) is None
    assert retry_after_delay(httpx.Response(429, headers={"Retry-After": "2"})) is None


def test_transport_error_after_a_retry_keeps_the_counts(tmp_path):
    server = Server([_busy("1"), httpx.ConnectError("refused")])
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, sleep=sleeps)
    assert (result.ok, result.status, result.retries, result.retry_wait_s) == (False, None, 1, 1.0)
    assert result.error == "ConnectError: refused (after 1 retry on 503 Retry-After)"


def test_timeout_after_a_retry_is_reported_as_a_timeout(tmp_path):
    server = Server([_busy("2"), _busy("1"), httpx.ReadTimeout("slow")])
    sleeps = Sleeps()
    with server.client() as client:
        result = send_request(client, URL, REQ, steps=1, out_dir=tmp_path, sleep=sleeps)
    assert (result.status, result.retries, result.retry_wait_s) == (None, 2, 3.0)
    assert result.error == "no answer within the timeout (ReadTimeout) (after 2 retries on 503 Retry-After)"


def test_negative_bounds_are_refused():
    with Server([]).client() as client, pytest.raises(ValueError, match="max_retries -1"):
        post_honouring_retry_after(client, URL, {}, max_retries=-1)
    with Server([]).client() as client, pytest.raises(ValueError, match="deadline_s -1"):
        post_honouring_retry_after(client, URL, {}, deadline_s=-1)


def test_report_shows_the_retries_only_when_some_happened(tmp_path):
    def report(results: list[DemoResult]) -> str:
        console = Console(file=io.StringIO(), width=200)
        render_report(None, results, 1.0, tmp_path, console)
        return console.file.getvalue()

    quiet = [DemoResult(REQ, True, 200, 5.0)]
    assert "Retry-After" not in report(quiet)
    busy = [DemoResult(REQ, True, 200, 5.0, retries=3, retry_wait_s=4.5),
            DemoResult(REQ, True, 200, 5.0),
            DemoResult(REQ, False, 503, 5.0, error="HTTP 503: busy (gave up ...)", retries=2, retry_wait_s=3.5)]
    text = report(busy)
    assert "retried 2 requests after 503 Retry-After (5 retries, 8.0 s waited)" in text
    assert "3 requests (2 ok, 1 failed)" in text


# -- the asyncio twin and the benchmark scripts ----------------------------------------------------------------


def test_async_twin_waits_and_counts_like_the_sync_one():
    server = Server([_busy("3"), _busy("0.5")])
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def go():
        async with server.async_client() as client:
            return await apost_honouring_retry_after(client, f"{URL}/v1/images/generations", {"prompt": "p"},
                                                     timeout=5.0, sleep=sleep)

    response, retries, waited = asyncio.run(go())
    assert (response.status_code, retries, waited) == (200, 2, 3.5) and waits == [3.0, 0.5]


def _krea_req() -> dict:
    return {"prompt": "a fox", "n": 2, "width": 256, "height": 256, "num_inference_steps": 1, "seed": 5}


def test_bench_router_counts_http_retries_apart_from_errors_and_server_retries():
    ok_server = Server([_busy("0"), _busy("0")])
    busy_server = Server([], then=lambda: _busy("0"))

    async def go():
        async with ok_server.async_client() as a, busy_server.async_client() as b:
            first = await bench_router._one(0, _krea_req(), "http", None, URL, a, 5.0)
            second = await bench_router._one(1, _krea_req(), "http", None, URL, b, 5.0, http_retries=1)
            return [first, second]

    first, second = asyncio.run(go())
    assert (first["status"], first["http_retries"], first["http_retry_wait_s"]) == (200, 2, 0.1)
    assert first["retries"] == 0 and first["images"] == 2  # the server's own retries stay its own
    assert (second["status"], second["http_retries"]) == (503, 1)
    assert second["error"] == "every replica is busy"
    total = bench_router.summarize([first, second], wall_s=1.0)
    assert (total["ok"], total["errors"], total["http_retries"], total["http_retried"]) == (1, {"503": 1}, 3, 2)
    assert total["http_retry_wait_s"] == 0.15 and total["retried"] == 0


def test_autoscale_replay_resends_503_with_retry_after(monkeypatch):
    servers = iter([Server([_busy("0"), _busy("0")], n=1), Server([], then=lambda: _busy("0"), n=1),
                    Server([_busy(None)], n=1)])
    real_client = httpx.AsyncClient

    def one_server_per_request(**kwargs):
        server = next(servers)

        def route(request: httpx.Request) -> httpx.Response:
            return server(request)

        return real_client(transport=httpx.MockTransport(route), **kwargs)

    body = {"prompt": "p", "n": 1, "size": "256x256", "num_inference_steps": 1, "seed": 0}
    stats = {"arrivals": [], "inflight": 0}
    results = []
    for retries in (5, 2, 5):
        monkeypatch.setattr(httpx, "AsyncClient", one_server_per_request)
        results += asyncio.run(autoscale_replay.replay([{"at": 0.0, "body": body}], URL, retries, 5.0, 60.0, stats))
    ok, bound, plain = results
    assert (ok["status"], ok["tries"], ok["retries"], ok["retry_wait_s"], ok["images"]) == (200, 3, 2, 0.1, 1)
    assert (bound["status"], bound["tries"], bound["retries"]) == (503, 3, 2)
    assert (plain["status"], plain["tries"], plain["retries"]) == (503, 1, 0)  # no Retry-After: final
    assert stats["inflight"] == 0 and len(stats["arrivals"]) == 3
