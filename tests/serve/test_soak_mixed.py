"""The 50-second mixed soak (issue 45, part 5), the CI version of docs/RELIABILITY.md's 30-minute run.

``benchmarks/soak_mixed.py --duration-s 50 --max-images 2`` runs in a subprocess against one local application
(loopback only): 5 clients send generations, streamed generations with previews, requests with one and two LoRA
adapters, image-to-image and inpainting edits, and 10% bad requests, at the krea rows' sizes with at most 2 images
a request. Checked: every kind was answered, every bad request was refused with a 4xx and no good one was, nothing
was lost, hung or answered 5xx, both memory readings were taken at rest, and the ingress's memory at rest stayed
within 5% of its value after warm-up (+12% in 5 minutes before it trimmed its heap and fixed its mmap threshold:
``deployments/memory.py``). The DiT replica's memory at rest is reported, not judged here: over a minute or two it
is within a few percent of the 5% bound on this machine (+4.7% in a 5-minute run), which the 30-minute run judges.

Timing, on 2 busy cores: with the rows' own image counts (9 in most) a request took seconds, so the 75 s this test
ran before sent about 15 requests, its rest after warm-up waited 26 s for those in flight, and about 20 s of load
followed. With at most 2 images, 50 s sent 31 requests (26 reached the replica), the rest after warm-up took 10 s,
the load after it lasted as long (23 s), and a sample every 3 s gave 13 samples under load (5 s gave 10 in 75 s).
The module went from 133 s to 90 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"generate", "stream", "lora1", "lora2", "img2img", "inpaint", "bad"}

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("soak_mixed") / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak_mixed.py"), "--duration-s", "50", "--max-images", "2",
           "--sample-s", "3", "--warmup-share", "0.3", "--window-s", "15", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_every_kind_is_served_and_every_bad_request_refused(soak):
    o = soak["outcomes"]
    assert set(o) == KINDS, o  # the first seven requests are one of each kind
    for kind, counts in o.items():
        if kind == "bad":
            assert counts.get("4xx", 0) >= 1 and set(counts) == {"4xx"}, counts
        else:
            assert counts.get("ok", 0) >= 1 and set(counts) <= {"ok", "disconnected"}, (kind, counts, soak["failures"])
    assert soak["targets_met"]["none_lost_hung_5xx_or_bad_accepted"] and soak["targets_met"]["no_good_request_refused"]
    assert soak["replica"]["failed"] == 0


def test_memory_is_read_at_rest_for_every_process_and_the_ingress_stays_flat(soak):
    rest = soak["at_rest"]
    assert rest["after_warmup"]["rest"]["settled"] and rest["end"]["rest"]["settled"], rest
    for when in ("after_warmup", "end"):
        assert {"DiTReplica", "Ingress", "ProxyActor", "raylet"} <= set(rest[when]["groups_mb"]), rest[when]
    assert rest["change_dit"] is not None and abs(rest["change_groups"]["Ingress"]) <= 0.05, rest["change_groups"]
    assert soak["under_load"]["samples"] >= 10
