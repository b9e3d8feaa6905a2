"""Faults on a Ray cluster, under load, counted: nothing may be lost or hang.

One application (tiny model, step scheduler, shape-aware routing) is deployed on a ``ray.cluster_utils.Cluster``
of fake GPU nodes on this machine (loopback only), with 3 DiT replicas and 2 ingress replicas. Scenarios run in
this order, each under its own bounded load of HTTP requests (exact sizes of the table's tiers, round robin;
``--requests`` of them, ``--concurrency`` in flight, ``--steps`` denoising steps):

- ``capture_stalled``: the application starts with the ``capture_stall`` failpoint armed
  (:mod:`bcg_core.failpoints`): one DiT replica sleeps ``--stall-s`` in its first capture. With
  ``routing.capture_stall_s`` = ``--capture-stall-s`` the coordinator takes it out of the assignment; the
  others capture its shapes and serve them as owners. The load runs while it is stuck (``stalled_through_load``:
  it still was when the load's last answer came); then the scenario ends the stall (the failpoint's release file;
  ``--full-stall``: it sleeps all of ``--stall-s``), waits for it to recover (its event ``recovered``) and for
  every replica to be ready.
- ``dit_killed``: a DiT replica is killed (``ray.kill``) once the coordinator's last heartbeat from it shows at
  least 2 requests of one shape in its step scheduler (rows of several requests in one batch). The ingress
  resends its requests in flight (``bcg.retries`` in their answers); Serve starts a replacement.
- ``coordinator_killed``: the ownership coordinator is killed after the first answers; Serve restarts it and it
  rebuilds the ownership from the replicas' heartbeats. ``GET /v1/buckets`` is polled throughout.
- ``ingress_killed``: one of the 2 ingress replicas is killed after the first answers. Requests that were in it
  fail at Ray's HTTP proxy; the client resends each once (as the OpenAI client does on a 5xx or a dropped
  connection: ``max_retries`` 2 by default).
- ``forward_error``: the ``forward_error`` failpoint is armed: one padded bucket forward in one replica raises a
  (simulated) CUDA error. The bucket is demoted to unpadded eager (``bucket_faults`` in that replica's
  heartbeat) and every request is answered 200.
- ``step_oom``: the ``step_oom`` failpoint is armed: one denoising step in one replica raises
  ``torch.OutOfMemoryError``. That step's requests are answered 503 with ``Retry-After``; the client waits and
  resends them (``answered_503_then_resent``), the replica counts the step (``oom_steps``) and serves on.

The client honours 503 with ``Retry-After`` (:func:`deployments.cli.demo.apost_honouring_retry_after`) and resends a
request once after a dropped connection or a 5xx other than 503 (``client_resent``). Per scenario: requests sent,
answered 200, answered 4xx / 503, lost (no 200 after the resend), hung (no answer in ``--timeout-s``), served by
a replica owning the shape, resent by the ingress, and the resident memory (RSS, MB) summed over the live DiT
replica processes before the fault and at the end.

Usage::

    python benchmarks/faults.py --json docs/bench/faults_cpu.json
    python benchmarks/faults.py --scenarios dit_killed,ingress_killed --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import faults_scenarios  # noqa: E402
from bench_router import bench_ray  # noqa: E402
from faults_cluster import APP, DIT_REPLICAS, INGRESS_REPLICAS, app_config, wait_until  # noqa: E402
from faults_scenarios import SCENARIOS  # noqa: E402

from bcg_core.failpoints import CAPTURE_STALL_ENV, FORWARD_ERROR_ENV, STEP_OOM_ENV  # noqa: E402


async def run(args) -> dict:
    from ray import serve

    from deployments import build_app

    config = app_config(args)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    base = f"http://127.0.0.1:{args.port}"
    app = build_app({"config": config, "dit_replicas": DIT_REPLICAS, "dit_num_gpus": 1, "dit_num_cpus": 0.5,
                     "ingress_replicas": INGRESS_REPLICAS})
    if "capture_stalled" in args.scenarios:
        os.makedirs(args.claim_dir, exist_ok=True)  # arms the failpoint: one replica stalls its first capture
    t0 = time.perf_counter()
    # not serve.run: it waits for the application to be RUNNING, which a stalled replica holds back; serve deploy
    # does not wait either, and the HTTP proxy serves the application while it is DEPLOYING
    serve.run_many([serve.RunTarget(app, name=APP, route_prefix="/")], wait_for_applications_running=False)

    async def ingress_up():
        try:
            import httpx

            async with httpx.AsyncClient(timeout=5.0) as c:
                return (await c.get(f"{base}/healthz")).status_code == 200
        except Exception:  # noqa: BLE001 - not up yet
            return False

    if not await wait_until(ingress_up, args.start_timeout_s):
        raise TimeoutError(f"the ingress did not answer /healthz within {args.start_timeout_s} s")
    report: dict = {"config": config, "ingress_up_s": round(time.perf_counter() - t0, 1), "scenarios": {}}
    for name in SCENARIOS:
        if name not in args.scenarios:
            continue
        t1 = time.perf_counter()
        result = await getattr(faults_scenarios, name)(args, base)
        result["wall_s"] = round(time.perf_counter() - t1, 1)
        if not args.records:
            result.pop("records", None)
        report["scenarios"][name] = result
        print(json.dumps({name: {k: v for k, v in result.items() if k != "records"}}, default=str), flush=True)
    return report


def _commit() -> str | None:
    """The checkout's commit (``+changes`` when the tree differs from it), or None outside git."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty.strip() else "")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--requests", type=int, default=12, help="requests of each scenario's load")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kill-steps", type=int, default=24, help="steps of dit_killed's requests (long enough to be "
                   "killed mid-denoise)")
    p.add_argument("--fault-after", type=int, default=2, help="answers before the coordinator or ingress is killed")
    p.add_argument("--stall-s", type=float, default=40.0, help="seconds the stalled replica sleeps in its capture at "
                   "most: capture_stalled releases it once the load is answered and the ownership judged")
    p.add_argument("--full-stall", action="store_true", help="let the stalled replica sleep all of --stall-s (the "
                   "recovery then comes that long after start-up, as a capture that really hangs that long)")
    p.add_argument("--capture-stall-s", type=float, default=4.0, help="routing.capture_stall_s of the application")
    p.add_argument("--lease-s", type=float, default=3.0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="a request without an answer by then is hung")
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    p.add_argument("--node-cpus", type=int, default=1)
    p.add_argument("--no-warm-up", action="store_true", help="no warm-up requests before a scenario's RSS baseline "
                   "(for a run that does not read the RSS columns)")
    p.add_argument("--records", action="store_true", help="keep per-request records in the report")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; allowed: {', '.join(SCENARIOS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    scratch = tempfile.mkdtemp(prefix="bcg-faults-")
    args.claim_dir = os.path.join(scratch, "armed")
    args.forward_dir = os.path.join(scratch, "forward")
    args.oom_dir = os.path.join(scratch, "oom")
    # every Ray process of the cluster inherits the failpoints; each stays disarmed until its folder exists
    args.stall_claim = os.path.join(args.claim_dir, "capture_stall")
    os.environ[CAPTURE_STALL_ENV] = f"{args.stall_s}:{args.stall_claim}"
    os.environ[FORWARD_ERROR_ENV] = os.path.join(args.forward_dir, "claim")
    os.environ[STEP_OOM_ENV] = os.path.join(args.oom_dir, "claim")
    t0 = time.perf_counter()
    try:
        with bench_ray(DIT_REPLICAS, args.node_cpus):
            report = asyncio.run(run(args))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report.update(wall_s=round(time.perf_counter() - t0, 1), commit=_commit(),
                  args={k: v for k, v in vars(args).items()
                        if k not in ("claim_dir", "stall_claim", "forward_dir", "oom_dir", "port")})
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    return report


if __name__ == "__main__":
    main()
