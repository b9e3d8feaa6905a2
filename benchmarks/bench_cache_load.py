"""The step cache under load, in one process: which half of which cached step first goes non-finite, and what the
step-cache halves' captures cost while serving.

Why: the served run of docs/BENCHMARKS.md (2026-12-07, "the step cache under load") answered 11 of 32 cached
requests with ``NonFiniteOutput`` on a GPU, while every CPU gate of the step cache passes. This script runs the
same replay without Ray and HTTP, so that what goes wrong is seen where it happens:

1. One model (``--model``, built as ``benchmarks/bench_saturation.py``'s ``build_model`` builds it: random weights of
   the published transformer config, bf16 on CUDA; ``tiny``: the embedded default, fp32), the default-like table of
   ``bench_saturation`` (``--batch-sizes``, ``--resolutions``, text bucket ``--text-tokens``, masked image padding),
   ``runner.kernels`` ``--kernels``, and ``cache.default`` First Block Cache at ``--threshold`` (every request
   caches unless a round says otherwise). Every bucket is captured at start (:meth:`DiTPipeline.prepare`).
2. The step scheduler's cost measurement runs in a worker thread (``--background-measure``, on by default), as a
   replica runs it after ready (``runner.ready_after_s``), while the first round is served.
3. Rounds (``--rounds``): ``cached`` (every request caches), ``cached-again`` (the same, the halves now captured),
   ``uncached`` (every request with ``cache: none``): the first ``--requests`` requests of the production-like mix
   (``bench_saturation.replay_requests(mix="gentd26")``, ``--steps`` steps), ``--concurrency`` in flight, through
   :class:`~bcg_core.scheduler.step_scheduler.StepScheduler` (``submit`` per request).

During every round each half of every cached step (:func:`bcg_core.step_cache.step._run`) is checked: its inputs'
cached residuals and its outputs (head hidden, residual, text stream; tail residuals; the rows' outputs) finite or
not; the first ``--report`` non-finite halves are printed with their bucket, rows, tokens and the runner's
step-cache captures so far. Per round the JSON (``--out``) holds: requests answered and failed (with their errors),
wall seconds, the scheduler's busy seconds, non-finite halves, step-cache captures in the round; and at the end the
runner's capture totals (``piece_captures``, ``piece_failures``), each bucket whose halves failed or that does not
replay a graph (its note), the seconds the halves' captures took (sum and largest) and their measured shares.

On the GPU machine, after the site pack is unpacked and on ``PYTHONPATH``::

    python benchmarks/bench_cache_load.py --scratch /dev/shm --out cache_load.json

On a CPU (``--model tiny``; halves run on static buffers, no captures) it runs in about a minute and checks the
script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


class HalfChecks:
    """Wraps :func:`bcg_core.step_cache.step._run` to check each half's inputs and outputs for NaN and inf."""

    def __init__(self, report: int):
        import bcg_core.step_cache.step as step

        self.step, self.inner, self.report = step, step._run, report
        self.events: list[dict] = []
        step._run = self._run

    def close(self) -> None:
        self.step._run = self.inner

    def _run(self, pipe, split, chunk, forwards, rows, phase):
        import torch

        def finite(t) -> bool:
            return bool(torch.isfinite(t).all())

        from bcg_core.step_cache.split import HeadPhase

        before = {}
        if isinstance(phase, HeadPhase):
            for i, (h, e) in phase.residuals.items():
                before[f"cached_residual_row{i}"] = finite(h) and (e is None or finite(e))
        else:
            before = {"in_hidden": finite(phase.hidden)}
            if phase.encoder is not None:
                before["in_encoder"] = finite(phase.encoder)
        captures = pipe.runner.stats.piece_captures
        out = self.inner(pipe, split, chunk, forwards, rows, phase)
        after = {n: finite(t) for n in ("hidden", "residual", "encoder", "residual_hidden", "residual_encoder")
                 if isinstance(t := getattr(phase, n, None), torch.Tensor)}
        after["output"] = finite(out)
        if not all(before.values()) or not all(after.values()):
            event = {"half": type(phase).__name__, "bucket": None if chunk.key is None else str(chunk.key),
                     "eager": chunk.key is None, "rows": rows.rows, "image_tokens": rows.image_tokens,
                     "inputs_finite": before, "outputs_finite": after, "captures_before": captures,
                     "captures_after": pipe.runner.stats.piece_captures}
            if len(self.events) < self.report:
                print("NON-FINITE", json.dumps(event), flush=True)
            self.events.append(event)
        return out


def build_pipeline(args):
    """The pipeline of ``args`` (module docstring, 1), every bucket prepared."""
    import bench_saturation as bs

    from bcg_core import DiTPipeline
    from deployments.settings import ServeConfig

    device = "cuda" if args.model != "tiny" or _cuda() else "cpu"
    model, _, _ = bs.build_model(args.model, False, args.scratch, device)
    buckets = {"batch_sizes": args.batch_sizes, "resolutions": args.resolutions, "text_lengths": [args.text_tokens],
               "image_padding": "masked"}
    config = ServeConfig(model=model, buckets=buckets, runner={"kernels": args.kernels},
                         cache={"default": {"method": "first_block", "threshold": args.threshold}})
    pipe = DiTPipeline.from_config(config)
    pipe.prepare()
    return pipe


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


async def serve_round(pipe, requests, concurrency: int) -> dict:
    """One round: every request submitted, ``concurrency`` in flight; answered, failed, wall and busy seconds."""
    from bcg_core.scheduler.step_scheduler import StepScheduler

    sched = StepScheduler.from_pipeline(pipe)
    gate = asyncio.Semaphore(concurrency)

    async def one(r):
        async with gate:
            try:
                await sched.submit(pipe.validator.validate(r))
                return None
            except Exception as e:  # noqa: BLE001 - each request's own error is the result
                return f"{type(e).__name__}: {str(e)[:200]}"

    t0 = time.perf_counter()
    errors = await asyncio.gather(*[one(r) for r in requests])
    wall = time.perf_counter() - t0
    stats = sched.stats()
    sched.close()
    failed = [{"width": r.width, "height": r.height, "n": r.n, "error": e}
              for r, e in zip(requests, errors, strict=True) if e is not None]
    return {"requests": len(requests), "answered": len(requests) - len(failed), "failed": failed,
            "wall_s": round(wall, 3), "busy_s": stats.get("busy_s")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import bench_saturation as bs

    from bcg_core.scheduler.step_scheduler import StepScheduler
    from bcg_core.step_cache import NoCache

    t0 = time.perf_counter()
    pipe = build_pipeline(args)
    result: dict = {"benchmark": "cache_load", "argv": sys.argv[1:] if argv is None else argv,
                    "commit": args.commit, "prepare_s": round(time.perf_counter() - t0, 1), "rounds": {}}
    print(f"prepared in {result['prepare_s']} s", flush=True)
    requests = [bs.generation_request(d, args.steps) for d in bs.replay_requests(args.requests, mix="gentd26")]
    measure = None
    if args.background_measure:
        sched = StepScheduler.from_pipeline(pipe)
        keys = list(pipe.table.keys)

        def run_measure():
            t = time.perf_counter()
            sched.measure_costs(keys)
            result["background_measure_s"] = round(time.perf_counter() - t, 1)

        measure = threading.Thread(target=run_measure, name="bench-measure", daemon=True)
        measure.start()
    checks = HalfChecks(args.report)
    try:
        for name in args.rounds:
            if name != "cached" and measure is not None:
                measure.join()
            batch = requests if name.startswith("cached") else [replace(r, cache=NoCache()) for r in requests]
            checks.events.clear()
            before = pipe.runner.stats.piece_captures
            r = asyncio.run(serve_round(pipe, batch, args.concurrency))
            r.update(non_finite_halves=len(checks.events), first_non_finite=checks.events[: args.report],
                     piece_captures=pipe.runner.stats.piece_captures - before)
            result["rounds"][name] = r
            print(f"{name}: {r['answered']} of {r['requests']} answered, {r['wall_s']} s (busy {r['busy_s']} s), "
                  f"{r['non_finite_halves']} non-finite halves, {r['piece_captures']} step-cache captures",
                  flush=True)
    finally:
        checks.close()
    runner = pipe.runner
    runner_graphs = any(e.mode.value == "graph" for e in runner.entries.values())  # a CPU replays none
    pieces = [e.pieces for e in runner.entries.values() if e.pieces not in (None, False)]
    result["capture"] = {k: v for k, v in vars(runner.stats).items() if isinstance(v, int | float)}
    times = [p.capture_s for p in pieces]
    result["piece_capture_s"] = {"sum": round(sum(times), 3), "max": round(max(times, default=0.0), 3),
                                 "buckets": len(times)}
    from bcg_core.runners.piecewise import PiecewiseReplay

    shares = runner.piece_shares if isinstance(runner, PiecewiseReplay) else {}
    result["piece_shares"] = {str(k): v for k, v in shares.items()}
    result["buckets_not_replaying"] = [{"key": str(k), "mode": e.mode.value, "pieces_failed": e.pieces is False,
                                        "note": e.note} for k, e in runner.entries.items()
                                       if e.pieces is False or (runner_graphs and e.mode.value != "graph")]
    print(json.dumps({k: result[k] for k in ("capture", "piece_capture_s")}), flush=True)
    for b in result["buckets_not_replaying"][: args.report]:
        print("BUCKET", json.dumps(b), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flux-dev-width", choices=["tiny", "flux-dev-width"])
    ap.add_argument("--scratch", default=None, help="folder for the random-weight checkpoint")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--kernels", default="eager", choices=["eager", "compiled", "fp8"])
    ap.add_argument("--threshold", type=float, default=0.5, help="First Block Cache threshold of every request")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 18, 20])
    ap.add_argument("--resolutions", type=lambda s: s.split(","),
                    default=["256x256", "512x512", "512x768", "768x768", "1024x1024"])
    ap.add_argument("--text-tokens", type=int, default=512, help="the one text bucket (tiny: 256)")
    ap.add_argument("--rounds", type=lambda s: s.split(","), default=["cached", "cached-again", "uncached"])
    ap.add_argument("--no-background-measure", dest="background_measure", action="store_false")
    ap.add_argument("--report", type=int, default=12, help="non-finite halves and buckets printed")
    return ap.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
