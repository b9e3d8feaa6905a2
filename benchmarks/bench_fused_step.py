"""Fused step against the transformer-only graph: milliseconds per denoising step, side by side in one run.

For each model, two :class:`~bcg_core.pipeline.DiTPipeline` share one loaded model and one bucket table
(``batch_sizes`` 1, 2, 4, 8, 16 at one resolution, text at the model's native length):

- ``host``: ``runner.fused_step: never``: each bucket graph holds the transformer alone; after the replay,
  every request's CFG combination and ``scheduler.step`` run on the host (the family's ``advance``);
- ``fused``: ``runner.fused_step: always``: each graph holds the transformer, every image's CFG combination
  and its flow-match Euler update (``bcg_core/runners/fused.py``); one replay is one whole step.

A case is ``R`` requests of ``n`` images each (with or without classifier-free guidance), all in one bucket
forward per step (``DiTPipeline.step``). Both paths start from the same states; per round each path runs
``--steps`` steps back to back (the host runs ahead of the GPU as in serving; one ``torch.cuda.synchronize``
at the end); rounds alternate the two paths. Reported per case (medians over ``--rounds``):

- ``wall_ms``: wall milliseconds per step, enqueue to completion;
- ``host_ms``: host milliseconds of the first step of a round, enqueued on an idle GPU: where the host path
  pays its per-request Python and kernel launches (later steps of a round may wait on the launch queue);
- ``ratio``: host ``wall_ms`` / fused ``wall_ms`` (above 1: the fused step is faster);
- ``bitwise_equal``: both paths' latents identical after the timed steps (``torch.equal``).

Models (``--models``; CFG on every odd request, so the cases have 1, 6, 12 and 12 rows):

- ``flux-dev-width``: FLUX.1-dev width 3072, 2 double + 4 single blocks, bf16, 1024x1024 and 512x512, guidance
  embedding 3.5 and true CFG 4.0 with a negative prompt;
- ``sd3-medium``: the SD3-medium transformer, bf16, 512x512, CFG 7.0;
  (both with random weights built by ``benchmarks/bench_families.py``'s ``build_checkpoint`` under ``--scratch``)
- ``tiny-flux`` / ``tiny-sd3``: the tests/tiny checkpoints (fp32, 64x64): launch-bound, where host work per
  request is the largest share of a step;
- ``tiny``: the embedded default (fp32, 256x256; needs the embedded MiniLM package, so not on the GPU machine's
  site pack).

Run on the GPU machine after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``::

    python benchmarks/bench_fused_step.py --scratch /dev/shm --commit <sha>

JSON to ``docs/bench/<date>_fused_step_<gpu>.json`` (``--out``); a table on stdout. ``--device cpu --models
tiny-flux,tiny-sd3 --steps 2 --rounds 1`` is the CPU smoke (the fused step then runs eagerly on the static
buffers). The exit status is 1 if any case's latents differ between the two paths.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bcg_core import BucketConfig, DiTPipeline, GenerationRequest, LimitsConfig, ModelConfig  # noqa: E402
from bcg_core.models import load_model  # noqa: E402
from deployments.settings import ServeConfig  # noqa: E402

CASES = [(1, 1), (4, 1), (8, 1), (4, 2)]
"""(requests, images per request) of every model: CFG on the odd requests, so 1, 6, 12 and 12 rows."""

MODELS = {  # name: (bench_families model or tests/tiny module, sizes, CFG scale)
    "flux-dev-width": ("flux-dev", [1024, 512], 4.0),
    "sd3-medium": ("sd3-medium", [512], 7.0),
    "tiny-flux": ("tiny.flux", [64], 4.0),
    "tiny-sd3": ("tiny.sd3", [64], 7.0),
    "tiny": (None, [256], 4.0),
}


def build(name: str, scratch: str | None, device: torch.device) -> tuple[ModelConfig, dict]:
    """The model's config (built under ``scratch`` with random weights; the tiny default is embedded)."""
    if name == "tiny":
        return ModelConfig(device=device.type), {"model": "bcg-tiny-flux (embedded)"}
    if name.startswith("tiny-"):
        import importlib

        folder = Path(tempfile.mkdtemp(prefix=f"bcg-fused-{name}-", dir=scratch))
        importlib.import_module(MODELS[name][0]).build(folder / name.removeprefix("tiny-"))
        return (ModelConfig(path=str(folder / name.removeprefix("tiny-")), device=device.type, dtype="float32"),
                {"model": f"tests/{MODELS[name][0].replace('.', '/')}.py (fp32)"})
    import bench_families
    from bench_saturation import FLUX_DEV_WIDTH_LAYERS

    spec = bench_families.bench_models(tiny=device.type != "cuda")[MODELS[name][0]]
    if name == "flux-dev-width" and device.type == "cuda":
        double, single = FLUX_DEV_WIDTH_LAYERS
        spec = spec._replace(transformer=dict(spec.transformer, num_layers=double, num_single_layers=single))
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    folder = Path(tempfile.mkdtemp(prefix=f"bcg-fused-{name}-", dir=scratch))
    info = bench_families.build_checkpoint(spec, folder, device, getattr(torch, dtype))
    return ModelConfig(path=str(folder), device=device.type, dtype=dtype), info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _twin(state):
    return dataclasses.replace(state, latents=state.latents.clone(), scheduler=copy.deepcopy(state.scheduler),
                               step_ms=[])


def bench_case(pipes: dict[str, DiTPipeline], size: int, requests: int, n: int, guidance: float | None,
               args) -> dict:
    """One case: ``requests`` requests of ``n`` images (CFG on the odd ones when ``guidance``)."""
    device = pipes["fused"].model.device
    true_cfg = pipes["fused"].model.spec.cfg_rule == "true_cfg"  # FLUX.1: true CFG with a negative prompt
    reqs = []
    for i in range(requests):
        cfg = bool(guidance and i % 2)
        extra = (dict(guidance_scale=3.5, true_cfg_scale=guidance if cfg else None,
                      negative_prompt="blurry" if cfg else None) if true_cfg
                 else dict(guidance_scale=guidance if cfg else 1.0, negative_prompt="blurry" if cfg else None))
        reqs.append(GenerationRequest(f"a lighthouse, study {i}", n=n, width=size, height=size,
                                      num_inference_steps=args.steps * (args.rounds + 1) + 1, seed=i, **extra))
    validated_requests = [pipes["fused"].validator.validate(r) for r in reqs]
    states = {"fused": [pipes["fused"].start(p) for p in validated_requests]}
    states["host"] = [_twin(s) for s in states["fused"]]
    rows = sum(s.rows for s in states["fused"])
    lookup = None
    for path in ("fused", "host"):  # one warm-up step each
        lookup = pipes[path].step(states[path])
    _sync(device)
    walls, hosts = {"fused": [], "host": []}, {"fused": [], "host": []}
    for r in range(args.rounds):
        for path in (("fused", "host") if r % 2 == 0 else ("host", "fused")):
            _sync(device)
            t0 = time.perf_counter()
            pipes[path].step(states[path])
            t1 = time.perf_counter()  # one step's host time, from an idle GPU (no launch queue to wait on)
            for _ in range(args.steps - 1):
                pipes[path].step(states[path])
            _sync(device)
            t2 = time.perf_counter()
            walls[path].append((t2 - t0) * 1e3 / args.steps)
            hosts[path].append((t1 - t0) * 1e3)
    equal = all(torch.equal(a.latents, b.latents) for a, b in zip(states["fused"], states["host"], strict=True))
    med = {p: round(statistics.median(walls[p]), 3) for p in walls}
    return dict(size=f"{size}x{size}", requests=requests, n=n, rows=rows, bucket=str(lookup.key),
                cfg_requests=sum(s.cfg for s in states["fused"]),
                fused_wall_ms=med["fused"], host_wall_ms=med["host"],
                fused_host_ms=round(statistics.median(hosts["fused"]), 3),
                host_host_ms=round(statistics.median(hosts["host"]), 3),
                ratio=round(med["host"] / med["fused"], 3), bitwise_equal=equal,
                fused_steps=pipes["fused"].fused.steps,
                walls_ms={p: [round(w, 3) for w in v] for p, v in walls.items()})


def bench_model(name: str, args, device: torch.device) -> dict:
    """Every case of one model; the two pipelines captured over one loaded model."""
    mc, info = build(name, args.scratch, device)
    model = load_model(mc)
    sizes, guidance, cases = MODELS[name][1], MODELS[name][2], CASES
    text = model.rules.native_text_tokens
    out = dict(model=name, build=info, cases=[])
    for size in sizes:
        buckets = BucketConfig(batch_sizes=[1, 2, 4, 8, 16], resolutions=[f"{size}x{size}"],
                               text_lengths=[text] if text else None)
        pipes, capture_s = {}, {}
        for path, how in (("fused", "always"), ("host", "never")):
            t0 = time.perf_counter()
            limits = LimitsConfig(min_side_px=16, max_steps=max(50, args.steps * (args.rounds + 1) + 1))
            cfg = ServeConfig(model=mc, buckets=buckets, limits=limits, runner={"fused_step": how, "kernels": "eager"})
            pipes[path] = DiTPipeline(cfg, model)
            _sync(device)
            capture_s[path] = round(time.perf_counter() - t0, 2)
        out.setdefault("fused_check", {})[f"{size}x{size}"] = pipes["fused"].fused.note
        out.setdefault("prepare_s", {})[f"{size}x{size}"] = capture_s
        for requests, n in cases:
            row = bench_case(pipes, size, requests, n, guidance, args)
            out["cases"].append(row)
            print(f"{name} {row['size']} {requests}x{n} ({row['rows']} rows, {row['bucket']}): fused "
                  f"{row['fused_wall_ms']} ms, host {row['host_wall_ms']} ms, x{row['ratio']}, "
                  f"equal {row['bitwise_equal']}", flush=True)
        del pipes
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def render(result: dict) -> str:
    """The Markdown table of ``docs/BENCHMARKS.md``."""
    from bench_families import format_table

    rows = [[m["model"], c["size"], f"{c['requests']} x {c['n']}", c["cfg_requests"], c["rows"], c["bucket"],
             c["host_wall_ms"], c["fused_wall_ms"], f"{c['ratio']:.3f}", c["host_host_ms"], c["fused_host_ms"],
             "yes" if c["bitwise_equal"] else "NO"]
            for m in result["models"] for c in m["cases"]]
    return format_table(["model", "size", "requests x n", "CFG reqs", "rows", "bucket", "host ms/step",
                         "fused ms/step", "host / fused", "host path: host ms", "fused: host ms", "bitwise equal"],
                        rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="flux-dev-width,sd3-medium,tiny-flux,tiny-sd3")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scratch", help="folder for the random-weight checkpoints (default: a temp dir)")
    ap.add_argument("--out", help="JSON result (default docs/bench/<date>_fused_step_<gpu>.json)")
    ap.add_argument("--commit", help="git commit to record")
    args = ap.parse_args(argv)
    import bench_families

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    result = dict(env=bench_families._env(device, args), steps=args.steps, rounds=args.rounds,
                  models=[bench_model(m, args, device) for m in names])
    table = render(result)
    print(table)
    gpu = (result["env"]["gpu"] or "cpu").split()[-1].lower() if device.type == "cuda" else "cpu"
    out = Path(args.out or ROOT / "docs" / "bench" /
               f"{datetime.now(timezone.utc):%Y-%m-%d}_fused_step_{gpu}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all(c["bitwise_equal"] for m in result["models"] for c in m["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
