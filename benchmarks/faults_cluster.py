"""The application and the Ray plumbing of the fault scenarios (``benchmarks/faults.py``): the ServeConfig under
test, the live Serve replica actors, killing one, the coordinator's snapshot and the waits on it, the DiT replicas'
resident memory.

Imported by ``faults.py``, which puts the repository and ``benchmarks/`` on ``sys.path`` first.
"""

from __future__ import annotations

import asyncio
import time

from soak import replica_rss_bytes

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


async def replica_counters(name: str, timeout_s: float = 30.0) -> dict:
    """``{replica: stats[name]}`` of the replicas whose heartbeat shows a nonzero ``name`` (``bucket_faults``,
    ``oom_steps``), once one does (bounded wait): a heartbeat every ``stats_period_s``, later on a busy machine."""
    async def seen():
        snap = await coordinator_snapshot()
        found = {r: v.get("stats", {}).get(name) for r, v in snap.get("replicas", {}).items()}
        return {r: c for r, c in found.items() if c} or None
    return await wait_until(seen, timeout_s) or {}

