"""Per-step benchmark of bucketed CUDA graphs against eager diffusers, on a CUDA GPU.

For each bucket (batch rows x resolution x the model's text bucket) it measures, in one process and one
run so the numbers compare as ratios:

- ``eager_ms``: the unpadded diffusers forward (the transformer's ``__call__``), median of iters;
- ``graph_ms``: bcg's ``CudaGraphRunner.run`` (copy inputs into static buffers, replay, clone outputs);
- ``floor_ms``: kernel-busy time, the sum of CUDA kernel durations of one eager forward (torch.profiler);
- ``kernels``: kernels launched per forward;
- capture seconds and graph-pool MiB per bucket, with one shared pool and with a private pool per bucket.

Models: published transformer configs with random weights in bf16, each with its family's adapter
(``flux-dev``: FLUX.1-dev, 11.9B parameters, 512 unmasked text tokens; ``sd3-medium``: Stable Diffusion 3
medium, 2.0B, 333 unmasked text tokens, keyed on the latent grid; ``pixart-sigma``: PixArt-Sigma-XL-2-1024-MS,
0.6B, masked text bucket of 128 of its 300 T5 tokens, keyed on the latent grid) and small variants of
each family (``*-small``) for quick checks.

Usage (on the GPU machine)::

    python benchmarks/bench_graphs.py --model flux-dev --sizes 512x512,1024x1024 --batches 1,2,4,8 \\
        --json out.json

``--dry-run`` builds the model and its buckets on the CPU in fp32 and checks each padded bucket forward
against the unpadded eager one, without timing (no GPU needed; meant for the ``*-small`` models).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bcg_core import (
    BucketKey,
    BucketMetrics,
    DiTAdapter,
    EagerBucketRunner,
    FluxAdapter,
    PixArtAdapter,
    SD3Adapter,
    parse_size,
)
from bcg_core.planning.profile import cuda_ms, kernel_floor
from bcg_core.runners.cuda_graph import CudaGraphRunner
from bcg_core.verify_inputs import BoundaryCase, random_inputs


@dataclass(frozen=True)
class BenchModel:
    """A benchmarked transformer: its diffusers class, config, text bucket and adapter.

    Attributes:
        cls: the diffusers class name (``diffusers.<cls>``).
        config: constructor arguments (a published ``transformer/config.json``, or a small variant).
        text_tokens: the text bucket benchmarked (the native length for families with unmasked text).
        adapter: builds the family's adapter from the model and ``text_tokens``.
    """

    cls: str
    config: dict
    text_tokens: int
    adapter: Callable[[torch.nn.Module, int], DiTAdapter]


def _flux(model: torch.nn.Module, text: int) -> DiTAdapter:
    return FluxAdapter(model, native_text_tokens=text)


def _sd3(model: torch.nn.Module, text: int) -> DiTAdapter:
    return SD3Adapter(model, native_text_tokens=text)


def _pixart(model: torch.nn.Module, text: int) -> DiTAdapter:
    return PixArtAdapter(model)  # text is a masked bucket (<= 300 T5 tokens), not a native length

_FLUX = {
    # black-forest-labs/FLUX.1-dev transformer/config.json
    "flux-dev": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                     guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
    "flux-small": dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=64,
                       num_attention_heads=4, joint_attention_dim=128, pooled_projection_dim=96,
                       guidance_embeds=False, axes_dims_rope=(16, 24, 24)),
}
_TEXT = {"flux-dev": 512, "flux-small": 64}

MODELS: dict[str, BenchModel] = {
    **{name: BenchModel("FluxTransformer2DModel", cfg, _TEXT[name], _flux) for name, cfg in _FLUX.items()},
    # stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json, as diffusers'
    # scripts/convert_sd3_to_diffusers.py builds it for SD3.0 medium: 24 layers, heads = layers = 24 of 64
    # channels, caption_projection_dim 1536 (= 24 x 64, read from the checkpoint's context_embedder),
    # pos_embed_max_size 192 ("sd3.0 and sd3.5 8b use 192"), 16 latent channels; 2.03B parameters.
    # Text: 77 CLIP + 256 T5 tokens (StableDiffusion3Pipeline, max_sequence_length=256).
    "sd3-medium": BenchModel("SD3Transformer2DModel", dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
        out_channels=16, pos_embed_max_size=192), 77 + 256, _sd3),
    "sd3-small": BenchModel("SD3Transformer2DModel", dict(
        sample_size=64, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=64,
        num_attention_heads=4, joint_attention_dim=256, caption_projection_dim=256, pooled_projection_dim=128,
        out_channels=16, pos_embed_max_size=96), 77 + 256, _sd3),
    # PixArt-alpha/PixArt-Sigma-XL-2-1024-MS transformer/config.json (huggingface.co, commit edfd592; later
    # copies of it name "use_additional_conditions": false, which PixArtSigmaPipeline's
    # added_cond_kwargs={"resolution": None, "aspect_ratio": None} requires): 28 layers, 16 heads of 72,
    # caption_channels 4096 (T5-XXL), sample_size 128, interpolation_scale 2, learned sigma (out_channels 8);
    # 0.61B parameters. Text: a masked bucket of 128 of the 300 T5 tokens it was trained with.
    "pixart-sigma": BenchModel("PixArtTransformer2DModel", dict(
        num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
        cross_attention_dim=1152, attention_bias=True, sample_size=128, patch_size=2,
        activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=2, use_additional_conditions=False,
        caption_channels=4096), 128, _pixart),
    "pixart-small": BenchModel("PixArtTransformer2DModel", dict(
        num_attention_heads=4, attention_head_dim=64, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=256, sample_size=128, patch_size=2, interpolation_scale=2,
        use_additional_conditions=False, caption_channels=256), 128, _pixart),
}


def build(name: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, DiTAdapter]:
    """Model ``name`` of :data:`MODELS` with random weights on ``device`` in ``dtype``, and its adapter.

    Weights: matrices N(0, 0.02), norm scales 1, biases 0. A model without buffers is built on the meta
    device and materialised with ``to_empty`` (no slow CPU init of 12B parameters); a model with buffers
    (the sin-cos position tables of SD3 and PixArt, computed in ``__init__``) is built on ``device``
    itself, since ``to_empty`` would leave those tables uninitialised.
    """
    import diffusers

    spec = MODELS[name]
    cls = getattr(diffusers, spec.cls)
    with torch.device("meta"):
        model = cls(**spec.config)
    if any(True for _ in model.buffers()):
        with torch.device(device):
            model = cls(**spec.config)
        model = model.to(dtype)
    else:
        model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim >= 2:
                torch.nn.init.normal_(p, std=0.02)
            elif pname.endswith("weight"):
                torch.nn.init.ones_(p)
            else:
                torch.nn.init.zeros_(p)
    model.eval()
    return model, spec.adapter(model, spec.text_tokens)


def bench_cases(adapter: DiTAdapter, text: int, sizes: list[str], batches: list[int],
                with_masked: bool) -> list[tuple[str, BoundaryCase]]:
    """One exact-fit case per size and batch (plus its tier's masked bucket with ``with_masked``).

    Grid-keyed families (SD3, PixArt) key each size on its latent grid and have no masked image buckets.
    """
    grid_keyed = adapter.rules.grid_keyed
    cases = []
    for size in sizes:
        w, h = parse_size(size)
        adapter.rules.check_size(w, h)
        grid = adapter.rules.grid(w, h)
        for b in batches:
            for masked in (False, True) if with_masked and not grid_keyed else (False,):
                key = BucketKey(b, grid[0] * grid[1], text, grid if grid_keyed else None, image_mask=masked)
                cases.append((size, BoundaryCase(key, b, grid, text)))
    return cases


def dry_run(name: str, sizes: list[str], batches: list[int], with_masked: bool = False) -> list[dict]:
    """Build ``name`` on the CPU in fp32 and check each bucket's padded forward against unpadded eager.

    Returns:
        One row per case: size, batch, key, output shape and relative error.
    """
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model, adapter = build(name, cpu, torch.float32)
    cases = bench_cases(adapter, MODELS[name].text_tokens, sizes, batches, with_masked)
    keys = [c.key for _, c in cases]
    runner = EagerBucketRunner(adapter, keys, BucketMetrics(keys), cpu, torch.float32)
    runner.prepare()
    rows = []
    for size, case in cases:
        x = random_inputs(adapter, case, cpu, torch.float32)
        out = runner.run(case.key, x)
        with torch.inference_mode():
            ref = adapter.forward_eager(x)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        rows.append(dict(size=size, batch=case.rows, key=str(case.key), shape=list(out.shape),
                         rel_err=float(f"{err:.2e}")))
    return rows


def compiled_step(adapter: DiTAdapter, x, iters: int) -> dict:
    """``torch.compile(mode="reduce-overhead")`` of the unpadded forward: compile seconds and step ms.

    The first call compiles and captures (its wall time is ``compile_s``); later calls replay. Dynamo's
    cache is reset first, so each shape pays its own compilation, as a new bucket would.
    """
    import copy

    torch._dynamo.reset()
    compiled = copy.copy(adapter)
    compiled.model = torch.compile(adapter.model, mode="reduce-overhead", dynamic=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        compiled.forward_eager(x)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        step = cuda_ms(lambda: compiled.forward_eager(x), iters)
    return dict(compile_ms=round(step, 3), compile_s=round(compile_s, 1))


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
    ap.add_argument("--compile-batches", default="",
                    help="comma-separated rows for which to also time torch.compile(mode='reduce-overhead') "
                    "(compile seconds reported; slow: tens of seconds per shape)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dry-run", action="store_true",
                    help="build on the CPU in fp32 and check padded vs eager per bucket, no timing "
                    "(no GPU needed)")
    args = ap.parse_args()
    sizes, batches = args.sizes.split(","), [int(x) for x in args.batches.split(",")]

    if args.dry_run:
        for row in dry_run(args.model, sizes, batches, args.with_masked):
            print(json.dumps(row))
        return

    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, adapter = build(args.model, dev, dtype)
    params_b = sum(p.numel() for p in model.parameters()) / 1e9
    text = MODELS[args.model].text_tokens
    print(f"{args.model}: {params_b:.2f}B params, built in {time.perf_counter() - t0:.1f} s "
          f"on {torch.cuda.get_device_name()}")

    cases = bench_cases(adapter, text, sizes, batches, args.with_masked)
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
            eager = cuda_ms(lambda x=x: adapter.forward_eager(x), args.iters)
            floor, kernels = kernel_floor(lambda x=x: adapter.forward_eager(x))
        graph = cuda_ms(lambda key=case.key, x=x: shared.run(key, x), args.iters)
        entry = shared.entries[case.key]
        replay = cuda_ms(entry.graph.replay, args.iters)
        out = shared.run(case.key, x).float()
        with torch.inference_mode():
            ref = adapter.forward_eager(x).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        row = dict(size=size, batch=case.rows, key=str(case.key), eager_ms=round(eager, 3), graph_ms=round(graph, 3),
                   replay_only_ms=round(replay, 3), floor_ms=round(floor, 3), kernels=kernels,
                   speedup=round(eager / graph, 2), graph_over_floor=round(graph / floor, 3),
                   capture_s=round(entry.capture_s, 3), pool_mib=round(entry.pool_bytes / 2**20, 1),
                   rel_err=float(f"{err:.2e}"))
        if str(case.rows) in args.compile_batches.split(",") and not case.key.image_mask:
            row.update(compiled_step(adapter, x, args.iters))
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
