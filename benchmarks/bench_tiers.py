"""One request, side by side in one process: diffusers' own pipeline (eager, and with its regional compilation)
against bcg-serve's kernel tiers (eager kernels in a CUDA graph, compiled kernels in a CUDA graph).

Per case (``--cases``, from ``benchmarks/bench_families.py``'s ``CASES``: published transformer config with random
weights, bf16, the real VAE config, random stand-in text encoders), one checkpoint is built under ``--scratch`` and:

- ``diffusers``: the family's diffusers pipeline, ``from_pretrained`` of that folder, called with the request's
  prompt, size, steps, guidance and one CPU generator per image (as bcg-serve seeds them);
- ``diffusers-compiled``: a second copy of it with ``transformer.compile_repeated_blocks(fullgraph=True)`` (FLUX.1,
  Qwen-Image: diffusers' documented one line), or ``torch.compile(transformer, fullgraph=True)`` where the
  transformer names no repeated blocks;
- ``bcg-eager`` / ``bcg-compiled`` / ``bcg-fp8``: :class:`~bcg_core.pipeline.DiTPipeline` with the one bucket that
  holds the request exactly (nothing padded), ``runner.mode: graph``, ``runner.kernels`` eager, compiled or fp8
  (eager and compiled share one loaded model; fp8 turns its linear layers to float8 in place, so it loads its own).

A warm-up request per mode (its wall is reported as ``first_ms``: compile and capture for the compiled modes),
then ``--repeats`` requests per mode, the modes alternating. Reported per mode: median wall ms and, for bcg,
its encode / denoise / decode / image_encode split; ``vs_diffusers``: diffusers' wall / the mode's wall (above 1:
faster). diffusers' call ends at PIL images while bcg-serve's wall includes the PNG files it sends, so each
diffusers call's images are also saved as PNG (Pillow's defaults, as bcg-serve encodes them), timed apart as its
``image_encode_ms``; ``served_ms`` is the wall plus that for diffusers (the wall itself for bcg-serve), and
``served_vs_diffusers`` compares those: what a server built on each sends.

On the GPU machine, after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``::

    python benchmarks/bench_tiers.py --cases flux-dev-1024 --scratch /dev/shm --commit <sha> --out tiers.json

CPU smoke: ``--device cpu --tiny --repeats 1`` (fp32 tiny configs; bcg modes without graphs).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import bench_families  # noqa: E402
from bcg_core import DiTPipeline, GenerationRequest, load_model  # noqa: E402
from bcg_core.config import EngineConfig, LimitsConfig, ModelConfig, RunnerConfig  # noqa: E402

MODES = ("diffusers", "diffusers-compiled", "bcg-eager", "bcg-compiled", "bcg-fp8")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def diffusers_pipeline(folder: Path, dtype: torch.dtype, device: torch.device, compiled: bool):
    """The checkpoint's own diffusers pipeline; with ``compiled``, its transformer compiled as diffusers documents
    (regional where the transformer names repeated blocks, whole otherwise)."""
    import diffusers

    index = json.loads((folder / "model_index.json").read_text())
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(str(folder), torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    if compiled:
        if getattr(pipe.transformer, "_repeated_blocks", None):
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
        else:
            pipe.transformer.compile(fullgraph=True)
    return pipe


def bench_case(case: str, folder: Path, model, args, device: torch.device, dtype: str) -> dict:
    """Every mode of one case (one request of ``args.n`` images), alternating."""
    _, size, tiny_size, steps, guidance = bench_families.CASES[case]
    size, steps = (tiny_size, 2) if args.tiny else (size, steps)
    req = GenerationRequest(bench_families.PROMPT, n=args.n, width=size, height=size, num_inference_steps=steps,
                            guidance_scale=guidance, seed=1)
    limits = LimitsConfig(min_side_px=16)
    buckets = bench_families.exact_buckets(folder, req, limits)
    mc = ModelConfig(path=str(folder), device=device.type, dtype=dtype)
    graph = "graph" if device.type == "cuda" else "eager"
    runs: dict[str, list] = {}
    calls, first, prepare = {}, {}, {}
    for mode in args.modes:
        t0 = time.perf_counter()
        if mode.startswith("bcg"):
            kernels = mode.removeprefix("bcg-")
            pipe = DiTPipeline(EngineConfig(model=mc, buckets=buckets, limits=limits,
                                            runner=RunnerConfig(mode=graph, kernels=kernels, fused_step="never")),
                               load_model(mc) if kernels == "fp8" else model)

            def call(pipe=pipe):
                return pipe.generate(req).timings_ms
        else:
            pipe = diffusers_pipeline(folder, getattr(torch, dtype), device, mode == "diffusers-compiled")

            def call(pipe=pipe):
                gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
                images = pipe(prompt=req.prompt, num_images_per_prompt=req.n, width=req.width, height=req.height,
                              num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
                              generator=gens).images
                return {"images": images}
        _sync()
        prepare[mode] = round(time.perf_counter() - t0, 2)
        calls[mode] = call
        t0 = time.perf_counter()
        call()
        _sync()
        first[mode] = round((time.perf_counter() - t0) * 1e3, 1)
        runs[mode] = []
        print(f"{case}: {mode} prepared in {prepare[mode]} s, first request {first[mode]} ms", flush=True)
    for i in range(args.repeats):
        for mode in args.modes if i % 2 == 0 else args.modes[::-1]:
            _sync()
            t0 = time.perf_counter()
            timings = calls[mode]()
            _sync()
            wall = (time.perf_counter() - t0) * 1e3
            if "images" in timings:  # diffusers: the PNG files a server would send, timed apart from the call
                t0 = time.perf_counter()
                for image in timings.pop("images"):
                    image.save(io.BytesIO(), format="PNG")
                timings["image_encode"] = (time.perf_counter() - t0) * 1e3
            runs[mode].append((wall, timings))
    out = {}
    for mode, rs in runs.items():
        out[mode] = dict(wall_ms=round(statistics.median(w for w, _ in rs), 1), walls_ms=[round(w, 1) for w, _ in rs],
                         first_ms=first[mode], prepare_s=prepare[mode])
        for k in ("encode", "denoise", "decode", "image_encode"):
            vals = [t[k] for _, t in rs if k in t]
            out[mode][f"{k}_ms"] = round(statistics.median(vals), 1) if vals else None
        # served: what a server sends, the image files included (bcg-serve's wall has them; diffusers' call ends
        # at PIL images, so its PNG encoding is added)
        png = out[mode]["image_encode_ms"] or 0.0
        out[mode]["served_ms"] = round(out[mode]["wall_ms"] + (png if mode.startswith("diffusers") else 0.0), 1)
    base = out.get("diffusers", {}).get("wall_ms")
    served = out.get("diffusers", {}).get("served_ms")
    for mode, r in out.items():
        r["vs_diffusers"] = round(base / r["wall_ms"], 3) if base else None
        r["served_vs_diffusers"] = round(served / r["served_ms"], 3) if served else None
    return dict(case=case, n=args.n, size=f"{size}x{size}", steps=steps, guidance_scale=guidance,
                bucket=buckets.model_dump(), modes=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="flux-dev-1024", help=f"comma-separated, of {','.join(bench_families.CASES)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--n", type=int, default=1, help="images per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: tiny configs, fp32, 2 steps")
    ap.add_argument("--scratch", help="folder for the checkpoints (default: a temp dir)")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--commit", help="git commit to record")
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    if unknown := [m for m in args.modes if m not in MODES]:
        raise SystemExit(f"unknown mode {unknown[0]!r}; modes: {', '.join(MODES)}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = "float32" if args.tiny else "bfloat16"
    models = bench_families.bench_models(args.tiny)
    result = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=args.commit,
                  gpu=torch.cuda.get_device_name() if device.type == "cuda" else None, torch=torch.__version__,
                  command=" ".join(sys.argv), dtype=dtype, cases=[])
    for case in args.cases.split(","):
        name = bench_families.CASES[case][0]
        folder = Path(tempfile.mkdtemp(prefix=f"bcg-tiers-{name}-", dir=args.scratch))
        try:
            t0 = time.perf_counter()
            info = bench_families.build_checkpoint(models[name], folder, device, getattr(torch, dtype))
            info["build_save_s"] = round(time.perf_counter() - t0, 1)
            model = load_model(ModelConfig(path=str(folder), device=device.type, dtype=dtype))
            row = bench_case(case, folder, model, args, device, dtype)
            row["built"] = info
            result["cases"].append(row)
            for mode, r in row["modes"].items():
                print(f"{case} n={args.n} {mode}: {r['wall_ms']} ms (x{r['vs_diffusers']} vs diffusers; served "
                      f"{r['served_ms']} ms, x{r['served_vs_diffusers']}), first {r['first_ms']} ms, denoise "
                      f"{r['denoise_ms']} ms, decode {r['decode_ms']} ms, PNG {r['image_encode_ms']} ms", flush=True)
        finally:
            model = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            shutil.rmtree(folder, ignore_errors=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
