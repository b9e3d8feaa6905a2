"""Correctness gates: every bucket against an unpadded eager run, at its boundary shapes (docs/DESIGN.md section 4).

:func:`verify_runner` runs each boundary case (:func:`~bcg_core.verify_inputs.boundary_cases`: per bucket, the request
shapes at the bucket's size, one below it, and the smallest request that maps to it) through a runner (padded:
static buffers, graph replay on CUDA) and through the adapter's unpadded eager forward with the same inputs
(:func:`~bcg_core.verify_inputs.random_inputs`), and reports the relative error per bucket. ``bcg verify`` prints
the report.

:func:`compile_entry` checks a bucket's compiled forward against its eager one when it is prepared, within the
kernel tier's tolerance (:func:`kernel_tolerance`, :func:`derived_tolerance`). The cases and inputs are built in
:mod:`bcg_core.verify_inputs`; the fused step's check is :mod:`bcg_core.verify_fused`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from bcg_core.capabilities import supports_plain_forward
from bcg_core.keys import BucketKey
from bcg_core.padding import DenoiseInputs, DiTAdapter
from bcg_core.runners.base import BucketEntry, BucketRunner
from bcg_core.runners.kernels import CompileFailed
from bcg_core.verify_inputs import BoundaryCase, bucket_inputs, random_inputs, text_pad_of

__all__ = ["COMPILED_CAP", "COMPILED_FACTOR", "RTOL", "BucketVerdict", "compile_entry", "compiled_deviation",
           "derived_tolerance", "kernel_tolerance", "precision_deviation", "verify_runner"]


RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
"""Relative tolerance of padded vs unpadded per dtype (docs/DESIGN.md section 4: fp32 ~1e-5, bf16 ~1e-2; bf16 here
is 2e-2 because a masked bucket's attention kernel differs from the unmasked eager one, docs/BENCHMARKS.md)."""


@dataclass
class BucketVerdict:
    """Result of :func:`verify_runner` for one bucket: worst relative error over its cases."""

    key: BucketKey
    cases: int = 0
    max_rel_err: float = 0.0
    nan: bool = False
    rtol: float = 1e-5
    shapes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no output had a NaN and every relative error is below ``rtol``."""
        return self.cases > 0 and not self.nan and self.max_rel_err <= self.rtol


def _lora_variants(adapter, plain: bool, x: DenoiseInputs) -> list[DenoiseInputs]:
    """``x`` as it is (no adapter rows: a LoRA deployment's plain graph), and with ``plain`` (the adapter is a
    :class:`~bcg_core.capabilities.PlainForward`: a LoRA deployment) also with every row on slot 0 at scale 0, which
    replays the graph that serves adapter rows (its deltas add zeros, so the reference is the same)."""
    return [x, adapter.on_slot_zero(x)] if plain else [x]


COMPILED_FACTOR = 2.0
"""The ``compiled`` tier's tolerance is this many times the eager forward's own rounding error
(:func:`kernel_tolerance`): compiled kernels may round differently, not worse than that."""

COMPILED_CAP = 0.1
"""The most the derived ``compiled`` tolerance may be, so that the check still catches a broken compile where the
eager forward's own rounding error is large: the full FLUX.1-dev transformer with random weights deviates 0.50 in
bf16 from float32 (docs/BENCHMARKS.md), which would make the tolerance 0.99, while its compiled forwards deviated
0.019-0.025 from the eager ones; a broken compile deviates by O(1) or NaN."""


@torch.no_grad()
def precision_deviation(adapter: DiTAdapter, key: BucketKey, device, dtype, seed: int = 0) -> float | None:
    """The rounding error of the eager forward in ``dtype``: ``max|eager(dtype) - eager(wide)| / max|eager(wide)|``
    on seeded random inputs that fill bucket ``key`` (:func:`~bcg_core.verify_inputs.bucket_inputs`), where
    ``wide`` is float32 for a bf16 or fp16 model and float64 for a float32 one.

    Every floating parameter and buffer of ``adapter.model`` is widened for the wide forward and then given back
    its own tensor (the same storage: nothing captured or compiled loses its addresses, and fp32 modules of a bf16
    model stay as they were). The own tensors stay alive meanwhile, so the transformer's repeated blocks
    (:func:`~bcg_core.runners.kernels.repeated_blocks`) are widened one at a time, each for its own forward (module
    hooks), and everything else for the whole forward: the wide copies need the non-block tensors' and the largest
    block's ``wide`` bytes of free device memory, not the whole model's (FLUX.1-dev in bf16: about 1.4 GB instead of
    47.6 GB beside its own 23.8 GB). Each block computes as in a forward of the widened model: its inputs are the
    wide outputs of the widened modules before it.

    Returns:
        The relative deviation, or None when the wide copies would not fit in 80% of the device's free memory.
    """
    from bcg_core.runners.kernels import repeated_blocks

    model = adapter.model
    wide = torch.float64 if dtype == torch.float32 else torch.float32

    def narrow_of(module: torch.nn.Module) -> list[torch.Tensor]:
        return [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point() and t.dtype != wide]

    blocks, in_blocks = [], set()
    for b in repeated_blocks(model):  # outermost first (pre-order): a nested block's tensors stay its parent's
        ts = [t for t in narrow_of(b) if id(t) not in in_blocks]
        in_blocks.update(id(t) for t in ts)
        blocks.append((b, ts))
    rest = [t for t in narrow_of(model) if id(t) not in in_blocks]
    wide_bytes = lambda ts: sum(t.numel() * wide.itemsize for t in ts)  # noqa: E731
    extra = wide_bytes(rest) + max((wide_bytes(ts) for _, ts in blocks), default=0)
    if torch.device(device).type == "cuda" and extra > 0.8 * torch.cuda.mem_get_info(device)[0]:
        return None
    inputs = bucket_inputs(adapter, key, device, dtype, seed)
    narrow = adapter.forward_eager(inputs).to(wide)
    own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, its own data), while widened

    def widen(ts: list[torch.Tensor]) -> None:
        for t in ts:
            own[id(t)] = (t, t.data)
            t.data = t.data.to(wide)

    def give_back(ts: list[torch.Tensor]) -> None:
        for t in ts:
            t.data = own.pop(id(t))[1]

    hooks = []
    try:
        for block, ts in blocks:
            hooks.append(block.register_forward_pre_hook(lambda _m, _a, ts=ts: widen(ts)))
            hooks.append(block.register_forward_hook(lambda _m, _a, _o, ts=ts: give_back(ts)))
        widen(rest)
        ref = adapter.forward_eager(inputs).to(wide)
    finally:
        for h in hooks:
            h.remove()
        for t, data in list(own.values()):
            t.data = data
        own.clear()
    return ((narrow - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def derived_tolerance(tier: str, adapter: DiTAdapter, keys: list[BucketKey], device, dtype, cache_dir: str | None,
                      weights: str | None) -> tuple[float, str]:
    """:func:`kernel_tolerance` of ``tier`` from :func:`precision_deviation` on the smallest of ``keys``, which is
    read from ``<cache_dir>/bcg-deviation.json`` (default: inductor's cache folder) when a start before measured it
    for the same weights (``weights``: :func:`bcg_core.models.weights_stamp`), transformer
    (:func:`~bcg_core.runners.attention.model_signature`), device, bucket, GPU, torch and cuDNN (and ``v1``, the way
    it is measured), else measured and kept:
    a restart skips the widened copy of every weight and a forward at float32 rates (FLUX.1-dev: 47.6 GB). Never
    measured for ``fp8`` (a stated bound) or without ``keys``; never kept without ``weights`` (the tiny default).

    Returns:
        ``(rtol, note)`` as :func:`kernel_tolerance`; the note says when the deviation was kept from a start before.
    """
    import math

    from bcg_core.runners.attention import KeptValues, model_signature

    if tier == "fp8" or not keys:
        return kernel_tolerance(tier, dtype, None)
    smallest = min(keys, key=lambda k: (k.tokens, k.batch))
    if weights is None:
        return kernel_tolerance(tier, dtype, precision_deviation(adapter, smallest, device, dtype))
    if cache_dir is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

        cache_dir = inductor_cache_dir()

    store = KeptValues(cache_dir, "bcg-deviation.json", lambda v: isinstance(v, (int, float)) and math.isfinite(v)
                       and v >= 0)
    name = f"deviation v1 | {model_signature(adapter.model)} | weights {weights} | {torch.device(device)} | {smallest}"
    kept = store.get(name)
    deviation = float(kept) if kept is not None else precision_deviation(adapter, smallest, device, dtype)
    if kept is None and deviation is not None and math.isfinite(deviation):
        store.put(name, deviation)
    rtol, note = kernel_tolerance(tier, dtype, deviation)
    return rtol, note + (" (kept from an earlier start)" if kept is not None else "")


def kernel_tolerance(tier: str, dtype: torch.dtype, deviation: float | None) -> tuple[float, str]:
    """The tolerance of a kernel tier's padded forward against the unpadded eager one, and where it comes from.

    - ``eager``: :data:`RTOL` of the dtype (padding and masked attention kernels only).
    - ``compiled``: ``max(RTOL, min(COMPILED_FACTOR x deviation, COMPILED_CAP))``, ``deviation`` being the eager
      forward's own rounding error in this dtype (:func:`precision_deviation`); :data:`RTOL` when it could not be
      measured.
    - ``fp8``: the stated bound :data:`~bcg_core.runners.fp8.FP8_RTOL`.

    Returns:
        ``(rtol, note)``, the note saying how it was derived (for logs, ``bcg verify`` and ``/v1/buckets``).
    """
    from bcg_core.runners.fp8 import FP8_RTOL

    base = RTOL[dtype]
    if tier == "fp8":
        return FP8_RTOL, f"fp8 stated bound {FP8_RTOL:g}"
    if tier != "compiled":
        return base, f"{str(dtype).removeprefix('torch.')} padding tolerance {base:g}"
    if deviation is None:
        return base, f"eager rounding not measured (no memory for a wide copy): {base:g}"
    rtol = max(base, min(COMPILED_FACTOR * deviation, COMPILED_CAP))
    return rtol, (f"max({base:g}, min({COMPILED_FACTOR:g} x eager rounding {deviation:.2e} measured against "
                  f"{'float64' if dtype == torch.float32 else 'float32'}, cap {COMPILED_CAP:g}))")


T = TypeVar("T")


def compile_entry(kernels, adapter: DiTAdapter, entry: BucketEntry, warm: Callable[[], T]) -> T:
    """Compile bucket ``entry``'s shapes with ``kernels`` (a :class:`~bcg_core.runners.kernels.CompiledKernels`) and
    check them, all under :meth:`~bcg_core.runners.kernels.CompiledKernels.compiling` (its timing, its deadline).

    First the bucket's SDPA backend is chosen (:meth:`~bcg_core.runners.kernels.CompiledKernels.attention_for`:
    its eager forward on seeded inputs that fill it is recorded, the backends measured on those calls) and kept as
    ``entry.attention``; the compile traces attention to that backend.

    ``warm()`` (the runner's warm-up forwards on the bucket's buffers) compiles each repeated block for the
    bucket's shape. Then, with ``kernels.rtol`` set, :func:`compiled_deviation` compares the compiled forward with
    the eager one on seeded random inputs that fill the bucket; the deviation is kept as ``entry.compile_rel_err``.

    Returns:
        What ``warm()`` returned.

    Raises:
        CompileFailed: the compile raised, passed ``kernels.timeout_s``, or the deviation is above ``kernels.rtol``
            (or NaN): the message starts ``compile_failed:``, ``compile_timeout:`` or ``compile_check_failed:``;
            on a failed check the precompiled blocks the compile used are deleted
            (:meth:`~bcg_core.runners.precompiled.PrecompiledBlocks.discard_used`).
        torch.OutOfMemoryError: out of memory while compiling.
    """
    latents = entry.buffers["latents"]
    adapter.fill(entry.buffers, bucket_inputs(adapter, entry.key, latents.device, latents.dtype))
    entry.attention = kernels.attention_for(entry.key, lambda: adapter.forward(entry.buffers), latents.device)
    with kernels.compiling(entry.attention.backend):
        result = warm()
        if kernels.rtol is not None:
            err = entry.compile_rel_err = compiled_deviation(kernels, adapter, entry)
            if not err <= kernels.rtol:
                if kernels.precompiled is not None:  # never load these compiled blocks again
                    kernels.precompiled.discard_used()
                raise CompileFailed(f"compile_check_failed: the compiled forward deviates {err:.2e} from the eager "
                                    f"one (tolerance {kernels.rtol:.2e}, {kernels.rtol_note or 'runner.compile_rtol'})")
    return result


@torch.inference_mode()
def compiled_deviation(kernels, adapter: DiTAdapter, entry: BucketEntry, seed: int = 0) -> float:
    """``max|compiled - eager| / max|eager|`` of bucket ``entry``'s padded forward over its real rows and tokens,
    the compiled blocks of ``kernels`` against the eager ones on the same buffers: on seeded random inputs that
    fill it (:func:`~bcg_core.verify_inputs.bucket_inputs`) and, where the family pads text, on inputs that leave
    :func:`~bcg_core.verify_inputs.text_pad_of` of its text tokens to the padding (masked zero pads reach the blocks
    as zero rows: the fp8 tier once turned them into NaN); the larger of the two, NaN if either is."""
    latents = entry.buffers["latents"]
    errs = []
    for pad in sorted({0, text_pad_of(adapter, entry.key)}):
        inputs = bucket_inputs(adapter, entry.key, latents.device, latents.dtype, seed, text_pad=pad)
        adapter.fill(entry.buffers, inputs)
        with kernels.active(True):
            compiled = adapter.unpad(adapter.forward(entry.buffers), inputs).float().clone()
        with kernels.active(False):
            eager = adapter.unpad(adapter.forward(entry.buffers), inputs).float().clone()
        errs.append(((compiled - eager).abs().max() / eager.abs().max().clamp_min(1e-12)).item())
    return float("nan") if any(e != e for e in errs) else max(errs)


def verify_runner(adapter: DiTAdapter, runner: BucketRunner, cases: list[BoundaryCase], device, dtype,
                  rtol: float, on_case: Callable[[BoundaryCase, float], Any] | None = None) -> list[BucketVerdict]:
    """Run every case padded (through ``runner``) and unpadded (``adapter.forward_eager``); compare.

    Relative error is ``max|padded - eager| / max|eager|`` over the real rows and tokens.

    Args:
        on_case: called after each case with the case and the seconds it took (both runs), e.g. for progress.

    Returns:
        One verdict per bucket that has cases, in bucket order.
    """
    verdicts: dict[BucketKey, BucketVerdict] = {}
    plain = supports_plain_forward(adapter)
    for i, case in enumerate(cases):
        start = time.perf_counter()
        x = random_inputs(adapter, case, device, dtype, seed=i)
        with torch.inference_mode():
            ref = adapter.forward_eager(x).float()
        v = verdicts.setdefault(case.key, BucketVerdict(case.key, rtol=rtol))
        v.cases += 1
        for xi in _lora_variants(adapter, plain, x):  # a LoRA deployment's buckets hold two graphs: check both
            out = runner.run(case.key, xi).float()
            v.nan |= bool(torch.isnan(out).any())
            err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
            v.max_rel_err = max(v.max_rel_err, err)
        v.shapes.append(f"{case.rows}x{case.grid[0]}x{case.grid[1]}+{case.text_tokens}")
        if on_case is not None:
            on_case(case, time.perf_counter() - start)
    return [verdicts[k] for k in sorted(verdicts)]
