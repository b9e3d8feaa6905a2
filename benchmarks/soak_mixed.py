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
import io
import json
import os
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

from deployments.cli.demo import load_requests  # noqa: E402

MIX = {"generate": 0.25, "stream": 0.15, "lora1": 0.15, "lora2": 0.10, "img2img": 0.125, "inpaint": 0.125,
       "bad": 0.10}
"""Share of each request kind (sums to 1): the issue's mix, 10% bad requests."""

BAD_KINDS = ("size", "adapter", "n", "json", "not_image", "mask_size")
"""The bad requests, sent in turn: each must be answered 4xx (422, or 400 for a body that is not JSON)."""

ADAPTERS = ("style", "ink")


# ---------------------------------------------------------------------------------------------- memory by process


def _descendants(root: int) -> list[int]:
    """Pids of every process below ``root`` (``/proc/<pid>/stat``'s parent field), ``root`` excluded."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def _group(cmdline: bytes) -> str:
    """A process's group name: Ray's title without ``ray::``, the application and the method it runs now
    (``ray::ServeReplica:bcg:DiTReplica.generate`` -> ``DiTReplica``, ``ray::ProxyActor.receive_asgi_messages`` ->
    ``ProxyActor``), else the program's file name (``raylet``, ``gcs_server``) or a Python program's script
    (``dashboard.py``)."""
    args = cmdline.split(b"\0")
    first = args[0].decode(errors="replace")
    if first.startswith("ray::"):  # Ray appends the method running now: ``ray::ServeReplica:bcg:Ingress.handle_...``
        title = first[5:].split()[0] if first[5:].strip() else "worker"
        return title.rsplit(":", 1)[-1].split(".", 1)[0]
    name = os.path.basename(first)
    if name.startswith("python") and len(args) > 1:  # a Python helper (dashboard agent, log monitor): its script
        script = next((a.decode(errors="replace") for a in args[1:] if a.endswith(b".py")), "")
        return os.path.basename(script) or name
    return name


def process_groups(root: int | None = None) -> dict[str, int]:
    """Resident memory (VmRSS, bytes) of the processes below ``root`` (default: this one), summed per group
    (:func:`_group`). Linux ``/proc`` only; a process gone while being read is skipped."""
    out: dict[str, int] = {}
    for pid in _descendants(os.getpid() if root is None else root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if kb is not None and cmd:
            name = _group(cmd)
            out[name] = out.get(name, 0) + kb * 1024
    return out


def group_memory(group: str, root: int | None = None) -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``RssShmem`` (bytes) summed over the processes of ``group`` below
    ``root`` (:func:`process_groups`): private heap, mapped files and shared memory (Ray's object store)."""
    out = dict.fromkeys(("VmRSS", "RssAnon", "RssFile", "RssShmem"), 0)
    for pid in _descendants(os.getpid() if root is None else root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if cmd and _group(cmd) == group:
            for line in status.splitlines():
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] += int(line.split()[1]) * 1024
    return out


def slope_mb_per_min(series: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, bytes)`` samples in MB (2**20 bytes) per minute; None under 3 samples."""
    if len(series) < 3:
        return None
    ts, ys = [t for t, _ in series], [y for _, y in series]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return None if den == 0 else sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den * 60 / 2**20


def under_load_summary(series: list[tuple[float, dict[str, int]]], start_s: float, end_s: float,
                       window_s: float) -> dict:
    """The memory under load after ``start_s`` (end of warm-up) up to ``end_s``, per group and in total.

    Args:
        series: ``(seconds since the start, {group: bytes})`` samples.
        start_s, end_s: the span judged (seconds since the start).
        window_s: width of the first and last windows compared (seconds).

    Returns:
        ``{group: {"per_minute_median_mb", "slope_mb_per_min", "slope_last_half_mb_per_min", "first_window_mb",
        "last_window_mb", "change_first_to_last", "last_half_growth"}}`` with ``"total"`` for the sum;
        ``last_half_growth`` is the last half's slope times its length over its median (the target's measure).
    """
    span = [(t, s) for t, s in series if start_s <= t <= end_s]
    groups = sorted({g for _, s in span for g in s} | {"total"})
    mid = (start_s + end_s) / 2
    out = {}
    for g in groups:
        pts = [(t, float(sum(s.values()) if g == "total" else s.get(g, 0))) for t, s in span]
        if not pts:
            continue
        minutes: dict[int, list[float]] = {}
        for t, y in pts:
            minutes.setdefault(int(t // 60), []).append(y)
        first = [y for t, y in pts if t < start_s + window_s]
        last = [y for t, y in pts if t > end_s - window_s]
        half = [(t, y) for t, y in pts if t >= mid]
        f = statistics.median(first) if first else None
        la = statistics.median(last) if last else None
        sl_half = slope_mb_per_min(half)
        med_half = statistics.median([y for _, y in half]) if half else None
        out[g] = {
            "per_minute_median_mb": {m: round(statistics.median(v) / 2**20, 1) for m, v in sorted(minutes.items())},
            "slope_mb_per_min": _r(slope_mb_per_min(pts), 2),
            "slope_last_half_mb_per_min": _r(sl_half, 2),
            "first_window_mb": _r(f / 2**20 if f else None, 1), "last_window_mb": _r(la / 2**20 if la else None, 1),
            "change_first_to_last": _r((la - f) / f if f and la else None, 4),
            "last_half_growth": _r(sl_half * (end_s - mid) / 60 / (med_half / 2**20)
                                   if sl_half is not None and med_half else None, 4),
        }
    return out


def _r(x, nd):
    return None if x is None else round(x, nd)


# ---------------------------------------------------------------------------------------------- requests


def make_adapters(folder: Path) -> Path:
    """Two random rank-4 adapters (:data:`ADAPTERS`) of the tiny default, saved as diffusers saves LoRA weights
    (``<folder>/loras/<name>/pytorch_lora_weights.safetensors``), made with peft as
    ``tests/serve/test_lora_serve.py`` makes them; returns the ``loras`` folder."""
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from bcg_core.families.tiny import tiny_transformer_config

    loras = folder / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(ADAPTERS):
        transformer = FluxTransformer2DModel(**tiny_transformer_config(384))  # all-MiniLM-L6-v2's 384 channels
        cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v"])
        transformer.add_adapter(cfg, adapter_name=name)
        gen = torch.Generator().manual_seed(seed)
        sd = {k: torch.randn(v.shape, generator=gen) * 0.2
              for k, v in get_peft_model_state_dict(transformer, adapter_name=name).items()}
        FluxPipeline.save_lora_weights(str(loras / name), transformer_lora_layers=sd,
                                       transformer_lora_adapter_metadata=cfg.to_dict())
    return loras


def noise_png(width: int, height: int, rng: random.Random) -> bytes:
    """An RGB PNG of ``width`` x ``height`` pixels: coarse random blocks (8 px), so it encodes small but differs
    per call."""
    from PIL import Image

    small = Image.frombytes("RGB", (max(1, width // 8), max(1, height // 8)),
                            rng.randbytes(3 * max(1, width // 8) * max(1, height // 8)))
    buf = io.BytesIO()
    small.resize((width, height), Image.NEAREST).save(buf, format="PNG")
    return buf.getvalue()


def mask_png(width: int, height: int) -> bytes:
    """OpenAI's mask convention: opaque keeps, fully transparent (the left half) is edited."""
    from PIL import Image

    im = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    im.paste((0, 0, 0, 0), (0, 0, width // 2, height))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def build_request(kind: str, row, steps: int, rng: random.Random, bad_index: int) -> dict:
    """One request of ``kind``: ``{"kind", "path", "json" | "files"+"data" | "content", "stream", "n"}``."""
    size = f"{row.width}x{row.height}"
    base = {"prompt": row.prompt, "num_inference_steps": steps, "seed": rng.randrange(2**31)}
    if kind in ("generate", "stream", "lora1", "lora2"):
        body = {**base, "size": size, "n": row.n}
        if kind == "stream":
            body.update(stream=True, partial_images=rng.choice((1, 2)))
        elif kind == "lora1":
            body["lora"] = [{"name": rng.choice(ADAPTERS), "scale": round(rng.uniform(0.3, 1.2), 2)}]
        elif kind == "lora2":
            body["lora"] = [{"name": n, "scale": round(rng.uniform(0.3, 1.0), 2)} for n in ADAPTERS]
        return {"kind": kind, "path": "/v1/images/generations", "json": body, "stream": kind == "stream",
                "n": row.n}
    if kind in ("img2img", "inpaint"):
        n = min(row.n, 2)
        files = {"image": ("photo.png", noise_png(row.width, row.height, rng), "image/png")}
        if kind == "inpaint":
            files["mask"] = ("mask.png", mask_png(row.width, row.height), "image/png")
        data = {k: str(v) for k, v in base.items()}
        data.update(n=str(n), strength=str(round(rng.uniform(0.5, 1.0), 2)))
        return {"kind": kind, "path": "/v1/images/edits", "files": files, "data": data, "stream": False, "n": n}
    bad = BAD_KINDS[bad_index % len(BAD_KINDS)]
    gen = "/v1/images/generations"
    if bad == "size":
        return {"kind": "bad", "bad": bad, "path": gen, "json": {**base, "size": "500x500"}}
    if bad == "adapter":
        return {"kind": "bad", "bad": bad, "path": gen, "json": {**base, "size": size, "lora": [{"name": "nope"}]}}
    if bad == "n":
        return {"kind": "bad", "bad": bad, "path": gen, "json": {**base, "size": size, "n": 1000}}
    if bad == "json":
        return {"kind": "bad", "bad": bad, "path": gen, "content": b'{"prompt": "a lighthouse", "size": '}
    data = {k: str(v) for k, v in base.items()}
    if bad == "not_image":
        return {"kind": "bad", "bad": bad, "path": "/v1/images/edits", "data": data,
                "files": {"image": ("photo.png", rng.randbytes(4096), "image/png")}}
    return {"kind": "bad", "bad": bad, "path": "/v1/images/edits", "data": data,  # mask_size
            "files": {"image": ("photo.png", noise_png(256, 256, rng), "image/png"),
                      "mask": ("mask.png", mask_png(128, 128), "image/png")}}


async def send(client, url: str, req: dict, timeout_s: float, gone_after: float | None, details: list) -> str:
    """Send ``req``; the outcome: ``ok``, ``4xx``, ``503``, ``5xx``, ``disconnected``, ``lost`` or ``hung``."""
    import httpx

    async def go() -> str:
        kw: dict = {}
        if "json" in req:
            kw["json"] = req["json"]
        elif "content" in req:
            kw.update(content=req["content"], headers={"Content-Type": "application/json"})
        else:
            kw.update(files=req["files"], data=req["data"])
        if req.get("stream"):
            async with client.stream("POST", url + req["path"], **kw) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _status(r.status_code)
                text = ""
                async for chunk in r.aiter_text():
                    text += chunk
                done = text.count(".completed")
                if done >= req["n"] and "event: error" not in text:
                    return "ok"
                details.append({"kind": req["kind"], "stream_tail": text[-300:]})
                return "5xx"
        r = await client.post(url + req["path"], **kw)
        if r.status_code == 200:
            return "ok" if len(r.json().get("data", ())) == req.get("n", -1) else "5xx"
        if r.status_code >= 500 and r.status_code != 503 or (r.status_code < 500 and req["kind"] != "bad"):
            details.append({"kind": req["kind"], "status": r.status_code, "answer": r.text[:300]})
        return _status(r.status_code)

    try:
        if gone_after is not None:
            try:
                return await asyncio.wait_for(go(), gone_after)
            except asyncio.TimeoutError:
                return "disconnected"
        return await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        return "hung"
    except httpx.HTTPError:
        return "lost"


def _status(code: int) -> str:
    if code == 503:
        return "503"
    return "4xx" if 400 <= code < 500 else "5xx"


# ---------------------------------------------------------------------------------------------- the soak


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
