"""One request, side by side in one process: diffusers' own pipeline (eager, and with its regional compilation)
against bcg-serve's kernel tiers (eager kernels in a CUDA graph, compiled kernels in a CUDA graph).

Per case (``--cases``, from ``benchmarks/bench_families.py``'s ``CASES``: published transformer config with random
weights, bf16, the real VAE config, random stand-in text encoders), one checkpoint is built under ``--scratch`` and:

- ``diffusers``: the family's diffusers pipeline, ``from_pretrained`` of that folder, called with the request's
  prompt, size, steps, guidance and one CPU generator per image (as bcg-serve seeds them);
- ``diffusers-compiled``: a second copy of it with ``transformer.compile_repeated_blocks(fullgraph=True)`` (FLUX.1,
  FLUX.2, Z-Image, Qwen-Image: diffusers' documented one line; their transformers name ``_repeated_blocks``), or
  ``torch.compile(transformer, fullgraph=True)`` where the transformer names no repeated blocks;
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
    python benchmarks/bench_tiers.py --cases flux2-klein-1024 \
        --modes diffusers,diffusers-compiled,bcg-compiled,bcg-fp8 --steps 10 --repeats 2 --scratch /dev/shm \
        --commit <sha> --out tiers_flux2-klein.json

(cases of ``bench_families.CASES``: pixart-512, pixart-1024, sd3-512, sd3-1024, sana-1024, flux-dev-1024,
flux-dev-width-512, flux2-klein-1024, flux2-dev-slice-1024, zimage-1024.)

Compute accounting (``compute`` per case, and per mode): before the modes, one transformer forward of the request's
exact shape is counted with ``torch.utils.flop_counter.FlopCounterMode`` (one eager forward, no grad), as each side
runs it. A forward pre-hook on the transformer records its real args/kwargs during a 1-step call (diffusers'
eager pipeline with ``output_type="latent"``; an eager ``DiTPipeline`` over the exact bucket), which also counts
the forwards per step; the first call's inputs are then run once under the counter. The rows are the rows a
denoising step runs: classifier-free guidance rows included where the family batches them (PixArt, SD3, Sana: 2n),
FLUX.1-dev and FLUX.2 [dev] one row per image (guidance embedding). FLUX.2 [klein] with CFG: diffusers runs two
forwards per step (cond, then uncond), bcg-serve one of 2n rows; Z-Image batches its 2n CFG rows on both sides, and
bcg-serve's fixed-shape Z-Image forward (the transformer's modules one by one, not its ``forward``) is counted on its
bucket buffers (:func:`one_forward`'s ``adapter``). The two sides differ only in text length where bcg-serve runs the
prompt's text bucket and diffusers its padded ``max_sequence_length`` (PixArt, Sana; Z-Image's exact caption bucket
holds the same 32-slot blocks the transformer rounds a caption to). FlopCounterMode counts the
matrix products only: mm/addmm/bmm/baddbmm, ``_scaled_mm``, convolutions and SDPA attention (QK^T and PV; the flash,
efficient and cudnn kernels, and here the CPU's fused one as well); not elementwise ops, norms, softmax or
activations, so it is the tensor-core work a peak figure is about. Reported: per case ``forward_tflop`` (TFLOP of
one forward, as diffusers runs it) and ``forwards`` (steps x forwards per step); per mode its side's
``forward_tflop`` and ``forwards``, ``tflops_over_wall`` (forward_tflop x forwards / wall s: a lower bound, as the
wall also holds encode and decode), ``denoise_tflops`` (the same over the denoise split, where the mode has one:
bcg-serve's modes) and ``of_peak`` (denoise_tflops / peak; ``wall_of_peak`` from the wall, for every mode).

``peak_gpu_gb`` per case: ``torch.cuda.max_memory_allocated`` from loading bcg-serve's model to the case's end, every
mode's pipeline resident together (diffusers' transformer, once, shared by its modes; bcg-serve's; ``bcg-fp8``'s own).

``--peak-tflops``: the GPU's dense bf16 peak (fp32 with ``--tiny``). Default on CUDA where the GPU's name holds
"H100" or "H200" (not "PCIe" or "NVL"): 989.4 TFLOPS, the dense BF16 tensor-core figure of NVIDIA's H100 / H200 SXM
datasheets, and 1978.9 dense FP8 for ``bcg-fp8``; elsewhere none (``of_peak`` is then null). A given
``--peak-tflops`` sets the bf16 peak and twice it as the fp8 peak (Hopper's ratio).

``--compile-decode``: ``runner.compile_decode`` in ``bcg-compiled`` and ``bcg-fp8`` (each then loads its own model,
so ``bcg-eager``'s VAE stays eager); after its first request the mode waits for the background decode compile, and
its ``decode_compile`` reports the wait and each latent shape's state and eager / compiled ms.

Step cache (``--cache-threshold T``): every mode but ``diffusers-uncached`` (diffusers' eager pipeline without the
hook: the baseline of each mode's ``served_vs_diffusers_uncached``) runs with First Block Cache at threshold ``T``:
diffusers' modes with ``transformer.enable_cache(FirstBlockCacheConfig(threshold=T))`` (on the compiled copy too),
bcg-serve's with the request's ``cache={"method": "first_block", "threshold": T}``. ``--cache-search T1,T2,...``
first runs diffusers' eager pipeline once per threshold and takes the one whose computed share of the steps is
closest to a half (``cache_search``: steps computed per threshold), since random weights do not show real skip
rates: both sides are compared at the same config, with the steps each computed reported per mode
(``computed_steps``: diffusers' counted at the last block's first layer, which runs only when the remaining blocks
do, and not for ``diffusers-compiled``, whose compiled blocks run no forward hook; bcg-serve's from the answer's
``bcg.cache``), and for bcg-serve's modes on CUDA graphs the halves' measured shares of the whole forward
(``step_cache_shares``, :attr:`bcg_core.costs.CostModel.piece_shares`).

CPU smoke: ``--device cpu --tiny --repeats 1`` (fp32 tiny configs; bcg modes without graphs, no ``bcg-fp8``;
tests/engine/test_bench_tiers.py runs the FLUX.2 and Z-Image cases with ``--modes diffusers,bcg-eager``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import io
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils import flop_counter

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import bench_families  # noqa: E402

from bcg_core import DiTPipeline, GenerationRequest, load_model  # noqa: E402
from bcg_core.config import EngineConfig, LimitsConfig, ModelConfig, RunnerConfig  # noqa: E402

TABLE = {"wall ms": "wall_ms", "x diffusers": "vs_diffusers", "served ms": "served_ms",  # header: key per mode
         "x served": "served_vs_diffusers", "first ms": "first_ms", "denoise ms": "denoise_ms",
         "decode ms": "decode_ms", "PNG ms": "image_encode_ms", "TFLOP/fwd": "forward_tflop", "fwds": "forwards",
         "TFLOPS/wall": "tflops_over_wall", "denoise TFLOPS": "denoise_tflops", "of peak": "of_peak",
         "computed steps": "computed_steps", "x uncached": "served_vs_diffusers_uncached"}
MODES = ("diffusers", "diffusers-uncached", "diffusers-compiled", "bcg-eager", "bcg-compiled", "bcg-fp8")
HOPPER_SXM_PEAK_TFLOPS = (989.4, 1978.9)  # dense BF16, FP8 tensor-core TFLOPS: NVIDIA H100 / H200 SXM datasheets


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shared_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers are ``module``'s own tensors (no new weight memory), with
    modules of its own: its cache hooks and compiled blocks stay on the copy. Each diffusers mode runs such a twin of
    one loaded transformer, so the full FLUX.1-dev (24 GB in bf16) fits one H100 beside bcg-serve's two models."""
    memo = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


def diffusers_pipeline(folder: Path, dtype: torch.dtype, device: torch.device, compiled: bool,
                       cache: float | None = None, weights: torch.nn.Module | None = None):
    """The checkpoint's own diffusers pipeline; with ``compiled``, its transformer compiled as diffusers documents
    (regional where the transformer names repeated blocks, whole otherwise); with ``cache``, First Block Cache at
    that threshold (``transformer.enable_cache``), and a counter of the steps whose remaining blocks ran
    (``pipe.computed``: forwards of the last block's first layer); with ``weights`` (a loaded transformer of the
    same checkpoint), a :func:`shared_twin` of it instead of loading the transformer again."""
    import diffusers

    index = json.loads((folder / "model_index.json").read_text())
    extra = {} if weights is None else {"transformer": shared_twin(weights)}
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(str(folder), torch_dtype=dtype, **extra).to(device)
    pipe.set_progress_bar_config(disable=True)
    if cache is not None:
        from bcg_core.step_cache import FirstBlockCache, to_diffusers
        from bcg_core.step_cache.split import block_names

        pipe.transformer.enable_cache(to_diffusers(FirstBlockCache(threshold=cache)))
        pipe.computed = [0]
        tail = dict(pipe.transformer.named_modules())[block_names(pipe.transformer)[-1]]
        next(tail.children()).register_forward_hook(lambda *_: pipe.computed.__setitem__(0, pipe.computed[0] + 1))
    if compiled:  # with a cache hook on the blocks, its decision (torch.compiler.disable) breaks the graph there
        if getattr(pipe.transformer, "_repeated_blocks", None):
            pipe.transformer.compile_repeated_blocks(fullgraph=cache is None)
        else:
            pipe.transformer.compile(fullgraph=cache is None)
    return pipe


def cache_search(folder: Path, req: GenerationRequest, thresholds: list[float], dtype, device,
                 weights: torch.nn.Module | None = None) -> dict:
    """diffusers' eager pipeline with First Block Cache at each threshold: the steps it computed for ``req``."""
    out = {}
    for t in thresholds:
        pipe = diffusers_pipeline(folder, dtype, device, False, cache=t, weights=weights)
        gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        pipe(prompt=req.prompt, num_images_per_prompt=req.n, width=req.width, height=req.height,
             num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale, generator=gens,
             output_type="latent")
        out[str(t)] = pipe.computed[0]
        print(f"cache search: threshold {t}: {pipe.computed[0]} of {req.num_inference_steps} steps computed",
              flush=True)
        del pipe
        gc.collect()
    return out


def peak_tflops(args, device: torch.device) -> tuple[float | None, float | None]:
    """The (bf16, fp8) peak TFLOPS ``of_peak`` divides by: ``--peak-tflops`` (fp8: twice it), else the H100 / H200
    SXM datasheet figures where the GPU's name says so, else none."""
    if args.peak_tflops:
        return args.peak_tflops, 2 * args.peak_tflops
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    if any(g in name for g in ("H100", "H200")) and not any(v in name for v in ("PCIe", "NVL")):
        return HOPPER_SXM_PEAK_TFLOPS
    return None, None


def _batch_shape(x) -> list[int] | None:
    """``x``'s shape; for a per-row list of tensors (Z-Image's transformer takes its latents and captions so), the
    row count before the first row's shape; None for None."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return [len(x), *x[0].shape]
    return list(x.shape)


def one_forward(transformer: torch.nn.Module, call, adapter=None) -> dict:
    """FLOPs of one ``transformer`` forward with the real inputs of its first call during ``call()`` (a 1-step
    request), and how many forwards that step ran. CPU's fused SDPA kernel is counted as the CUDA ones are. (The
    counter's per-module counts around the whole 1-step call, keyed by the transformer's class name, agree on torch
    2.13; the hook also gives the rows and forwards per step, and runs nothing else under the counter.)

    ``adapter`` (bcg-serve's side): a padding adapter whose bucket forward may not call ``transformer`` itself
    (Z-Image's fixed-shape forward runs the transformer's modules one by one); where the transformer's own forward
    never ran during ``call()``, the adapter's ``forward(buffers)`` calls are recorded instead, and the first one is
    counted on its buffers (rows, latents and text tokens read from them).

    Raises:
        RuntimeError: neither the transformer's forward nor the adapter's ran during ``call()``.
    """
    seen, buffers = [], []
    hook = transformer.register_forward_pre_hook(lambda m, a, kw: seen.append((a, kw)), with_kwargs=True)
    own = adapter is not None and "forward" in vars(adapter)
    if adapter is not None:
        real = adapter.forward

        def recording(bufs):
            buffers.append(bufs)
            return real(bufs)
        adapter.forward = recording
    try:
        call()
    finally:
        hook.remove()
        if adapter is not None:
            if own:
                adapter.forward = real
            else:
                del adapter.forward
    sdpa_cpu = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
                lambda q, k, v, *_, out_shape=None, **__: flop_counter.sdpa_flop_count(q, k, v)}
    if seen:
        args, kwargs = seen[0]
        with torch.no_grad(), flop_counter.FlopCounterMode(display=False, custom_mapping=sdpa_cpu) as counter:
            transformer(*args, **kwargs)
        # Z-Image: forward(x, t, cap_feats) with per-row lists; the others name hidden_states (and the text)
        latents = _batch_shape(kwargs.get("hidden_states", kwargs.get("x", args[0] if args else None)))
        text = _batch_shape(kwargs.get("encoder_hidden_states", kwargs.get("cap_feats", args[2] if len(args) > 2
                                                                             else None)))
        per_step = len(seen)
    elif buffers:
        with torch.no_grad(), flop_counter.FlopCounterMode(display=False, custom_mapping=sdpa_cpu) as counter:
            adapter.forward(buffers[0])
        latents, text = _batch_shape(buffers[0]["latents"]), _batch_shape(buffers[0].get("text"))
        per_step = len(buffers)
    else:
        raise RuntimeError(f"no forward of {type(transformer).__name__} ran during the counted call")
    return dict(forward_tflop=counter.get_total_flops() / 1e12, per_step=per_step, rows=latents[0], latents=latents,
                text_tokens=None if text is None or len(text) < 3 else text[1])


def count_compute(folder: Path, model, cfg: EngineConfig, req: GenerationRequest, device: torch.device,
                  weights: torch.nn.Module | None = None) -> dict:
    """One forward's FLOPs as diffusers' eager pipeline runs the request and as bcg-serve's exact bucket runs it
    (:func:`one_forward`); each with ``forwards`` = steps x forwards per step."""
    one_step = dataclasses.replace(req, num_inference_steps=1)
    pipe = diffusers_pipeline(folder, model.dtype, device, compiled=False, weights=weights)
    out = dict(diffusers=one_forward(pipe.transformer, lambda: pipe(
        prompt=req.prompt, num_images_per_prompt=req.n, width=req.width, height=req.height, num_inference_steps=1,
        guidance_scale=req.guidance_scale, generator=torch.Generator("cpu").manual_seed(req.seed),
        output_type="latent")))
    pipe = None  # freed before the modes load theirs
    gc.collect()
    eager = DiTPipeline(cfg.model_copy(update={"runner": RunnerConfig(mode="eager", kernels="eager")}), model)
    out["bcg"] = one_forward(model.adapter.model, lambda: eager.generate(eager.validator.validate(one_step)),
                             adapter=model.adapter)
    for side in out.values():
        side["forwards"] = req.num_inference_steps * side["per_step"]
    return out


def rates(r: dict, side: dict, peak: float | None) -> dict:
    """A mode's compute rates from its medians ``r`` and its side's counted forward."""
    tflop = side["forward_tflop"] * side["forwards"]
    over_wall = tflop / (r["wall_ms"] / 1e3)
    denoise = tflop / (r["denoise_ms"] / 1e3) if r["denoise_ms"] else None
    sig = lambda x: None if x is None else float(f"{x:.4g}")  # noqa: E731
    return dict(forward_tflop=sig(side["forward_tflop"]), forwards=side["forwards"], tflops_over_wall=sig(over_wall),
                denoise_tflops=sig(denoise), peak_tflops=peak, of_peak=sig(denoise and peak and denoise / peak),
                wall_of_peak=sig(peak and over_wall / peak))


def bench_case(case: str, folder: Path, model, args, device: torch.device, dtype: str) -> dict:
    """Every mode of one case (one request of ``args.n`` images), alternating."""
    _, size, tiny_size, steps, guidance = bench_families.CASES[case]
    size, steps = (tiny_size, 2) if args.tiny else (size, steps if args.steps is None else args.steps)
    req = GenerationRequest(bench_families.PROMPT, n=args.n, width=size, height=size, num_inference_steps=steps,
                            guidance_scale=guidance, seed=1)
    searched = None
    # diffusers' transformer, loaded once: every diffusers pipeline below runs a twin of it (shared_twin)
    weights = diffusers_pipeline(folder, getattr(torch, dtype), device, False).transformer
    if args.cache_search:
        searched = cache_search(folder, req, args.cache_search, getattr(torch, dtype), device, weights)
        args.cache_threshold = min(searched, key=lambda t: (abs(searched[t] / steps - 0.5), -float(t)))
        args.cache_threshold = float(args.cache_threshold)
        print(f"cache search: threshold {args.cache_threshold} chosen", flush=True)
    if args.cache_threshold is not None:
        from bcg_core.step_cache import FirstBlockCache

        req = dataclasses.replace(req, cache=FirstBlockCache(threshold=args.cache_threshold))
    limits = LimitsConfig(min_side_px=16)
    buckets = bench_families.exact_buckets(folder, req, limits)
    mc = ModelConfig(path=str(folder), device=device.type, dtype=dtype)
    graph = "graph" if device.type == "cuda" else "eager"
    # counted before the modes: bcg-compiled compiles the shared model's blocks in place
    compute = count_compute(folder, model, EngineConfig(model=mc, buckets=buckets, limits=limits), req, device,
                            weights)
    print(f"{case}: one forward, " + "; ".join(
        f"{side}: {c['forward_tflop']:.4g} TFLOP ({c['rows']} rows, {c['text_tokens']} text tokens) x {c['forwards']}"
        for side, c in compute.items()), flush=True)
    runs: dict[str, list] = {}
    calls, first, prepare, decode_compile, computed, shares = {}, {}, {}, {}, {}, {}
    for mode in args.modes:
        t0 = time.perf_counter()
        if mode.startswith("bcg"):
            kernels = mode.removeprefix("bcg-")
            decode = args.compile_decode and kernels != "eager"
            pipe = DiTPipeline(EngineConfig(model=mc, buckets=buckets, limits=limits,
                                            runner=RunnerConfig(mode=graph, kernels=kernels, fused_step="never",
                                                                compile_decode=decode)),
                               load_model(mc) if kernels == "fp8" or decode else model)

            def call(pipe=pipe, mode=mode):
                result = pipe.generate(pipe.validator.validate(req))
                report = result.cache
                if report:
                    computed[mode] = sum(s["computed"] for s in report["steps"].values())
                    shares[mode] = pipe.decider.costs.describe()
                return result.timings_ms
        else:
            cache = None if mode == "diffusers-uncached" else args.cache_threshold
            pipe = diffusers_pipeline(folder, getattr(torch, dtype), device, mode == "diffusers-compiled",
                                      cache=cache, weights=weights)

            def call(pipe=pipe, mode=mode, cache=cache):
                if cache is not None:
                    pipe.computed[0] = 0
                gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
                images = pipe(prompt=req.prompt, num_images_per_prompt=req.n, width=req.width, height=req.height,
                              num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
                              generator=gens).images
                if cache is not None and mode != "diffusers-compiled":  # compiled blocks run no forward hook
                    computed[mode] = pipe.computed[0]
                return {"images": images}
        _sync()
        prepare[mode] = round(time.perf_counter() - t0, 2)
        calls[mode] = call
        t0 = time.perf_counter()
        call()
        _sync()
        first[mode] = round((time.perf_counter() - t0) * 1e3, 1)
        if getattr(pipe, "decoder", None) is not None:  # the first request queued its decode shape: wait for it
            t0 = time.perf_counter()
            pipe.decoder.wait(600)
            decode_compile[mode] = {"wait_s": round(time.perf_counter() - t0, 1), **pipe.decoder.describe()}
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
        if mode in decode_compile:
            out[mode]["decode_compile"] = decode_compile[mode]
        if mode in computed:
            out[mode]["computed_steps"] = computed[mode]
        if shares.get(mode, {}).get("step_cache_shares"):  # the halves' measured shares (CUDA graphs only)
            out[mode]["step_cache_shares"] = shares[mode]["step_cache_shares"]
            out[mode]["bucket_ms"] = shares[mode]["bucket_ms"]  # the whole forward's replay, the shares' base
        png = out[mode]["image_encode_ms"] or 0.0
        out[mode]["served_ms"] = round(out[mode]["wall_ms"] + (png if mode.startswith("diffusers") else 0.0), 1)
    base = out.get("diffusers", {}).get("wall_ms")
    served = out.get("diffusers", {}).get("served_ms")
    uncached = out.get("diffusers-uncached", {}).get("served_ms")
    bf16, fp8 = peak_tflops(args, device)
    for mode, r in out.items():
        r["vs_diffusers"] = round(base / r["wall_ms"], 3) if base else None
        r["served_vs_diffusers"] = round(served / r["served_ms"], 3) if served else None
        if uncached:
            r["served_vs_diffusers_uncached"] = round(uncached / r["served_ms"], 3)
        r.update(rates(r, compute[mode.split("-")[0]], fp8 if mode == "bcg-fp8" else bf16))
    return dict(case=case, n=args.n, size=f"{size}x{size}", steps=steps, guidance_scale=guidance,
                cache_threshold=args.cache_threshold, cache_search=searched,
                bucket=buckets.model_dump(), forward_tflop=compute["diffusers"]["forward_tflop"],
                forwards=compute["diffusers"]["forwards"], compute=compute, modes=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="flux-dev-1024", help=f"comma-separated, of {','.join(bench_families.CASES)}")
    ap.add_argument("--modes", help=f"comma-separated, of {','.join(MODES)} (default: all; bcg-fp8 on CUDA only)")
    ap.add_argument("--n", type=int, default=1, help="images per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, help="denoising steps of every case (default: the case's own, "
                    "bench_families.CASES: 28 for FLUX.1-dev, 50 (the pipelines' defaults) for FLUX.2 and Z-Image, "
                    "20 for the others; --tiny always runs 2)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: tiny configs, fp32, 2 steps")
    ap.add_argument("--compile-decode", action="store_true",
                    help="runner.compile_decode in bcg-compiled and bcg-fp8 (each then loads its own model); after "
                    "the first request the mode waits for its decode compile")
    ap.add_argument("--cache-threshold", type=float, default=None,
                    help="First Block Cache at this threshold in every mode (module docstring)")
    ap.add_argument("--cache-search", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="thresholds to try on diffusers' eager pipeline first; the one computing about half the "
                    "steps is used")
    ap.add_argument("--scratch", help="folder for the checkpoints (default: a temp dir)")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--commit", help="git commit to record")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's dense bf16 peak TFLOPS for of_peak (fp8: twice it); default: H100/H200 SXM's "
                         "989.4 (fp8 1978.9) on such a GPU, else none")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    args.modes = args.modes.split(",") if args.modes else [m for m in MODES if device.type == "cuda" or m != "bcg-fp8"]
    if unknown := [m for m in args.modes if m not in MODES]:
        raise SystemExit(f"unknown mode {unknown[0]!r}; modes: {', '.join(MODES)}")
    dtype = "float32" if args.tiny else "bfloat16"
    models = bench_families.bench_models(args.tiny)
    result = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=args.commit,
                  gpu=torch.cuda.get_device_name() if device.type == "cuda" else None, torch=torch.__version__,
                  command=" ".join(sys.argv), dtype=dtype, cases=[])
    for case in args.cases.split(","):
        name = bench_families.CASES[case][0]
        folder = Path(tempfile.mkdtemp(prefix=f"bcg-tiers-{name}-", dir=args.scratch))
        model = None
        try:
            t0 = time.perf_counter()
            info = bench_families.build_checkpoint(models[name], folder, device, getattr(torch, dtype))
            info["build_save_s"] = round(time.perf_counter() - t0, 1)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            model = load_model(ModelConfig(path=str(folder), device=device.type, dtype=dtype))
            row = bench_case(case, folder, model, args, device, dtype)
            row["built"] = info
            # every mode's pipeline stays resident to the end of the case: the peak holds them all
            row["peak_gpu_gb"] = (round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda"
                                  else None)
            result["cases"].append(row)
            print(f"\n{case} n={args.n}\n" + bench_families.format_table(["mode", *TABLE], [
                [mode] + [r.get(k) for k in TABLE.values()] for mode, r in row["modes"].items()]), flush=True)
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
