"""Edits benchmark: what an edit (``POST /v1/images/edits``) costs against text to image, alone and in a replay.

One model per invocation, in this process (no HTTP; the engine as a replica runs it: one ``DiTPipeline`` and its
``StepScheduler``, built once and shared by both parts), side by side in one run:

1. ``single``: one request alone at ``--size`` (default 1024x1024, ``n`` 1, ``--steps`` steps), three ways,
   interleaved ``--repeats`` times (default 5) after one untimed run of each: ``text-to-image``; ``image-to-image``
   of that request's own image at ``--strength`` (default 0.6); ``inpainting``, the same with an OpenAI mask (opaque,
   its centre half of each side fully transparent: edit there). Each run is validated first (the ingress's work:
   the image read, the bucket looked up), then ``DiTPipeline.generate`` (the request alone, in the forwards the
   step scheduler gives a request that has its shape to itself) is timed: ``wall_ms`` (from a device sync to the
   images, which end in a host copy), and the split of its ``timings_ms``: ``encode`` (text encoders, noise and,
   for an edit, the image's preprocessing and VAE encode), ``denoise`` (its steps), ``decode`` (VAE decode),
   ``image_encode`` (PNG); medians. An edit runs the last ``steps x strength`` steps, rounded up
   (``bcg_core.request.steps_run``: 12 of 20 at 0.6), so the expected edit is about 0.6 of the denoise plus one VAE
   encode: ``predicted_wall_ms`` = text to image's wall - (1 - steps_run / steps) x its denoise + the edit's
   extra encode (its ``encode`` - text to image's), and ``wall_vs_predicted`` the measured wall over that. Ratios
   against text to image: ``wall``, ``denoise`` (expected ``steps_run / steps``) and ``encode_extra_ms``. On CUDA
   the ``encode`` timing is host time until the start returns: VAE-encode kernels still queued then finish inside
   the first step and are counted in ``denoise`` (the wall is exact).
2. ``replay``: the first ``--requests`` (default 32) krea requests (``bench_saturation.replay_requests``: each its
   own size, or ``--replay-size``, and image count, the data's seeds; ``--steps`` steps) through the step scheduler,
   ``--concurrency`` in flight (default 16), twice: ``plain`` (text to image only) and ``mixed``, where a seeded
   ``--edit-share`` of them (default 0.1, exactly ``round(share x requests)``, at least one; :func:`assign_edits`) are
   edits instead (same prompt, ``n``, steps and seed, ``--strength``), every other one of those (in request order, the
   first one included) with a mask (:func:`mask_png` at its size): inpainting, the others image-to-image. Each edit's
   input image is generated first (untimed): its own text-to-image request with ``n`` 1 at its size. Both replays follow
   one untimed warm-up through the scheduler: one text-to-image request of each distinct (size, n)
   (``bench_saturation.warmup_requests``) and each edit of the mixed replay once. Reported per replay: images/s,
   per-request latency (submission to answer) p50 / p99 / mean overall and per kind, and ``image_steps`` (the sum of
   ``n x`` steps run: the denoising work); ``ratios``, ``mixed / plain``, of images/s, p50, p99 and image_steps (the
   last is the share of the denoising work left: about the throughput change fewer steps alone would give). Raw rows
   (kind, size, n, steps run, latency, ``timings_ms``) are in the JSON.

Models (``--model``): ``flux-dev-width`` (FLUX.1-dev's published width, 2 double and 4 single blocks, as
``bench_saturation``) and ``sd3-medium`` (``bench_families``' published SD3-medium transformer), random weights,
bf16 on CUDA (``bench_lora.build_model``); the table is ``bench_saturation.base_config``'s (the default buckets,
which hold 1024x1024, and the model's text bucket). With CUDA graphs (``runner.mode`` auto on CUDA) the costs of
every bucket are measured first (``DiTPipeline.measure_costs``, as a replica does after its capture). ``--tiny``
uses the tests/tiny configs in fp32 on the CPU (the smoke: random tiny weights, so only the plumbing and the
relative costs of the host path are measured), with both parts at 64x64 (:data:`TINY_SIZE`; ``--size`` and
``--replay-size`` change them), a table of exactly those sizes and ``limits.min_side_px`` 16.

On the GPU machine (one H200), after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``::

    python benchmarks/bench_edits.py --model flux-dev-width --scratch /dev/shm --commit <sha>
    python benchmarks/bench_edits.py --model sd3-medium --scratch /dev/shm --commit <sha>

(JSON to ``docs/bench/<date>_edits_<model>_<gpu>.json`` unless ``--out``). CPU smoke, about 20 s on 2 cores::

    python benchmarks/bench_edits.py --tiny --requests 6 --out /tmp/edits.json

The JSON holds date (UTC), commit, the command line, GPU name, torch version, the config, both parts' summaries
and raw rows, and the ratios; the exit status is 0 when every request succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import random
import shlex
import shutil
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT)]

PROMPT = "a photo of a cat sitting on a red chair"
"""The prompt of the ``single`` part (``bench_families.PROMPT``)."""
KINDS = ("text-to-image", "image-to-image", "inpainting")
TINY_SIZE = (64, 64)
"""The sizes of ``--tiny`` (both parts): the tests/tiny VAEs downsample by 2, not 8, so a krea size would be 16 times
the tokens of the published model's (a 512x512 request: 16384 image tokens)."""


# -- pure parts ------------------------------------------------------------------------------------------------


def mask_png(width: int, height: int) -> bytes:
    """An OpenAI mask of ``width`` x ``height``: opaque (keep) but for its centre, half of each side, fully
    transparent (edit there)."""
    from PIL import Image

    im = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    im.paste((0, 0, 0, 0), (width // 4, height // 4, width // 4 + width // 2, height // 4 + height // 2))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def assign_edits(count: int, share: float, seed: int = 0) -> list[str]:
    """Each request's kind: exactly ``round(share x count)`` of them (at least one where ``share`` > 0), drawn with
    ``random.Random(seed)``, are edits, every other one of those in request order (the first included)
    ``"inpainting"``, the rest ``"image-to-image"``; every other request ``"text-to-image"``.

    Raises:
        ValueError: ``share`` outside 0..1.
    """
    if not 0 <= share <= 1:
        raise ValueError(f"--edit-share must be from 0 to 1, got {share}")
    k = min(count, max(1, round(share * count))) if share > 0 else 0
    edits = sorted(random.Random(seed).sample(range(count), k))
    kinds = ["text-to-image"] * count
    for j, i in enumerate(edits):
        kinds[i] = "inpainting" if j % 2 == 0 else "image-to-image"
    return kinds


def as_edit(request, kind: str, image: bytes | None, strength: float):
    """``request`` (a text-to-image ``GenerationRequest``) as a request of ``kind``: an edit of ``image`` at
    ``strength`` (inpainting: with :func:`mask_png` at its size), or itself for text to image."""
    if kind == "text-to-image":
        return request
    mask = mask_png(request.width, request.height) if kind == "inpainting" else None
    return dataclasses.replace(request, image=image, mask=mask, strength=strength)


def _ms(x: float | None, d: int = 1) -> float | None:
    return None if x is None else round(x, d)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def replay_summary(rows: list[dict], wall_s: float) -> dict:
    """Images/s, latency percentiles (overall and per kind, ms) and image-steps of one replay's ``rows``."""
    from bench_saturation import percentile

    ok = [r for r in rows if r["ok"]]
    images = sum(r["images"] for r in ok)

    def lat(sel: list[dict]) -> dict:
        xs = [r["latency_ms"] for r in sel]
        return {"requests": len(sel), "p50": _ms(percentile(xs, 50)), "p99": _ms(percentile(xs, 99)),
                "mean": _ms(sum(xs) / len(xs) if xs else None)}

    return {"requests": len(rows), "ok": len(ok), "failures": len(rows) - len(ok), "images": images,
            "wall_s": round(wall_s, 3), "images_per_s": round(images / wall_s, 4) if wall_s > 0 else None,
            "image_steps": sum(r["n"] * r["steps_run"] for r in ok), "latency_ms": lat(ok),
            "by_kind": {k: lat([r for r in ok if r["kind"] == k]) for k in KINDS if any(r["kind"] == k for r in ok)}}


def single_summary(runs: dict[str, list[dict]], steps: int) -> dict:
    """Medians of the ``single`` part's runs per kind, and each edit against text to image (module docstring)."""
    out: dict[str, Any] = {}
    for kind, rs in runs.items():
        parts = {p: _ms(median(r["timings_ms"][p] for r in rs), 2)
                 for p in ("encode", "denoise", "decode", "image_encode", "total")}
        out[kind] = {"repeats": len(rs), "steps_run": rs[0]["steps_run"],
                     "wall_ms": _ms(median(r["wall_ms"] for r in rs), 2), "timings_ms": parts}
    t2i = out["text-to-image"]
    for kind in ("image-to-image", "inpainting"):
        e = out[kind]
        extra = e["timings_ms"]["encode"] - t2i["timings_ms"]["encode"]
        predicted = t2i["wall_ms"] - (1 - e["steps_run"] / steps) * t2i["timings_ms"]["denoise"] + extra
        e["vs_text_to_image"] = {
            "wall": _ratio(e["wall_ms"], t2i["wall_ms"]),
            "denoise": _ratio(e["timings_ms"]["denoise"], t2i["timings_ms"]["denoise"]),
            "denoise_expected": round(e["steps_run"] / steps, 3), "encode_extra_ms": _ms(extra, 2),
            "predicted_wall_ms": _ms(predicted, 2), "wall_vs_predicted": _ratio(e["wall_ms"], predicted)}
    return out


# -- the engine ------------------------------------------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_single(pipe, size: tuple[int, int], steps: int, strength: float, repeats: int) -> dict[str, list[dict]]:
    """Part 1: text to image, image-to-image and inpainting of one request alone (module docstring); the raw
    runs per kind."""
    from bcg_core.request import GenerationRequest

    w, h = size
    text = GenerationRequest(PROMPT, n=1, width=w, height=h, num_inference_steps=steps, seed=7)
    # the input image, and text to image's untimed run
    image = pipe.generate(pipe.validator.validate(text)).image_bytes[0]
    validated_requests = {k: pipe.validator.validate(as_edit(text, k, image, strength)) for k in KINDS}
    for k in KINDS[1:]:
        pipe.generate(validated_requests[k])  # untimed: each edit path's first run
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    for _ in range(repeats):
        for k in KINDS:
            _sync(pipe.model.device)
            t0 = time.perf_counter()
            res = pipe.generate(validated_requests[k])
            wall = time.perf_counter() - t0
            runs[k].append({"wall_ms": round(wall * 1e3, 2), "steps_run": validated_requests[k].steps_run,
                            "timings_ms": res.timings_ms})
    return runs


def replay(sched, pipe, requests: list, kinds: list[str], concurrency: int) -> tuple[list[dict], float]:
    """Serve ``requests`` through the step scheduler, ``concurrency`` in flight, each validated first (untimed,
    as the ingress validates it); ``(rows, wall seconds)``. A request that fails is a row with ``ok`` False."""
    validated_requests = [pipe.validator.validate(r) for r in requests]

    async def run():
        gate = asyncio.Semaphore(concurrency)

        async def one(validated, kind):
            async with gate:
                t = time.perf_counter()
                r = validated.request
                row = {"kind": kind, "size": f"{r.width}x{r.height}", "n": r.n, "steps_run": validated.steps_run}
                try:
                    res = await sched.submit(validated)
                except Exception as e:  # noqa: BLE001 - a failed request is counted, the replay goes on
                    return {**row, "ok": False, "images": 0, "latency_ms": None, "error": f"{type(e).__name__}: {e}"}
                return {**row, "ok": True, "images": len(res.image_bytes),
                        "latency_ms": round((time.perf_counter() - t) * 1e3, 2),
                        "bucket": None if res.bucket is None else str(res.bucket),
                        "timings_ms": res.timings_ms}

        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(p, k) for p, k in zip(validated_requests, kinds, strict=True)))
        return list(rows), time.perf_counter() - t0

    return asyncio.run(run())


# -- main ------------------------------------------------------------------------------------------------------


def render(result: dict) -> str:
    """The plain-text tables of a result: the single requests, then the two replays and their ratios."""
    from bench_families import format_table

    s = result["single"]
    rows = []
    for k in KINDS:
        e, t = s[k], s[k]["timings_ms"]
        vs = e.get("vs_text_to_image") or {}
        rows.append([k, e["steps_run"], e["wall_ms"], t["encode"], t["denoise"], t["decode"], vs.get("wall"),
                     vs.get("denoise"), vs.get("denoise_expected"), vs.get("wall_vs_predicted")])
    single = format_table(["single " + result["single_size"], "steps", "wall ms", "encode", "denoise", "decode",
                           "wall/t2i", "denoise/t2i", "expected", "wall/predicted"], rows)
    rows = []
    for name in ("plain", "mixed"):
        m = result["replay"][name]
        by = m["by_kind"]
        rows.append([name, f"{m['ok']}/{m['requests']}", m["images"], m["wall_s"], m["images_per_s"],
                     m["latency_ms"]["p50"], m["latency_ms"]["p99"],
                     ", ".join(f"{k} {v['requests']}: {v['p50']}" for k, v in by.items())])
    table = format_table(["replay", "ok/req", "images", "wall s", "img/s", "p50 ms", "p99 ms", "p50 ms by kind"],
                         rows)
    return f"{single}\n\n{table}\nmixed vs plain: {result['ratios']}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see ``--help``)."""
    from bcg_core.config import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("flux-dev-width", "sd3-medium"), default="flux-dev-width")
    ap.add_argument("--tiny", action="store_true", help="tests/tiny configs, fp32 (CPU smoke)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--strength", type=float, default=0.6)
    ap.add_argument("--size", type=parse_size, help="WxH of the single part (default 1024x1024; --tiny: 64x64)")
    ap.add_argument("--replay-size",
                    help="every replayed request at this WxH (default: as in the data; --tiny: 64x64)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each kind in the single part")
    ap.add_argument("--requests", type=int, default=32, help="first N krea requests of the replay")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--edit-share", type=float, default=0.1, help="share of the mixed replay's requests that edit")
    ap.add_argument("--seed", type=int, default=0, help="seed of the draw of edits")
    ap.add_argument("--kernels", choices=("eager", "compiled", "fp8"), default="eager")
    ap.add_argument("--scratch", help="folder for the checkpoint (default a temp dir)")
    ap.add_argument("--out", help="JSON result (default docs/bench/<date>_edits_<model>_<gpu>.json)")
    ap.add_argument("--commit")
    args = ap.parse_args(argv)
    if args.size is None:
        args.size = TINY_SIZE if args.tiny else (1024, 1024)
    if args.replay_size is None and args.tiny:
        args.replay_size = "{}x{}".format(*TINY_SIZE)
    if args.steps < 1 or args.repeats < 1 or args.requests < 1 or args.concurrency < 1:
        ap.error("--steps, --repeats, --requests and --concurrency must be >= 1")
    if not 0 < args.strength <= 1 or not 0 <= args.edit_share <= 1:
        ap.error("--strength must be in (0, 1], --edit-share in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 0 when every request succeeded."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    import bench_lora
    import bench_saturation as bs
    import torch

    from bcg_core.models import describe_model, load_tokenizer_counter
    from deployments.settings import ServeConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.tiny:
        raise SystemExit("published sizes need CUDA; use --tiny on a CPU")
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    out = Path(args.out) if args.out else (
        ROOT / "docs" / "bench" / f"{date[:10]}_edits_{args.model}_{bs.gpu_label(gpu)}.json")
    cfg, folder, family = bench_lora.build_model(args.model, args.tiny, args.scratch, device)
    try:
        demo = bs.replay_requests(args.requests, args.replay_size)
        plain = [bs.generation_request(r, args.steps) for r in demo]
        kinds = assign_edits(len(plain), args.edit_share, args.seed)
        mc = ServeConfig.model_validate({"model": cfg}).model
        base = bs.base_config(cfg, describe_model(mc), load_tokenizer_counter(mc), demo, args.steps)
        base["runner"] = {"kernels": args.kernels}
        if args.tiny:  # a table of exactly the smoke's sizes (the default tiers would pad 64x64 to 256x256's tokens)
            sizes = {"{}x{}".format(*args.size), args.replay_size}
            base["buckets"]["resolutions"] = sorted(sizes)
            base["limits"]["min_side_px"] = 16
        config = ServeConfig.model_validate(base)
        result: dict[str, Any] = {
            "benchmark": "edits", "date": date, "commit": args.commit, "argv": raw,
            "command": shlex.join(["python", "benchmarks/bench_edits.py", *raw]), "model": args.model,
            "family": family, "tiny": args.tiny, "device": device, "gpu": gpu, "torch": torch.__version__,
            "steps": args.steps, "strength": args.strength, "kernels": args.kernels,
            "single_size": "{}x{}".format(*args.size), "repeats": args.repeats,
            "config": config.model_dump(mode="json")}
        pipe, sched, start_s = bench_lora.start_engine(config)
        result["start_s"] = round(start_s, 2)
        try:
            runs = run_single(pipe, args.size, args.steps, args.strength, args.repeats)
            result["single"] = single_summary(runs, args.steps)
            result["single_runs"] = runs
            print("single", json.dumps({k: {"wall_ms": v["wall_ms"], **v.get("vs_text_to_image", {})}
                                        for k, v in result["single"].items()}), flush=True)
            # the edits' input images: each its own text-to-image request, n 1, alone (untimed)
            images = {i: pipe.generate(pipe.validator.validate(dataclasses.replace(plain[i], n=1))).image_bytes[0]
                      for i, k in enumerate(kinds) if k != "text-to-image"}
            mixed = [as_edit(r, k, images.get(i), args.strength)
                     for i, (r, k) in enumerate(zip(plain, kinds, strict=True))]
            warm = [bs.generation_request(r, args.steps) for r in bs.warmup_requests(demo, "shapes")]
            edits = [(r, k) for r, k in zip(mixed, kinds, strict=True) if k != "text-to-image"]
            replay(sched, pipe, warm + [r for r, _ in edits], ["text-to-image"] * len(warm) + [k for _, k in edits],
                   args.concurrency)
            result["replay_setup"] = {"requests": len(plain), "images": sum(r.n for r in plain),
                                      "concurrency": args.concurrency, "edit_share": args.edit_share,
                                      "kinds": {k: kinds.count(k) for k in KINDS}, "warmup_requests": len(warm)}
            result["replay"], result["replay_rows"] = {}, {}
            for name, reqs, ks in (("plain", plain, ["text-to-image"] * len(plain)), ("mixed", mixed, kinds)):
                rows, wall = replay(sched, pipe, reqs, ks, args.concurrency)
                result["replay"][name] = replay_summary(rows, wall)
                result["replay_rows"][name] = rows
                print(name, json.dumps({k: v for k, v in result["replay"][name].items() if k != "by_kind"}),
                      flush=True)
        finally:
            sched.close()
        p, m = result["replay"]["plain"], result["replay"]["mixed"]
        result["ratios"] = {"images_per_s": _ratio(m["images_per_s"], p["images_per_s"]),
                            "p50": _ratio(m["latency_ms"]["p50"], p["latency_ms"]["p50"]),
                            "p99": _ratio(m["latency_ms"]["p99"], p["latency_ms"]["p99"]),
                            "image_steps": _ratio(m["image_steps"], p["image_steps"])}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print("\n" + render(result))
        print(f"\nwrote {out}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a new folder of this run (bench_lora.build_model)
    return 0 if all(r["failures"] == 0 for r in result["replay"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
