"""The 75-second soak (issue: reliability), a `long` test outside the default run (README, Tests): the short version of
docs/RELIABILITY.md's 10-minute run.

``benchmarks/soak.py --duration-s 75`` runs in a subprocess against one local application (loopback only):
4 clients send the packaged krea requests (their sizes and image counts) with 1, 2 or 4 steps, 30% streamed,
10% abandoned mid-request, while ``GET /v1/buckets`` is polled every second. Targets: no lost or hung request,
no 5xx, every poll answered, the bucket table unchanged, and the replica's memory at rest after the run within
5% of its memory at rest after warm-up (the first 30% of the run).

Memory at rest, and why it is judged this way (a run on a busy 2-core machine once measured +8.6% against the
5%): what the bound protects against is memory that stays after the requests are gone (a leak, or the freed heap
that glibc kept before the replica's idle trim, +17% in 2 minutes: ``bcg_core/scheduler/memtrim.py``). The old
measurement waited a fixed 3 s after the client's last answer, which on a busy machine can land before the replica is at
rest: an abandoned request still runs until its next step, and the idle trim comes ``scheduler.trim_idle_s`` after the
replica's last request, so the sample could hold memory about to be given back, at either end. And a slow warm-up got
through few requests, so memory made once on first use (the preview thread and its fitted decoder of the first streamed
request) could fall after the baseline. ``benchmarks/soak.py`` now takes both measurements the same way, once the
replica itself is at rest (``memory_at_rest``): no request in its step scheduler and its idle trim done (its own
counters in ``GET /v1/buckets``), then the median of 5 samples, kept only if no request ran on the replica meanwhile
(else it waits again); and its first two requests are a streamed one with previews and an abandoned one, so every kind
of request has run before the baseline. The 5% bound is unchanged: measured this way on this 2-core machine under load
(load average about 4), 1.332 GB -> 1.385 GB (+4.0%). ``memory.rest.*.memory_mb`` splits the resident set (private heap
``RssAnon``, files, shared memory) for a failure's diagnosis. A replica that never gets to rest after the clients are
gone (a request left in its scheduler) fails the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # outside the default run (README, Tests)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration-s", "75", "--warmup-share", "0.3",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_the_soak_loses_hangs_and_fails_nothing(soak):
    o = soak["outcomes"]
    assert soak["sent"] >= 10 and o.get("ok", 0) >= 5, o
    assert o.get("lost", 0) == o.get("hung", 0) == o.get("5xx", 0) == 0, (o, soak["failures"])
    assert soak["polls"]["failed"] == 0 and soak["polls"]["ok"] >= 40  # one a second over 75 s
    # every request the client abandoned was cancelled by the replica, or had finished already
    assert soak["replica"]["cancelled"] <= o.get("disconnected", 0)
    assert soak["replica"]["failed"] == 0


def test_the_bucket_table_is_unchanged(soak):
    assert soak["table_start"] == soak["table_end"] and soak["table_end"]["buckets"] > 0


def test_memory_at_rest_is_flat_after_warm_up(soak):
    m = soak["memory"]
    assert m["at_rest_after_warmup_bytes"] and m["at_rest_end_bytes"], m
    # each measurement was taken at rest: the replica's scheduler empty and its idle trim done
    assert m["rest"]["after_warmup"]["settled"] and m["rest"]["end"]["settled"], m["rest"]
    assert abs(m["change_at_rest"]) <= 0.05, {k: v for k, v in m.items() if k != "series"}
