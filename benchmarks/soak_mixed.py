"""A bounded soak of one local bcg-serve application under a mixed load (loopback only), for docs/RELIABILITY.md.

``benchmarks/soak.py`` soaks generations only. This one sends the mix of issue 45 ("memory that settles"): for
``--duration-s`` seconds ``--concurrency`` clients each draw every request's kind (seeded) from :data:`MIX`:

- ``generate``: a plain generation of the next packaged krea request (its size and image count, at most
  ``--max-images``);
- ``stream``: the same, streamed as Server-Sent Events with ``partial_images`` 1 or 2 (previews);
- ``lora1`` / ``lora2``: a generation with one of the two adapters, or both, at a drawn scale. The adapters are
  made offline with peft at start-up, as ``tests/serve/test_lora_serve.py`` makes them (rank 4, on ``to_q``,
  ``to_k``, ``to_v`` of the tiny default), in a temporary ``lora.dir`` (``slots`` 2);
- ``img2img`` / ``inpaint``: ``POST /v1/images/edits`` with a noise PNG of the krea request's size (a fresh image
  every request: every upload differs) and, for inpainting, a mask whose left half is transparent; strength drawn
  from 0.5-1.0, at most 2 images;
- ``bad``: a request the server must refuse with a 4xx (:data:`BAD_KINDS`: a size off the 16-pixel grid, an
  unknown adapter, too many images, a body that is not JSON, an upload that is not an image, a mask of the wrong
  size), drawn in turn.

Steps are drawn from ``--steps``; ``--disconnect-share`` of good requests are abandoned after 0.2-2 s. The first
requests run one of each kind, so everything made on first use (previews' decoder, adapters' weights, the edit
encoder) exists before the warm-up's baseline.

Memory is sampled per process of the application: every process descended from this one (the Ray instance
``start_local`` starts: GCS, raylet, workers), grouped by name (:func:`process_groups`: ``DiTReplica``,
``Ingress``, ``BucketCoordinator``, ``ServeController``, ``ProxyActor``, ``raylet``, ``gcs_server``, idle
workers...). Another engineer's Ray instance on the same machine is not a descendant and is left out.

Reported (JSON, ``--out``):

- outcomes per kind (``ok``, ``4xx``, ``503``, ``5xx``, ``disconnected``, ``lost``, ``hung``; a bad request
  answered 4xx is expected, answered 200 it is counted ``accepted_bad``);
- **at rest** (taken as :func:`soak.memory_at_rest` takes it: the replica's step scheduler empty, its idle trim
  done, then the median of 5 samples) after warm-up and at the end, per group, and the change of the DiT replica
  and of the whole application: target within 5%;
- **under load**: a sample every ``--sample-s`` seconds per group; for the whole application and each group the
  medians per minute, the least-squares slope (MB per minute) after warm-up and over the last half of the run,
  and the change between the median of the first and the last ``--window-s`` after warm-up. Target: level after
  the first minutes, judged as the last half's slope times its length within 5% of its median.

Run (about ``--duration-s`` plus a minute of start-up)::

    python benchmarks/soak_mixed.py --duration-s 1800 --out docs/bench/<date>_soak_mixed_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from soak import memory_at_rest  # noqa: E402
from soak_mixed_memory import (  # noqa: E402, F401  _group, slope_mb_per_min: for tests/unit/test_soak_mixed_report.py
    _group,
    group_memory,
    process_groups,
    slope_mb_per_min,
    under_load_summary,
)
from soak_mixed_requests import (  # noqa: E402, F401  ADAPTERS, BAD_KINDS: for tests/unit/test_soak_mixed_report.py
    ADAPTERS,
    BAD_KINDS,
    MIX,
    build_request,
    make_adapters,
    send,
)

from deployments.cli.demo import load_requests  # noqa: E402


async def soak(url: str, args) -> dict:
    import httpx

    rng = random.Random(args.seed)
    rows = load_requests(args.requests)
    if args.max_images is not None:  # the rows' sizes kept, their image counts capped
        rows = [dataclasses.replace(r, n=min(r.n, args.max_images)) for r in rows]
    steps = [int(s) for s in args.steps.split(",")]
    kinds, weights = list(MIX), list(MIX.values())
    outcomes: dict[str, dict[str, int]] = {}
    details: list[dict] = []
    series: list[tuple[float, dict[str, int]]] = []
    at_rest: dict[str, dict] = {}
    go = asyncio.Event()
    go.set()
    in_flight = 0
    t0 = time.monotonic()
    deadline = t0 + args.duration_s
    counter = iter(range(10**9))
    bad_counter = iter(range(10**9))
    warm_end: dict[str, float] = {}

    async def client_loop() -> None:
        nonlocal in_flight
        async with httpx.AsyncClient(timeout=args.request_timeout_s, trust_env=False) as client:
            while time.monotonic() < deadline:
                await go.wait()
                i = next(counter)
                kind = kinds[i] if i < len(kinds) else rng.choices(kinds, weights)[0]  # one of each first
                row = rows[i % len(rows)]
                req = build_request(kind, row, steps[-1] if i < len(kinds) else rng.choice(steps), rng,
                                    next(bad_counter) if kind == "bad" else 0)
                gone = (rng.uniform(0.2, 2.0) if kind != "bad" and i >= len(kinds)
                        and rng.random() < args.disconnect_share else None)
                in_flight += 1
                try:
                    out = await send(client, url, req, args.request_timeout_s, gone, details)
                finally:
                    in_flight -= 1
                if kind == "bad" and out == "ok":
                    out = "accepted_bad"
                per = outcomes.setdefault(kind, {})
                per[out] = per.get(out, 0) + 1

    async def scheduler_state(client) -> dict | None:
        try:
            r = await client.get(f"{url}/v1/buckets")
        except httpx.HTTPError:
            return None
        sched = r.json().get("scheduler") if r.status_code == 200 else None
        return sched if isinstance(sched, dict) and sched.get("kind") == "step" else None

    async def rest(name: str) -> None:
        samples: list[dict[str, int]] = []

        def dit() -> int:
            groups = process_groups()
            samples.append(groups)
            return groups.get("DiTReplica", 0)

        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            rss, note = await memory_at_rest(lambda: scheduler_state(client), lambda: in_flight > 0, dit,
                                             args.quiet_s, args.request_timeout_s)
        last = samples[-5:]
        groups = {g: int(statistics.median([s.get(g, 0) for s in last])) for g in sorted({g for s in last for g in s})}
        for g in ("DiTReplica", "Ingress", "ProxyActor"):
            parts = await asyncio.to_thread(group_memory, g)
            note[f"{g}_memory_mb"] = {k: round(v / 2**20, 1) for k, v in parts.items()}
        at_rest[name] = {"dit_bytes": rss, "total_bytes": sum(groups.values()),
                         "groups_mb": {g: round(v / 2**20, 1) for g, v in groups.items()}, "rest": note,
                         "t_s": round(time.monotonic() - t0, 1)}

    async def pause_after_warmup() -> None:
        await asyncio.sleep(args.warmup_share * args.duration_s)
        go.clear()
        try:
            await rest("after_warmup")
        finally:
            warm_end["t"] = time.monotonic() - t0
            go.set()

    async def sampler() -> None:
        while time.monotonic() < deadline:
            began = time.monotonic()
            if go.is_set():  # under load only: not while the clients pause for the baseline
                series.append((began - t0, await asyncio.to_thread(process_groups)))
            await asyncio.sleep(max(0.0, args.sample_s - (time.monotonic() - began)))

    await asyncio.gather(sampler(), pause_after_warmup(), *(client_loop() for _ in range(args.concurrency)))
    # under load ends with the last sample (at the deadline), not when the last request in flight was answered
    end_s = series[-1][0] if series else time.monotonic() - t0
    await rest("end")
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        stats = (await client.get(f"{url}/v1/buckets")).json()
    start = warm_end.get("t", args.warmup_share * args.duration_s)
    load = under_load_summary(series, start, end_s, args.window_s)
    a, b = at_rest.get("after_warmup", {}), at_rest.get("end", {})

    def change(key: str):
        return round((b[key] - a[key]) / a[key], 4) if a.get(key) and b.get(key) else None

    sched = stats.get("scheduler") or {}
    shapes = sched.get("shapes") or {}
    step = max(1, len(series) // 120)
    return {
        "duration_s": args.duration_s, "mix": MIX,
        "sent": sum(sum(v.values()) for v in outcomes.values()), "outcomes": outcomes, "failures": details[:20],
        "at_rest": {**at_rest, "change_dit": change("dit_bytes"), "change_total": change("total_bytes"),
                    "change_groups": {g: round((b["groups_mb"][g] - v) / v, 4)
                                     for g, v in a.get("groups_mb", {}).items() if v and g in b.get("groups_mb", {})}},
        "under_load": {"warmup_end_s": round(start, 1), "end_s": round(end_s, 1), "samples": len(series),
                       "summary": load,
                       "series_mb": [(round(t, 1), {g: round(v / 2**20, 1) for g, v in s.items()})
                                     for t, s in series[::step]]},
        "replica": {"totals": stats.get("totals"), "lora": stats.get("lora"),
                    "cancelled": sum(s.get("cancelled", 0) + s.get("cancelled_waiting", 0) for s in shapes.values()),
                    "failed": sum(s.get("failed", 0) for s in shapes.values()),
                    "memory_trim": sched.get("memory_trim")},
    }


def main(argv: list[str] | None = None) -> int:
    """Run the mixed soak; exit 0 when it met its targets (none lost, hung or 5xx; every bad request refused;
    memory at rest within 5% for the DiT replica and the whole application; the last half under load level within
    5%)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--concurrency", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64, help="krea requests cycled through (sizes, image counts)")
    ap.add_argument("--max-images", type=int, default=None, help="cap on the images of one request (default: the "
                    "krea rows' counts, mostly 9): more, shorter requests in the same time")
    ap.add_argument("--steps", default="1,2,4", help="step counts drawn from (comma-separated)")
    ap.add_argument("--disconnect-share", type=float, default=0.05)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--warmup-share", type=float, default=0.2)
    ap.add_argument("--quiet-s", type=float, default=3.0)
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples under load")
    ap.add_argument("--window-s", type=float, default=120.0, help="first and last windows compared under load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON result")
    args = ap.parse_args(argv)
    if args.duration_s <= 0 or not 1 <= args.concurrency <= 16:
        ap.error("--duration-s must be positive and --concurrency from 1 to 16")
    if args.max_images is not None and args.max_images < 1:
        ap.error(f"--max-images must be at least 1; got {args.max_images}")

    from deployments.cli.local import start_local, stop_local
    from deployments.settings import ServeConfig

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "bcg_core", "deployments", "router"], cwd=ROOT,
                           capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="bcg-soak-") as tmp:
        loras = make_adapters(Path(tmp))
        config = ServeConfig.model_validate({"lora": {"dir": str(loras), "slots": 2, "max_rank": 8,
                                                      "max_per_request": 2}})
        url = start_local(config, port=0, quiet=True)
        try:
            result = asyncio.run(soak(url, args))
        finally:
            stop_local()
    result.update(date=time.strftime("%Y-%m-%d"), commit=commit.stdout.strip(),  # the code the run started with
                  uncommitted=dirty.stdout.split("\n")[:20] if dirty.stdout.strip() else [], args=vars(args))
    bad = sum(v.get(k, 0) for v in result["outcomes"].values() for k in ("lost", "hung", "5xx", "accepted_bad"))
    good_4xx = sum(v.get("4xx", 0) for k, v in result["outcomes"].items() if k != "bad")
    rest = result["at_rest"]
    growth = result["under_load"]["summary"].get("total", {}).get("last_half_growth")
    result["targets_met"] = {
        "none_lost_hung_5xx_or_bad_accepted": bad == 0, "no_good_request_refused": good_4xx == 0,
        "dit_at_rest_within_5pct": rest["change_dit"] is not None and abs(rest["change_dit"]) <= 0.05,
        "total_at_rest_within_5pct": rest["change_total"] is not None and abs(rest["change_total"]) <= 0.05,
        "under_load_level_5pct": growth is not None and abs(growth) <= 0.05}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
