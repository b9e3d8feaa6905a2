"""Per-step benchmark of bucketed CUDA graphs against eager diffusers, on a CUDA GPU.

For each bucket (batch rows x resolution, FLUX text at its native length) it measures, in one process
and one run so the numbers compare as ratios:

- ``eager_ms``: the unpadded diffusers forward (``FluxTransformer2DModel.__call__``), median of iters;
- ``graph_ms``: bcg's ``CudaGraphRunner.run`` (copy inputs into static buffers, replay, clone outputs);
- ``floor_ms``: kernel-busy time, the sum of CUDA kernel durations of one eager forward (torch.profiler);
- ``kernels``: kernels launched per forward;
- capture seconds and graph-pool MiB per bucket, with one shared pool and with a private pool per bucket.

Models: published configs with random weights in bf16 (``flux-dev``: black-forest-labs/FLUX.1-dev
transformer config, 11.9B parameters; ``flux-small``: a 2+2-block model for quick checks).

Usage (on the GPU machine)::

    python benchmarks/bench_graphs.py --model flux-dev --sizes 512x512,1024x1024 --batches 1,2,4,8 \\
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bcg_core import BucketKey, BucketMetrics, FluxAdapter, parse_size
from bcg_core.graphs import CudaGraphRunner
from bcg_core.verify import BoundaryCase, random_inputs

MODELS = {
    # black-forest-labs/FLUX.1-dev transformer/config.json
    "flux-dev": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                     guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
    "flux-small": dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=64,
                       num_attention_heads=4, joint_attention_dim=128, pooled_projection_dim=96,
                       guidance_embeds=False, axes_dims_rope=(16, 24, 24)),
}
TEXT_TOKENS = {"flux-dev": 512, "flux-small": 64}


def cuda_ms(fn, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, timed with CUDA events after 2 warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_floor(fn) -> tuple[float, int]:
    """(sum of CUDA kernel milliseconds, kernel count) of one ``fn()`` call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in kernels)
    return total_us / 1e3, len(kernels)


def buffer_bytes(runner: CudaGraphRunner) -> int:
    """Bytes of a runner's static input buffers (allocated outside the graph pool)."""
    return sum(t.numel() * t.element_size() for e in runner.entries.values() for t in e.buffers.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="flux-small")
    ap.add_argument("--sizes", default="512x512,1024x1024", help="comma-separated WxH")
    ap.add_argument("--batches", default="1,2,4,8", help="comma-separated transformer rows")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--with-masked", action="store_true",
                    help="also time each size through its tier's masked bucket (the graph that serves smaller sizes)")
    ap.add_argument("--private-pools", action="store_true", help="also capture each bucket in a private pool")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    from diffusers import FluxTransformer2DModel

    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = FluxTransformer2DModel(**MODELS[args.model])
    model = model.to_empty(device=dev).to(dtype)
    for name, p in model.named_parameters():  # random weights: matrices N(0, 0.02), norm scales 1, biases 0
        if p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.02)
        elif name.endswith("weight"):
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.zeros_(p)
    model.eval()
    params_b = sum(p.numel() for p in model.parameters()) / 1e9
    adapter = FluxAdapter(model, TEXT_TOKENS[args.model])
    text = TEXT_TOKENS[args.model]
    print(f"{args.model}: {params_b:.2f}B params, built in {time.perf_counter() - t0:.1f} s on {torch.cuda.get_device_name()}")

    cases = []
    for size in args.sizes.split(","):
        w, h = parse_size(size)
        grid = adapter.rules.grid(w, h)
        for b in (int(x) for x in args.batches.split(",")):
            for masked in (False, True) if args.with_masked else (False,):
                key = BucketKey(b, grid[0] * grid[1], text, image_mask=masked)
                cases.append((size, BoundaryCase(key, b, grid, text)))
    keys = [c.key for _, c in cases]

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_reserved = torch.cuda.memory_reserved()
    shared = CudaGraphRunner(adapter, keys, BucketMetrics(keys), dev, dtype)
    t0 = time.perf_counter()
    shared.prepare()
    shared_capture_s = time.perf_counter() - t0
    torch.cuda.empty_cache()
    shared_pool = torch.cuda.memory_reserved() - base_reserved - buffer_bytes(shared)
    print(f"shared pool: {len(keys)} buckets captured in {shared_capture_s:.2f} s, pool {shared_pool / 2**20:.0f} MiB")

    rows = []
    for size, case in cases:
        x = random_inputs(adapter, case, dev, dtype)
        with torch.inference_mode():
            eager = cuda_ms(lambda: adapter.forward_eager(x), args.iters)
            floor, kernels = kernel_floor(lambda: adapter.forward_eager(x))
        graph = cuda_ms(lambda: shared.run(case.key, x), args.iters)
        entry = shared.entries[case.key]
        replay = cuda_ms(entry.graph.replay, args.iters)
        out = shared.run(case.key, x).float()
        with torch.inference_mode():
            ref = adapter.forward_eager(x).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        row = dict(size=size, batch=case.rows, key=str(case.key), eager_ms=round(eager, 3), graph_ms=round(graph, 3), replay_only_ms=round(replay, 3),
                   floor_ms=round(floor, 3), kernels=kernels, speedup=round(eager / graph, 2),
                   graph_over_floor=round(graph / floor, 3), capture_s=round(entry.capture_s, 3),
                   pool_mib=round(entry.pool_bytes / 2**20, 1), rel_err=float(f"{err:.2e}"))
        rows.append(row)
        print(json.dumps(row))

    private = None
    if args.private_pools:
        del shared
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        keep = []
        for k in keys:
            r = CudaGraphRunner(adapter, [k], BucketMetrics([k]), dev, dtype)
            r.prepare()
            keep.append(r)
        torch.cuda.empty_cache()
        private = torch.cuda.memory_reserved() - before - sum(buffer_bytes(r) for r in keep)
        print(f"private pools: {private / 2**20:.0f} MiB for {len(keys)} buckets")

    result = dict(model=args.model, params_b=round(params_b, 2), gpu=torch.cuda.get_device_name(),
                  torch=torch.__version__, shared_pool_mib=round(shared_pool / 2**20, 1),
                  private_pools_mib=None if private is None else round(private / 2**20, 1),
                  shared_capture_s=round(shared_capture_s, 2), rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
