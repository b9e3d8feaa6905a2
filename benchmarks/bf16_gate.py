"""bcg-serve's bf16 images against diffusers' own bf16 pipeline, per family, beside diffusers' own deviations.

For each family (the tiny random-weight checkpoints of ``tests/tiny/``, built offline), in bf16 on ``--device``,
``tests/reference_gate_bf16.py`` (:func:`reference_gate_bf16.measure_family`) measures diffusers' own deviations
(``batch``: alone against beside another prompt in a batch of two; ``kernel``: default SDPA backend against the math
backend; ``fp32``: bf16 against fp32) and bcg-serve's (``runner.kernels`` ``--kernels``) against diffusers alone for an
exact bucket, image padding into a masked tier, text padding and a batched request, then applies the gate
(:func:`reference_gate_bf16.check`). Each cell: largest pixel difference in levels / share of pixel values that differ /
relative error of the final latents.

Usage::

    PYTHONPATH=$PWD python benchmarks/bf16_gate.py [--device cpu|cuda] [--kernels eager|compiled|fp8]
        [--families flux sd3 ...] [--steps 4] [--out results.json]

Exits 1 when the gate fails for any family.

With ``--dtypes``, no gate: diffusers' own pipeline alone, one request per family (seed 3, 4 steps, each run
drawing its own noise from the seed, as a user's call does), in fp32 and bf16 on the CPU and on ``--device``, each
against fp32 on the CPU (:func:`dtype_check`), with the initial noise and each module's first output compared: it
found that torch 2.11's CPU generator draws other noise in bf16 than in fp32 (docs/BENCHMARKS.md, 2026-12-04).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT, _ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from reference_gate_bf16 import BOUNDS, CASES, FAMILIES, check, fp32_is_rounding, measure_family  # noqa: E402


def cell(d: dict | None) -> str:
    """``levels / share% / latent rel`` of one :class:`reference_gate_bf16.Deviation` as a dict; ``-`` for none."""
    if d is None:
        return "-"
    rel = d.get("latent_rel")
    return f"{d['max_levels']} / {d['share']:.1%} / {'-' if rel is None else f'{rel:.1e}'}"


def table(results: list[dict]) -> str:
    """A Markdown table: one row per family, diffusers' bounds then bcg-serve's cases, and the gate's verdict."""
    head = ["family"] + [f"diffusers {b}" for b in BOUNDS] + [f"bcg {c}" for c in CASES] + ["gate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        verdict = "pass" if not r["violations"] else "FAIL"
        lines.append("| " + " | ".join([r["family"]] + [cell(r["bounds"].get(b)) for b in BOUNDS]
                                       + [cell(r["cases"].get(c)) for c in CASES] + [verdict]) + " |")
    return "\n".join(lines)


def _env(args: argparse.Namespace) -> dict:
    """Where the gate ran: date, commit (None outside a git checkout), torch, diffusers, device, kernels, steps."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
           "torch": torch.__version__, "device": args.device, "kernels": args.kernels, "steps": args.steps,
           "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "cpus": os.cpu_count()}
    for package in ("diffusers", "transformers"):
        try:
            env[package] = importlib.import_module(package).__version__
        except ImportError:
            pass
    return env


def dtype_check(family: str, devices: list[str], steps: int = 4) -> dict:
    """Diffusers' pipeline of ``family`` (its tiny checkpoint) on each of ``devices`` in fp32 and bf16, one request.

    Returns:
        ``{"<device> <dtype>": Deviation as a dict}``: each run's image and final latents against fp32 on the first
        device (the reference, 0), plus ``"<device> bf16 vs <device> fp32"`` for each device, and
        ``"<device> components"``: the relative error ``max|a - b| / max|b|`` in bf16 against fp32 of the initial
        noise (``noise``: each run draws its own from the seed, :func:`reference_gate_bf16.initial_noise`) and of
        the first call's output of each of the pipeline's modules (text encoders, transformer; :func:`first_outputs`),
        which says where the two first part.
    """
    import tempfile

    from bcg_core import GenerationRequest
    from reference_gate_bf16 import WORDS_PROMPT, compare, diffusers_images, initial_noise, load_diffusers

    case = FAMILIES[family]
    runs, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        built = importlib.import_module(f"tiny.{case.builder}").build(Path(tmp) / family, **case.build_kwargs)
        request = GenerationRequest(prompt=WORDS_PROMPT, n=1, seed=3, num_inference_steps=steps, **case.fields)
        for device in devices:
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                pipe = load_diffusers(case, built, device, dtype)
                with first_outputs(pipe) as firsts, initial_noise(pipe) as noise:
                    images, latents = diffusers_images(pipe, [request], **case.call_kwargs)
                runs[f"{device} {name}"] = (images[0], latents)
                outputs[f"{device} {name}"] = {"noise": noise[0].float().cpu(), **firsts}
                del pipe
    ref_image, ref_latents = runs[f"{devices[0]} fp32"]
    out = {k: compare(im, ref_image, lat, ref_latents).to_json() for k, (im, lat) in runs.items()}
    for device in devices:
        (im, lat), (im32, lat32) = runs[f"{device} bf16"], runs[f"{device} fp32"]
        out[f"{device} bf16 vs {device} fp32"] = compare(im, im32, lat, lat32).to_json()
        b16, b32 = outputs[f"{device} bf16"], outputs[f"{device} fp32"]
        out[f"{device} components"] = {k: round(float((b16[k] - b32[k]).abs().max() / b32[k].abs().max()), 6)
                                       for k in b32 if k in b16 and b16[k].shape == b32[k].shape}
    return out


@contextlib.contextmanager
def first_outputs(pipe):
    """Within the block, the first output tensor of each ``torch.nn.Module`` component of ``pipe`` (its first call;
    a model output's first field), as float32 on the CPU, into the yielded dict by component name."""
    found, hooks = {}, []

    def grab(name):
        def hook(module, args, output):
            if name not in found:
                t = output if torch.is_tensor(output) else output[0] if isinstance(output, (tuple, list)) else \
                    next((v for v in getattr(output, "values", lambda: [])() if torch.is_tensor(v)), None)
                if torch.is_tensor(t):
                    found[name] = t.detach().float().cpu()
        return hook

    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            hooks.append(module.register_forward_hook(grab(name)))
    try:
        yield found
    finally:
        for h in hooks:
            h.remove()


def main(argv: list[str] | None = None) -> int:
    """Run the gate for each family; print the table (and violations); write JSON with ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--kernels", default="eager", choices=["eager", "compiled", "fp8"])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="write the results (and the environment) as JSON here")
    ap.add_argument("--dtypes", action="store_true",
                    help="no gate: diffusers alone in fp32 and bf16 on the CPU and --device (dtype_check)")
    args = ap.parse_args(argv)
    if args.device == "cuda":  # fp32 is fp32: cuDNN's convolutions default to TF32 (tests/gpu's no_tf32 fixture)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    try:
        from diffusers.utils import logging as dlog
        from transformers.utils import logging as tlog

        dlog.set_verbosity_error(), tlog.set_verbosity_error()
        dlog.disable_progress_bar(), tlog.disable_progress_bar()
    except ImportError:
        pass
    env = _env(args) if args.out else None
    if args.dtypes:
        devices = ["cpu"] + ([args.device] if args.device != "cpu" else [])
        found = {}
        for name in args.families:
            found[name] = dtype_check(name, devices, args.steps)
            for k, d in found[name].items():
                shown = d if k.endswith("components") else f"{cell(d)} / PSNR {d['psnr_db']}"
                print(f"{name:10s} {k:24s} {shown}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"env": env, "dtypes": found}, indent=1) + "\n")
        return 0
    results = []
    for name in args.families:
        t0 = time.perf_counter()
        r = measure_family(name, device=args.device, kernels=args.kernels, steps=args.steps)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        r["violations"] = check(r)
        r["fp32_is_rounding"] = fp32_is_rounding(r)
        results.append(r)
        print(f"{name}: {r['seconds']} s, {len(r['requests'])} requests", file=sys.stderr, flush=True)
        if args.out:  # after every family: a run stopped by a time bound keeps the families that finished
            args.out.parent.mkdir(parents=True, exist_ok=True)
            done = {"families": [x["family"] for x in results],
                    "complete": len(results) == len(args.families)}
            args.out.write_text(json.dumps({"env": {**env, **done}, "results": results}, indent=1) + "\n")
    print(table(results))
    for r in results:
        for v in r["violations"]:
            print("gate:", v)
        if not r["fp32_is_rounding"]:
            print(f"note: {r['family']}: diffusers' bf16 image is another image than its fp32 one (latents "
                  f"{r['bounds']['fp32']['latent_rel']:.2f} relative): no rounding, so the gate's bound leaves "
                  f"fp32 out")
    return 1 if any(r["violations"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
