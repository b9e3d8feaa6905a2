"""Static or dynamic shapes for the ``compiled`` tier: compile seconds per bucket shape, and replay time, side by side.

The ``compiled`` tier (:mod:`bcg_core.runners.kernels`) compiles the repeated transformer blocks with
``torch.compile(dynamic=False)``: one inductor compile per block class and bucket shape. A FLUX.1-dev-width table
of 63 buckets took about 12 s a bucket on an H100 (docs/BENCHMARKS.md, 2026-12-06), so a cold cache compiles for
over ten minutes. With ``dynamic=True`` dynamo traces each block class with symbolic sizes once (a size of 1 is
still specialized) and every later shape passes its guards, so a table would compile a handful of times; on a
CPU the token dimensions still specialized (the rotary tables' length is guarded), so ``batch`` marks only the
batch dimension dynamic (:func:`batch_dynamic`: batch sizes above 1 of one token shape share a compile). This
script measures whether that costs replay speed, and how long each way compiles, on the same blocks in one run:

- each mode runs in its own process (dynamo's caches and inductor's on-disk cache start empty: a cold compile);
  ``batch-warm`` and ``dynamic-warm`` run ``batch`` and ``dynamic`` again on the cache they filled (a restart);
- per bucket shape (rows x size at the model's text bucket, as ``benchmarks/bench_graphs.py`` builds them, random
  inputs from :func:`bcg_core.verify_inputs.random_inputs`): ``compile_s``, the wall time of the first forward with the
  compiled blocks (the compile and one forward; ~0 where an earlier shape's code is reused); ``graph_ms``, the
  median replay of a CUDA graph captured around that forward (20 replays, CUDA events); ``eager_graph_ms``, the
  same for the eager blocks (the ``eager`` tier); ``rel_err``, max |compiled - eager| / max |eager| of the output;
- ``graphs``: dynamo's compiled graphs at the end (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``), and
  ``recompile_reasons``: the guard failures dynamo logged (``TORCH_LOGS=recompiles``).

Models: ``flux-dev-width`` (FLUX.1-dev's published config with 2 double- and 4 single-stream blocks, as
``benchmarks/bench_saturation.py``'s stand-in), ``pixart-sigma`` (PixArt-Sigma-XL-2-1024-MS), random weights,
bf16. On the GPU machine (after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``)::

    python benchmarks/bench_compile_shapes.py --model flux-dev-width --sizes 512x512,768x768,1024x1024 \\
        --batches 1,2,4,8 --out x.json

On a CPU (``--device cpu``, fp32, the ``*-small`` models of bench_graphs) it checks that the modes run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "benchmarks", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402 - after the path setup above

MODES = ("static", "batch", "batch-warm", "dynamic", "dynamic-warm")


def _model(name: str):
    import bench_graphs

    if name == "flux-dev-width":
        spec = bench_graphs.MODELS["flux-dev"]
        return bench_graphs.BenchModel(spec.cls, dict(spec.config, num_layers=2, num_single_layers=4),
                                       spec.text_tokens, spec.adapter)
    return bench_graphs.MODELS[name]


def _build(name: str, device: torch.device, dtype: torch.dtype):
    import bench_graphs

    spec = _model(name)
    bench_graphs.MODELS[f"_{name}"] = spec
    try:
        model, adapter = bench_graphs.build(f"_{name}", device, dtype)
    finally:
        bench_graphs.MODELS.pop(f"_{name}")
    return model, adapter, spec.text_tokens


def _graph_ms(fn, device: torch.device, iters: int = 20) -> float:
    """Median ms of a CUDA graph replay of ``fn`` (captured after two warm-up calls on a side stream); on a CPU
    the median wall time of ``fn``."""
    if device.type != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def batch_dynamic(compiled):
    """``compiled`` (a static-shape ``torch.compile``) called with the batch dimension of its inputs left to vary,
    as the server's ``compiled`` tier does (:func:`bcg_core.runners.kernels.shared_batch`): batch sizes 2, 3, 4 ...
    of one token shape share one compile (a batch of 1 stays specialized, as dynamo specializes sizes 0 and 1)."""
    from bcg_core.runners.kernels import shared_batch

    def forward(*args, **kwargs):
        shared_batch(args, kwargs)
        return compiled(*args, **kwargs)

    return forward


def worker(args) -> dict:
    """One mode in this process: every case's compile seconds, replay ms and error (module docstring)."""
    from bench_graphs import bench_cases

    from bcg_core.runners.kernels import raise_recompile_limits, repeated_blocks
    from bcg_core.verify_inputs import random_inputs

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model, adapter, text = _build(args.model, device, dtype)
    cases = bench_cases(adapter, text, args.sizes.split(","), [int(b) for b in args.batches.split(",")], False)
    inputs = [random_inputs(adapter, case, device, dtype) for _, case in cases]
    rows = []
    with torch.inference_mode():
        refs = []
        for x in inputs:
            refs.append(adapter.forward_eager(x).float())
            rows.append({"eager_graph_ms": round(_graph_ms(lambda x=x: adapter.forward_eager(x), device), 3)})
    blocks = repeated_blocks(model) or [model]
    raise_recompile_limits(256, 256 * len(blocks))
    for block in blocks:
        compiled = torch.compile(block.forward, fullgraph=True, dynamic=args.worker == "dynamic")
        block.forward = batch_dynamic(compiled) if args.worker == "batch" else compiled
    t_all = time.perf_counter()
    with torch.inference_mode():
        for (size, case), x, ref, row in zip(cases, inputs, refs, rows, strict=True):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = adapter.forward_eager(x).float()
            if device.type == "cuda":
                torch.cuda.synchronize()
            row.update(size=size, rows=case.rows, key=str(case.key), compile_s=round(time.perf_counter() - t0, 2),
                       rel_err=float(f"{((out - ref).abs().max() / ref.abs().max()).item():.2e}"))
            row["graph_ms"] = round(_graph_ms(lambda x=x: adapter.forward_eager(x), device), 3)
            row["graph_vs_eager"] = round(row["eager_graph_ms"] / row["graph_ms"], 3)
            print(json.dumps({"mode": args.worker, **row}), flush=True)
    from torch._dynamo.utils import counters

    return {"mode": args.worker, "cases": rows, "compile_s_total": round(sum(r["compile_s"] for r in rows), 1),
            "wall_s": round(time.perf_counter() - t_all, 1), "graphs": counters["stats"]["unique_graphs"]}


def _env(device: str) -> dict:
    import diffusers

    gpu = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else None
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "diffusers": diffusers.__version__, "gpu": gpu}


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flux-dev-width",
                    help="flux-dev-width or a benchmarks/bench_graphs.py model (flux-small, pixart-sigma, ...)")
    ap.add_argument("--sizes", default="512x512,1024x1024")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit")
    ap.add_argument("--worker", choices=("static", "batch", "dynamic"), help=argparse.SUPPRESS)
    args = ap.parse_args(raw)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: a subset of {','.join(MODES)}")
    result = {"benchmark": "compile_shapes", **_env(args.device), "commit": args.commit, "model": args.model,
              "command": " ".join(["python", "benchmarks/bench_compile_shapes.py", *raw]), "modes": []}
    caches = {}
    for mode in modes:
        base = mode.removesuffix("-warm")
        cache = caches.get(base) if mode.endswith("-warm") else None
        if cache is None:
            cache = caches[base] = tempfile.mkdtemp(prefix=f"bcg-compile-{base}-")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                   TORCH_LOGS="recompiles")
        cmd = [sys.executable, __file__, *raw, "--worker", base]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-4000:])
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        entry = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-2000:]}
        reasons = [ln.split("[__recompiles]", 1)[1].strip() for ln in proc.stderr.splitlines()
                   if "[__recompiles]" in ln and "mismatch" in ln]
        entry.update(mode=mode, process_s=round(time.perf_counter() - t0, 1),
                     recompile_reasons=sorted(set(reasons))[:40])
        result["modes"].append(entry)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in entry.items() if k != "cases"}), flush=True)
    by = {m["mode"]: m for m in result["modes"] if "cases" in m}
    for mode in ("batch", "dynamic"):
        if "static" in by and mode in by:
            s, d = by["static"]["cases"], by[mode]["cases"]
            result[f"{mode}_vs_static_replay"] = [round(a["graph_ms"] / b["graph_ms"], 3)
                                                  for a, b in zip(s, d, strict=True)]
            print(f"{mode}/static replay speed per case:", result[f"{mode}_vs_static_replay"])
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if all("cases" in m for m in result["modes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
