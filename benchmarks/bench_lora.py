"""LoRA benchmark: the same replay with and without per-request adapters, and diffusers switching adapters.

One model per invocation, in this process (no HTTP; the engine as a replica runs it: ``DiTPipeline`` and its
``StepScheduler``), side by side in one run:

- ``base``: the first ``--requests`` krea requests (``bench_saturation.replay_requests``: their sizes and image
  counts, or with ``--mix gentd26`` image counts drawn from a GenTD26 trace, ``--trace``: the production-like mix;
  ``--steps`` steps) through the step scheduler, ``--concurrency`` in flight, no adapters.
- ``lora``: the same requests, ``lora.dir`` set, where a seeded ``--lora-share`` of them (default 0.17, the
  GenTD26 trace's 16.8%; exactly that count, :func:`assign_adapters`) carry adapters: one, or two for
  ``--two-share`` of those (GenTD26: 1.0% of 16.8%
  carry two, 0.2% more; default 0.07), drawn from a pool of ``--pool`` adapters (default 20) with Zipf-like
  weights ``1 / k^s`` (``--zipf``, default 1.1), scales drawn from 0.6 to 1.0. ``--slots`` GPU slots (default 8).
  Each adapter has rank ``--rank`` on the attention and MLP projections of every block (peft ``LoraConfig``,
  random weights, saved with the pipeline class's ``save_lora_weights``).
- ``diffusers`` (``--diffusers-requests`` of them, default all; 0 skips): the family's diffusers pipeline on
  the same checkpoint with every pool adapter loaded (``load_lora_weights``), one request at a time, switching
  adapters per request (``set_adapters`` with the request's names and scales, ``disable_lora`` for none).

Both engine servers warm up on one request of each (size, n) first (untimed; the lora server's warm-up has no
adapters, so the timed replay loads them). Reported per server: images/s, p50 and p99 latency; for ``lora`` the
p99 latency of requests that waited for a load (``timings_ms.lora_load`` > 0), slot loads, hits, evictions;
ratios ``lora / base`` (the issue's target: at least 0.9) and ``lora / diffusers``. With ``--rounds N`` the two
engine servers alternate N times (base, lora, base, lora ...): ``rounds`` lists each round's images/s and ratio,
``lora_vs_base`` is their median, and ``servers`` holds the last round's. Where diffusers served fewer requests
than the replay, its ratio is ``lora_vs_diffusers_subset`` (images/s of different requests, not like for like).
The JSON is written after every round and after diffusers, so a run stopped by a time bound keeps what finished.

Models (``--model``): ``flux-dev-width`` (FLUX.1-dev's published width, 2 double and 4 single blocks, as
``bench_saturation``), ``sd3-medium`` (``bench_families``' published SD3-medium transformer), random weights,
bf16; ``--tiny`` uses the tests/tiny configs in fp32 (the CPU smoke). On the GPU machine::

    python benchmarks/bench_lora.py --model flux-dev-width --rank 16 --scratch /dev/shm --commit <sha>
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT)]

TARGETS = {"flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"],
           "sd3": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                   "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]}
"""peft ``target_modules`` of the adapters per family: attention and MLP projections (diffusers' DreamBooth LoRA
scripts' defaults, with FLUX's single-block ``proj_mlp``)."""


def start_engine(config):
    """The pipeline and step scheduler a replica would run for ``config``: every bucket's costs measured where
    ``scheduler.measure_costs`` asks for it (:meth:`StepScheduler.measure_costs`) and the memory budget set after that,
    as ``DiTReplica`` does after its capture. ``(pipe, scheduler, start seconds)``."""
    from bcg_core.pipeline import DiTPipeline
    from bcg_core.scheduler import StepScheduler

    t0 = time.perf_counter()
    pipe = DiTPipeline.from_config(config)
    sched = StepScheduler.from_pipeline(pipe)
    sched.measure_costs(list(pipe.table.keys))
    sched.measure_memory_budget()
    return pipe, sched, time.perf_counter() - t0


def build_model(name: str, tiny: bool, scratch: str | None, device: str) -> tuple[dict, Path, str]:
    """``(model config mapping, checkpoint folder, family)``: ``flux-dev-width`` through ``bench_saturation``,
    ``sd3-medium`` through ``bench_families``."""
    import bench_families as bf
    import bench_saturation as bs
    import torch

    if name == "flux-dev-width":
        cfg, folder, _ = bs.build_model(name, tiny, scratch, device)
        return cfg, Path(folder), "flux"
    spec = bf.bench_models(tiny)[name]
    dtype = "float32" if tiny else "bfloat16"
    folder = Path(tempfile.mkdtemp(prefix=f"bcg-lora-{name}-", dir=scratch)).resolve()
    bf.build_checkpoint(spec, folder, torch.device(device), getattr(torch, dtype))
    return {"path": str(folder), "dtype": dtype, "device": device}, folder, spec.family


def build_pool(folder: Path, family: str, pool: int, rank: int, out: Path) -> list[str]:
    """``pool`` adapters ``a00``.. of rank ``rank`` (alpha = rank) on :data:`TARGETS`, random N(0, 0.02) weights
    (peft ``LoraConfig`` on the checkpoint's transformer, saved with the pipeline class's ``save_lora_weights``)."""
    import diffusers
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    index = json.loads((folder / "model_index.json").read_text())
    pipe_cls = getattr(diffusers, index["_class_name"])
    transformer = getattr(diffusers, index["transformer"][1]).from_pretrained(folder / "transformer")
    cfg = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=TARGETS[family])
    transformer.add_adapter(cfg, adapter_name="x")
    shapes = {k: v.shape for k, v in get_peft_model_state_dict(transformer, adapter_name="x").items()}
    del transformer
    names = []
    for i in range(pool):
        gen = torch.Generator().manual_seed(i)
        sd = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
        name = f"a{i:02d}"
        pipe_cls.save_lora_weights(str(out / name), transformer_lora_layers=sd,
                                   transformer_lora_adapter_metadata=cfg.to_dict())
        names.append(name)
    return names


def assign_adapters(requests: list, names: list[str], share: float, two_share: float, zipf: float,
                    seed: int = 0) -> list[tuple[tuple[str, float], ...]]:
    """Each request's ``lora`` entries (module docstring), seeded: exactly ``round(share x requests)`` requests
    carry adapters (a fixed count, so a short replay is not skewed by the draw: a Bernoulli draw per request gave
    1 of 32 at seed 0), ``round(two_share x`` those ``)`` of them two (at least one where ``two_share`` > 0), names
    drawn with Zipf-like weights over ``names``."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(len(names))]
    carriers = rng.sample(range(len(requests)), round(share * len(requests)))
    twos = set(carriers[:max(1, round(two_share * len(carriers))) if two_share > 0 and carriers else 0])
    out: list[tuple[tuple[str, float], ...]] = [() for _ in requests]
    for i in carriers:
        picked: list[str] = []
        while len(picked) < (2 if i in twos else 1):
            n = rng.choices(names, weights)[0]
            if n not in picked:
                picked.append(n)
        out[i] = tuple((n, round(rng.uniform(0.6, 1.0), 2)) for n in picked)
    return out


def replay_engine(config, requests: list, concurrency: int, warm: list) -> dict:
    """Serve ``requests`` (GenerationRequests) through a fresh pipeline and step scheduler, ``concurrency`` in
    flight, after serving ``warm`` untimed. Started as a replica starts (:func:`start_engine`: the cost
    model measured where ``scheduler.measure_costs`` asks for it, the memory budget set; the runs up to commit fdfe4bc
    used the token-count stand-in instead). Returns wall time, images/s, latencies, the pipeline's LoRA stats, the
    timed replay's steps run as two (without and with adapters, ``adapter_splits``) and each bucket's measured
    forward with adapter rows over its plain one (``lora_factor``)."""
    from bench_saturation import percentile  # the benchmarks' one percentile (linear, numpy's default)

    pipe, sched, start_s = start_engine(config)

    async def run(reqs):
        gate = asyncio.Semaphore(concurrency)

        async def one(r):
            async with gate:
                t = time.perf_counter()
                res = await sched.submit(pipe.validator.validate(r))
                return res, time.perf_counter() - t
        return await asyncio.gather(*(one(r) for r in reqs))

    try:
        asyncio.run(run(warm))
        splits = sched.stats()["adapter_splits"]
        t1 = time.perf_counter()
        done = asyncio.run(run(requests))
        wall = time.perf_counter() - t1
        st = sched.stats()
    finally:
        sched.close()
    lat = [s for _, s in done]
    waited = [s for (res, s) in done if res.timings_ms.get("lora_load", 0) > 0]
    images = sum(len(res.image_bytes) for res, _ in done)
    out = {"start_s": round(start_s, 2), "wall_s": round(wall, 3), "images": images,
           "images_per_s": round(images / wall, 4), "p50_s": round(percentile(lat, 50), 3),
           "p99_s": round(percentile(lat, 99), 3), "waited_for_load": len(waited),
           "p99_waited_s": None if not waited else round(percentile(waited, 99), 3),
           "lora": pipe.stats()["lora"], "adapter_splits": st["adapter_splits"] - splits}
    plain_ms = st["costs"]["bucket_ms"]
    out["lora_factor"] = {k: round(v / plain_ms[k], 3) for k, v in st["costs"].get("lora_ms", {}).items()
                          if plain_ms.get(k)}
    return out  # the pipeline goes with this frame: main collects it before the next server starts


def replay_diffusers(folder: Path, loras: Path, requests: list, names: list[str], device: str, dtype: str) -> dict:
    """The family's diffusers pipeline, every pool adapter loaded, one request at a time (module docstring)."""
    import diffusers
    import torch

    index = json.loads((folder / "model_index.json").read_text())
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(
        str(folder), torch_dtype=getattr(torch, dtype), local_files_only=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    for n in names:
        pipe.load_lora_weights(str(loras / n), adapter_name=n)
    images, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for r in requests:
            if r.lora:
                pipe.enable_lora()
                pipe.set_adapters([n for n, _ in r.lora], [s for _, s in r.lora])
            else:
                pipe.disable_lora()
            gens = [torch.Generator("cpu").manual_seed(r.seed + i) for i in range(r.n)]
            out = pipe(prompt=r.prompt, num_images_per_prompt=r.n, width=r.width, height=r.height,
                       num_inference_steps=r.num_inference_steps, generator=gens, output_type="pil")
            images += len(out.images)
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 3), "images": images, "images_per_s": round(images / wall, 4),
            "requests": len(requests)}


def free_device() -> None:
    """Collect the last server's pipeline and give its cached device memory back (one server at a time)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("flux-dev-width", "sd3-medium"), default="flux-dev-width")
    ap.add_argument("--tiny", action="store_true", help="tests/tiny configs, fp32 (CPU smoke)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pool", type=int, default=20)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--lora-share", type=float, default=0.17)
    ap.add_argument("--two-share", type=float, default=0.07)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1,
                    help="base and lora servers alternated this many times (base, lora, base, lora ...); the ratio "
                         "is the median of the rounds' lora / base")
    ap.add_argument("--kernels", choices=("eager", "compiled", "fp8"), default="eager")
    ap.add_argument("--diffusers-requests", type=int, help="requests diffusers serves (default all; 0: skip)")
    ap.add_argument("--size", help="every request at this WxH")
    ap.add_argument("--mix", choices=("krea", "gentd26"), default="krea",
                    help="image counts: krea's own, or drawn from a GenTD26 trace (the production-like mix; "
                         "bench_saturation.replay_requests)")
    ap.add_argument("--trace", help="GenTD26 CSV for --mix gentd26 (default: the packaged burst slice)")
    ap.add_argument("--mix-seed", type=int, default=0, help="seed of the --mix gentd26 draw")
    ap.add_argument("--mix-draw", choices=("random", "quota"), default="random",
                    help="--mix gentd26: each count drawn alone, or the trace's shares up to rounding")
    ap.add_argument("--scratch", help="folder for the checkpoint and adapters (default a temp dir)")
    ap.add_argument("--out", help="JSON result (default docs/bench/<date>_lora_<model>_r<rank>.json)")
    ap.add_argument("--commit")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.diffusers_requests is not None and args.diffusers_requests < 0:
        raise SystemExit(f"--diffusers-requests: 0 (skip) or more, got {args.diffusers_requests}")
    import bench_saturation as bs
    import torch

    from bcg_core.models import describe_model, load_tokenizer_counter
    from deployments.settings import ServeConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.tiny:
        raise SystemExit("published sizes need CUDA; use --tiny on a CPU")
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out = Path(args.out) if args.out else ROOT / "docs" / "bench" / f"{date[:10]}_lora_{args.model}_r{args.rank}.json"
    cfg, folder, family = build_model(args.model, args.tiny, args.scratch, device)
    try:
        loras = folder.parent / f"{folder.name}-loras"
        names = build_pool(folder, family, args.pool, args.rank, loras)
        demo = bs.replay_requests(args.requests, args.size, mix=args.mix, trace=args.trace, mix_seed=args.mix_seed,
                                   mix_draw=args.mix_draw)
        plain = [bs.generation_request(r, args.steps) for r in demo]
        entries = assign_adapters(plain, names, args.lora_share, args.two_share, args.zipf)
        with_lora = [dataclasses.replace(r, lora=e) for r, e in zip(plain, entries, strict=True)]
        warm = [bs.generation_request(r, args.steps) for r in bs.warmup_requests(demo, "shapes")]
        mc = ServeConfig.model_validate({"model": cfg}).model
        base = bs.base_config(cfg, describe_model(mc), load_tokenizer_counter(mc), demo, args.steps)
        base["runner"] = {"kernels": args.kernels}
        lora_cfg = {**base, "lora": {"dir": str(loras), "slots": args.slots, "max_rank": args.rank,
                                     "max_per_request": 2}}
        result: dict[str, Any] = {
            "benchmark": "lora", "date": date, "commit": args.commit, "argv": raw,
            "command": shlex.join(["python", "benchmarks/bench_lora.py", *raw]), "model": args.model,
            "tiny": args.tiny, "device": device,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
            "replay": {"requests": len(plain), "images": sum(r.n for r in plain), "steps": args.steps,
                       "mix": args.mix, "trace": args.trace, "mix_seed": args.mix_seed, "mix_draw": args.mix_draw,
                       "concurrency": args.concurrency, "with_adapters": sum(1 for e in entries if e),
                       "with_two": sum(1 for e in entries if len(e) == 2),
                       "adapters_used": len({n for e in entries for n, _ in e})},
            "pool": args.pool, "rank": args.rank, "slots": args.slots, "kernels": args.kernels, "servers": {}}
        rounds = []

        def write() -> None:  # after every phase: a run stopped by a time bound keeps what finished
            result["servers"].update(rounds[-1])
            result["rounds"] = [{"base": o["base"]["images_per_s"], "lora": o["lora"]["images_per_s"],
                                 "lora_vs_base": round(o["lora"]["images_per_s"] / o["base"]["images_per_s"], 3)}
                                for o in rounds]
            ips = {k: v["images_per_s"] for k, v in result["servers"].items()}
            result["ratios"] = {"lora_vs_base": statistics.median(o["lora_vs_base"] for o in result["rounds"]),
                                **({("lora_vs_diffusers" if result.get("diffusers_requests") == len(with_lora)
                                     else "lora_vs_diffusers_subset"): round(ips["lora"] / ips["diffusers"], 3)}
                                   if "diffusers" in ips else {})}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))

        for r in range(max(1, args.rounds)):  # alternated: GPU timings drift between runs, a ratio per round holds
            one = {}
            one["base"] = replay_engine(ServeConfig.model_validate(base), plain, args.concurrency, warm)
            print(f"round {r} base", one["base"], flush=True)
            free_device()
            one["lora"] = replay_engine(ServeConfig.model_validate(lora_cfg), with_lora, args.concurrency, warm)
            print(f"round {r} lora", {k: v for k, v in one["lora"].items() if k != "lora"}, flush=True)
            free_device()
            rounds.append(one)
            write()
        n = len(with_lora) if args.diffusers_requests is None else args.diffusers_requests
        if n:
            result["diffusers_requests"] = min(n, len(with_lora))  # fewer than the replay: not like for like
            result["servers"]["diffusers"] = replay_diffusers(folder, loras, with_lora[:n], names, device,
                                                              cfg["dtype"])
            print("diffusers", result["servers"]["diffusers"], flush=True)
            write()
        print("ratios", result["ratios"], flush=True)
        print(f"wrote {out}")
    finally:  # the checkpoint and its adapters are this run's own (a temp dir, or one made under --scratch)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(folder.parent / f"{folder.name}-loras", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
