"""The ingress trims its heap once no HTTP request is in flight (``deployments/memory.py``; issue 45, part 5: the
ingress's memory at rest grew 12% in a 5-minute mixed soak): a streamed answer counts until its last chunk, the trim
comes only after the delay with nothing in flight, and the ingress's app carries the middleware."""

import asyncio
import time

from bcg_core.scheduler.memtrim import IdleTrimmer
from deployments.memory import IdleTrimMiddleware, InFlightCounter


def _streaming_app(release: asyncio.Event):
    """An ASGI app answering 200 in two body chunks, the second once ``release`` is set."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"b", "more_body": False})

    return app


async def _receive():
    return {"type": "http.request", "body": b"", "more_body": False}


def test_a_streamed_answer_is_in_flight_until_its_last_chunk_then_idle_is_signalled_once():
    idles = []
    counter = InFlightCounter(on_idle=lambda: idles.append(counter.count))

    async def run():
        release = asyncio.Event()
        mw = IdleTrimMiddleware(_streaming_app(release), counter)
        sent = []

        async def send(message):
            sent.append(message)

        tasks = [asyncio.create_task(mw({"type": "http"}, _receive, send)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert counter.count == 3 and not counter.idle() and idles == []  # all three mid-stream
        release.set()
        await asyncio.gather(*tasks)
        assert sum(m.get("body") == b"b" for m in sent) == 3

    asyncio.run(run())
    assert counter.idle() and idles == [0]  # once, when the last of the three finished


def test_a_failing_request_still_leaves_the_count():
    counter = InFlightCounter()

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    async def run():
        try:
            await IdleTrimMiddleware(broken, counter)({"type": "http"}, _receive, None)
        except RuntimeError:
            pass

    asyncio.run(run())
    assert counter.count == 0


def test_the_trim_comes_after_the_delay_only_with_nothing_in_flight():
    counter = InFlightCounter()
    trims = []
    trimmer = IdleTrimmer(counter.idle, delay_s=0.2, trim=lambda: trims.append(time.monotonic()) or True)
    counter.on_idle = trimmer.notify
    try:
        counter.enter()
        counter.leave()  # idle: a trim 0.2 s from now
        counter.enter()  # ...but a request arrives before it
        time.sleep(0.4)
        assert trims == []
        done = time.monotonic()
        counter.leave()
        deadline = time.monotonic() + 5
        while not trims and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(trims) == 1 and trims[0] - done >= 0.19
    finally:
        trimmer.close()


def test_the_ingress_app_counts_its_requests_and_sets_the_delay_from_the_config():
    from deployments.ingress import app
    from deployments.memory import INGRESS_TRIM, configure_trim

    assert any(m.cls is IdleTrimMiddleware for m in app.user_middleware)
    try:
        trimmer = configure_trim(2.5)
        assert trimmer.delay_s == 2.5 and INGRESS_TRIM.enabled and INGRESS_TRIM.on_idle == trimmer.notify
        assert configure_trim(None) is None and not INGRESS_TRIM.enabled and INGRESS_TRIM.on_idle is None
    finally:  # as before any Ingress configured it: counting, no trimmer attached
        INGRESS_TRIM.enabled, INGRESS_TRIM.on_idle = True, None
