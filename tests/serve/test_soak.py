"""The 2-minute soak (issue: reliability), the CI version of docs/RELIABILITY.md's 10-minute run.

``benchmarks/soak.py --duration-s 120`` runs in a subprocess against one local application (loopback only):
4 clients send the packaged krea requests (their sizes and image counts) with 1, 2 or 4 steps, 30% streamed,
10% abandoned mid-request, while ``GET /v1/buckets`` is polled every second. Targets: no lost or hung request,
no 5xx, every poll answered, the bucket table unchanged, and the replica's memory at rest after the run within
5% of its memory at rest after warm-up (the first 30% of the run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration-s", "120", "--warmup-share", "0.3",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_the_soak_loses_hangs_and_fails_nothing(soak):
    o = soak["outcomes"]
    assert soak["sent"] >= 10 and o.get("ok", 0) >= 5, o
    assert o.get("lost", 0) == o.get("hung", 0) == o.get("5xx", 0) == 0, (o, soak["failures"])
    assert soak["polls"]["failed"] == 0 and soak["polls"]["ok"] >= 60
    # every request the client abandoned was cancelled by the replica, or had finished already
    assert soak["replica"]["cancelled"] <= o.get("disconnected", 0)
    assert soak["replica"]["failed"] == 0


def test_the_bucket_table_is_unchanged(soak):
    assert soak["table_start"] == soak["table_end"] and soak["table_end"]["buckets"] > 0


def test_memory_at_rest_is_flat_after_warm_up(soak):
    m = soak["memory"]
    assert m["at_rest_after_warmup_bytes"] and m["at_rest_end_bytes"], m
    assert abs(m["change_at_rest"]) <= 0.05, {k: v for k, v in m.items() if k != "series"}
