"""The client of the fault scenarios (``benchmarks/faults.py``): the request bodies, one request sent as a client
sends it (503 + Retry-After honoured, one resend after a dropped connection or another 5xx), a bounded load, the
RELIABILITY table's counts of its records, and ``GET /v1/buckets`` polled during a fault.

Imported by ``faults.py``, which puts the repository and ``benchmarks/`` on ``sys.path`` first.
"""

from __future__ import annotations

import asyncio
import time

from faults_cluster import SIZES

from deployments.cli.demo import apost_honouring_retry_after


def requests_for(count: int, steps: int, size: tuple[int, int] | None = None) -> list[dict]:
    """``count`` request bodies: the tiers' exact sizes in turn (or all ``size``), 1 or 2 images, fixed seeds."""
    out = []
    for i in range(count):
        w, h = size or SIZES[i % len(SIZES)]
        out.append({"prompt": f"a lighthouse at dusk, study {i}", "n": 1 + i % 2, "size": f"{w}x{h}",
                    "num_inference_steps": steps, "seed": 1000 + i})
    return out


async def send(client, base: str, body: dict, timeout_s: float) -> dict:
    """One request as a client sends it: 503 + Retry-After waited out and resent; one resend after a dropped
    connection or another 5xx. Returns its record."""
    import httpx

    rec: dict = {"size": body["size"], "n": body["n"], "client_resent": 0}
    t0 = time.monotonic()
    for attempt in range(2):
        try:
            r, waited, _ = await asyncio.wait_for(
                apost_honouring_retry_after(client, f"{base}/v1/images/generations", body, timeout=timeout_s),
                timeout_s)
        except asyncio.TimeoutError:
            rec.update(status=None, hung=True)
            break
        except httpx.HTTPError as exc:
            rec.update(status=None, error=f"{type(exc).__name__}: {exc}"[:200])
            if attempt == 0:
                rec.update(client_resent=1, first_answer=rec["error"])
                continue
            break
        rec.update(status=r.status_code, retry_after_resends=waited)
        if r.status_code == 200:
            b = r.json()["bcg"]
            rec.update(replica=b.get("replica"), owner=b.get("owner"), retries=b.get("retries", 0),
                       images=len(r.json()["data"]), error=None)
            break
        rec["error"] = r.text[:200]
        if r.status_code >= 500 and r.status_code != 503 and attempt == 0:
            rec.update(client_resent=1, first_answer=f"{r.status_code} {r.text[:160]}")
            continue
        break
    rec["latency_s"] = round(time.monotonic() - t0, 3)
    return rec


async def load(base: str, bodies: list[dict], concurrency: int, timeout_s: float, on_answer=None) -> list[dict]:
    """Send ``bodies`` with at most ``concurrency`` in flight; ``on_answer(answered, in_flight)`` after each
    answer."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    done = in_flight = 0
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        async def one(body):
            nonlocal done, in_flight
            async with sem:
                in_flight += 1
                try:
                    rec = await send(client, base, body, timeout_s)
                finally:
                    in_flight -= 1
            done += 1
            if on_answer is not None:
                await on_answer(done, in_flight)
            return rec
        return list(await asyncio.gather(*(one(b) for b in bodies)))


def counts(records: list[dict]) -> dict:
    """The RELIABILITY table's columns for one scenario's records."""
    ok = [r for r in records if r.get("status") == 200]
    return {
        "sent": len(records),
        "ok": len(ok),
        "4xx": sum(1 for r in records if r.get("status") and 400 <= r["status"] < 500),
        "503": sum(1 for r in records if r.get("status") == 503),
        "answered_503_then_resent": sum(1 for r in records if r.get("retry_after_resends")),
        "lost": sum(1 for r in records if not r.get("hung") and (r.get("status") is None
                                                                  or (r["status"] >= 500 and r["status"] != 503))),
        "hung": sum(1 for r in records if r.get("hung")),
        "client_resent": sum(r["client_resent"] for r in records),
        "ingress_resent": sum(1 for r in ok if r.get("retries")),
        "owner_served": sum(1 for r in ok if r.get("owner")),
        "first_answers_resent": sorted({r["first_answer"] for r in records if r.get("first_answer")})[:5],
        "errors": sorted({r["error"] for r in records if r.get("error")})[:5],
    }


async def poll_buckets(base: str, stop: asyncio.Event, out: list[int]) -> None:
    """``GET /v1/buckets`` every 0.5 s until ``stop``; appends each status (None: no answer in 10 s)."""
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as client:
        while not stop.is_set():
            try:
                out.append((await client.get(f"{base}/v1/buckets")).status_code)
            except httpx.HTTPError:
                out.append(None)
            await asyncio.sleep(0.5)
