"""Correctness gates: every bucket against an unpadded eager run, at its boundary shapes (docs/DESIGN.md section 4).

:func:`boundary_cases` lists, per bucket, the request shapes at the bucket's size, one below it, and the
smallest request that maps to it (per dimension; "one below" a bucket's size may fall into the next
smaller bucket, and is then checked there). :func:`verify_runner` runs each case through a runner
(padded: static buffers, graph replay on CUDA) and through the adapter's unpadded eager forward with the
same inputs, and reports the relative error per bucket. ``bcg verify`` prints the report.

:func:`check_fused` proves the fused step (:mod:`bcg_core.runners.fused`) bitwise equal to the host step on this
device before any request uses it; :class:`FusedStats` holds its outcome and counters.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from bcg_core.capabilities import supports_plain_forward
from bcg_core.config import LimitsConfig
from bcg_core.errors import RequestError
from bcg_core.keys import BucketKey, ShapeQuery
from bcg_core.padding import DenoiseInputs, DiTAdapter
from bcg_core.request import GenerationRequest
from bcg_core.runners.base import BucketEntry, BucketRunner
from bcg_core.runners.kernels import CompileFailed
from bcg_core.table import BucketTable

__all__ = ["COMPILED_CAP", "COMPILED_FACTOR", "RTOL", "BoundaryCase", "BucketVerdict", "FusedStats", "boundary_cases",
           "bucket_inputs", "check_fused", "compile_entry", "compiled_deviation", "derived_tolerance",
           "kernel_tolerance", "precision_deviation", "random_inputs", "square_grid", "verify_runner"]


RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
"""Relative tolerance of padded vs unpadded per dtype (docs/DESIGN.md section 4: fp32 ~1e-5, bf16 ~1e-2; bf16 here
is 2e-2 because a masked bucket's attention kernel differs from the unmasked eager one, docs/BENCHMARKS.md)."""


@dataclass(frozen=True)
class BoundaryCase:
    """One request shape to check: ``rows`` transformer rows of an image with token grid ``grid``."""

    key: BucketKey
    rows: int
    grid: tuple[int, int]
    text_tokens: int


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


def _grids(table: BucketTable, limits: LimitsConfig) -> list[tuple[int, int]]:
    step = table.rules.pixels_per_token
    sides = range(-(-limits.min_side_px // step), limits.max_side_px // step + 1)
    return [(h, w) for h in sides for w in sides]


def boundary_cases(table: BucketTable, limits: LimitsConfig) -> list[BoundaryCase]:
    """Shapes at each bucket's size, one below it, and the smallest valid request that maps to it.

    Image shapes are drawn from the grids of request sizes the limits allow (multiples of the model's
    pixels per token between ``min_side_px`` and ``max_side_px``), so every case is a real request size.
    Each case carries the key the table maps it to.
    """
    grids = _grids(table, limits)
    out: dict[tuple, BoundaryCase] = {}
    for key in table.keys:
        prev_b = max([b for b in table.batch_sizes if b < key.batch], default=0)
        rows = sorted({key.batch, key.batch - 1, prev_b + 1} - {0})
        if table.rules.grid_keyed:
            image = [key.latent_hw]
        else:
            prev_t = max([t for t in table.image_tiers if t < key.image_tokens], default=0)
            mapped = [g for g in grids if prev_t < g[0] * g[1] <= key.image_tokens]
            if not mapped:
                continue
            exact = [g for g in mapped if g[0] * g[1] == key.image_tokens][:1]
            under = [g for g in mapped if g[0] * g[1] < key.image_tokens]
            below = [max(under, key=lambda g: g[0] * g[1])] if under else []
            smallest = [min(mapped, key=lambda g: g[0] * g[1])]
            image = sorted({*exact, *below, *smallest})
        prev_s = max([s for s in table.texts_for(key.image_tokens, key.latent_hw) if s < key.text_tokens], default=0)
        texts = sorted({key.text_tokens} if table.rules.native_text_tokens else
                       {key.text_tokens, key.text_tokens - 1, prev_s + 1} - {0})
        for r, g, s in itertools.product(rows, image, texts):
            lk = table.lookup(ShapeQuery(r, g[0] * g[1], s, g if table.rules.grid_keyed else None))
            if lk.key is not None:
                out[(r, g, s)] = BoundaryCase(lk.key, r, g, s)
    return sorted(out.values(), key=lambda c: (c.key, c.rows, c.grid, c.text_tokens))


def random_inputs(adapter: DiTAdapter, case: BoundaryCase, device, dtype, seed: int = 0) -> DenoiseInputs:
    """Seeded random inputs of the case's shape (drawn on the CPU in fp32, then cast), for ``adapter``.

    Latents come in the family's layout (:meth:`DiTAdapter.example_latents`), timesteps uniform on the
    family's scale ``[0, adapter.timestep_max)``; every text token is real (``text_mask`` None).
    """
    g = torch.Generator().manual_seed(seed)
    n = case.rows

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    guidance = torch.full((n,), 3.5, device=device, dtype=dtype) if adapter.guidance_embeds else None
    return DenoiseInputs(
        latents=adapter.example_latents(n, case.grid, g).to(device=device, dtype=dtype),
        text=rnd(n, case.text_tokens, adapter.seq_dim), pooled=rnd(n, adapter.pooled_dim),
        timestep=(torch.rand(n, generator=g) * adapter.timestep_max).to(device=device, dtype=dtype),
        grid=case.grid, guidance=guidance,
    )


def _lora_variants(adapter, plain: bool, x: DenoiseInputs) -> list[DenoiseInputs]:
    """``x`` as it is (no adapter rows: a LoRA deployment's plain graph), and with ``plain`` (the adapter is a
    :class:`~bcg_core.capabilities.PlainForward`: a LoRA deployment) also with every row on slot 0 at scale 0, which
    replays the graph that serves adapter rows (its deltas add zeros, so the reference is the same)."""
    return [x, adapter.on_slot_zero(x)] if plain else [x]


class _SlotZero:
    """A stand-in lease of one adapter entry on slot 0 at scale 0: the rows of a check request carry LoRA entries,
    so a LoRA deployment's graph for adapter rows is the one checked (:func:`check_fused`)."""

    slots, scales = (0,), (0.0,)

    def release(self) -> None:
        """Nothing is pinned."""


def square_grid(tokens: int) -> tuple[int, int]:
    """A token grid ``(h, w)`` with ``h * w == tokens``, as square as possible (``h <= w``; FLUX-style buckets key on
    the token count only, so any grid of that count fills them)."""
    h = max(d for d in range(1, int(tokens ** 0.5) + 1) if tokens % d == 0)
    return h, tokens // h


def bucket_inputs(adapter: DiTAdapter, key: BucketKey, device, dtype, seed: int = 0,
                  text_pad: int = 0) -> DenoiseInputs:
    """Seeded random inputs (:func:`random_inputs`) that fill bucket ``key``: all its rows and text tokens (but the
    last ``text_pad``, left to the bucket's text padding), and its image tokens as a near-square grid
    (``key.latent_hw`` for grid-keyed families); a masked bucket gets one grid column fewer, so that its padding
    mask is exercised."""
    if key.latent_hw is not None:
        grid = key.latent_hw
    else:
        h, w = square_grid(key.image_tokens)
        grid = (h, w - 1) if key.image_mask and w > 1 else (h, w)
    case = BoundaryCase(key, key.batch, grid, key.text_tokens - text_pad)
    return random_inputs(adapter, case, device, dtype, seed)


def text_pad_of(adapter: DiTAdapter, key: BucketKey) -> int:
    """Text tokens the compile check leaves to bucket ``key``'s text padding: a quarter of them (at least one)
    where the family buckets its text lengths with masked pads (``rules.native_text_tokens`` None: PixArt-Sigma,
    SANA, Qwen-Image), else 0 (a fixed text length, never padded)."""
    if adapter.rules.native_text_tokens is not None or key.text_tokens < 2:
        return 0
    return max(1, key.text_tokens // 4)


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
    on seeded random inputs that fill bucket ``key`` (:func:`bucket_inputs`), where ``wide`` is float32 for a
    bf16 or fp16 model and float64 for a float32 one.

    Every floating parameter and buffer of ``adapter.model`` is widened for the wide forward and then given back
    its own tensor (the same storage: nothing captured or compiled loses its addresses, and fp32 modules of a bf16
    model stay as they were). The widened copies need ``(wide bytes - own bytes)`` of free memory on the device.

    Returns:
        The relative deviation, or None when the widened copies would not fit in 80% of the device's free memory.
    """
    model = adapter.model
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point() and t.dtype != wide]
    extra = sum(t.numel() * (wide.itemsize - t.element_size()) for t in tensors)
    if torch.device(device).type == "cuda" and extra > 0.8 * torch.cuda.mem_get_info(device)[0]:
        return None
    inputs = bucket_inputs(adapter, key, device, dtype, seed)
    narrow = adapter.forward_eager(inputs).to(wide)
    own = [t.data for t in tensors]
    try:
        for t in tensors:
            t.data = t.data.to(wide)
        ref = adapter.forward_eager(inputs).to(wide)
    finally:
        for t, data in zip(tensors, own, strict=True):
            t.data = data
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
    - ``fp8``: the stated bound :data:`~bcg_core.runners.kernels.FP8_RTOL`.

    Returns:
        ``(rtol, note)``, the note saying how it was derived (for logs, ``bcg verify`` and ``/v1/buckets``).
    """
    from bcg_core.runners.kernels import FP8_RTOL

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
    fill it (:func:`bucket_inputs`) and, where the family pads text, on inputs that leave :func:`text_pad_of` of
    its text tokens to the padding (masked zero pads reach the blocks as zero rows: the fp8 tier once turned them
    into NaN); the larger of the two, NaN if either is."""
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


# -- the fused step against the host step ---------------------------------------------------------------

@dataclass
class FusedStats:
    """State and counters of the fused step (:mod:`bcg_core.runners.fused`), shown in ``/v1/buckets`` as ``fused_step``.

    Attributes:
        wanted: the runner captures fused steps and the family has one (``runner.fused_step``).
        checked: :meth:`DiTPipeline.check_fused` has compared it with the host path.
        on: the check passed; steps may run fused.
        note: the check's outcome in words.
        steps: steps run fused.
        host_steps: steps that ran on the host while it was on, by reason: ``no_fused_graph`` (a miss, an
            unpadded eager chunk, a bucket without a fused graph), ``scheduler`` (a request whose scheduler or
            latents the fused update does not cover), ``cfg_pair_split`` (a split put an image's cond and uncond
            rows in different forwards), ``bucket_fault`` (a fused replay raised and its bucket now runs eager,
            :class:`~bcg_core.runners.base.BucketFault`).
    """

    wanted: bool = False
    checked: bool = False
    on: bool = False
    note: str = ""
    steps: int = 0
    host_steps: dict[str, int] | None = None

    def host(self, reason: str) -> None:
        """Count a step that runs on the host for ``reason``."""
        if self.host_steps is None:
            self.host_steps = {}
        self.host_steps[reason] = self.host_steps.get(reason, 0) + 1

    def describe(self) -> dict:
        """The JSON of ``/v1/buckets``' ``fused_step``."""
        note = self.note or ("off: runner.fused_step or the family has no fused step" if not self.wanted else "")
        return {"enabled": self.on, "note": note, "steps": self.steps, "host_steps": dict(self.host_steps or {})}


@torch.inference_mode()
def check_fused(pipe) -> bool:
    """Prove the fused step of ``pipe`` (a :class:`~bcg_core.pipeline.DiTPipeline`) bitwise equal to the host
    step on this device, before any request uses it.

    On the smallest prepared bucket with a fused graph, a request without CFG (and, where the family runs
    CFG, one with it) takes two steps fused and two on the host (transformer replay, then the family's
    :meth:`advance`: its CFG combination and ``scheduler.step``) from the same state; their latents must be
    bit for bit equal after each step. On any difference the fused step is turned off for this pipeline
    (:attr:`fused`, ``note`` says why; logged). Without a prepared bucket that fuses nothing is checked and
    the fused step stays off until the next :meth:`prepare`.

    Returns:
        True when the fused step is on.
    """
    log = logging.getLogger(__name__)
    keys = sorted((k for k in pipe.runner.prepared() if pipe.runner.fuses(k)), key=lambda k: (k.tokens, k.batch))
    cases = []
    for cfg in (False, True):
        for key in keys:
            try:
                validated = pipe.validator.validate(_check_request(pipe, key, cfg))
            except RequestError:
                continue
            if pipe.model.spec.uses_cfg(validated.request) != cfg:
                break  # this family never runs that way
            if validated.lookup.hit and pipe.runner.fuses(validated.lookup.key):
                cases.append(validated)
                break
    if not cases:
        pipe.fused.note = "not checked yet: no prepared bucket with a fused graph"
        return False
    leases = [None] + ([_SlotZero()] if pipe.lora is not None else [])  # both graphs of a LoRA deployment
    for validated, lease in ((p, le) for p in cases for le in leases):
        from bcg_core.costs import Chunk, StepForwards

        forwards = StepForwards((Chunk(validated.key, validated.rows, 0.0),))
        host = pipe.start(validated, lease=lease)
        mine = dataclasses.replace(host, latents=host.latents.clone(), scheduler=copy.deepcopy(host.scheduler),
                                   step_ms=[])
        for _ in range(min(2, len(host.timesteps))):
            pipe.step([host], forwards, fused=False)
            try:
                pipe.step([mine], forwards, fused=True)  # not counted; serving steps stay on the host until it passes
            except ValueError as e:
                pipe.fused.checked = True
                pipe.fused.note = f"off: {e}"
                log.warning("fused step %s", pipe.fused.note)
                return False
            if not torch.equal(host.latents, mine.latents):
                diff = (host.latents.float() - mine.latents.float()).abs()
                pipe.fused.checked = True
                pipe.fused.note = (f"off: the fused step differs from the host step on {validated.lookup.key} "
                                   f"(cfg {host.cfg}): {int((diff > 0).sum())} of {diff.numel()} latent "
                                   f"values, max |d| {float(diff.max()):.3g}")
                log.warning("fused step %s", pipe.fused.note)
                return False
    pipe.fused.checked = pipe.fused.on = True
    pipe.fused.note = (f"on: bitwise equal to the host step on {', '.join(str(p.lookup.key) for p in cases)} "
                       f"(cfg {', '.join(str(pipe.model.spec.uses_cfg(p.request)) for p in cases)})")
    log.info("fused step %s", pipe.fused.note)
    return True


def _check_request(pipe, key: BucketKey, cfg: bool) -> GenerationRequest:
    """A request of one image whose shape is bucket ``key``'s tier, asking for CFG when ``cfg``."""
    spec = pipe.model.spec
    gh, gw = pipe._example_grid(key)
    ppt = pipe.table.rules.pixels_per_token
    fields = dict(prompt="a lighthouse on a cliff at dusk", n=1, width=gw * ppt, height=gh * ppt,
                  num_inference_steps=2, seed=0)
    if cfg:
        fields["negative_prompt"] = "blurry"
        if spec.cfg_rule == "true_cfg":
            fields["true_cfg_scale"] = 4.0
        else:
            fields["guidance_scale"] = 4.5
    elif spec.cfg_rule != "true_cfg":
        fields["guidance_scale"] = 1.0
    return GenerationRequest(**fields)
