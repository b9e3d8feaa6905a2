"""A bounded soak of one local bcg-serve application on this machine (loopback only), for docs/RELIABILITY.md.

For ``--duration-s`` seconds, ``--concurrency`` clients send the packaged krea requests in order (their own sizes
and image counts, cycling), each with a step count drawn from ``--steps`` (seeded), streamed with probability
``--stream-share`` (``partial_images`` 1-2) and abandoned mid-request with probability ``--disconnect-share``
(the client closes the connection after a random 0.2-2 s). The first request is streamed with 2 previews at the
most steps and the second abandoned after 1 s, whatever the draws: every kind of request (the preview thread
and its fitted decoder are made on first use) has run before the warm-up's memory baseline, however few
requests a slow machine gets through in warm-up. A poller reads ``GET /v1/buckets`` every second meanwhile (a
poll starts each second, however long the last one took). Every request is bounded by ``--request-timeout-s``.

Reported (JSON, ``--out``):

- requests sent, answered 200, 4xx, 503, other 5xx, disconnected by the client on purpose, **lost** (an error
  without an HTTP answer that the client did not cause) and **hung** (no answer within the request timeout);
- the DiT replica's resident memory (``/proc/<pid>/status`` VmRSS of the process Ray titles ``DiTReplica``):
  **at rest** after warm-up and at the end, the target's measure. At the end of warm-up (the first
  ``--warmup-share`` of the run) the clients pause; the memory at rest is taken once the replica itself is at
  rest, not after a fixed wait (:func:`memory_at_rest`): no request left in the client, none in the replica's
  step scheduler (``GET /v1/buckets``: waiting, starting, running and finishing all 0: an abandoned request runs
  until its next step), and the scheduler's idle trim (``bcg_core/scheduler/memtrim.py``, ``scheduler.trim_idle_s``)
  done since the replica went idle; then ``--quiet-s`` later the median of 5 samples 0.2 s apart, kept only if no
  request ran on the replica meanwhile (its step and request counters unchanged; else the wait starts over). That
  is the baseline, and the load resumes. After the run the same is taken again (``memory.rest``: whether rest was
  reached, the wait, the trims, restarts, and ``memory_mb``: the resident set split into private heap
  ``RssAnon``, mapped files and shared memory). On a busy machine a fixed wait could sample a replica still
  running an abandoned request, or before its trim: memory that is about to be given back. Under load the
  memory swings with the requests in flight (activations, decoded images of 9-image requests, previews), so the
  series sampled every poll and the medians of its first and last tenth after warm-up are reported too, but not
  judged;
- the bucket count and the runner's modes at the start and the end (the graph count on a GPU);
- the replica's counters at the end (``totals``, scheduler ``cancelled``, ``expired``, ``failed``).

Targets (issue: reliability): no lost or hung request, no 5xx, resident memory flat after warm-up within 5%, the
bucket (graph) count constant.

On a GPU (``--device cuda --model pixart-512`` or ``flux-dev-width``: random weights at published widths, bf16,
built as ``benchmarks/bench_saturation.py`` builds them, with its bucket table for the krea requests) the
replica's CUDA memory (``device_memory`` of ``GET /v1/buckets``: allocated and reserved bytes) is sampled at
each poll and at rest too, and judged by the same 5%.

``benchmarks/soak_mixed.py`` soaks a mixed load (previews, LoRA adapters, edits, bad requests) and reads the memory
of every process of the application.

Run (about ``--duration-s`` plus a minute of start-up)::

    python benchmarks/soak.py --duration-s 600 --out docs/bench/<date>_soak_cpu.json
    python benchmarks/soak.py --device cuda --model pixart-512 --scratch /dev/shm --duration-s 300 --out soak_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deployments.cli.demo import load_requests  # noqa: E402


def _replica_status(app: str):
    """``(pid, /proc/<pid>/status text)`` of every DiT replica process of application ``app`` on this machine."""
    mark = f"ray::ServeReplica:{app}:DiTReplica".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not (proc / "cmdline").read_bytes().startswith(mark):
                continue
            yield int(proc.name), (proc / "status").read_text()
        except OSError:
            continue


def replica_rss_bytes(app: str = "bcg") -> dict[int, int]:
    """VmRSS of every DiT replica process of application ``app`` on this machine, by pid: the processes Ray
    titles ``ray::ServeReplica:<app>:DiTReplica`` (Linux ``/proc``; Ray's state API needs the dashboard, which
    ``bcg serve`` does not start). Other applications' replicas (another test's, ``benchmarks/faults.py``'s) are
    left out. ``"bcg"``: the application of ``bcg serve``'s ``start_local``."""
    out = {}
    for pid, status in _replica_status(app):
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if kb is not None:
            out[pid] = kb * 1024
    return out


def replica_memory(app: str = "bcg") -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``RssShmem`` (bytes) summed over the processes of
    :func:`replica_rss_bytes`: private heap, mapped files and shared memory (Ray's object store)."""
    out = dict.fromkeys(("VmRSS", "RssAnon", "RssFile", "RssShmem"), 0)
    for _, status in _replica_status(app):
        for line in status.splitlines():
            key = line.split(":", 1)[0]
            if key in out:
                out[key] += int(line.split()[1]) * 1024
    return out


BUSY = ("waiting", "starting", "encoding", "encoded", "running", "finishing")
"""Step scheduler counts (``GET /v1/buckets`` ``scheduler``) of requests it still holds."""
ACTIVITY = ("admitted", "completed", "cancelled", "cancelled_waiting", "expired", "failed")
"""Per-shape scheduler counters that move when a request enters or leaves it."""


def _activity(state: dict) -> tuple:
    shapes = state.get("shapes") or {}
    return (state.get("iterations"), *(sum(v.get(k, 0) for v in shapes.values()) for k in ACTIVITY))


async def memory_at_rest(state, client_busy, rss, quiet_s: float, timeout_s: float,
                         poll_s: float = 0.25) -> tuple[int | None, dict]:
    """The replica's resident memory at rest and how the wait went (module docstring).

    At rest: ``client_busy()`` false, none of :data:`BUSY` in the replica's step scheduler (``await state()``:
    its ``GET /v1/buckets`` section, None without one), and its idle trim done since it went idle (its
    ``memory_trim.trims`` grew, or it has been idle a second longer than the trim's delay). Then, ``quiet_s``
    later, the median of 5 ``rss()`` samples 0.2 s apart; if a request ran on the replica meanwhile (it is busy
    again, or its step count or request counters moved: an abandoned request that started late), the wait starts
    over. Bounded by ``timeout_s``: ``settled`` says whether rest was reached.
    """
    t0 = time.monotonic()
    limit = t0 + timeout_s
    note: dict = {"settled": False, "restarts": 0}
    first = await state()
    trim = (first or {}).get("memory_trim") or None
    trims0 = trim["trims"] if trim else None
    samples: list[int] = []
    while True:
        settled_state, idle_since, idle_trims = None, None, None
        while time.monotonic() < limit:
            current = await state()
            now = time.monotonic()
            if current is None and first is not None:  # no answer this time: ask again
                await asyncio.sleep(poll_s)
                continue
            busy = client_busy() or (current is not None and any(current.get(k, 0) for k in BUSY))
            trim = (current or {}).get("memory_trim") or None
            if busy:
                idle_since = None
            elif idle_since is None:  # idle from now on: its trim comes trim_idle_s later
                idle_since, idle_trims = now, (trim or {}).get("trims")
            if idle_since is not None and (trim is None or trims0 is None  # no trim to wait for
                                           or trim["trims"] > idle_trims or now - idle_since >= trim["delay_s"] + 1.0):
                settled_state = current
                break
            await asyncio.sleep(poll_s)
        await asyncio.sleep(quiet_s)
        samples = []
        for _ in range(5):
            samples.append(await asyncio.to_thread(rss))
            await asyncio.sleep(0.2)
        after = await state() if settled_state is not None else None
        if settled_state is None or after is None or time.monotonic() >= limit:
            note["settled"] = settled_state is not None and first is not None and after is not None
            break
        if not client_busy() and not any(after.get(k, 0) for k in BUSY) \
                and _activity(after) == _activity(settled_state):
            note["settled"] = True
            break
        note["restarts"] += 1  # a request ran while the memory was sampled: wait for rest again
    if trims0 is not None and trim is not None:
        note["trims"] = trim["trims"] - trims0
    note["waited_s"] = round(time.monotonic() - t0, 2)
    return (int(statistics.median(samples)) if any(samples) else None), note


async def one(client, url: str, body: dict, stream: bool, disconnect_after: float | None, timeout_s: float,
              details: list) -> str:
    """Send one request; the outcome: ``ok``, ``4xx``, ``503``, ``5xx``, ``disconnected``, ``lost`` or ``hung``."""
    import httpx

    async def send() -> str:
        if stream:
            async with client.stream("POST", f"{url}/v1/images/generations", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _status(r.status_code)
                text = ""
                async for chunk in r.aiter_text():
                    text += chunk
                done = text.count("event: image_generation.completed")
                if done == body["n"] and "event: error" not in text:
                    return "ok"
                details.append({"body": body, "stream_tail": text[-300:], "completed": done})
                return "5xx"
        r = await client.post(f"{url}/v1/images/generations", json=body)
        if r.status_code == 200:
            return "ok" if len(r.json()["data"]) == body["n"] else "5xx"
        if r.status_code >= 500 and r.status_code != 503:
            details.append({"body": body, "status": r.status_code, "answer": r.text[:300]})
        return _status(r.status_code)

    try:
        if disconnect_after is not None:
            try:
                return await asyncio.wait_for(send(), disconnect_after)
            except asyncio.TimeoutError:
                return "disconnected"
        return await asyncio.wait_for(send(), timeout_s)
    except asyncio.TimeoutError:
        return "hung"
    except httpx.HTTPError:
        return "lost"


def _status(code: int) -> str:
    if code == 503:
        return "503"
    return "4xx" if 400 <= code < 500 else "5xx"


async def soak(url: str, args) -> dict:
    import httpx

    rng = random.Random(args.seed)
    rows = load_requests(args.requests)
    steps = [int(s) for s in args.steps.split(",")]
    outcomes: dict[str, int] = {}
    details: list[dict] = []
    memory: list[tuple[float, int]] = []
    device_memory: list[tuple[float, int, int]] = []  # (t, allocated, reserved) on CUDA
    at_rest: dict[str, int | None] = {}
    rest: dict[str, dict] = {}
    device_at_rest: dict[str, dict | None] = {}
    polls = {"ok": 0, "failed": 0}
    go = asyncio.Event()
    go.set()
    in_flight = 0
    first_stats: dict = {}
    t0 = time.monotonic()
    deadline = t0 + args.duration_s
    next_row = iter(range(10**9))

    async def client_loop() -> None:
        nonlocal in_flight
        async with httpx.AsyncClient(timeout=args.request_timeout_s, trust_env=False) as client:
            while time.monotonic() < deadline:
                await go.wait()
                i = next(next_row)
                d = rows[i % len(rows)]
                stream = rng.random() < args.stream_share
                body = {"prompt": d.prompt, "size": f"{d.width}x{d.height}", "n": d.n,
                        "num_inference_steps": rng.choice(steps), "seed": rng.randrange(2**31)}
                if stream:
                    body.update(stream=True, partial_images=rng.choice((1, 2)))
                gone = rng.uniform(0.2, 2.0) if rng.random() < args.disconnect_share else None
                if i == 0:  # every kind runs before the baseline (module docstring); the draws stay as they were
                    stream, gone = True, None
                    body.update(stream=True, partial_images=2, num_inference_steps=max(steps))
                elif i == 1:
                    gone = 1.0
                in_flight += 1
                try:
                    out = await one(client, url, body, stream, gone, args.request_timeout_s, details)
                finally:
                    in_flight -= 1
                outcomes[out] = outcomes.get(out, 0) + 1

    async def scheduler_state(client) -> dict | None:
        """The replica's step scheduler as ``GET /v1/buckets`` shows it; None without an answer or a step
        scheduler."""
        try:
            r = await client.get(f"{url}/v1/buckets")
        except httpx.HTTPError:
            return None
        sched = r.json().get("scheduler") if r.status_code == 200 else None
        return sched if isinstance(sched, dict) and sched.get("kind") == "step" else None

    async def rest_rss(name: str) -> int | None:
        """The replica's memory at rest (:func:`memory_at_rest`); how the wait went is kept in ``rest[name]``."""
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            rss, rest[name] = await memory_at_rest(lambda: scheduler_state(client), lambda: in_flight > 0,
                                                   lambda: sum(replica_rss_bytes().values()), args.quiet_s,
                                                   args.request_timeout_s)
        parts = await asyncio.to_thread(replica_memory)
        rest[name]["memory_mb"] = {k: round(v / 2**20, 1) for k, v in parts.items()}
        return rss

    async def rest_device() -> dict | None:
        """The replica's CUDA memory at rest (after :func:`rest_rss`), None on a CPU."""
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            r = await client.get(f"{url}/v1/buckets")
        return r.json().get("device_memory") if r.status_code == 200 else None

    async def pause_after_warmup() -> None:
        await asyncio.sleep(args.warmup_share * args.duration_s)
        go.clear()
        try:
            at_rest["after_warmup"] = await rest_rss("after_warmup")
            device_at_rest["after_warmup"] = await rest_device()
        finally:
            go.set()

    async def poller() -> None:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            while time.monotonic() < deadline:
                began = time.monotonic()
                try:
                    r = await client.get(f"{url}/v1/buckets")
                    polls["ok" if r.status_code == 200 else "failed"] += 1
                    if r.status_code == 200 and not first_stats:
                        first_stats.update(r.json())
                    dm = r.json().get("device_memory") if r.status_code == 200 else None
                    if dm:
                        device_memory.append((time.monotonic() - t0, dm["allocated_bytes"], dm["reserved_bytes"]))
                except httpx.HTTPError:
                    polls["failed"] += 1
                rss = await asyncio.to_thread(replica_rss_bytes)
                if rss:
                    memory.append((time.monotonic() - t0, sum(rss.values())))
                await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - began)))  # a poll each second

    await asyncio.gather(poller(), pause_after_warmup(), *(client_loop() for _ in range(args.concurrency)))
    at_rest["end"] = await rest_rss("end")
    device_at_rest["end"] = await rest_device()
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        end_stats = (await client.get(f"{url}/v1/buckets")).json()
    # under load, for reference: the medians of the first and last tenth of the series after warm-up
    warm = [m for t, m in memory if t >= args.warmup_share * args.duration_s]
    k = max(1, len(warm) // 10)
    after_warmup = statistics.median(warm[:k]) if warm else None
    at_end = statistics.median(warm[-k:]) if warm else None
    base, end = at_rest.get("after_warmup"), at_rest.get("end")
    change = (end - base) / base if base and end else None
    dev = None
    d0, d1 = device_at_rest.get("after_warmup"), device_at_rest.get("end")
    if d0 and d1:
        dev = {"at_rest_after_warmup": d0, "at_rest_end": d1,
               "change_at_rest_reserved": round((d1["reserved_bytes"] - d0["reserved_bytes"])
                                                / d0["reserved_bytes"], 4),
               "change_at_rest_allocated": round((d1["allocated_bytes"] - d0["allocated_bytes"])
                                                 / d0["allocated_bytes"], 4),
               "series": [(round(t, 1), a, r) for t, a, r in device_memory[:: max(1, len(device_memory) // 60)]]}

    def shape(stats: dict) -> dict:
        modes: dict[str, int] = {}
        for b in stats.get("buckets", []):
            modes[str(b.get("mode"))] = modes.get(str(b.get("mode")), 0) + 1
        return {"buckets": len(stats.get("buckets", [])), "modes": modes}

    sched = end_stats.get("scheduler") or {}
    shapes = sched.get("shapes") or {}
    return {
        "duration_s": args.duration_s, "sent": sum(outcomes.values()), "outcomes": outcomes, "failures": details[:20],
        "polls": polls,
        "memory": {"at_rest_after_warmup_bytes": base, "at_rest_end_bytes": end,
                   "change_at_rest": round(change, 4) if change is not None else None, "rest": rest,
                   "samples": len(memory), "under_load_first_tenth_median_bytes": after_warmup,
                   "under_load_last_tenth_median_bytes": at_end,
                   "series": [(round(t, 1), m) for t, m in memory[:: max(1, len(memory) // 60)]]},
        "device_memory": dev,
        "table_start": shape(first_stats), "table_end": shape(end_stats),
        "replica": {"totals": end_stats.get("totals"),
                    "cancelled": sum(s.get("cancelled", 0) + s.get("cancelled_waiting", 0) for s in shapes.values()),
                    "expired": sum(s.get("expired", 0) for s in shapes.values()),
                    "failed": sum(s.get("failed", 0) for s in shapes.values())},
    }


def model_config(args):
    """``(ServeConfig or None, built checkpoint folder or None)``: None for the tiny default; else the model
    built by ``benchmarks/bench_saturation.py`` (``build_model``) with its bucket table for the soak's requests
    (``base_config``)."""
    if args.model == "tiny":
        return None, None
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_saturation as bs

    from bcg_core.models import describe_model, load_tokenizer_counter
    from deployments.settings import ServeConfig

    model, folder, _ = bs.build_model(args.model, False, args.scratch, args.device)
    mc = ServeConfig.model_validate({"model": model}).model
    base = bs.base_config(model, describe_model(mc), load_tokenizer_counter(mc), load_requests(args.requests),
                          max(int(s) for s in args.steps.split(",")))
    return ServeConfig.model_validate(base), folder


def main(argv: list[str] | None = None) -> int:
    """Run the soak; exit 0 when it met its targets."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64, help="krea requests cycled through")
    ap.add_argument("--steps", default="1,2,4", help="step counts drawn from (comma-separated)")
    ap.add_argument("--stream-share", type=float, default=0.3)
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--warmup-share", type=float, default=0.2)
    ap.add_argument("--quiet-s", type=float, default=3.0, help="seconds without a request in flight before the "
                    "memory at rest is sampled (cancelled requests stop at their next step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny", choices=("tiny", "flux-dev-width", "pixart-512"),
                    help="tiny: the embedded default; flux-dev-width / pixart-512: published widths, random weights "
                    "(needs --device cuda)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scratch", default=None, help="folder for a built checkpoint (default: a temp dir)")
    ap.add_argument("--out", help="JSON result")
    args = ap.parse_args(argv)
    if args.duration_s <= 0 or not 1 <= args.concurrency <= 16:
        ap.error("--duration-s must be positive and --concurrency from 1 to 16")

    from deployments.cli.local import start_local, stop_local

    config, folder = model_config(args)
    try:
        url = start_local(config, port=0, quiet=True)
        try:
            result = asyncio.run(soak(url, args))
        finally:
            stop_local()
    finally:
        if folder is not None:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    result.update(date=time.strftime("%Y-%m-%d"), args=vars(args))
    o = result["outcomes"]
    bad = o.get("lost", 0) + o.get("hung", 0) + o.get("5xx", 0)
    change = result["memory"]["change_at_rest"]
    flat = change is not None and abs(change) <= 0.05
    dev = result["device_memory"]
    if dev is not None:
        flat = flat and abs(dev["change_at_rest_reserved"]) <= 0.05
    same = result["table_start"] == result["table_end"]
    result["targets_met"] = {"none_lost_hung_or_5xx": bad == 0, "memory_flat_5pct": flat, "table_constant": same}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if bad == 0 and flat and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
