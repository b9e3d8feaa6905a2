"""How far a served image moves when its request shares forwards with others, and in bf16 in a FLUX masked tier.

Two sweeps on the CPU, each over seeds, sizes and compositions, reporting every comparison and the maximum:

- ``company`` (fp32): a probe request served alone against the same request served beside others, through the
  step-level loop (:func:`reference_gate.bcg_run`, ``DiTPipeline.step`` of several requests): with more images of its
  own (``n`` 1 against 2 and 3: image 0 of each), and joining a company request of 1-3 images that started 0 or 1
  steps earlier (:func:`reference_gate.bcg_run_joined`). Forwards as the decider places them on a CPU
  (``decider``: unpadded eager rows) and on bucket forwards, padded (``buckets``,
  :func:`reference_gate.bucket_costs`). On the tiny default model (``build_tiny``, 256x256 and its default 512x512,
  guidance 3.5, rows as a CPU replica places them) and the tiny real-layout FLUX checkpoint of ``tests/tiny/flux.py``
  (64x64 and 32x32, guidance 1 and 3.5, both placements). The figure of docs/OPERATIONS.md "Images
  do not depend on their company" and ``tests/engine/test_step_scheduler.py`` ``same_image``.
- ``masked`` (bf16): the tiny real-layout FLUX checkpoint served by bcg-serve at sizes padded into a masked image
  tier (``runner.kernels: eager``, bucket forwards), against diffusers' own bf16 ``FluxPipeline`` alone on the same
  request, with diffusers' own attention-backend deviation beside it (the same call with SDPA's math backend,
  :func:`reference_gate_bf16.diffusers_images`). The figure of docs/CORRECTNESS.md.

Each comparison: the largest difference of one pixel value in levels (0-255), the share of pixel values that differ
and the relative error ``max|a - b| / max|b|`` of the final latents (:func:`reference_gate_bf16.compare`).

Usage::

    PYTHONPATH=$PWD python benchmarks/pixel_moves.py --out docs/bench/2026-12-06_pixel_moves_cpu.json

``--seeds``, ``--masked-seeds``, ``--steps`` and ``--sweeps`` shrink or grow it. The default run took 513 s of CPU
on 2 cores (the tiny default at 512x512 most of it; 21 min wall on a machine shared with other work); ``--seeds 1
--masked-seeds 1`` about halves it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT, _ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from bcg_core import BucketConfig, DiTPipeline, GenerationRequest  # noqa: E402
from reference_gate import GateRun, bcg_pipeline, bcg_run, bcg_run_joined, bucket_costs, pixels  # noqa: E402
from reference_gate_bf16 import FAMILIES, Deviation, compare, diffusers_images, load_diffusers  # noqa: E402

TINY_BUCKETS = {"batch_sizes": [1, 2, 4, 8], "resolutions": ["256x256", "512x512"], "text_lengths": [256]}
"""The tiny default's table in the company sweep (rows as ``tests/engine/test_step_scheduler.py``'s)."""

FLUX_COMPANY_BUCKETS = {"batch_sizes": [1, 2, 4, 8], "resolutions": ["32x32", "64x64"], "text_lengths": [32]}
"""The tiny FLUX checkpoint's table in the company sweep (``tests/reference_gate_bf16.py``'s, with 8 rows)."""

MASKED_BUCKETS = {"batch_sizes": [1, 2, 4], "resolutions": ["32x32", "64x64", "128x128"], "text_lengths": [32]}
"""The tiny FLUX checkpoint's table in the masked sweep: three masked image tiers (64, 256 and 1024 tokens)."""

MASKED_SIZES = ((112, 96), (96, 112), (112, 112), (80, 80), (100, 76), (120, 104), (128, 112), (96, 96),
                (52, 44), (36, 36), (48, 48), (64, 60), (60, 60), (48, 40))
"""(width, height) of the masked sweep: none a tier's exact size; 112x96 is the issue's."""

PROMPTS = ("a red cube on a wooden table", "a lighthouse at dusk", "an astronaut riding a horse on the moon",
           "a bowl of ramen, studio photo")
"""Probe prompts (seed i takes prompt i mod 4) and the company's (the next one)."""


def _env(steps: int) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    import diffusers

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "torch": torch.__version__, "diffusers": diffusers.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(), "steps": steps}


def _images(run) -> list:
    return [pixels(p) for p in run.pngs]


COMPOSITIONS = ((2, None), (3, None), (1, 1), (2, 0), (3, 1), (2, "decoded"))
"""The company sweep's compositions: ``(K, None)``, the probe's own request with K images (image 0 compared, the
other images of the request beside it in every forward and in its decode); ``(K, H)``, the probe joining a company
request of K images that is H steps ahead, each decoded alone; ``(K, "decoded")``, the same with H = 0, both
finishing at the same step and decoded in one call, as the step scheduler's finisher batches the decodes of requests
of one size (``bcg_core/scheduler/finish.py`` ``_decode_many``)."""


def joined_decoded_together(pipe: DiTPipeline, request: GenerationRequest, other: GenerationRequest) -> GateRun:
    """``request`` and ``other`` started together, stepped together (one forward per step) and decoded in one family
    decode call (their latents concatenated, as ``Finisher._decode_many`` merges states); ``request``'s run."""
    from bcg_core.images import encode_image

    a, b = pipe.start(pipe.validator.validate(request)), pipe.start(pipe.validator.validate(other))
    while not (a.done and b.done):
        live = [s for s in (a, b) if not s.done]
        pipe.step(live, pipe.decider.for_states(live))
    merged = dataclasses.replace(a, latents=torch.cat([a.latents, b.latents]))
    images = pipe.model.decode(merged)[:a.n]
    r = a.request
    return GateRun(a.latents.float().cpu(), [encode_image(im, r.output_format, r.output_compression) for im in images])


def company_cases(pipe: DiTPipeline, sizes: list[tuple[int, int]], seeds: int, steps: int, guidance: float,
                  model: str, forwards: tuple[str, ...] = ("decider", "buckets")) -> list[dict]:
    """The company sweep on ``pipe`` (see the module docstring); one row per (probe, composition, forwards).

    Args:
        pipe: a fp32 pipeline; its decider's costs are switched between its stand-in (``decider.fallback``, what a
            CPU replica runs) and :func:`bucket_costs`, and left on the stand-in.
        sizes: (width, height) of the probes.
        seeds: probes per size (seed i: prompt ``PROMPTS[i % 4]``).
        steps: denoising steps of every request.
        guidance: the requests' guidance scale.
        model: the label of each row.
        forwards: ``"decider"`` (rows as a CPU replica's decider places them) and/or ``"buckets"`` (padded bucket
            forwards).

    Returns:
        Rows: ``model``, ``forwards`` (``decider`` or ``buckets``), ``size``, ``seed``, ``composition`` (``n=K``: the
        probe's own request with K images, image 0 compared; ``join n=K head=H``: beside a K-image company request
        H steps ahead) and the :class:`Deviation` of the probe's image 0 from the probe alone (as a dict).
    """
    own_costs = pipe.decider.fallback  # the CPU's stand-in: rows unpadded where a padded row is extra work
    rows = []
    for placed in forwards:
        pipe.decider.set_costs(own_costs if placed == "decider" else bucket_costs(pipe), merge=False)
        for w, h in sizes:
            for i in range(seeds):
                # req and row are called only within this iteration, so they read this iteration's values
                def req(prompt: str, seed: int, n: int = 1) -> GenerationRequest:
                    r = GenerationRequest(prompt, n=n, width=w, height=h, num_inference_steps=steps,  # noqa: B023
                                          guidance_scale=guidance, seed=seed)
                    return pipe.validator.validate(r).request

                probe = req(PROMPTS[i % 4], 100 + i)
                alone = bcg_run(pipe, probe)
                ref_img = _images(alone)[0]

                def row(composition: str, run) -> None:
                    dev = compare(_images(run)[0], ref_img, run.latents[:1], alone.latents[:1])  # noqa: B023
                    rows.append({"model": model, "forwards": placed, "size": f"{w}x{h}",  # noqa: B023
                                 "seed": probe.seed, "guidance": guidance, "composition": composition,  # noqa: B023
                                 **dev.to_json()})

                for n, head in COMPOSITIONS:
                    if head is None:
                        row(f"n={n}", bcg_run(pipe, dataclasses.replace(probe, n=n)))
                    elif head == "decoded":
                        other = req(PROMPTS[(i + 1) % 4], 200 + i, n=n)
                        row(f"join n={n} head=0 decoded together", joined_decoded_together(pipe, probe, other))
                    else:
                        other = req(PROMPTS[(i + 1) % 4], 200 + i, n=n)
                        joined, _ = bcg_run_joined(pipe, probe, other, head_start=head)
                        row(f"join n={n} head={head}", joined)
    pipe.decider.set_costs(own_costs, merge=False)
    return rows


def masked_cases(folder: Path, sizes, seeds: int, steps: int) -> list[dict]:
    """The masked sweep (module docstring) on the tiny FLUX checkpoint in ``folder``; one row per request.

    Returns:
        Rows: ``size``, ``seed``, ``key`` (the request's bucket), ``bcg`` (bcg-serve against diffusers alone) and
        ``kernel`` (diffusers' math-backend image against its default one), each a :class:`Deviation` dict.
    """
    case = FAMILIES["flux"]
    pipe = bcg_pipeline(folder, MASKED_BUCKETS, dtype="bfloat16", kernels="eager")
    ref = load_diffusers(case, folder, "cpu", torch.bfloat16)
    rows = []
    for w, h in sizes:
        for i in range(seeds):
            r = pipe.validator.validate(GenerationRequest(PROMPTS[i % 4], n=1, seed=300 + i, width=w, height=h,
                                                    num_inference_steps=steps, guidance_scale=3.5)).request
            key = str(pipe.validator.validate(r).lookup.key)
            alone, lat = diffusers_images(ref, [r], **case.call_kwargs)
            math, lat_math = diffusers_images(ref, [r], attention=torch.nn.attention.SDPBackend.MATH,
                                              **case.call_kwargs)
            ours = bcg_run(pipe, r)
            rows.append({"size": f"{r.width}x{r.height}", "asked": f"{w}x{h}", "seed": r.seed, "key": key,
                         "bcg": compare(pixels(ours.pngs[0]), alone[0], ours.latents, lat).to_json(),
                         "kernel": compare(math[0], alone[0], lat_math, lat).to_json()})
    return rows


def worst(devs: list[dict]) -> dict:
    """The largest of each field of :class:`Deviation` dicts, or of rows holding one (the smallest PSNR)."""
    fields = [f.name for f in dataclasses.fields(Deviation)]
    out = Deviation(**{k: devs[0][k] for k in fields})
    for d in devs[1:]:
        out = out.worst(Deviation(**{k: d[k] for k in fields}))
    return out.to_json()


def summary(result: dict) -> dict:
    """Maxima of a run: per model and forwards of the company sweep; of the masked sweep, bcg-serve's and diffusers'
    attention-backend deviations, the sizes whose bcg-serve image moved at all, and bcg-serve's largest ratio to the
    same request's backend deviation (levels and latents)."""
    out: dict = {}
    company = result.get("company", [])
    for model in sorted({r["model"] for r in company}):
        for fw in ("decider", "buckets"):
            sel = [r for r in company if r["model"] == model and r["forwards"] == fw]
            if sel:
                out[f"company {model} {fw}"] = {
                    **worst(sel), "comparisons": len(sel), "moved": sum(r["max_levels"] > 0 for r in sel),
                    "share by composition": {c: max(r["share"] for r in sel if r["composition"] == c)
                                             for c in dict.fromkeys(r["composition"] for r in sel)}}
    masked = result.get("masked", [])
    if masked:
        bcg = [r["bcg"] for r in masked]
        out["masked bcg"] = {**worst(bcg), "requests": len(bcg), "moved": sum(d["max_levels"] > 0 for d in bcg),
                             "sizes moved": sorted({r["size"] for r in masked if r["bcg"]["max_levels"] > 0})}
        out["masked diffusers kernel"] = worst([r["kernel"] for r in masked])
        out["masked bcg / kernel, levels"] = max(r["bcg"]["max_levels"] / max(r["kernel"]["max_levels"], 1)
                                                 for r in masked)
        out["masked bcg / kernel, latents"] = max((r["bcg"]["latent_rel"] or 0) / max(r["kernel"]["latent_rel"] or 0,
                                                                                       1e-12) for r in masked)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweeps", nargs="+", default=["company", "masked"], choices=["company", "masked"])
    p.add_argument("--seeds", type=int, default=2, help="probes per size and guidance (default 2)")
    p.add_argument("--masked-seeds", type=int, default=2, help="requests per size in the masked sweep (default 2)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps of every request (default 4)")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    result: dict = {"env": _env(args.steps), "seconds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = importlib.import_module("tiny.flux").build(Path(tmp) / "flux", variant="dev")
        if "company" in args.sweeps:
            from bcg_core import build_tiny
            from deployments.settings import ServeConfig

            t0 = time.perf_counter()
            tiny = DiTPipeline(ServeConfig(buckets=BucketConfig(**TINY_BUCKETS)), build_tiny())
            # guidance 3.5 (CFG rows beside each image), rows as a CPU replica places them: minutes on 2 cores
            rows = company_cases(tiny, [(256, 256), (512, 512)], args.seeds, args.steps, 3.5, "tiny-default",
                                 forwards=("decider",))
            result["seconds"]["company tiny-default"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            flux = bcg_pipeline(folder, FLUX_COMPANY_BUCKETS)
            for guidance in (1.0, 3.5):  # without and with CFG rows
                rows += company_cases(flux, [(64, 64), (32, 32)], args.seeds, args.steps, guidance, "tiny-flux")
            result["seconds"]["company tiny-flux"] = round(time.perf_counter() - t0, 1)
            result["company"] = rows
        if "masked" in args.sweeps:
            t0 = time.perf_counter()
            result["masked"] = masked_cases(folder, MASKED_SIZES, args.masked_seeds, args.steps)
            result["seconds"]["masked"] = round(time.perf_counter() - t0, 1)
    result["summary"] = summary(result)
    result["cpu_seconds"] = round(time.process_time(), 1)
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
