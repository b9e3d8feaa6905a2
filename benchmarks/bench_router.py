"""Replay real request sizes through the whole application on a Ray cluster and measure the routing.

What it measures (one JSON report, ``--json``):

- ``replay``: requests built from ``bcg_core/data/krea_open_prompts_1k_flat.csv`` in file order (prompt,
  width, height, images per request; ``--steps`` denoising steps), sent ``--concurrency`` at a time over
  HTTP and through the ingress's Python handle (``--via``). Per request: status, serving replica, whether
  it owns the request's bucket shape, batch size, retries, latency. Totals: owner-hit rate (requests with a
  bucket that landed on an owner), images/s, latency p50/p99, requests per replica, errors, lost (no answer).
  Over HTTP a 503 with ``Retry-After`` is waited out and resent (``--http-retries`` at most,
  :func:`deployments.cli.demo.apost_honouring_retry_after`); those resends are counted apart from ``retries``
  (the server's own resends to another replica) as ``http_retries`` and ``http_retry_wait_s`` (per request
  and in total) and ``http_retried`` (requests resent), and a request that got its answer after them is ok.
- ``kill``: with ``--kill-after K``, one DiT replica is killed (``ray.kill``) after K answers; the report
  shows that every request still got an answer, the ownership before and after, and the owner-hit rate
  of the requests answered after the kill.
- ``overhead``: with ``--ping N``, N keyed no-op calls (``DiTReplica.ping``) through the DiT deployment's
  handle, timed; with ``--compare-routers`` the same application is also deployed with the other router
  (``routing.shape_aware`` flipped) and the calls alternate between the two, so the added routing latency
  of ShapeAwareRouter over Ray's default router (p50, p99 of the per-call difference) is measured under
  the same load.
- ``padding``: padded-token waste summed over the replicas (the step scheduler's forwards).

Cluster: ``--fake-gpu-nodes N`` starts a ``ray.cluster_utils.Cluster`` on this machine with N worker nodes
that each declare one GPU; the DiT replicas ask for ``num_gpus=1`` and run on the CPU. Without it, Ray
starts locally with the GPUs it finds (the H200 runs).

Usage::

    python benchmarks/bench_router.py --fake-gpu-nodes 3 --replicas 3 --requests 60 --steps 1 --json out.json
    python benchmarks/bench_router.py --replicas 2 --device cuda --model-path /tmp/ckpt --requests 200 --steps 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.cli.demo import RETRY_MAX_RETRIES, apost_honouring_retry_after

SMALL_TABLE = {"batch_sizes": [1, 2, 4, 8, 16, 20], "resolutions": ["512x512", "640x640", "768x768", "1024x1024"],
               "text_lengths": [256]}


def krea_requests(count: int, steps: int, max_images: int = 4, start: int = 0) -> list[dict]:
    """``count`` requests from evenly spaced krea rows (every ``len/count``-th; rows without a size skipped).

    Each is ``{"prompt", "n", "width", "height", "num_inference_steps", "seed"}``; ``n`` is the row's
    ``num_generations`` capped at ``max_images`` (the mix's 9-image grids would dominate a short replay).
    """
    from router.ownership import krea_rows

    out: list[dict] = []
    rows = krea_rows()[start:]
    # evenly spaced rows, so that a short replay keeps the size mix of the whole file
    stride = max(1, len(rows) // max(1, count))
    rows = rows[::stride] + [r for i, r in enumerate(rows) if i % stride]
    for i, row in enumerate(rows):
        try:
            w, h = int(float(row["width"])), int(float(row["height"]))
        except (TypeError, ValueError):
            continue
        n = int(float(row["num_generations"] or 1))
        prompt = row["prompt"].strip() or "an image"
        out.append({"prompt": prompt[:300], "n": max(1, min(n, max_images)), "width": w, "height": h,
                    "num_inference_steps": steps, "seed": start + i})
        if len(out) == count:
            break
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def dit_actor_names() -> list[str]:
    """Names of the live DiT replica actors (namespace ``serve``)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if "DiTReplica" in a["name"] and a.get("namespace") == "serve")


async def _one(i: int, req: dict, via: str, handle, base_url: str, client, timeout_s: float,
               http_retries: int = RETRY_MAX_RETRIES) -> dict:
    t0 = time.perf_counter()
    rec: dict = {"i": i, "via": via, "shape_wh": f"{req['width']}x{req['height']}", "n": req["n"]}
    try:
        if via == "http":
            body = {"prompt": req["prompt"], "n": req["n"], "size": f"{req['width']}x{req['height']}",
                    "num_inference_steps": req["num_inference_steps"], "seed": req["seed"]}
            rec.update(http_retries=0, http_retry_wait_s=0.0)
            try:
                r, resent, waited = await apost_honouring_retry_after(
                    client, f"{base_url}/v1/images/generations", body, timeout=timeout_s,
                    max_retries=http_retries)
            except Exception as exc:  # the resends made before a send failed, then recorded below
                rec.update(http_retries=getattr(exc, "retries", 0),
                           http_retry_wait_s=round(getattr(exc, "retry_wait_s", 0.0), 3))
                raise
            rec.update(status=r.status_code, http_retries=resent, http_retry_wait_s=round(waited, 3))
            data = r.json()
            if r.status_code == 200:
                b = data["bcg"]
                rec.update(bucket=b["bucket"], replica=b["replica"], owner=b["owner"], batch_size=b["batch_size"],
                           retries=b["retries"], images=len(data["data"]), server_ms=b["timings_ms"])
            else:
                rec["error"] = data.get("error", {}).get("message", "")[:200]
        else:
            res = await asyncio.wait_for(handle.images.remote(req), timeout=timeout_s)
            rec.update(status=200, bucket=None if res.bucket is None else str(res.bucket), replica=res.replica,
                       owner=res.owner, batch_size=res.batch_size, retries=res.retries, images=len(res.image_bytes),
                       server_ms=res.timings_ms)
    except Exception as exc:  # noqa: BLE001 - every outcome is recorded
        status = getattr(exc, "status", None)
        rec.update(status=status or 599, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    rec["t_end"] = time.perf_counter()
    rec["latency_s"] = rec["t_end"] - t0
    return rec


async def replay(requests: list[dict], concurrency: int, via: str, handle, base_url: str, timeout_s: float,
                 on_done=None, http_retries: int = RETRY_MAX_RETRIES) -> list[dict]:
    """Send ``requests`` with at most ``concurrency`` in flight; ``via`` is ``http``, ``handle`` or ``mixed``
    (alternating). ``on_done(count)`` is called after each answer. Over HTTP a 503 with ``Retry-After`` is
    resent up to ``http_retries`` times. Returns one record per request, in order."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    done = 0
    async with httpx.AsyncClient() as client:
        async def run(i: int, req: dict) -> dict:
            nonlocal done
            async with sem:
                how = via if via != "mixed" else ("http" if i % 2 == 0 else "handle")
                rec = await _one(i, req, how, handle, base_url, client, timeout_s, http_retries)
            done += 1
            if on_done is not None:
                on_done(done)
            return rec

        return list(await asyncio.gather(*(run(i, r) for i, r in enumerate(requests))))


def summarize(records: list[dict], wall_s: float) -> dict:
    """Totals of a replay (see the module docstring)."""
    ok = [r for r in records if r.get("status") == 200]
    keyed = [r for r in ok if r.get("owner") is not None]
    lat = [r["latency_s"] for r in ok]
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    errors: dict[str, int] = {}
    for r in records:
        if r.get("status") != 200:
            errors[str(r.get("status"))] = errors.get(str(r.get("status")), 0) + 1
    server: dict[str, dict[str, float]] = {}
    for r in ok:
        agg = server.setdefault(r["replica"], {"encode": 0.0, "denoise": 0.0, "decode": 0.0, "total": 0.0, "images": 0})
        for k in ("encode", "denoise", "decode", "total"):
            agg[k] += r.get("server_ms", {}).get(k, 0.0) / 1e3 / max(1, r.get("batch_size", 1))
        agg["images"] += r.get("images", 0)
    return {
        "server_s_per_replica": {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in sorted(server.items())},
        "requests": len(records), "ok": len(ok), "errors": errors,
        "lost": sum(1 for r in records if "status" not in r),
        "owner_hits": sum(1 for r in keyed if r["owner"]), "keyed": len(keyed),
        "owner_hit_rate": round(sum(1 for r in keyed if r["owner"]) / len(keyed), 4) if keyed else None,
        "misses": len(ok) - len(keyed),
        "images": sum(r.get("images", 0) for r in ok),
        "images_per_s": round(sum(r.get("images", 0) for r in ok) / wall_s, 3) if wall_s > 0 else None,
        "wall_s": round(wall_s, 2),
        "latency_p50_s": round(percentile(lat, 0.5), 3), "latency_p99_s": round(percentile(lat, 0.99), 3),
        "per_replica": dict(sorted(per_replica.items())),
        "retried": sum(1 for r in ok if r.get("retries")),
        "http_retries": sum(r.get("http_retries", 0) for r in records),
        "http_retried": sum(1 for r in records if r.get("http_retries")),
        "http_retry_wait_s": round(sum(r.get("http_retry_wait_s", 0.0) for r in records), 2),
        "mean_batch_size": round(statistics.mean(r.get("batch_size", 1) for r in ok), 3) if ok else None,
    }


async def ping_overhead(handles: dict, shapes: list[str], count: int) -> dict:
    """Time ``count`` rounds of keyed ``DiTReplica.ping`` calls, one per handle in each round (so routers
    compared are measured under the same machine load), shapes cycled; p50/p99/mean milliseconds per handle
    after 20 warm-up rounds, and the p50/p99 of the per-round difference to the first handle."""
    times: dict[str, list[float]] = {name: [] for name in handles}
    for i in range(count):
        key = shapes[i % len(shapes)] if shapes else ""
        for name, handle in handles.items():
            h = handle.options(multiplexed_model_id=key)
            t0 = time.perf_counter()
            await h.ping.remote()
            times[name].append((time.perf_counter() - t0) * 1e3)
    skip = min(20, count // 5)
    out: dict = {"calls_per_router": count}
    names = list(handles)
    for name in names:
        warm = times[name][skip:]
        out[name] = {"p50_ms": round(percentile(warm, 0.5), 3), "p99_ms": round(percentile(warm, 0.99), 3),
                     "mean_ms": round(statistics.mean(warm), 3)}
    for name in names[1:]:
        diff = [a - b for a, b in zip(times[names[0]][skip:], times[name][skip:], strict=True)]
        out[f"{names[0]}_minus_{name}"] = {"p50_ms": round(percentile(diff, 0.5), 3),
                                           "p99_ms": round(percentile(diff, 0.99), 3)}
    return out


@contextlib.contextmanager
def bench_ray(fake_gpu_nodes: int, node_cpus: int):
    """Ray for one benchmark run, shut down (Serve, Ray, the cluster) on exit.

    ``fake_gpu_nodes`` > 0: a ``ray.cluster_utils.Cluster`` on this machine, a head with 2 CPUs and no GPU plus
    that many worker nodes of ``node_cpus`` CPUs that each declare one GPU. 0: a new local instance with the
    GPUs this machine has.
    """
    import ray
    from ray import serve

    cluster = None
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    if fake_gpu_nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0,
                                                                "include_dashboard": False})
        for _ in range(fake_gpu_nodes):
            cluster.add_node(num_cpus=node_cpus, num_gpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
    else:
        ray.init(address="local", include_dashboard=False)
    try:
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()


async def run_and_wait(app, name: str, timeout_s: float, route_prefix: str = "/") -> float:
    """Deploy ``app`` as ``name`` (``serve.run``, not blocking) and wait until it is RUNNING; returns seconds.

    Raises:
        RuntimeError: the application failed to deploy (its status message).
        TimeoutError: not running after ``timeout_s``.
    """
    from ray import serve

    t0 = time.perf_counter()
    serve.run(app, name=name, route_prefix=route_prefix, blocking=False)
    while True:
        st = serve.status().applications.get(name)
        if st is not None and st.status == "RUNNING":
            return time.perf_counter() - t0
        if st is not None and st.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"application failed: {st.message}")
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"application not running after {timeout_s} s: {st}")
        await asyncio.sleep(0.5)


async def wait_ready(app_name: str, replicas: int, timeout_s: float) -> dict:
    """Wait until the coordinator has an assignment over ``replicas`` replicas that all report every owned
    shape ready (or ``timeout_s``); returns the last ownership snapshot (``{}`` without a coordinator)."""
    from ray import serve

    try:
        coord = serve.get_deployment_handle("BucketCoordinator", app_name)
    except Exception:  # noqa: BLE001 - default-router apps have no coordinator
        return {}
    deadline = time.monotonic() + timeout_s
    snap: dict = {}
    while time.monotonic() < deadline:
        snap = await coord.snapshot.remote()
        reps = snap.get("replicas", {})
        if snap.get("assigned") and len(reps) >= replicas and all(
                set(r["owned"]) <= set(r["ready"]) for r in reps.values()):
            return snap
        await asyncio.sleep(0.5)
    return snap


def padding_totals(stats_list: list[dict]) -> dict:
    """Real vs padded tokens summed over replica stats (``DiTReplica.stats``), and the waste in percent."""
    real = padded = 0
    for s in stats_list:
        for b in s.get("buckets", []):
            real += b["real_tokens"]
            padded += b["padded_tokens"]
    return {"real_tokens": real, "padded_tokens": padded,
            "padding_waste_pct": round(100 * (1 - real / padded), 2) if padded else 0.0}


def build(args) -> tuple[object, dict]:
    """The application and its ServeConfig mapping from the command line."""
    from deployments import build_app

    config: dict = {
        "model": {"device": args.device, **({"path": args.model_path} if args.model_path else {}),
                  **({"dtype": args.dtype} if args.dtype else {})},
        "buckets": dict(SMALL_TABLE, miss_policy="eager"),
        "routing": {"shape_aware": args.router == "shape", "hot_share": args.hot_share,
                    "lease_s": args.lease_s, "fallback_wait_s": args.fallback_wait_s,
                    "join_window_s": args.start_timeout_s},
    }
    app = build_app({"config": config, "dit_replicas": args.replicas, "dit_num_gpus": args.dit_gpus,
                     "dit_num_cpus": args.dit_cpus, "ingress_replicas": args.ingress_replicas})
    return app, config


async def run(args) -> dict:
    import ray
    from ray import serve

    app, config = build(args)
    port = args.port
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t0 = time.perf_counter()
    await run_and_wait(app, args.app, args.start_timeout_s)
    snap = await wait_ready(args.app, args.replicas, args.start_timeout_s)
    report: dict = {"args": vars(args), "config": config, "start_s": round(time.perf_counter() - t0, 2),
                    "ownership_start": {r: v["owned"] for r, v in snap.get("replicas", {}).items()}}
    handle = serve.get_app_handle(args.app)
    dit = serve.get_deployment_handle("DiTReplica", args.app)
    base_url = f"http://127.0.0.1:{port}"
    # routing stats arrive only after the first poll: give the router one period plus a margin
    await asyncio.sleep(2 * 1.0 + 0.5)

    if args.ping:
        shapes = sorted({s for v in snap.get("replicas", {}).values() for s in v["owned"]}) or ["i1024_t256"]
        handles = {args.router: dit}
        if args.compare_routers:
            other = "default" if args.router == "shape" else "shape"
            args_other = argparse.Namespace(**{**vars(args), "router": other})
            app_other, _ = build(args_other)
            serve.run(app_other, name=f"{args.app}-{other}", route_prefix=f"/{other}")
            await wait_ready(f"{args.app}-{other}", args.replicas, args.start_timeout_s)
            await asyncio.sleep(3.0)
            handles[other] = serve.get_deployment_handle("DiTReplica", f"{args.app}-{other}")
        report["overhead"] = await ping_overhead(handles, shapes, args.ping)

    if args.requests:
        reqs = krea_requests(args.requests, args.steps, args.max_images)
        killed: dict = {}

        def on_done(n: int) -> None:
            if args.kill_after and n == args.kill_after and not killed:
                names = dit_actor_names()
                victim = names[0]
                killed.update(name=victim, at=n, t=time.perf_counter())
                ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

        t1 = time.perf_counter()
        records = await replay(reqs, args.concurrency, args.via, handle, base_url, args.timeout_s, on_done,
                               args.http_retries)
        wall = time.perf_counter() - t1
        report["replay"] = summarize(records, wall)
        if killed:
            after = [r for r in records if r.get("status") == 200 and r["t_end"] > killed["t"]]
            keyed_after = [r for r in after if r.get("owner") is not None]
            keyed_before = [r for r in records if r.get("status") == 200 and r["t_end"] <= killed["t"]
                            and r.get("owner") is not None]
            snap_after = await wait_ready(args.app, args.replicas - 1, 30)
            report["kill"] = {
                "victim": killed["name"], "after_answers": killed["at"],
                "answered_after_kill": len(after),
                "owner_hit_rate_before": round(sum(1 for r in keyed_before if r["owner"]) / len(keyed_before), 4)
                if keyed_before else None,
                "keyed_before": len(keyed_before),
                "owner_hit_rate_after": round(sum(1 for r in keyed_after if r["owner"]) / len(keyed_after), 4)
                if keyed_after else None,
                "ownership_after": {r: v["owned"] for r, v in snap_after.get("replicas", {}).items()},
                "events": snap_after.get("events", []),
                "moves": snap_after.get("moves"),
            }
        if args.records:
            report["records"] = records
        stats = []
        for _ in range(4 * args.replicas):
            s = await dit.stats.remote()
            if all(s["replica"] != x["replica"] for x in stats):
                stats.append(s)
        report["padding"] = padding_totals(stats)
        report["replica_stats"] = {
            s["replica"]: {"routing": s["routing"], "scheduler": s.get("scheduler"), "totals": s["totals"],
                           "graphs": sorted(b["key"] for b in s["buckets"] if b.get("mode") == "graph"),
                           "prepared": sum(1 for b in s["buckets"] if b.get("mode")),
                           "pool_mib": round(sum(b.get("pool_bytes") or 0 for b in s["buckets"]) / 2**20, 1),
                           "capture_s": round(sum(b.get("capture_s") or 0 for b in s["buckets"]), 2)}
            for s in stats}
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fake-gpu-nodes", type=int, default=0, help="worker nodes of a local Cluster, 1 GPU each")
    p.add_argument("--node-cpus", type=int, default=2, help="logical CPUs per fake node")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--router", choices=["shape", "default"], default="shape")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--via", choices=["http", "handle", "mixed"], default="mixed")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--max-images", type=int, default=4)
    p.add_argument("--kill-after", type=int, default=0, help="kill one DiT replica after this many answers")
    p.add_argument("--ping", type=int, default=0, help="keyed no-op calls for the router overhead")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dit-cpus", type=float, default=1)
    p.add_argument("--ingress-replicas", type=int, default=1)
    p.add_argument("--dit-gpus", type=float, default=1, help="GPUs per DiT replica (0.5 fits two apps per GPU)")
    p.add_argument("--compare-routers", action="store_true",
                   help="with --ping: also deploy the app with the other router and ping both, interleaved")
    p.add_argument("--hot-share", type=float, default=0.10)
    p.add_argument("--lease-s", type=float, default=3.0)
    p.add_argument("--fallback-wait-s", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--http-retries", type=int, default=RETRY_MAX_RETRIES,
                   help="most resends of an HTTP request answered 503 with Retry-After")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--app", default="bcg-bench")
    p.add_argument("--records", action="store_true", help="keep per-request records in the report")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not args.port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]

    with bench_ray(args.fake_gpu_nodes, args.node_cpus):
        report = asyncio.run(run(args))
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text if not args.records else json.dumps({k: v for k, v in report.items() if k != "records"}, indent=1,
                                                     default=str))
    return report


if __name__ == "__main__":
    main()
