"""Autoscaling end to end on this machine: real GenTD26 arrivals against fake GPU nodes.

``benchmarks/autoscale_replay.py`` runs in a subprocess (its own ``ray.cluster_utils.Cluster``: a CPU head and
two worker nodes that each declare one GPU; the DiT replicas ask for one GPU each and run the tiny model on the
CPU). It replays 00:34 to 00:44 of 2024-12-06 from ``bcg_core/data/alibaba_gentd26_burst_2024-12-06.csv``
(every second arrival, six times faster than real time, each with its own number of images and a size drawn
from the krea mix) over HTTP against an application that autoscales by bucket load from 1 to 2 replicas (target
utilisation 0.25, so that the burst asks for a second replica on fast and slow CPUs alike).

- every request is answered 200 (none lost; a 503 would be retried after its Retry-After);
- the replica count goes up during the burst and back to 1 after it;
- the added replica joined the ownership coordinator with shapes assigned from the measured load;
- the timeline plot is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # outside the default run (README, Tests)

ROOT = Path(__file__).resolve().parents[2]
COMPRESS = 6.0
# the burst: arrivals pick up at 00:37:30 (3x the quiet rate), peak from 00:38:00 and end at 00:41:30; in seconds
# after 00:34:00, compressed
BURST = (210 / COMPRESS, 450 / COMPRESS)


@pytest.fixture(scope="module")
def replay(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("autoscale")
    report, png = out / "report.json", out / "timeline.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "autoscale_replay.py"), "--compress", str(COMPRESS),
           "--every", "2", "--max-replicas", "2", "--target-utilization", "0.25", "--retries", "10",
           "--settle-s", "60", "--records",
           "--json", str(report), "--plot", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(report.read_text()), png


def test_no_request_is_lost(replay):
    report, _ = replay
    r = report["replay"]
    assert r["requests"] >= 80 and r["lost"] == 0
    bad = [x for x in report["records"] if x.get("status") != 200]
    assert r["ok"] == r["requests"], bad[:5]


def test_replicas_scale_up_with_the_burst_and_back_down_after_it(replay):
    report, _ = replay
    tl = report["timeline"]
    assert report["peak_replicas"] == 2 and report["final_replicas"] == 1
    # the second replica was asked for during the burst (it starts within seconds on this machine)
    asked = next(p["t"] for p in tl if p["running"] + p["starting"] >= 2)
    assert BURST[0] <= asked <= BURST[1] + 10, asked
    up = [e for e in report["scale_events"] if e["to"] > e["from"]]
    down = [e for e in report["scale_events"] if e["to"] < e["from"]]
    assert up and down and down[-1]["t"] > up[0]["t"]
    # quiet before the burst: one replica
    assert all(p["running"] + p["starting"] == 1 for p in tl if p["t"] < BURST[0])


def test_the_added_replica_owns_shapes_by_measured_load(replay):
    report, _ = replay
    assert report["demand_at_peak"]["source"] == "measured"
    at_peak = report["ownership_at_peak"]
    assert len(at_peak) == 2
    joined = [e for e in report["coordinator_events"] if e["event"] == "join"]
    assert len(joined) >= 2
    added = joined[1]["replica"]
    shares = report["demand_at_peak"]["shares"]
    hottest = max(shares, key=shares.get)
    assert hottest in at_peak[added]  # the scale-up replica co-owns the hottest shape
    # on the downscale one replica left the coordinator, and the survivor owns every shape
    assert any(e["event"] in ("leave", "expired") for e in report["coordinator_events"])
    (survivor,) = report["ownership_end"].values()
    assert set(survivor) == set(shares)


def test_the_timeline_plot_is_written(replay):
    _, png = replay
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
