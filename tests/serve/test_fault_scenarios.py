"""Faults on a Ray cluster under load (issue: reliability), counted by ``benchmarks/faults.py``.

The script runs in a subprocess with its own ``ray.cluster_utils.Cluster`` (a CPU head and three worker nodes
that each declare one GPU; 3 DiT replicas of the tiny model on the CPU, 2 ingress replicas, the ownership
coordinator). Each scenario sends its own bounded load over HTTP; the client honours 503 + Retry-After and
resends once after a dropped connection or another 5xx, as the OpenAI client does. For every scenario: every
request answered 200, none lost, none hung. And per scenario:

- ``capture_stalled``: one replica sleeps in its first capture past ``routing.capture_stall_s``; the coordinator
  takes it out, the others capture its shapes, every request is served by an owner meanwhile, and the replica
  comes back once its capture ends.
- ``dit_killed``: a replica holding >= 2 requests of one shape is killed mid-denoise; the ingress resends them,
  the coordinator expires it and its shapes are owned by live replicas.
- ``coordinator_killed``: Serve restarts it and the replicas' heartbeats rebuild the same ownership;
  ``GET /v1/buckets`` answers 200 throughout.
- ``ingress_killed``: the requests in the killed ingress replica are resent by the client and answered.
- ``forward_error``: one padded forward raises a simulated CUDA error (a failpoint); one bucket of one replica is
  demoted to eager, counted, and every request answered 200.
- ``step_oom``: one denoising step raises ``torch.OutOfMemoryError`` (a failpoint); its requests are answered 503
  with Retry-After, resent by the client, and served; the replica counts one OOM step.

On a busy 2-core machine, what is timed and how it is kept deterministic:

- The stall is a fixed sleep in the stalled replica (``--stall-s``, from its first capture at start-up), and
  ``capture_stalled`` judges the ownership while the replica is still stalled: after the others have taken its
  shapes and the whole load has been answered. With 12 s (this test before) that left about 4 s of margin on an
  idle machine (the 40 s run of docs/RELIABILITY.md, 12 requests, recovered 31.9 s after its load ended: the load
  ended about 8 s into the stall), so a machine 1.5 times slower let the replica recover mid-load and failed the
  ownership checks without any fault of the code. The test stalls up to 40 s, as that run: room for a machine 5
  times slower, and asserts ``stalled_through_load`` so that a machine slower still says so instead of failing an
  ownership check. The 40 s are a bound, not a wait: once the load is answered and the ownership judged,
  ``faults.py`` releases the stall (the failpoint's release file, :func:`bcg_core.failpoints.release_path`), and
  the replica recovers and joins then (about 40 s less than sleeping out the stall on 2 busy cores). The judgment
  is the same: it is made before the release, while the replica is stuck.
- The fault counters (``bucket_faults``, ``oom_steps``) reach the coordinator by heartbeat: ``faults.py`` waits
  for them (bounded, 30 s) instead of a fixed 1.5 s.
- ``dit_killed``'s requests run 12 steps (``--kill-steps``; the script's default, 24, is the documented run's).
  The replica is killed as soon as a heartbeat at most 0.6 s old shows 2 of its requests (heartbeats every 0.5 s),
  and on 2 cores one of those requests takes over 10 s at 12 steps (4 rows a forward on one owner), so it is still
  mid-denoise when killed (3 requests resent by the ingress in one run, as at 24 steps). The scenario's load took
  20 s instead of 32 s at 24 steps, the scenario 34 s instead of 46 s.
- No warm-up requests before each scenario (``--no-warm-up``): they only make the RSS before a fault comparable
  with the RSS after it (docs/RELIABILITY.md's memory column), which this test does not judge, and their answers
  were never counted; 6-7 s each for 4 scenarios on 2 busy cores.
- After a kill, "every replica ready" requires the coordinator's replicas to be the live ones, not only their
  count: a killed replica stays listed until its lease expires, and its replacement may already be alive.

What the test protects is unchanged: every request answered 200 in every scenario, none lost, none hung. With the
release, the 12 steps and no warm-up this module took 115 s where it took 172 s before, run back to back on 2 busy
cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# outside the default run (README, Tests): 226 s of the 1557 s a fresh-clone run took at 44c7b56 on 2 cores, which put
# CI over its 25 minutes; the in-process fault tests (tests/engine, tests/unit) stay in it. Run it by hand (pytest -m
# long tests/serve/test_fault_scenarios.py) before a change to routing, ownership, retries or the ingress lands.
pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 8
KILL_STEPS = 12  # dit_killed's steps per request (module docstring)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("faults") / "report.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--requests", str(REQUESTS), "--stall-s", "40",
           "--kill-steps", str(KILL_STEPS), "--no-warm-up", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())["scenarios"]


@pytest.mark.parametrize("scenario", ["capture_stalled", "dit_killed", "coordinator_killed", "ingress_killed",
                                      "forward_error", "step_oom"])
def test_no_request_is_lost_or_hung(report, scenario):
    r = report[scenario]
    assert r["sent"] >= REQUESTS and r["ok"] == r["sent"], r
    assert r["lost"] == 0 and r["hung"] == 0 and r["4xx"] == 0, r


def test_a_replica_stalled_in_capture_gives_its_shapes_to_the_others_until_it_recovers(report):
    r = report["capture_stalled"]
    (stalled,) = r["stalled"]
    assert r["stalled_through_load"], "the load outlasted the --stall-s stall: this machine is too slow for it"
    assert stalled not in r["owners_while_stalled"]
    assert r["owner_served"] == r["ok"]  # the others captured its shapes: no request waited for a fallback
    assert r["stalled_events"][-3:] == ["stalled", "recovered", "join"]


def test_a_replica_killed_mid_step_has_its_requests_resent_and_its_shapes_moved(report):
    r = report["dit_killed"]
    assert max(r["victim_queue_at_kill"].values()) >= 2  # rows of several requests in its steps
    assert r["ingress_resent"] >= 1, r
    assert "expired" in r["victim_events"] or "leave" in r["victim_events"]
    assert all(r["victim"] not in owners for owners in r["owners_after"].values())


def test_a_killed_coordinator_is_restarted_and_rebuilds_the_same_ownership(report):
    r = report["coordinator_killed"]
    assert r["restarted"] and r["ownership_rebuilt_same"], r
    assert set(r["buckets_polls"]) == {"200"}, r["buckets_polls"]


def test_a_killed_ingress_replica_is_replaced_and_its_requests_answered(report):
    r = report["ingress_killed"]
    assert r["in_flight_at_kill"] >= 4 and r["ingress_replicas_after"] == 2, r


def test_a_cuda_error_mid_forward_demotes_one_bucket_and_serving_goes_on(report):
    r = report["forward_error"]
    (faults,) = r["bucket_faults"].values()
    assert list(faults.values()) == [1], r["bucket_faults"]
    assert r["503"] == 0 and r["answered_503_then_resent"] == 0


def test_an_out_of_memory_step_is_answered_503_and_its_requests_served_on_resend(report):
    r = report["step_oom"]
    assert list(r["oom_steps"].values()) == [1], r
    assert r["answered_503_then_resent"] >= 1 and r["ok"] == r["sent"]
