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

from bench_router import bench_ray  # noqa: E402
from soak import replica_rss_bytes  # noqa: E402

from bcg_core.failpoints import CAPTURE_STALL_ENV, FORWARD_ERROR_ENV, STEP_OOM_ENV, release_path  # noqa: E402
from deployments.cli.demo import apost_honouring_retry_after  # noqa: E402

SCENARIOS = ("capture_stalled", "dit_killed", "coordinator_killed", "ingress_killed", "forward_error", "step_oom")
APP = "bcg-faults"
SIZES = ((512, 512), (384, 384), (256, 256))
DIT_REPLICAS, INGRESS_REPLICAS = 3, 2


def app_config(args) -> dict:
    """The ServeConfig mapping of the application under test."""
    return {
        "model": {"device": "cpu"},
        "buckets": {"batch_sizes": [1, 2, 4], "resolutions": [f"{w}x{h}" for w, h in SIZES],
                    "text_lengths": [256], "miss_policy": "eager"},
        "routing": {"hot_share": 1.0, "lease_s": args.lease_s, "stats_period_s": 0.5, "fallback_wait_s": 1.0,
                    "join_window_s": 60.0, "capture_stall_s": args.capture_stall_s},
    }


def requests_for(count: int, steps: int, size: tuple[int, int] | None = None) -> list[dict]:
    """``count`` request bodies: the tiers' exact sizes in turn (or all ``size``), 1 or 2 images, fixed seeds."""
    out = []
    for i in range(count):
        w, h = size or SIZES[i % len(SIZES)]
        out.append({"prompt": f"a lighthouse at dusk, study {i}", "n": 1 + i % 2, "size": f"{w}x{h}",
                    "num_inference_steps": steps, "seed": 1000 + i})
    return out


# -- Ray plumbing -------------------------------------------------------------------------------------------


def serve_actors(kind: str) -> list[dict]:
    """Live Serve replica actors of deployment ``kind`` of the application: ``{"name", "id"}``."""
    import ray

    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"] if isinstance(a, dict) else a
        if f"#{kind}#" in name and APP in name:
            out.append({"name": name, "id": name.rsplit("#", 1)[-1]})
    return sorted(out, key=lambda a: a["name"])


def dit_rss_mb() -> float:
    """Resident memory (MB) summed over this machine's DiT replica processes of the application
    (:func:`soak.replica_rss_bytes`)."""
    return round(sum(replica_rss_bytes(APP).values()) / 2**20, 1)


def kill(name: str) -> None:
    import ray

    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


async def coordinator_snapshot(timeout_s: float = 5.0) -> dict:
    from ray import serve

    coord = serve.get_deployment_handle("BucketCoordinator", APP)
    try:
        return await asyncio.wait_for(coord.snapshot.remote(), timeout_s)
    except Exception:  # noqa: BLE001 - a coordinator being restarted
        return {}


async def wait_until(predicate, timeout_s: float, period_s: float = 0.5):
    """Await ``predicate()`` (a coroutine function) until it returns something true; returns it (None: timed out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await predicate()
        if got:
            return got
        await asyncio.sleep(period_s)
    return None


async def all_ready(timeout_s: float) -> dict:
    """Wait until the coordinator has every DiT replica with every owned shape ready and none stalled, and the
    replicas it lists are the live ones (a killed replica stays listed until its lease expires: with its
    replacement already alive the count alone would match too early)."""
    async def ok():
        snap = await coordinator_snapshot()
        reps = snap.get("replicas", {})
        live = {a["id"] for a in serve_actors("DiTReplica")}
        good = (snap.get("assigned") and len(reps) == DIT_REPLICAS and not snap.get("stalled")
                and all(set(r["owned"]) <= set(r["ready"]) for r in reps.values())
                and len(live) == DIT_REPLICAS and set(reps) <= live)
        return snap if good else None
    return await wait_until(ok, timeout_s) or await coordinator_snapshot()


# -- the client ---------------------------------------------------------------------------------------------


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


# -- scenarios ----------------------------------------------------------------------------------------------


async def capture_stalled(args, base: str) -> dict:
    snap = await wait_until(lambda: _stalled_and_covered(), args.start_timeout_s)
    if not snap:
        raise RuntimeError(f"no replica was taken out as stalled: {await coordinator_snapshot()}")
    stalled = snap["stalled"]
    before = dit_rss_mb()
    records = await load(base, requests_for(args.requests, args.steps), args.concurrency, args.timeout_s)
    during = await coordinator_snapshot()
    # the stall must outlast the load for the load to test it (--stall-s leaves room for that)
    still = sorted(set(stalled) & set(during.get("stalled", [])))
    if not args.full_stall:  # judged: end the stall now rather than sleep out the rest of --stall-s
        Path(release_path(args.stall_claim)).touch()
    t0 = time.monotonic()
    after = await all_ready(args.stall_s + args.start_timeout_s)
    events = [e for e in after.get("events", []) if e["replica"] in stalled]
    return {**counts(records), "rss_mb_before": before, "rss_mb_after": dit_rss_mb(),
            "stalled": stalled, "stalled_through_load": still == sorted(stalled),
            "owners_while_stalled": {r: v["owned"] for r, v in during.get("replicas", {}).items()},
            "recovered_after_s": round(time.monotonic() - t0, 1),
            "stalled_events": [e["event"] for e in events], "records": records}


async def _stalled_and_covered():
    """The snapshot once a replica is stalled out and the others have captured every shape; else None."""
    snap = await coordinator_snapshot()
    reps = snap.get("replicas", {})
    if not snap.get("stalled") or len(reps) != DIT_REPLICAS - 1:
        return None
    owned = set().union(*(set(r["owned"]) for r in reps.values())) if reps else set()
    if owned != set(snap.get("owners", {})) or not all(set(r["owned"]) <= set(r["ready"]) for r in reps.values()):
        return None
    return snap


async def warm_up(base: str, args) -> None:
    """One request of each size, 2 images, on every replica's shapes: allocations made before the RSS baseline.
    Its answers are not counted. ``--no-warm-up``: none (the RSS before a fault then misses what the load allocates
    first)."""
    if args.no_warm_up:
        return
    await load(base, [dict(b, n=2) for b in requests_for(len(SIZES) * 2, args.steps)], len(SIZES) * 2,
               args.timeout_s)


async def dit_killed(args, base: str) -> dict:
    await all_ready(args.start_timeout_s)
    await warm_up(base, args)
    before = dit_rss_mb()
    size = SIZES[0]
    killed: dict = {}

    async def watch():
        """Kill the replica whose last heartbeat shows >= 2 requests of one shape (bounded wait). Only a heartbeat
        sent after the load began counts (one from before could still list the warm-up's requests), and only one
        at most 0.6 s old (its requests still run)."""
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline and not killed:
            asked = time.monotonic()  # the snapshot is taken after this: a heartbeat seen_s_ago before it is later
            snap = await coordinator_snapshot()
            for rid, view in snap.get("replicas", {}).items():
                busy = {s: n for s, n in (view.get("queue") or {}).items() if n >= 2}
                seen = view.get("seen_s_ago", 1e9)
                if busy and seen <= 0.6 and asked - seen > load_began:
                    victim = next((a for a in serve_actors("DiTReplica") if a["id"] == rid), None)
                    if victim is not None:
                        kill(victim["name"])
                        killed.update(replica=rid, queue_at_kill=view["queue"], t=time.monotonic())
                        return
            await asyncio.sleep(0.2)

    load_began = time.monotonic()
    watcher = asyncio.ensure_future(watch())
    bodies = requests_for(args.requests, args.kill_steps, size)
    records = await load(base, bodies, args.concurrency, args.timeout_s)
    await watcher
    if not killed:
        raise RuntimeError("no replica ever held 2 requests of one shape: nothing was killed")
    after = await all_ready(args.start_timeout_s)
    return {**counts(records), "rss_mb_before": before, "rss_mb_after": dit_rss_mb(),
            "victim": killed["replica"], "victim_queue_at_kill": killed["queue_at_kill"],
            "victim_events": [e["event"] for e in after.get("events", []) if e["replica"] == killed["replica"]],
            "owners_after": after.get("owners", {}), "records": records}


async def coordinator_killed(args, base: str) -> dict:
    before_snap = await all_ready(args.start_timeout_s)
    held = {r: sorted(v["owned"]) for r, v in before_snap.get("replicas", {}).items()}
    await warm_up(base, args)
    before = dit_rss_mb()
    coord = serve_actors("BucketCoordinator")
    killed: dict = {}

    async def on_answer(n: int, in_flight: int) -> None:
        if n == args.fault_after and not killed:
            kill(coord[0]["name"])
            killed.update(name=coord[0]["name"], t=time.monotonic(), in_flight=in_flight)

    stop, polls = asyncio.Event(), []
    poller = asyncio.ensure_future(poll_buckets(base, stop, polls))
    records = await load(base, requests_for(args.requests, args.steps), args.concurrency, args.timeout_s, on_answer)
    t0 = time.monotonic()
    after_snap = await all_ready(args.start_timeout_s)
    stop.set()
    await poller
    now = {r: sorted(v["owned"]) for r, v in after_snap.get("replicas", {}).items()}
    new_coord = serve_actors("BucketCoordinator")
    return {**counts(records), "rss_mb_before": before, "rss_mb_after": dit_rss_mb(),
            "in_flight_at_kill": killed.get("in_flight"),
            "restarted": bool(new_coord) and new_coord[0]["name"] != killed.get("name"),
            "ownership_rebuilt_same": now == held, "rebuilt_after_s": round(time.monotonic() - t0, 1),
            "ownership_before": held, "ownership_after": now,
            "buckets_polls": {str(k): polls.count(k) for k in sorted(set(polls), key=str)}, "records": records}


async def ingress_killed(args, base: str) -> dict:
    await all_ready(args.start_timeout_s)
    await warm_up(base, args)
    before = dit_rss_mb()
    ingresses = serve_actors("Ingress")
    if len(ingresses) < 2:
        raise RuntimeError(f"need 2 ingress replicas, found {ingresses}")
    killed: dict = {}

    async def on_answer(n: int, in_flight: int) -> None:
        if n >= args.fault_after and in_flight >= INGRESS_REPLICAS * 2 and not killed:
            kill(ingresses[0]["name"])
            killed.update(name=ingresses[0]["name"], in_flight=in_flight)

    records = await load(base, requests_for(args.requests, args.steps), args.concurrency, args.timeout_s, on_answer)
    after = await wait_until(lambda: _ingress_back(), args.start_timeout_s)
    # the replacement serves too: a few more requests, all must be answered
    more = await load(base, requests_for(2 * INGRESS_REPLICAS, 1), 2 * INGRESS_REPLICAS, args.timeout_s)
    return {**counts(records + more), "rss_mb_before": before, "rss_mb_after": dit_rss_mb(),
            "killed": killed.get("name"), "in_flight_at_kill": killed.get("in_flight"),
            "ingress_replicas_after": len(after or []), "records": records + more}


async def forward_error(args, base: str) -> dict:
    await all_ready(args.start_timeout_s)
    await warm_up(base, args)
    before = dit_rss_mb()
    os.makedirs(args.forward_dir, exist_ok=True)  # arms it: one padded forward somewhere raises
    records = await load(base, requests_for(args.requests, args.steps), args.concurrency, args.timeout_s)
    faults = await replica_counters("bucket_faults")
    return {**counts(records), "rss_mb_before": before, "rss_mb_after": dit_rss_mb(), "bucket_faults": faults,
            "records": records}


async def step_oom(args, base: str) -> dict:
    await all_ready(args.start_timeout_s)
    before = dit_rss_mb()
    os.makedirs(args.oom_dir, exist_ok=True)  # arms it: one denoising step somewhere runs out of memory
    records = await load(base, requests_for(args.requests, args.steps), args.concurrency, args.timeout_s)
    ooms = await replica_counters("oom_steps")
    return {**counts(records), "rss_mb_before": before, "rss_mb_after": dit_rss_mb(), "oom_steps": ooms,
            "records": records}


async def replica_counters(name: str, timeout_s: float = 30.0) -> dict:
    """``{replica: stats[name]}`` of the replicas whose heartbeat shows a nonzero ``name`` (``bucket_faults``,
    ``oom_steps``), once one does (bounded wait): a heartbeat every ``stats_period_s``, later on a busy machine."""
    async def seen():
        snap = await coordinator_snapshot()
        found = {r: v.get("stats", {}).get(name) for r, v in snap.get("replicas", {}).items()}
        return {r: c for r, c in found.items() if c} or None
    return await wait_until(seen, timeout_s) or {}


async def _ingress_back():
    got = serve_actors("Ingress")
    return got if len(got) == INGRESS_REPLICAS else None


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
        result = await globals()[name](args, base)
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
