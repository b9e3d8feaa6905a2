"""The fault scenarios of ``benchmarks/faults.py`` (its docstring describes each): each waits for the application
to be ready, runs its load with its fault, and returns the counts of its records with what it judged.

Imported by ``faults.py``, which puts the repository and ``benchmarks/`` on ``sys.path`` first.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from faults_cluster import (
    DIT_REPLICAS,
    INGRESS_REPLICAS,
    SIZES,
    all_ready,
    coordinator_snapshot,
    dit_rss_mb,
    kill,
    replica_counters,
    serve_actors,
    wait_until,
)
from faults_load import counts, load, poll_buckets, requests_for

from bcg_core.failpoints import release_path

SCENARIOS = ("capture_stalled", "dit_killed", "coordinator_killed", "ingress_killed", "forward_error", "step_oom")


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


async def _ingress_back():
    got = serve_actors("Ingress")
    return got if len(got) == INGRESS_REPLICAS else None

