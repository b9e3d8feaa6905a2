"""Shape-aware routing on a multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``).

Three worker nodes each declare one GPU; the three DiT replicas ask for ``num_gpus=1`` (one per node) and
run the tiny model on the CPU. ``benchmarks/bench_router.py`` runs in a subprocess (its own Ray cluster,
apart from the session's local Ray instance in conftest) and replays real krea sizes, half over HTTP and
half through the ingress's Python handle. After 32 answers one DiT replica is killed:

- before the kill, >= 99% of the requests that have a bucket land on an owner of its shape;
- every request is answered 200 (in-flight ones on the victim are resent), the coordinator records the
  death, the victim's shapes move to the survivors, and serving continues.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # outside the default run (README, Tests)

ROOT = Path(__file__).resolve().parents[2]
REQUESTS, KILL_AFTER = 56, 32


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("router") / "report.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_router.py"), "--fake-gpu-nodes", "3", "--replicas", "3",
           "--node-cpus", "1", "--dit-cpus", "0.5", "--steps", "1", "--max-images", "2", "--concurrency", "4",
           "--requests", str(REQUESTS), "--kill-after", str(KILL_AFTER), "--records", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_each_replica_captures_its_own_shapes(report):
    own = report["ownership_start"]
    assert len(own) == 3
    shapes = set().union(*map(set, own.values()))
    assert len(shapes) >= 6  # the replay's table: 4 tiers, exact and masked
    # a split, not three full copies: each replica holds fewer than all shapes
    assert all(len(v) < len(shapes) for v in own.values()), own
    assert sum(map(len, own.values())) < 2 * len(shapes)


def test_owner_hit_rate_on_real_sizes(report):
    k = report["kill"]
    assert k["keyed_before"] >= 24
    assert k["owner_hit_rate_before"] >= 0.99, k
    # the mix is spread by ownership, not piled on one replica
    assert len(report["replay"]["per_replica"]) >= 3


def test_replica_death_loses_no_request_and_rebalances(report):
    r, k = report["replay"], report["kill"]
    assert r["requests"] == REQUESTS and r["lost"] == 0
    assert r["ok"] == REQUESTS, (r["errors"], [x.get("error") for x in report["records"] if x.get("status") != 200])
    assert k["answered_after_kill"] >= REQUESTS - KILL_AFTER
    victim_id = k["victim"].rsplit("#", 1)[-1]
    # the coordinator saw the victim go (lease expiry or graceful leave) ...
    assert any(e["replica"] == victim_id and e["event"] in ("expired", "leave") for e in k["events"]), k["events"]
    # ... and its shapes are owned by live replicas afterwards
    after = k["ownership_after"]
    assert victim_id not in after
    assert set(report["ownership_start"][victim_id]) <= set().union(*map(set, after.values()))
