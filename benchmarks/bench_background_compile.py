"""Ready first, compiled later, measured: a cold start's first image, its background compile, and what serving keeps.

For one model per invocation (``benchmarks/bench_saturation.py``'s models, checkpoints and production-like mix:
``--mix gentd26``, GenTD26's images per request joined with krea's sizes and prompts), servers start one after
another in this process (``deployments.cli.local.start_local``, Ray and Serve on 127.0.0.1; the time includes Ray's
start, as ``bcg serve``'s does), each on the default table unless said otherwise:

- ``naive``: bench_saturation's naive server (unpadded eager, one forward per request step, no batching);
- ``eager``: the step scheduler with ``runner.kernels: eager`` (the baseline of the 0.8x target);
- ``cold``: ``runner.kernels: compiled`` (or ``--kernels fp8``) with ``runner.compile_in_background`` and an empty
  ``runner.compile_cache_dir``. Reported: ``ready_s`` (launch to healthy), ``first_image_s`` (launch to the answer
  of one request sent at ready: the replay's first), then replay rounds back to back while the background compile
  runs (each round's images/s and the buckets pending before and after it), ``captured_s`` (launch to every owned
  shape captured: ``runner.ready_after_s`` lets a replica report ready before), ``all_compiled_s`` (launch to the
  moment ``/v1/buckets`` showed every shape captured and nothing pending; polled every 0.5 s), and one more round
  once every bucket is compiled;
- ``warm``: the same config restarted on the cache ``cold`` filled: ``ready_s``, and the buckets pending at ready
  (0 expected: compiled from the start) with ``kernels.start``.

Every server but ``cold`` waits for every shape to be captured (``captured_s``) before its rounds, so the baselines
time graphs.

``ratios``: each round's images/s during the compile over ``eager``'s; ``compiled`` (the round after every swap) and
``eager`` over ``naive``. Each server gets one warm-up request per distinct (size, n) first (2 steps), as
bench_saturation's ``--warmup shapes``, except ``cold``, whose warm-up runs after its first image, during the compile.

Run on the GPU machine after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``::

    python benchmarks/bench_background_compile.py --model pixart-512 --scratch /dev/shm --commit <sha> --out x.json

CPU smoke (``--model tiny --kernels compiled``, a two-bucket table: ``--batch-sizes 1,2``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import bench_saturation as sat  # noqa: E402

SERVERS = ("naive", "eager", "cold", "warm")


def _pending(stats: dict) -> int | None:
    """Buckets pending their background compile (None where the answer has no such section, recorded as null)."""
    return sat.background_compiles(stats).get("pending")


def _round_of(url: str, reqs: list, args, png_dir: Path) -> dict:
    """One replay of ``reqs`` (``--concurrency`` in flight): images/s, failures, and the pending count around it."""
    from deployments.cli.demo import replay

    stats = sat._get_stats(url)
    before, modes = _pending(stats), _modes(stats)
    t0 = time.perf_counter()
    results = replay(url, reqs, steps=args.steps, concurrency=args.concurrency, out_dir=png_dir, timeout_s=600)
    wall = time.perf_counter() - t0
    summary = sat.summarize([sat.result_row(r) for r in results], wall)
    stats = sat._get_stats(url)
    return {"images_per_s": summary["images_per_s"], "wall_s": round(wall, 2), "failures": summary["failures"],
            "p50_ms": (summary.get("latency_ms") or {}).get("p50"), "pending_before": before,
            "pending_after": _pending(stats), "forwards": {m: n - modes.get(m, 0) for m, n in _modes(stats).items()}}


def _modes(stats: dict) -> dict[str, int]:
    """Forwards so far by mode (graph, static_eager, eager), over the buckets and the misses."""
    out: dict[str, int] = {}
    for row in [*(stats.get("buckets") or []), stats.get("misses") or {}]:
        for mode, n in (row.get("forwards_by_mode") or {}).items():
            out[mode] = out.get(mode, 0) + int(n)
    return out


class _DoneWatch:
    """Polls ``/v1/buckets`` every 0.5 s until every shape is captured (``captured_at``, ``runner.ready_after_s``)
    and then nothing is pending (``done_at``), both ``time.perf_counter()``."""

    def __init__(self, url: str):
        self.url, self.done_at, self.captured_at, self.polls = url, None, None, 0
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from deployments.cli.local import uncaptured_shapes

        while not self._stop.wait(0.5):
            try:
                stats = sat._get_stats(self.url)
            except Exception:  # noqa: BLE001 - the next poll tries again
                continue
            self.polls += 1
            self.last = sat.background_compiles(stats)
            if self.captured_at is None and not uncaptured_shapes(stats):
                self.captured_at = time.perf_counter()
            if self.captured_at is not None and _pending(stats) == 0 and not self.last.get("running"):
                self.done_at = time.perf_counter()
                return

    def stop(self) -> None:
        self._stop.set()


def run(name: str, config, reqs: list, warm: list, args) -> dict:
    """Start server ``name``, measure it (module docstring), stop it; its JSON entry."""
    from deployments.cli.demo import replay
    from deployments.cli.local import start_local, stop_local, uncaptured_shapes, wait_captured, wait_healthy

    entry: dict[str, Any] = {"server": name}
    png_dir = Path(tempfile.mkdtemp(prefix=f"bcg-bg-{name}-", dir=args.scratch))
    try:
        t0 = time.perf_counter()
        url = start_local(config, 0, args.num_cpus, quiet=True)
        wait_healthy(url, timeout_s=900)
        entry["ready_s"] = round(time.perf_counter() - t0, 2)
        stats = sat._get_stats(url)
        entry["at_ready"] = {"pending": _pending(stats), "start": (stats.get("kernels") or {}).get("start"),
                             "kernels": sorted({b.get("kernels") or "not prepared"
                                                for b in stats.get("buckets") or []})}
        entry["at_ready"]["uncaptured_shapes"] = len(uncaptured_shapes(stats))
        entry["replica_start"] = stats.get("start")  # load, join, capture, cost timing: where ready_s went
        print(f"[{name}] ready after {entry['ready_s']} s: {entry['at_ready']}", flush=True)
        watch = _DoneWatch(url) if name == "cold" else None
        if watch is None:  # the baselines are timed on their graphs: every shape captured first
            wait_captured(url, timeout_s=900)
            entry["captured_s"] = round(time.perf_counter() - t0, 2)
        if name == "cold":
            first = replay(url, reqs[:1], steps=args.steps, concurrency=1, out_dir=png_dir, timeout_s=600)
            entry["first_image_s"] = round(time.perf_counter() - t0, 2)
            entry["first_ok"] = all(r.ok for r in first)
            print(f"[cold] first image after {entry['first_image_s']} s", flush=True)
        if warm:
            replay(url, warm, steps=2, concurrency=1, out_dir=png_dir, timeout_s=600)
        rounds = []
        while True:
            rounds.append(_round_of(url, reqs, args, png_dir))
            print(f"[{name}] round {len(rounds)}: {rounds[-1]}", flush=True)
            if watch is None or watch.done_at is not None or time.perf_counter() - t0 > args.compile_bound_s:
                break
        entry["rounds"] = rounds
        if watch is not None:
            watch.stop()
            entry["all_compiled_s"] = None if watch.done_at is None else round(watch.done_at - t0, 2)
            entry["captured_s"] = None if watch.captured_at is None else round(watch.captured_at - t0, 2)
            entry["background"] = watch.last
            if watch.done_at is not None:  # one round with every bucket compiled
                entry["compiled_round"] = _round_of(url, reqs, args, png_dir)
                print(f"[cold] every bucket compiled after {entry['all_compiled_s']} s; "
                      f"compiled round: {entry['compiled_round']}", flush=True)
        stats = sat._get_stats(url)
        entry["kernels"] = {k: (stats.get("kernels") or {}).get(k) for k in ("tier", "start", "pending",
                                                                             "compile_failed", "compile_s")}
        entry["buckets"] = [{k: b.get(k) for k in ("key", "mode", "kernels", "note")}
                            for b in stats.get("buckets") or []]
    finally:
        try:
            stop_local()
        finally:
            shutil.rmtree(png_dir, ignore_errors=True)
    return entry


def ratios(servers: dict[str, dict]) -> dict:
    """The ratios of the module docstring (None where a side is missing)."""
    def ips(entry, key="rounds"):
        if not entry:
            return None
        r = entry.get(key)
        return (r[0] if isinstance(r, list) and r else r or {}).get("images_per_s")

    eager, naive, cold = ips(servers.get("eager")), ips(servers.get("naive")), servers.get("cold") or {}
    during = [r for r in cold.get("rounds", []) if r.get("pending_before")]
    compiled = ips(cold, "compiled_round")
    return {"during_compile_vs_eager": [sat._ratio(r["images_per_s"], eager) for r in during],
            "compiled_vs_naive": sat._ratio(compiled, naive), "eager_vs_naive": sat._ratio(eager, naive),
            "compiled_vs_eager": sat._ratio(compiled, eager)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every server ran."""
    raw = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sat.MODELS, default="tiny")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--scratch")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kernels", choices=("compiled", "fp8"), default="compiled")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"subset of {','.join(SERVERS)}, in that order")
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--compile-bound-s", type=float, default=420.0, help="stop the rounds after this (from launch)")
    ap.add_argument("--num-cpus", type=int, default=4)
    args = ap.parse_args(raw)
    import torch

    from bcg_core.models import describe_model, load_tokenizer_counter
    from deployments.settings import ServeConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = [n for n in SERVERS if n in args.servers.split(",")]
    reqs = sat.replay_requests(args.requests, mix="gentd26")
    warm = sat.warmup_requests(reqs, "shapes")
    result: dict[str, Any] = {"benchmark": "background_compile", **sat._env(args, device),
                              "command": shlex.join(["python", "benchmarks/bench_background_compile.py", *raw]),
                              "model": args.model, "kernels": args.kernels,
                              "replay": {"requests": len(reqs), "images": sum(r.n for r in reqs), "steps": args.steps,
                                         "concurrency": args.concurrency, "mix": "gentd26"}, "servers": []}
    out = Path(args.out)

    def save() -> None:
        result["ratios"] = ratios({s["server"]: s for s in result["servers"]})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))

    model_cfg, folder, info = sat.build_model(args.model, args.tiny, args.scratch, device)
    cache = Path(tempfile.mkdtemp(prefix="bcg-bg-cache-", dir=args.scratch))
    try:
        mc = ServeConfig.model_validate({"model": model_cfg}).model
        spec, counter = describe_model(mc), load_tokenizer_counter(mc)
        base = sat.base_config(model_cfg, spec, counter, reqs + warm, args.steps, args.batch_sizes)
        result.update(model_info=info, base_config=base)
        for name in names:
            over = (sat.server_overrides("naive", base, spec, reqs + warm, args.concurrency) if name == "naive" else
                    {"runner": {"kernels": "eager"}} if name == "eager" else
                    {"runner": {"kernels": args.kernels, "compile_in_background": True,
                                "compile_cache_dir": str(cache)}})
            config = ServeConfig.model_validate(sat.merge(base, over))
            try:
                result["servers"].append({**run(name, config, reqs, warm, args), "overrides": over})
            except Exception as e:  # noqa: BLE001 - one failing server must not lose the others' results
                result["servers"].append({"server": name, "error": f"{type(e).__name__}: {e}"[:2000],
                                          "overrides": over})
                print(f"[{name}] FAILED: {e}", flush=True)
            save()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    save()
    print(json.dumps({"ratios": result["ratios"]}, indent=1))
    return 0 if all("error" not in s for s in result["servers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
