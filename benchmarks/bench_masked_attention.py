"""Key-padding attention of a masked bucket: the dense boolean mask against layouts that keep a faster kernel.

A masked bucket (``image_padding: masked``, ``bcg_core/families/flux_adapter.py``) holds rows with fewer real tokens
than its shape; their pad tokens sit at the end of each row and are hidden from every query by a boolean key-padding
mask ``(batch, 1, 1, tokens)``. On an H200 that mask sends PyTorch's cuDNN SDPA down a path that spends 60-70%
more on attention than an unmasked call of the same shape (2026-12-05 profile, docs/BENCHMARKS.md). This script
times, for the same queries, keys, values and real lengths, each way of computing that attention:

- ``dense``: no mask at all. Wrong for the pad keys; the floor every other layout is measured against.
- ``masked``: today's call, ``scaled_dot_product_attention(q, k, v, attn_mask=bool mask)``.
- ``masked-float``: the same mask as an additive float mask (0 and -inf).
- ``bias-dim-E``: no mask; ``E`` zero head dimensions appended to query, key and value, the query's first one set
  to 1 and the key's to 0 (real) or -30000 (pad), so each score gains 0 or -30000 / sqrt(128): ``exp`` of that
  underflows to exactly 0 in float32 and the pad keys drop out of the softmax. The scale stays 1/sqrt(128).
  The call is unmasked, so it runs the dense kernel at head dimension 128 + E.
- ``ragged-cudnn``: cuDNN's ragged (nested) layout, ``torch.ops.aten._cudnn_attention_forward`` with cumulative
  sequence lengths of 2 x batch segments (each row's real tokens, then its pads as a segment of their own), on
  the padded buffer itself: no copy, pads attend only among themselves.
- ``varlen-flash``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2) with ``seqused_k``, the real
  key count per row, where this torch has it.

Each layout is captured in a CUDA graph (so that what runs is what a bucket graph could hold) and replayed;
``ms`` is the mean of ``--iters`` replays, the best of ``--rounds`` rounds that alternate the layouts.
``max_err`` is the largest deviation of a real query's output from a float32 math reference with the mask,
relative to the reference's largest value; a layout that cannot run (no kernel, no such op) reports why.

On the GPU machine, after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``::

    python benchmarks/bench_masked_attention.py --commit <sha> --out masked_attention.json

On a CPU, ``--small`` runs the layouts that exist there on small shapes (no timing worth reading; a check that
each layout computes the masked attention).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

PAD_BIAS = -30000.0
"""The key's bias for a pad token in ``bias-dim``: times 1/sqrt(128) it is about -2650, whose ``exp`` is 0 in
float32 (the smallest subnormal is about exp(-103)), so a pad key's softmax weight is exactly zero."""

CASES = {
    # name: (rows, heads, head_dim, text tokens, image tokens of the bucket, real image tokens per row)
    "flux-b1-4096": (1, 24, 128, 512, 4096, (3072,)),
    "flux-b2-4096": (2, 24, 128, 512, 4096, (3840, 3072)),
    "flux-b4-4096": (4, 24, 128, 512, 4096, (4096, 3840, 3072, 2304)),
    "flux-b2-1024": (2, 24, 128, 512, 1024, (960, 768)),
}
SMALL = {"small-b2": (2, 4, 64, 16, 96, (96, 50)), "small-b3": (3, 2, 32, 8, 64, (40, 64, 17))}


def make_case(rows: int, heads: int, dim: int, text: int, image: int, real: tuple[int, ...], device, dtype,
              seed: int = 0):
    """Queries, keys and values ``(rows, heads, text + image, dim)`` as views of ``(rows, tokens, heads, dim)``
    buffers (diffusers' layout before its SDPA call), the boolean key-padding mask ``(rows, text + image)`` and the
    real token counts ``(rows,)`` int32."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = text + image
    q, k, v = (torch.randn(rows, tokens, heads, dim, generator=gen).to(device, dtype).transpose(1, 2)
               for _ in range(3))
    lengths = torch.tensor([text + r for r in real], dtype=torch.int32)
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    return q, k, v, mask.to(device), lengths.to(device)


def masked(q, k, v, mask, lengths):
    """Today's call: SDPA with the boolean key-padding mask ``(rows, 1, 1, tokens)``; ``(rows, heads, tokens,
    dim)`` in and out, as every layout here."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])


def masked_float(q, k, v, mask, lengths):
    """The same mask as an additive float one (0 for a real key, -inf for a pad)."""
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None, None, :])


def dense(q, k, v, mask, lengths):
    """No mask: wrong for the pad keys; the floor."""
    return F.scaled_dot_product_attention(q, k, v)


def bias_dim(extra: int) -> Callable:
    """The ``bias-dim-<extra>`` layout (module docstring). Its time includes the three ``torch.cat`` copies into
    the wider buffers, which a forward could avoid by projecting into them; which SDPA backend runs at head
    dimension ``128 + extra`` is PyTorch's choice (not pinned here)."""

    def run(q, k, v, mask, lengths):
        b, h, n, d = q.shape
        zeros = q.new_zeros(b, h, n, extra)
        qa = torch.cat([q, zeros], -1)
        qa[..., d] = 1.0
        kb = zeros.clone()
        kb[..., 0] = torch.where(mask, 0.0, PAD_BIAS).to(q.dtype)[:, None, :]
        out = F.scaled_dot_product_attention(qa, torch.cat([k, kb], -1), torch.cat([v, zeros], -1), scale=d ** -0.5)
        return out[..., :d]

    return run


def segments(lengths: torch.Tensor, tokens: int) -> torch.Tensor:
    """Cumulative offsets ``(2 * rows + 1,)`` int32 of each row's real tokens and then its pads, in a padded
    ``(rows * tokens)`` buffer: ``[0, l0, T, T + l1, 2T, ...]``."""
    rows = lengths.shape[0]
    starts = torch.arange(rows, device=lengths.device, dtype=torch.int32) * tokens
    cum = torch.stack([starts, starts + lengths], 1).flatten()
    return torch.cat([cum, cum.new_full((1,), rows * tokens)])


def _packed(x: torch.Tensor) -> torch.Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b * n, h, d)  # a view when x is a transposed (b, n, h, d) buffer


def ragged_cudnn(q, k, v, mask, lengths):
    """cuDNN's ragged layout over the padded buffer (:func:`segments`). A row without pads gets an empty pad
    segment, which cuDNN may refuse (reported as failed)."""
    b, h, n, d = q.shape
    cum = segments(lengths, n)
    out = torch.ops.aten._cudnn_attention_forward(_packed(q), _packed(k), _packed(v), None, cum, cum, n, n, False,
                                                  0.0, False, False, scale=d ** -0.5)[0]
    return out.reshape(b, n, h, d).transpose(1, 2)


def varlen_flash(q, k, v, mask, lengths):
    """FlashAttention-2 varlen, one segment per row, ``seqused_k`` its real key count (torch 2.13 has it)."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, n, d = q.shape
    cu = torch.arange(b + 1, device=q.device, dtype=torch.int32) * n
    out = varlen_attn(_packed(q), _packed(k), _packed(v), cu, cu, n, n, seqused_k=lengths)
    return out.reshape(b, n, h, d).transpose(1, 2)


def layouts(device: torch.device) -> dict[str, Callable]:
    """The layouts that may run on ``device`` (module docstring)."""
    out = {"dense": dense, "masked": masked, "masked-float": masked_float,
           **{f"bias-dim-{e}": bias_dim(e) for e in (8, 16, 64)}}
    if device.type == "cuda":
        out |= {"ragged-cudnn": ragged_cudnn, "varlen-flash": varlen_flash}
    return out


def max_error(out: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` over each row's real queries."""
    worst = 0.0
    for i, n in enumerate(lengths.tolist()):
        worst = max(worst, (out[i, :, :n].float() - ref[i, :, :n]).abs().max().item())
    return worst / ref.abs().max().item()


def graph_ms(call: Callable[[], object], iters: int) -> tuple[float, object]:
    """``call()`` (CUDA work) after two warm-up calls, captured in a CUDA graph and replayed: milliseconds per
    replay (CUDA events over ``iters`` replays after one) and the captured call's output (its static buffers,
    holding the last replay's values)."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters, out


def time_layout(fn: Callable, args: tuple, iters: int) -> tuple[float, torch.Tensor]:
    """Milliseconds per call (CUDA: :func:`graph_ms`; CPU: eager calls) and the output."""
    if args[0].is_cuda:
        return graph_ms(lambda: fn(*args), iters)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    return (time.perf_counter() - t0) * 1e3 / iters, out


def bench_case(spec: tuple, device: torch.device, dtype: torch.dtype, iters: int, rounds: int) -> dict:
    """Every layout on one case: ``{layout: {"ms", "max_err"} or {"failed"}}``."""
    rows, heads, dim, text, image, real = spec
    args = make_case(rows, heads, dim, text, image, real, device, dtype)
    q, k, v, mask, lengths = args
    with torch.inference_mode():
        ref = F.scaled_dot_product_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                                             attn_mask=mask.cpu()[:, None, None, :])
        result: dict[str, dict] = {}
        for _ in range(rounds):
            for name, fn in layouts(device).items():
                if "failed" in result.get(name, {}):
                    continue
                try:
                    ms, out = time_layout(fn, args, iters)
                except (RuntimeError, TypeError, ImportError, NotImplementedError) as e:
                    result[name] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                    continue
                best = min(ms, result.get(name, {}).get("ms", float("inf")))
                result[name] = {"ms": round(best, 4), "max_err": float(f"{max_error(out.cpu(), ref, lengths):.3e}")}
    base = result.get("masked", {}).get("ms")
    for r in result.values():
        if base and "ms" in r:
            r["vs_masked"] = round(r["ms"] / base, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); the JSON is rewritten after each case, so a run that dies in a CUDA
    layout keeps the cases before it. Returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    ap.add_argument("--small", action="store_true", help="small shapes, on the CPU when there is no GPU")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--commit", help="git commit to record")
    ap.add_argument("--out", help="JSON result")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = SMALL if args.small else CASES
    if device.type == "cpu" and not args.small:
        ap.error("without a GPU only --small runs")
    names = args.cases.split(",") if args.cases else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown case {unknown[0]!r}; known: {', '.join(table)}")
    dtype = torch.bfloat16
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": args.commit,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "cases": {}}
    for name in names:
        report["cases"][name] = {"shape": table[name], "layouts": bench_case(table[name], device, dtype, args.iters,
                                                                             args.rounds)}
        for layout, r in report["cases"][name]["layouts"].items():
            print(f"{name:14} {layout:14} {r}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
