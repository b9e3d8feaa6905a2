"""Replay real arrivals against an autoscaling application and record the DiT replica count over time.

Arrivals: the rows of a GenTD26 trace from ``--start`` to ``--end`` (default: 00:34 to 00:44 of
``bcg_core/data/alibaba_gentd26_burst_2024-12-06.csv``: 4 quiet minutes, the 3.5-minute burst of 00:38 to
00:41:30 at about 20x the quiet rate, 2.5 quiet minutes; ``--trace`` reads another file, e.g. the full trace), each sent
at its own timestamp divided by ``--compress``, with its own number of images (``num_images_per_prompt``, capped by
``--max-images``). The trace has no sizes or prompts: each request takes the prompt and size of a krea row
(``bcg_core/data/krea_open_prompts_1k_flat.csv``) drawn with a seeded generator, each side scaled by ``--size-scale``
and rounded to the model's 16 pixels (the default 0.5 keeps the krea mix's shape, 512x768 -> 256x384, so that the tiny
model on a CPU keeps up). ``--every K`` keeps every K-th arrival. Requests are sent open-loop (at their time, whatever
is in flight) over HTTP; a 503 with ``Retry-After`` is resent after it up to ``--retries`` times
(:func:`deployments.cli.demo.apost_honouring_retry_after`: the wait clamped to 0.05..30 s, no resend later than 600 s
after the first send; a 503 without the header is final). Sending stops at ``--deadline-s``.

The application autoscales by bucket load (``autoscaling.enabled``, :class:`router.autoscaling.BucketLoadPolicy`)
from ``--min-replicas`` to ``--max-replicas``. Every ``--sample-s`` the script records the DiT deployment's
replica states (``serve.status()``: running, starting, stopping), the arrivals of the last second and the
requests in flight; after the replay it keeps recording until the replica count is back at the minimum
(or ``--settle-s`` passed).

Cluster: ``--fake-gpu-nodes N`` (default: ``--max-replicas``) starts a ``ray.cluster_utils.Cluster`` with N
worker nodes that each declare one GPU (replicas ask for ``num_gpus=1`` and run the tiny model on the CPU).
``--fake-gpu-nodes 0 --device cuda`` runs on this machine's real GPUs instead (CUDA graphs captured at start
and after ownership changes).

Report (``--json``): the replay totals (requests, ok, statuses, lost: requests without an answer, retried:
requests resent, retries: resends in all, retry_wait_s: seconds waited for Retry-After in all; each record
has ``tries``, ``retries`` and ``retry_wait_s``),
``timeline`` (samples), ``scale_events`` (each change of the running count), the peak and final replica
counts, the coordinator's ownership at the peak and at the end, and ``policy_log``: the policy's own log
lines from the Serve controller's log (each change of what it wants or decides, with the per-shape loads).
``--plot PNG`` draws the timeline (matplotlib).

Usage::

    python benchmarks/autoscale_replay.py --json out/autoscale.json --plot docs/autoscaling_timeline.png
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import json
import random
import sys
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_router import bench_ray, run_and_wait  # beside this script

from deployments.cli.demo import apost_honouring_retry_after

TRACE = "alibaba_gentd26_burst_2024-12-06.csv"
TABLE = {"batch_sizes": [1, 2, 4], "resolutions": ["256x256", "256x384", "384x384", "512x512"],
         "text_lengths": [256], "image_padding": "masked", "miss_policy": "eager"}


def trace_arrivals(path: str | None = None, start: str | None = None, end: str | None = None) -> list[dict]:
    """Trace rows as ``{"t": seconds since the first kept row, "n": images, "steps": denoising steps}``, in
    time order.

    Args:
        path: a GenTD26 CSV (``gmt_create``, ``num_images_per_prompt``); the packaged burst slice when None.
        start, end: keep rows with ``start <= gmt_create < end`` (ISO strings); all when None.
    """
    if path is None:
        text = resources.files("bcg_core").joinpath("data", TRACE).read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    rows = [r for r in csv.DictReader(text.splitlines())
            if (start is None or r["gmt_create"] >= start) and (end is None or r["gmt_create"] < end)]
    if not rows:
        raise ValueError(f"no trace rows in [{start}, {end}) of {path or TRACE}")
    times = [dt.datetime.fromisoformat(r["gmt_create"]) for r in rows]
    t0 = min(times)
    out = [{"t": (t - t0).total_seconds(), "n": int(float(r["num_images_per_prompt"] or 1)),
            "steps": int(float(r["num_inference_steps"] or 30))} for t, r in zip(times, rows, strict=True)]
    return sorted(out, key=lambda a: a["t"])


def build_requests(arrivals: list[dict], compress: float, every: int, max_images: int, size_scale: float,
                   steps: int, seed: int) -> list[dict]:
    """One request per kept arrival: ``{"at": send time (s), "body": the HTTP body}`` (see the module docstring)."""
    from router.ownership import krea_rows

    krea = [r for r in krea_rows() if r["width"] and r["height"]]
    rng = random.Random(seed)
    out = []
    for i, a in enumerate(arrivals[::every]):
        row = rng.choice(krea)
        w = max(256, round(float(row["width"]) * size_scale / 16) * 16)
        h = max(256, round(float(row["height"]) * size_scale / 16) * 16)
        body = {"prompt": (row["prompt"].strip() or "an image")[:300], "n": max(1, min(a["n"], max_images)),
                "size": f"{w}x{h}", "num_inference_steps": steps or a["steps"], "seed": seed + i}
        out.append({"at": a["t"] / compress, "body": body})
    return out


def dit_states(app: str) -> dict[str, int]:
    """Replica states of the application's DiT deployment (``{"RUNNING": n, ...}``), from ``serve.status()``."""
    from ray import serve

    st = serve.status().applications.get(app)
    if st is None or "DiTReplica" not in st.deployments:
        return {}
    return {str(getattr(k, "value", k)): int(v) for k, v in st.deployments["DiTReplica"].replica_states.items()}


async def replay(requests: list[dict], base_url: str, retries: int, timeout_s: float, deadline_s: float,
                 stats: dict) -> list[dict]:
    """Send every request at its time (open loop); resend a 503 with Retry-After after it, at most ``retries``
    times. One record per request."""
    import httpx

    t0 = time.perf_counter()

    async def one(i: int, req: dict, client) -> dict:
        delay = req["at"] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        rec: dict = {"i": i, "at": round(req["at"], 3), "size": req["body"]["size"], "n": req["body"]["n"],
                     "tries": 0, "retries": 0, "retry_wait_s": 0.0}
        if time.perf_counter() - t0 > deadline_s:
            rec["status"] = "not sent"
            return rec
        stats["arrivals"].append(time.perf_counter() - t0)
        stats["inflight"] += 1
        try:
            r, resent, waited = await apost_honouring_retry_after(
                client, f"{base_url}/v1/images/generations", req["body"], timeout=timeout_s,
                max_retries=retries)
            rec.update(status=r.status_code, tries=1 + resent, retries=resent, retry_wait_s=round(waited, 3))
            data = r.json()
            if r.status_code == 200:
                b = data["bcg"]
                rec.update(bucket=b["bucket"], replica=b["replica"], owner=b["owner"], images=len(data["data"]))
            else:
                rec["error"] = data.get("error", {}).get("message", "")[:200]
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded
            resent = getattr(exc, "retries", 0)
            rec.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:200]}", tries=1 + resent,
                       retries=resent, retry_wait_s=round(getattr(exc, "retry_wait_s", 0.0), 3))
        finally:
            stats["inflight"] -= 1
        rec["latency_s"] = round(time.perf_counter() - t0 - req["at"], 3)
        return rec

    async with httpx.AsyncClient(trust_env=False) as client:
        return list(await asyncio.gather(*(one(i, r, client) for i, r in enumerate(requests))))


async def sample(app: str, stats: dict, period_s: float, stop: asyncio.Event, t0: float) -> None:
    """Append a timeline point every ``period_s`` until ``stop`` is set."""
    while not stop.is_set():
        states = await asyncio.to_thread(dit_states, app)
        now = time.perf_counter() - t0
        recent = sum(1 for a in stats["arrivals"] if now - 1.0 < a + stats["offset"] <= now)
        stats["timeline"].append({"t": round(now, 2), "running": states.get("RUNNING", 0),
                                  "starting": states.get("STARTING", 0) + states.get("PENDING_MIGRATION", 0),
                                  "stopping": states.get("STOPPING", 0), "arrivals_last_s": recent,
                                  "inflight": stats["inflight"]})
        try:
            await asyncio.wait_for(stop.wait(), timeout=period_s)
        except asyncio.TimeoutError:
            pass


def scale_events(timeline: list[dict]) -> list[dict]:
    """Each change of the running replica count: ``{"t", "from", "to"}``."""
    out, last = [], None
    for p in timeline:
        if last is not None and p["running"] != last:
            out.append({"t": p["t"], "from": last, "to": p["running"]})
        last = p["running"]
    return out


def policy_log(session_dir: str) -> list[str]:
    """The policy's lines (``BucketLoadPolicy: ...``) from the Serve controller's log of the cluster's session."""
    from router.autoscaling import LOG_PREFIX

    lines: list[str] = []
    for f in sorted(Path(session_dir, "logs", "serve").glob("controller_*.log")):
        lines += [ln.strip() for ln in f.read_text(errors="replace").splitlines() if LOG_PREFIX in ln]
    return lines


def plot(report: dict, path: str) -> None:
    """Draw the arrivals and the replica count over time into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = report["timeline"]
    t = [p["t"] for p in tl]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), height_ratios=[1, 1.3])
    ax1.plot(t, [p["arrivals_last_s"] for p in tl], color="tab:gray", lw=1, label="arrivals in the last second")
    ax1.plot(t, [p["inflight"] for p in tl], color="tab:orange", lw=1, label="requests in flight")
    ax1.set_ylabel("requests")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.step(t, [p["running"] for p in tl], where="post", color="tab:blue", lw=2, label="running DiT replicas")
    ax2.step(t, [p["running"] + p["starting"] for p in tl], where="post", color="tab:blue", lw=1, ls="--",
             label="running + starting")
    a = report["args"]
    ax2.axvline(report["replay"]["send_span_s"], color="tab:gray", lw=0.8, ls=":", label="last arrival sent")
    ax2.set_ylim(0, a["max_replicas"] + 0.5)
    ax2.set_yticks(range(a["max_replicas"] + 1))
    ax2.set_ylabel("replicas")
    ax2.set_xlabel(f"seconds (trace time / {a['compress']:g})")
    ax2.legend(loc="upper right", fontsize=8)
    span = f"{a['start'] or 'start'} to {a['end'] or 'end'}"
    where = ("fake GPU nodes, CPU" if a.get("fake_gpu_nodes", None) != 0
             else f"{a.get('device')}, {a.get('dit_gpus')} GPU/replica")
    fig.suptitle(f"BucketLoadPolicy: {report['replay']['requests']} GenTD26 arrivals ({span}, every {a['every']}), "
                 f"krea sizes x{a['size_scale']:g}; {where}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run(args) -> dict:
    from ray import serve

    from deployments import build_app

    config = {
        "model": {"device": args.device, **({"dtype": args.dtype} if args.dtype else {}),
                  **({"path": args.model_path} if args.model_path else {})},
        "buckets": {**TABLE, "resolutions": args.resolutions.split(","),
                    "batch_sizes": [int(b) for b in args.batch_sizes.split(",")]},
        "limits": {"default_guidance_scale": args.guidance_scale},
        "routing": {"lease_s": 5.0, "join_window_s": 30.0},
        "autoscaling": {"enabled": True, "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                        "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s,
                        "look_back_period_s": args.look_back_s, "target_utilization": args.target_utilization},
    }
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    app = build_app({"config": config, "dit_num_gpus": args.dit_gpus, "dit_num_cpus": args.dit_cpus})
    start_s = await run_and_wait(app, args.app, args.start_timeout_s)
    await asyncio.sleep(2.5)  # routing stats arrive after the first poll
    coord = serve.get_deployment_handle("BucketCoordinator", args.app)
    requests = build_requests(trace_arrivals(args.trace, args.start, args.end), args.compress, args.every,
                              args.max_images, args.size_scale, args.steps, args.seed)
    stats: dict = {"arrivals": [], "inflight": 0, "timeline": [], "offset": 0.0}
    stop = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.get_running_loop().create_task(sample(args.app, stats, args.sample_s, stop, t0))
    peak_snapshot: dict = {}
    peak = 0

    async def watch_peak() -> None:
        nonlocal peak, peak_snapshot
        while not stop.is_set():
            running = stats["timeline"][-1]["running"] if stats["timeline"] else 0
            if running > peak:
                peak, peak_snapshot = running, await coord.snapshot.remote()
            await asyncio.sleep(1.0)

    watcher = asyncio.get_running_loop().create_task(watch_peak())
    records = await replay(requests, f"http://127.0.0.1:{args.port}", args.retries, args.timeout_s,
                           args.deadline_s, stats)
    replay_s = time.perf_counter() - t0
    settle_t0 = time.perf_counter()
    while time.perf_counter() - settle_t0 < args.settle_s:
        tl = stats["timeline"]
        if tl and tl[-1]["running"] == args.min_replicas and not tl[-1]["starting"] and not tl[-1]["stopping"] \
                and any(p["running"] > args.min_replicas for p in tl):
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(2 * args.sample_s)
    stop.set()
    await asyncio.gather(sampler, watcher)
    end_snapshot = await coord.snapshot.remote()
    ok = [r for r in records if r.get("status") == 200]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
    tl = stats["timeline"]

    def owners(snap: dict) -> dict:
        return {r: v["owned"] for r, v in snap.get("replicas", {}).items()}

    return {
        "args": vars(args), "config": config, "start_s": round(start_s, 2),
        "replay": {"requests": len(records), "ok": len(ok), "statuses": statuses,
                   "lost": sum(1 for r in records if r.get("status") in (None, "error")),
                   "retried": sum(1 for r in records if r.get("tries", 0) > 1),
                   "retries": sum(r.get("retries", 0) for r in records),
                   "retry_wait_s": round(sum(r.get("retry_wait_s", 0.0) for r in records), 2),
                   "images": sum(r.get("images", 0) for r in ok), "replay_s": round(replay_s, 2),
                   "send_span_s": round(requests[-1]["at"], 2) if requests else 0.0,
                   "latency_p50_s": sorted(r["latency_s"] for r in ok)[len(ok) // 2] if ok else None,
                   "per_replica": {k: sum(1 for r in ok if r["replica"] == k)
                                   for k in sorted({r["replica"] for r in ok})}},
        "peak_replicas": max((p["running"] for p in tl), default=0),
        "final_replicas": tl[-1]["running"] if tl else 0,
        "scale_events": scale_events(tl),
        "ownership_at_peak": owners(peak_snapshot), "ownership_end": owners(end_snapshot),
        "demand_at_peak": peak_snapshot.get("demand"), "coordinator_events": end_snapshot.get("events", []),
        "timeline": tl,
        **({"records": records} if args.records else {}),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="a GenTD26 CSV (default: the packaged 20-minute burst slice)")
    p.add_argument("--start", default="2024-12-06 00:34:00", help="keep rows from this gmt_create (ISO)")
    p.add_argument("--end", default="2024-12-06 00:44:00", help="keep rows before this gmt_create (ISO)")
    p.add_argument("--compress", type=float, default=6.0, help="trace seconds per replay second")
    p.add_argument("--every", type=int, default=2, help="keep every K-th arrival")
    p.add_argument("--max-images", type=int, default=4)
    p.add_argument("--size-scale", type=float, default=0.5, help="krea sizes scaled by this per side")
    p.add_argument("--steps", type=int, default=1, help="num_inference_steps of every request (0: the trace's own)")
    p.add_argument("--guidance-scale", type=float, default=1.0, help="limits.default_guidance_scale (1: no CFG)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--upscale-delay-s", type=float, default=2.0)
    p.add_argument("--downscale-delay-s", type=float, default=10.0)
    p.add_argument("--look-back-s", type=float, default=5.0)
    p.add_argument("--target-utilization", type=float, default=0.3)
    p.add_argument("--fake-gpu-nodes", type=int, default=None,
                   help="worker nodes that declare 1 GPU each (default: --max-replicas; 0: this machine's real GPUs)")
    p.add_argument("--device", default="cpu", help="model.device of the replicas (cuda with real GPUs)")
    p.add_argument("--dtype", default=None, help="model.dtype (bfloat16 on a GPU)")
    p.add_argument("--model-path", default=None, help="model.path: a checkpoint folder (default: the tiny model)")
    p.add_argument("--dit-gpus", type=float, default=1.0, help="GPUs per DiT replica (0.5: two share one GPU)")
    p.add_argument("--resolutions", default=",".join(TABLE["resolutions"]), help="bucket tiers, comma-separated")
    p.add_argument("--batch-sizes", default=",".join(map(str, TABLE["batch_sizes"])), help="batch buckets (rows)")
    p.add_argument("--node-cpus", type=int, default=1)
    p.add_argument("--dit-cpus", type=float, default=0.5)
    p.add_argument("--retries", type=int, default=3, help="resends of a request answered 503 with Retry-After")
    p.add_argument("--timeout-s", type=float, default=120.0, help="bound on each HTTP request")
    p.add_argument("--deadline-s", type=float, default=300.0, help="no request is sent after this")
    p.add_argument("--settle-s", type=float, default=90.0, help="most seconds to wait for the downscale")
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--app", default="bcg-autoscale")
    p.add_argument("--records", action="store_true", help="keep per-request records in the report")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG of the timeline")
    p.add_argument("--replot", default=None, metavar="REPORT_JSON",
                   help="only draw --plot from a report written earlier (e.g. on a GPU machine without matplotlib)")
    args = p.parse_args(argv)
    if args.replot:
        if not args.plot:
            p.error("--replot needs --plot")
        report = json.loads(Path(args.replot).read_text())
        plot(report, args.plot)
        return report
    if args.every < 1 or args.compress <= 0:
        p.error("--every must be >= 1 and --compress > 0")
    if not args.port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    nodes = args.fake_gpu_nodes if args.fake_gpu_nodes is not None else args.max_replicas

    import ray

    with bench_ray(nodes, args.node_cpus):
        report = asyncio.run(run(args))
        report["policy_log"] = policy_log(ray._private.worker._global_node.get_session_dir_path())
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(report, args.plot)
    summary = {k: v for k, v in report.items() if k not in ("timeline", "records", "args", "config")}
    print(json.dumps(summary, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
