"""What streamed previews cost the requests that share their steps, on the step scheduler (no Ray, no HTTP).

Two requests of one shape run together, step for step: A streams ``partial_images`` previews per image, B
streams none. B's latency (``timings_ms["total"]``: submitted to answered, so on a GPU it includes the steps'
device time) with A's previews on is compared with the same pair with A's previews off, interleaved,
``--trials`` times each (medians): ``ratio``. Also reported: B's ``timings_ms["denoise"]`` (the denoising
thread's wall time over B's steps; on a GPU that is the time to *launch* them, the device runs behind). Also reported:
the denoising thread's own share of each preview (``previews.handoff_ms_*``: the latent copy and the queue put) and the
preview thread's time per preview (linear latent-to-RGB map, resize, encode).

Usage::

    python benchmarks/bench_previews.py --sizes 512,1024 --steps 8 --trials 5 --json out.json

On a CPU it serves the tiny default model; with ``--device cuda`` the same on a GPU (graphs captured), or with
``--model flux-dev-width`` / ``pixart-512`` a published-width model with random weights (bf16)::

    python benchmarks/bench_previews.py --device cuda --model flux-dev-width --scratch /dev/shm --sizes 512,1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time

import torch

from bcg_core.pipeline import DiTPipeline
from bcg_core.request import GenerationRequest
from bcg_core.scheduler.step_scheduler import StepScheduler
from deployments.settings import ServeConfig


def run_size(size: int, steps: int, trials: int, previews: int, n: int, device: str,
             model: dict | None = None) -> dict:
    """Median total and denoise ms of B with A's previews off and on, the ratios, and the preview counters.

    ``model``: the ``model`` section (a checkpoint built by ``--model``); None: the tiny default on ``device``."""
    from bcg_core.models import describe_model

    model = model or {"device": device}
    mc = ServeConfig.model_validate({"model": model}).model
    spec = describe_model(mc)
    native = spec.rules.native_text_tokens
    tier = f"{size}x{size}" if not spec.size_bins else "x".join(map(str, spec.generation_size(size, size)))
    text = [native] if native is not None else [min(256, spec.max_text_tokens or 256)]
    cfg = ServeConfig.model_validate({"model": model,
                                      "buckets": {"batch_sizes": [1, 2, 4], "resolutions": [tier],
                                                  "text_lengths": text}})
    pipe = DiTPipeline.from_config(cfg)
    sched = StepScheduler(pipe)

    def req(seed: int, k: int):
        return pipe.validator.validate(GenerationRequest("a lighthouse at dusk", n=n, width=size, height=size,
                                                   num_inference_steps=steps, guidance_scale=0.0, seed=seed,
                                                   partial_images=k))

    async def pair(k: int) -> dict:
        async def drain():
            return [e async for e in sched.submit_stream(req(1, k))]

        _, b = await asyncio.gather(drain(), sched.submit(req(2, 0)))
        return b.timings_ms

    try:
        asyncio.run(pair(previews))  # warm-up (the linear map's fit, allocator)
        off, on = [], []
        for _ in range(trials):
            off.append(asyncio.run(pair(0)))
            on.append(asyncio.run(pair(previews)))
        stats = sched.stats()["previews"]
    finally:
        sched.close()
    med = lambda runs, k: statistics.median(t[k] for t in runs)  # noqa: E731
    return {"size": f"{size}x{size}", "n": n, "steps": steps, "partial_images": previews,
            "b_total_ms_off": round(med(off, "total"), 1), "b_total_ms_on": round(med(on, "total"), 1),
            "ratio": round(med(on, "total") / med(off, "total"), 3),
            "b_denoise_ms_off": round(med(off, "denoise"), 1), "b_denoise_ms_on": round(med(on, "denoise"), 1),
            "denoise_ratio": round(med(on, "denoise") / med(off, "denoise"), 3), "previews": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="512,1024", help="square sizes, comma-separated (default 512,1024)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--partial-images", type=int, default=3)
    parser.add_argument("--n", type=int, default=2, help="images of each request (default 2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", choices=("tiny", "flux-dev-width", "pixart-512"),
                        help="tiny: the embedded default; flux-dev-width / pixart-512: published widths with random "
                        "weights, bf16, built as benchmarks/bench_saturation.py builds them (needs --device cuda)")
    parser.add_argument("--scratch", default=None, help="folder for a built checkpoint (default: a temp dir)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model, folder = None, None
    if args.model != "tiny":
        import shutil
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_saturation import build_model

        model, folder, _ = build_model(args.model, False, args.scratch, args.device)
    try:
        rows = [run_size(int(s), args.steps, args.trials, args.partial_images, args.n, args.device, model)
                for s in args.sizes.split(",")]
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    print("| size | B total ms, A without previews | with A's previews | ratio | B denoise ms, without / with "
          "(ratio) | hand-off ms per preview (mean / max) | preview thread ms per preview |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["previews"]
        print(f"| {r['size']} | {r['b_total_ms_off']} | {r['b_total_ms_on']} | {r['ratio']} | "
              f"{r['b_denoise_ms_off']} / {r['b_denoise_ms_on']} ({r['denoise_ratio']}) | "
              f"{p['handoff_ms_mean']} / {p['handoff_ms_max']} | {p['draw_ms_mean']} |")
    if args.json:
        extra = {"gpu": torch.cuda.get_device_name()} if args.device.startswith("cuda") else {}
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
                       **extra, "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
