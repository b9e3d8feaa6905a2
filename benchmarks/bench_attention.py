"""SDPA attention backends inside a bucket graph: which backend PyTorch's default picks, and what each costs.

For FLUX.1-dev width (3072 wide, 2 double + 4 single blocks, bf16, random weights built by
``benchmarks/bench_families.py``), per bucket: the transformer forward on the bucket's static buffers
(``DiTAdapter.forward``), captured in a CUDA graph under ``torch.nn.attention.sdpa_kernel`` with one backend
(``default``: no restriction; ``cudnn``, ``flash``, ``efficient``), two warm-up forwards first, then 10 replays timed
with CUDA events. ``rel_err`` is ``max|out - default| / max|default|``: 0 means the backend computed exactly what
the default did (the same kernels). A backend that cannot run the shape (flash with an attention mask) is
reported as failed.

On the GPU machine, after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``::

    python benchmarks/bench_attention.py --scratch /dev/shm --out attention.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bench_masked_attention import graph_ms  # noqa: E402

from bcg_core.keys import BucketKey  # noqa: E402
from bcg_core.models import load_model  # noqa: E402
from bcg_core.verify_inputs import BoundaryCase, random_inputs  # noqa: E402

BUCKETS = ("b1_i4096_t512", "b2_i1024_t512", "b4_i4096_t512", "b2_i4096_m_t512")


def backends():
    from torch.nn.attention import SDPBackend

    return {"default": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
            "efficient": [SDPBackend.EFFICIENT_ATTENTION]}


def bench_bucket(adapter, model, key: BucketKey, iters: int) -> dict:
    """Every backend on bucket ``key``: ``{backend: {"ms", "rel_err"} or {"failed"}}``."""
    from torch.nn.attention import sdpa_kernel

    side = round(key.image_tokens ** 0.5)
    case = BoundaryCase(key, key.batch, (side, side), key.text_tokens)
    buffers = adapter.allocate(key, model.device, model.dtype)
    adapter.fill(buffers, random_inputs(adapter, case, model.device, model.dtype, seed=0))
    out, ref = {}, None
    for name, allowed in backends().items():
        try:
            with torch.inference_mode(), (sdpa_kernel(allowed) if allowed else contextlib.nullcontext()):
                ms, result = graph_ms(lambda: adapter.forward(buffers), iters)
            value = result.float().clone()
            ref = value if ref is None else ref
            out[name] = {"ms": round(ms, 3),
                         "rel_err": float(f"{((value - ref).abs().max() / ref.abs().max()).item():.3e}")}
        except RuntimeError as e:
            out[name] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(key, name, out[name], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buckets", default=",".join(BUCKETS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--scratch", help="folder for the random-weight checkpoint")
    ap.add_argument("--out", help="JSON result")
    args = ap.parse_args(argv)
    from bench_fused_step import build

    config, info = build("flux-dev-width", args.scratch, torch.device("cuda"))
    model = load_model(config)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": "flux-dev-width",
              "built": info, "buckets": {}}
    for key in args.buckets.split(","):
        result["buckets"][key] = bench_bucket(model.adapter, model, BucketKey.parse(key), args.iters)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
