"""Does encoding several edits' images in one VAE call pay? One batched ``vae.encode`` against one call per image.

The step scheduler's edit-start stage (``bcg_core/scheduler/edit_start.py``) encodes the images of edits admitted
together in one VAE call on CUDA and one at a time on a CPU; this script is the measurement behind that choice.
For each ``--sizes`` side S and ``--batch`` B: B random images (B, 3, S, S) in [-1, 1] through FLUX.1-dev's VAE
(``bench_families.FLUX_VAE``: its published config, random weights) in ``--dtype``, ``vae.encode(x).latent_dist``'s
mean, timed as the median of ``--repeats`` runs of (a) one call of B images and (b) B calls of one image each
(after one untimed warm-up of each; CUDA synchronised around every timing). Also reported: the largest difference
of the batched means from the single ones relative to their largest magnitude (batched kernels reduce in another
order). TF32 stays off on CUDA unless ``--tf32``.

On the GPU machine::

    python benchmarks/bench_vae_encode.py --sizes 512,1024 --batch 4 --dtype bfloat16 \\
        --out docs/bench/<date>_vae_encode_h200.json

On a CPU (slow at published sizes)::

    python benchmarks/bench_vae_encode.py --sizes 128 --batch 4 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]


def time_encode(vae, images, device, repeats: int) -> tuple[float, float, float]:
    """``(batched ms, singles ms, relative difference)``, medians over ``repeats`` (module docstring)."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def batched():
        return vae.encode(images).latent_dist.mean

    def singles():
        return torch.cat([vae.encode(images[i:i + 1]).latent_dist.mean for i in range(images.shape[0])])

    runs = {"batched": [], "singles": []}
    with torch.inference_mode():
        outs = {"batched": batched(), "singles": singles()}  # warm-up (cuDNN's algorithm choice, allocations)
        for _ in range(repeats):
            for name, fn in (("batched", batched), ("singles", singles)):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                runs[name].append((time.perf_counter() - t0) * 1e3)
    a, b = outs["batched"].float(), outs["singles"].float()
    rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    return statistics.median(runs["batched"]), statistics.median(runs["singles"]), rel


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512,1024", help="comma-separated square sides in pixels")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 convolutions and matmuls on CUDA")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--commit")
    args = ap.parse_args(raw)
    import torch
    from bench_families import FLUX_VAE
    from diffusers import AutoencoderKL

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    vae = AutoencoderKL(**FLUX_VAE).to(device=device, dtype=dtype).eval()
    rows = []
    for side in (int(s) for s in args.sizes.split(",")):
        g = torch.Generator().manual_seed(side)
        images = (torch.rand(args.batch, 3, side, side, generator=g) * 2 - 1).to(device=device, dtype=dtype)
        batched, singles, rel = time_encode(vae, images, device, args.repeats)
        row = {"side": side, "batch": args.batch, "batched_ms": round(batched, 2), "singles_ms": round(singles, 2),
               "speedup": round(singles / batched, 3), "batched_vs_singles_rel": float(f"{rel:.3g}")}
        rows.append(row)
        print(row, flush=True)
    result = {"benchmark": "vae_encode", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "commit": args.commit, "command": shlex.join(["python", "benchmarks/bench_vae_encode.py", *raw]),
              "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "dtype": args.dtype, "tf32": args.tf32, "vae": "FLUX.1-dev config, random",
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
