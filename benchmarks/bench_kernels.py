"""Kernel tiers per bucket: eager kernels in a CUDA graph against compiled kernels in a CUDA graph, side by side.

For each model, two :class:`~bcg_core.pipeline.DiTPipeline` share one loaded model and one bucket table (the
batch sizes of ``--batches`` at the model's sizes, text at its native length): ``eager`` (``runner.kernels:
eager``) and ``compiled`` (``runner.kernels: compiled``, ``bcg_core/runners/kernels.py``: the repeated blocks
compiled by inductor with static shapes, then captured into the bucket's graph), and with ``--tiers
eager,compiled,fp8`` a third over a model of its own (``fp8``: compiled, with the repeated blocks' linear layers in
float8 through torchao), and ``autotune`` (``compiled`` with ``runner.compile_mode: max-autotune-no-cudagraphs``;
a model of its own when another compiled tier runs too). Each captures every bucket at prepare. Per bucket, in one
process, alternating the two tiers per round:

- ``eager_ms`` / ``compiled_ms``: one graph replay (one transformer forward at the bucket's full shape), the
  median over ``--rounds`` rounds of ``--iters`` replays timed with CUDA events;
- ``ratio`` (and ``<tier>_ratio``): ``compiled_ms / eager_ms`` (below 1: compiled kernels are faster; the target is at
  most 0.85);
- ``prepare_s``: the bucket's warm-up and capture seconds (with compiled kernels, its compile);
- ``rel_err`` of each tier: ``max|padded - unpadded eager| / max|unpadded eager|`` at the bucket's exact shape
  (``bcg_core.verify.verify_runner``), against the tier's tolerance (``<tier>_rtol``: the dtype's
  ``bcg_core.verify.RTOL`` for eager, the runner's ``kernel_tolerance`` for compiled and fp8);
- with ``--profile``, ``<tier>_split``: where one replay's GPU time goes, from torch.profiler's CUDA kernel events
  of ``--iters`` replays (:func:`kernel_split`): milliseconds per replay of matmuls (cuBLAS, CUTLASS, ``_scaled_mm``),
  attention (SDPA's cuDNN, flash and memory-efficient kernels), inductor's Triton kernels (fused norms, RoPE,
  modulation, activations, float8 casts) and the rest, beside the summed kernel time and the replay's wall.

Models (``--models``): ``flux-dev-width`` (FLUX.1-dev width 3072, 2 double + 4 single blocks, bf16; guidance
embedding), ``sd3-medium`` (the SD3-medium transformer, bf16), ``pixart-512`` (PixArt-Sigma 512, bf16), all with
random weights built by ``benchmarks/bench_families.py``; ``tiny-flux`` (tests/tiny, fp32) for a CPU smoke.

Run on the GPU machine after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``::

    python benchmarks/bench_kernels.py --models flux-dev-width --scratch /dev/shm --commit <sha>

JSON to ``--out`` (default ``docs/bench/<date>_kernels_<model>_<gpu>.json``); a table on stdout. ``--device cpu
--models tiny-flux --batches 1,2 --rounds 1 --iters 1`` is the CPU smoke (no graphs: the padded forwards run on
the static buffers). The exit status is 1 if a bucket of either tier fails its tolerance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bcg_core import BucketConfig, DiTPipeline, LimitsConfig  # noqa: E402
from bcg_core.config import RunnerConfig, SchedulerConfig  # noqa: E402
from bcg_core.models import load_model  # noqa: E402
from bcg_core.verify import RTOL, verify_runner  # noqa: E402
from bcg_core.verify_inputs import BoundaryCase, random_inputs  # noqa: E402
from deployments.settings import ServeConfig  # noqa: E402

MODELS = {  # name: (bench_fused_step model, sizes in pixels)
    "flux-dev-width": ("flux-dev-width", [1024, 512]),
    "sd3-medium": ("sd3-medium", [1024, 512]),
    "pixart-512": ("pixart-512", [512]),
    "tiny-flux": ("tiny-flux", [64]),
}


TIERS = {  # --tiers name: (runner.kernels, runner.compile_mode)
    "eager": ("eager", "default"),
    "compiled": ("compiled", "default"),
    "autotune": ("compiled", "max-autotune-no-cudagraphs"),
    "fp8": ("fp8", "default"),
}
"""The tiers ``--tiers`` names: ``autotune`` is ``compiled`` with inductor's ``max-autotune-no-cudagraphs`` mode
(matmul configurations searched at compile), to choose ``runner.compile_mode`` by measurement."""


def build(name: str, scratch: str | None, device: torch.device):
    """The model's ``ModelConfig`` and what was built (random weights under ``scratch``)."""
    if name == "pixart-512":
        import tempfile

        import bench_families

        spec = bench_families.bench_models(tiny=device.type != "cuda")["pixart-sigma-512"]
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        folder = Path(tempfile.mkdtemp(prefix="bcg-kernels-pixart-", dir=scratch))
        info = bench_families.build_checkpoint(spec, folder, device, getattr(torch, dtype))
        from bcg_core import ModelConfig

        return ModelConfig(path=str(folder), device=device.type, dtype=dtype), info
    from bench_fused_step import build as build_fused

    return build_fused(MODELS[name][0], scratch, device)


def _replay_ms(entry, iters: int) -> float:
    """Milliseconds of one replay of ``entry``'s graph (mean of ``iters``, CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    entry.graph.replay()
    start.record()
    for _ in range(iters):
        entry.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _forward_ms(pipe: DiTPipeline, key, inputs, iters: int) -> float:
    """Milliseconds of one padded forward through the runner (CPU: no graph)."""
    t0 = time.perf_counter()
    for _ in range(iters):
        pipe.runner.run(key, inputs)
    return (time.perf_counter() - t0) * 1e3 / iters


KERNEL_KINDS = (
    ("triton", ("triton_",)),
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "scaled_mm", "splitk", "sm90_", "sm80_")),
)
"""Kernel kinds of :func:`kernel_split`, by substrings of the CUDA kernel's name (the first kind that matches wins:
inductor's kernels start ``triton_``, also those named after the SDPA call they feed, such as RoPE fused into
``triton_poi_fused__scaled_dot_product_*_attention_*``; cuDNN's attention kernels hold ``cudnn``, its matmuls do not
run here; cuBLAS's Hopper kernels are ``nvjet_*`` and ``sm90_xmma_gemm_*``). A kernel no kind matches counts as
``other`` (ATen's elementwise and reduction kernels)."""


def _kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` kind of a CUDA kernel's name, ``other`` when none matches."""
    low = name.lower()
    return next((kind for kind, subs in KERNEL_KINDS if any(t in low for t in subs)), "other")


def kernel_split(replay, iters: int) -> dict:
    """Milliseconds per call of ``replay`` (a graph replay: one transformer forward) by kernel kind.

    Runs ``replay`` ``iters`` times under torch.profiler (CUDA activity only; CUPTI records the kernels a graph
    launches) and sums each CUDA kernel's duration into its :data:`KERNEL_KINDS` kind. Returns ``{kind: ms}`` for
    the kinds plus ``other``, ``kernels_ms`` (their sum, memory copies and sets left out; kernels of a graph replay
    run one after another on its stream, so this is its kernel time), ``count`` (kernels per replay) and
    ``top`` (the 8 kernels with the most time: name cut to 90 characters, ms per replay, kind). Empty kinds when the
    profiler saw no kernel (``count`` 0).
    """
    from bench_families import cuda_events
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
        torch.cuda.synchronize()
    split = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    by_name: dict[str, float] = {}
    count = 0
    for e in cuda_events(prof):
        name, ms = e.name(), e.duration_ns() / 1e6 / iters
        if "memcpy" in name.lower() or "memset" in name.lower():
            continue
        split[_kind(name)] += ms
        by_name[name] = by_name.get(name, 0.0) + ms
        count += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    kinds = {k: round(v, 3) for k, v in split.items()}
    return kinds | {"kernels_ms": round(sum(split.values()), 3), "count": count // max(iters, 1),
                    "top": [[n[:90], round(ms, 3), _kind(n)] for n, ms in top]}


def bench_model(name: str, args, device: torch.device) -> dict:
    """Both tiers of one model: the rows of every bucket."""
    model_cfg, info = build(name, args.scratch, device)
    sizes = MODELS[name][1]
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    model = load_model(model_cfg)
    load_s = time.perf_counter() - t0
    native = model.rules.native_text_tokens
    text = [native] if native else [args.text_tokens]
    table = BucketConfig(batch_sizes=batches, resolutions=[f"{s}x{s}" for s in sizes], text_lengths=text)
    limits = LimitsConfig(min_side_px=min(sizes), max_side_px=max(sizes), max_images=max(batches))
    pipes, prepare_s = {}, {}
    for tier in args.tiers.split(","):
        kernels, mode = TIERS[tier]
        config = ServeConfig(model=model_cfg, buckets=table, limits=limits,
                             runner=RunnerConfig(kernels=kernels, compile_mode=mode, fused_step="never"),
                             scheduler=SchedulerConfig(measure_costs="never"))
        t0 = time.perf_counter()
        # fp8 turns the model's linear layers to float8 in place, and a model holds one set of compiled kernels:
        # every tier after the first compiled one gets a model of its own
        own = tier == "fp8" or (kernels != "eager" and any(TIERS[t][0] != "eager" for t in pipes))
        pipes[tier] = DiTPipeline(config, load_model(model_cfg) if own else model)
        prepare_s[tier] = round(time.perf_counter() - t0, 2)
        print(f"{name}: {tier} prepared ({len(pipes[tier].table.keys)} buckets) in {prepare_s[tier]} s", flush=True)
    graphs = device.type == "cuda"
    rows = []
    for key in pipes["eager"].table.keys:
        case = BoundaryCase(key, key.batch, pipes["eager"]._example_grid(key), key.text_tokens)
        inputs = random_inputs(model.adapter, case, model.device, model.dtype, seed=0)
        row = {"bucket": str(key), "rows": key.batch, "tokens": key.tokens}
        times = {tier: [] for tier in pipes}
        for _ in range(args.rounds):
            for tier, pipe in pipes.items():
                entry = pipe.runner.entries.get(key)
                if graphs and entry is not None and entry.graph is not None:
                    pipe.runner.run(key, inputs)  # fills the buffers
                    times[tier].append(_replay_ms(entry, args.iters))
                else:
                    times[tier].append(_forward_ms(pipe, key, inputs, args.iters))
        for tier, pipe in pipes.items():
            described = next(d for d in pipe.runner.describe() if d["key"] == str(key))
            kernels = pipe.runner.kernels  # a compiled tier's own bound (bcg_core.verify.kernel_tolerance)
            rtol = kernels.rtol if kernels is not None and kernels.rtol is not None else RTOL[model.dtype]
            verdict, = verify_runner(pipe.model.adapter, pipe.runner, [case], model.device, model.dtype, rtol=rtol)
            row[f"{tier}_rtol"] = rtol
            row[f"{tier}_ms"] = round(statistics.median(times[tier]), 4)
            row[f"{tier}_mode"], row[f"{tier}_kernels"] = described["mode"], described["kernels"]
            row[f"{tier}_prepare_s"] = described["capture_s"]
            row[f"{tier}_rel_err"] = float(f"{verdict.max_rel_err:.3e}")
            row[f"{tier}_passed"] = verdict.passed
            entry = pipe.runner.entries.get(key)
            if args.profile and graphs and entry is not None and entry.graph is not None:
                pipe.runner.run(key, inputs)
                row[f"{tier}_split"] = kernel_split(entry.graph.replay, args.iters)
        for tier in pipes:
            if tier != "eager" and row.get("eager_ms"):
                row[f"{tier}_ratio"] = round(row[f"{tier}_ms"] / row["eager_ms"], 4)
        row["ratio"] = row.get("compiled_ratio")
        rows.append(row)
        print(f"{name} {row['bucket']}: " + ", ".join(
            f"{t} {row[f'{t}_ms']:.3f} ms (x{row.get(f'{t}_ratio', 1.0)}, rel err {row[f'{t}_rel_err']:.1e})"
            for t in pipes), flush=True)
        for t in pipes:
            if f"{t}_split" in row:
                print(f"  {t} split: " + ", ".join(f"{k} {v}" for k, v in row[f"{t}_split"].items() if k != "top"),
                      flush=True)
    kernels = next((p.runner.kernels for p in pipes.values() if p.runner.kernels is not None), None)
    return {"model": name, "built": info, "dtype": str(model.dtype).removeprefix("torch."), "load_s": round(load_s, 2),
            "tiers": list(pipes), "prepare_s": prepare_s,
            "compile_s": {t: round(p.runner.kernels.compile_s, 2) for t, p in pipes.items() if p.runner.kernels},
            "regional": kernels.regional if kernels else None, "compiled_blocks": len(kernels.blocks) if kernels else 0,
            "fp8_layers": pipes["fp8"].stats()["kernels"]["fp8_layers"] if "fp8" in pipes else 0,
            "rtol": RTOL[model.dtype], "buckets": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="flux-dev-width")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--batches", default="1,2,4,8", help="batch sizes (rows) of the table")
    ap.add_argument("--tiers", default="eager,compiled",
                    help=f"kernel tiers, eager first, of {','.join(TIERS)} (autotune: compiled in inductor's "
                    "max-autotune-no-cudagraphs mode)")
    ap.add_argument("--text-tokens", type=int, default=256, help="text bucket of masked-text families")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="also split each replay's GPU time by kernel kind (torch.profiler; GPU only)")
    ap.add_argument("--iters", type=int, default=10, help="replays per timed round")
    ap.add_argument("--scratch", help="folder for the random-weight checkpoints (default: a temp dir)")
    ap.add_argument("--out", help="JSON result (default docs/bench/<date>_kernels_<models>_<gpu>.json)")
    ap.add_argument("--commit", help="git commit to record")
    args = ap.parse_args(argv)
    tiers = args.tiers.split(",")
    if tiers[0] != "eager" or any(t not in TIERS for t in tiers) or len(set(tiers)) != len(tiers):
        ap.error(f"--tiers: eager first, then any of {','.join(TIERS)}, each once; got {args.tiers!r}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = [bench_model(m, args, device) for m in args.models.split(",")]
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": gpu, "commit": args.commit,
              "torch": torch.__version__, "command": " ".join(sys.argv), "models": results}
    out = Path(args.out or ROOT / "docs" / "bench" / (f"{datetime.now(timezone.utc):%Y-%m-%d}_kernels_"
                                                     f"{args.models.replace(',', '+')}_{gpu.split()[-1].lower()}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    failed = [(r["model"], b["bucket"], t) for r in results for b in r["buckets"] for t in r["tiers"]
              if not b[f"{t}_passed"]]
    if failed:
        print(f"over tolerance: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
