"""VAE decode, eager against compiled: does compiling the decode of each bucket pay?

Per VAE (``--vaes``: the published configs in ``benchmarks/bench_families.py``, random weights, bf16) and per batch
of ``--batches`` latents at ``--size``: ``vae.decode`` eager, and ``torch.compile(vae.decode, dynamic=False)``
(inductor, one static compile per shape, as a compiled bucket would hold it), each timed over ``--iters`` calls
after a warm-up (the compiled one's first call, its compile, is reported as ``compile_s``). Reported per shape:
``eager_ms``, ``compiled_ms``, ``ratio`` (compiled / eager), ``max_rel_err`` (compiled against eager, relative to
the eager image's largest value) and ``compile_s``. Compare ``eager_ms`` with a request's wall
(``benchmarks/bench_tiers.py``'s ``decode_ms``) to see the share of a request that a gain could save.

On the GPU machine, after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``::

    python benchmarks/bench_decode.py --vaes flux,dc-ae --batches 1,4 --commit <sha> --out decode.json

CPU smoke: ``--device cpu --tiny --iters 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

VAES = {  # name: (diffusers class, config name in bench_families, latent channels, spatial compression)
    "flux": ("AutoencoderKL", "FLUX_VAE", 16, 8),
    "sdxl": ("AutoencoderKL", "SDXL_VAE", 4, 8),
    "dc-ae": ("AutoencoderDC", "DC_AE", 32, 32),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


@torch.inference_mode()
def bench_vae(name: str, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Every batch of ``args.batches`` for one VAE: eager and compiled decode, side by side."""
    import bench_families
    import diffusers

    cls, cfg_name, channels, down = VAES[name]
    config = dict(getattr(bench_families, cfg_name))
    if args.tiny:
        if cls != "AutoencoderKL":
            raise SystemExit("--tiny has a small AutoencoderKL only: use --vaes flux or sdxl")
        config.update(block_out_channels=(32, 32), down_block_types=config["down_block_types"][:2],
                      up_block_types=config["up_block_types"][:2], norm_num_groups=8)
        down = 2
    torch.manual_seed(0)
    with torch.device(device):
        vae = getattr(diffusers, cls)(**config).to(dtype).eval()
    side = args.size // down
    rows = []
    for batch in args.batches:
        z = torch.randn(batch, channels, side, side, device=device, dtype=dtype)
        eager = lambda z=z: vae.decode(z, return_dict=False)[0]  # noqa: E731
        compiled_decode = torch.compile(vae.decode, dynamic=False)
        compiled = lambda z=z, decode=compiled_decode: decode(z, return_dict=False)[0]  # noqa: E731
        ref = eager().float()
        t0 = time.perf_counter()
        out = compiled().float()
        _sync(device)
        compile_s = time.perf_counter() - t0
        err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        walls = {"eager": [], "compiled": []}
        for i in range(args.rounds):  # alternate, so drift hits both
            for mode, fn in (("eager", eager), ("compiled", compiled)) if i % 2 == 0 else (("compiled", compiled),
                                                                                            ("eager", eager)):
                walls[mode] += _time(fn, device, args.iters)
        e, c = statistics.median(walls["eager"]), statistics.median(walls["compiled"])
        row = dict(vae=name, cls=cls, batch=batch, size=f"{args.size}x{args.size}", eager_ms=round(e, 2),
                   compiled_ms=round(c, 2), ratio=round(c / e, 3), max_rel_err=float(f"{err:.3g}"),
                   compile_s=round(compile_s, 1))
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch._dynamo.reset()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vaes", default="flux,dc-ae", help=f"comma-separated, of {','.join(VAES)}")
    ap.add_argument("--batches", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--size", type=int, default=1024, help="image side in pixels")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per round and mode")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the modes alternating")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: a two-level AutoencoderKL, fp32, 64 px")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--commit", help="git commit to record")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        args.size = 64
    device = torch.device(args.device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    result = dict(benchmark="decode", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  commit=args.commit, torch=torch.__version__, command=" ".join(["python", *sys.argv]),
                  gpu=torch.cuda.get_device_name() if device.type == "cuda" else None, dtype=str(dtype), rows=[])
    for name in args.vaes.split(","):
        if name not in VAES:
            raise SystemExit(f"unknown VAE {name!r}; VAEs: {', '.join(VAES)}")
        result["rows"] += bench_vae(name, args, device, dtype)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
