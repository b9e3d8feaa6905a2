"""Bucket runners: execute one transformer forward on a bucket's static padded buffers.

Contract (every runner, CPU or CUDA graph):

- :meth:`BucketRunner.prepare` makes every bucket ready before the replica reports ready (here: static
  buffers, largest bucket first; the CUDA graph runner captures into one shared memory pool). It is
  idempotent.
- :meth:`BucketRunner.run` with a key copies the real inputs into that bucket's buffers (every element,
  so no earlier request leaks), runs the padded forward, and returns a *new* tensor holding only the real
  rows and tokens (never a view of a static buffer that the next forward overwrites). With ``key=None``
  (a miss under the eager policy) it runs the unpadded forward.
- Forwards are serialised by a lock: static buffers are shared state.

The bucket table decides the key; the runner trusts it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from bcg_core import failpoints
from bcg_core.errors import first_line
from bcg_core.keys import BucketKey
from bcg_core.metrics import BucketMetrics
from bcg_core.padding import DenoiseInputs, DiTAdapter
from bcg_core.runners.attention import ORDER_LOCK
from bcg_core.runners.kernels import CompiledKernels, KernelTier

__all__ = ["BucketEntry", "BucketFault", "BucketRunner", "CaptureStats", "RunMode", "budget_allows", "capture_order",
           "demote", "eager_forward", "entry_kernels", "fill_fused", "fused_buffers", "is_out_of_memory",
           "padded_forward", "sdpa_default_order", "static_forward"]


log = logging.getLogger(__name__)


class BucketFault(RuntimeError):
    """A bucket's padded forward (a graph replay, or the static-buffer forward) raised at run time, other than
    running out of memory; the bucket now runs unpadded and eager (:func:`demote`). Raised by ``run_fused``, whose
    caller then runs the step on the host path; ``run`` recovers by itself."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device out-of-memory error (``torch.OutOfMemoryError``, or a ``RuntimeError`` whose message
    says so, as some allocators raise), which :func:`demote` must not swallow: it is the request's to answer."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def demote(entry: BucketEntry, exc: BaseException, metrics: BucketMetrics) -> None:
    """After a runtime error in bucket ``entry.key``'s padded forward (a CUDA error mid-replay, say): drop its
    graph and static buffers, so that every later forward of the bucket runs unpadded and eager, note why (shown in
    ``/v1/buckets``), count the fault (:meth:`BucketMetrics.record_fault`, ``ray_bcg_bucket_faults_total``) and log
    it. A sticky CUDA error (the context is lost) fails the eager forward too; that request then fails and the
    replica's health check restarts it."""
    first = first_line(exc, type(exc).__name__)
    entry.mode = RunMode.STATIC_EAGER
    entry.graph = None
    entry.output = None
    entry.plain = None
    entry.buffers = {}
    entry.fused = None
    entry.pieces = None
    entry.note = f"runs unpadded and eager after a runtime error: {type(exc).__name__}: {first}"[:300]
    metrics.record_fault(entry.key)
    log.error("bucket %s: its padded forward raised %s; the bucket now runs unpadded and eager", entry.key,
              f"{type(exc).__name__}: {first}")


class RunMode(enum.Enum):
    """How a bucket's forward executes."""

    STATIC_EAGER = "static_eager"
    """Eager PyTorch over the bucket's static padded buffers (CPU, or a bucket whose capture failed)."""
    GRAPH = "graph"
    """Replay of the bucket's captured CUDA graph."""

    @property
    def replays(self) -> bool:
        """True when forwards replay a captured graph."""
        return self is RunMode.GRAPH


@dataclass
class BucketEntry:
    """Everything one bucket owns.

    Attributes:
        key: the bucket.
        buffers: static input buffers (name -> tensor), fixed shapes and addresses.
        mode: how forwards run.
        output: the static output of a captured graph, else None.
        graph: the captured ``torch.cuda.CUDAGraph``, else None.
        pool_bytes: graph memory pool growth measured at capture (0 on CPU).
        capture_s: seconds spent capturing (0 on CPU).
        note: why the bucket runs as it does (e.g. a capture failure), for logs and ``/v1/buckets``.
        kernels: the kernels of its padded forward (:class:`~bcg_core.runners.kernels.KernelTier`): the runner's
            tier, or ``eager`` after its compile failed.
        compile_rel_err: with compiled kernels, the deviation of its compiled forward from its eager one
            (:func:`bcg_core.verify.compile_entry`), else None.
        attention: with compiled kernels, the SDPA backend its compiled forward runs
            (:class:`~bcg_core.runners.attention.AttentionChoice`), else None (eager kernels: PyTorch's own choice).
        plain: with LoRA adapters (:class:`~bcg_core.lora.rows.LoRAAdapter`), the bucket's second graph, captured
            without the deltas, replayed for forwards in which no row has an adapter: ``(graph, output, next)``
            (``next``: its fused step's output, or None); else None.
    """

    key: BucketKey
    buffers: dict[str, torch.Tensor]
    mode: RunMode = RunMode.STATIC_EAGER
    output: torch.Tensor | None = None
    graph: object | None = None
    plain: tuple | None = None
    pool_bytes: int = 0
    capture_s: float = 0.0
    note: str = ""
    forwards: int = field(default=0)
    kernels: KernelTier = KernelTier.EAGER
    compile_rel_err: float | None = None
    attention: object | None = None
    pending: bool = False
    """Compiled kernels are asked for and not compiled yet (a cold cache, ``prepare(defer_compiles=True)``): the
    bucket serves eager kernels until :mod:`bcg_core.runners.background` compiles, checks and swaps it in."""
    pieces: object | None = None
    """Its step-cache graphs (:class:`~bcg_core.runners.piecewise.CachePieces`), captured at its first cached step;
    None before, False where their capture failed (its halves run unpadded and eager until a retry captures them:
    :meth:`~bcg_core.runners.piecewise.PiecewiseReplay.piece_retry_due`)."""
    piece_attempts: int = 0
    """Failed captures (or replays) of its step-cache graphs so far."""
    piece_retry_at: float = 0.0
    """``time.monotonic()`` from which a failed capture of its step-cache graphs may be tried again."""
    fused: dict[str, torch.Tensor] | None = None
    """With a fused step (:mod:`bcg_core.runners.fused`): its ``meta`` (4, B) and ``dt`` (B,) fp32 buffers, and under a
    captured graph its static ``next`` latents output; None otherwise."""

    def defer_compile(self) -> None:
        """Serve eager kernels until :mod:`bcg_core.runners.background` compiles this bucket and swaps it in."""
        self.kernels, self.pending, self.note = KernelTier.EAGER, True, "compiling in the background"

    @property
    def attention_json(self) -> dict:
        """``/v1/buckets``' ``attention`` of the bucket: :meth:`AttentionChoice.describe
        <bcg_core.runners.attention.AttentionChoice.describe>` with compiled kernels; with eager kernels
        ``{"backend": "default", "source": "eager kernels"}``."""
        if self.kernels is KernelTier.EAGER or self.attention is None:
            return {"backend": "default", "source": "eager kernels"}
        return self.attention.describe()

    @property
    def compile_err_json(self) -> float | None:
        """:attr:`compile_rel_err` to three significant digits, for ``/v1/buckets``."""
        return None if self.compile_rel_err is None else float(f"{self.compile_rel_err:.3g}")


class BucketRunner(Protocol):
    """What the pipeline needs from a runner (see the module docstring). What only some runners can do is declared
    in :mod:`bcg_core.capabilities` (:class:`~bcg_core.capabilities.GraphReplay`)."""

    fused: bool
    """It was built to serve :meth:`run_fused` (``runner.fused_step``)."""
    kernels: CompiledKernels | None
    """The compiled kernels of its padded forwards (``runner.kernels``), or None: eager kernels."""
    stats: CaptureStats
    """Its capture totals (``/v1/buckets`` ``capture``)."""
    gate: threading.RLock
    """Held by a capture and by other threads' GPU work that synchronizes the whole device (a background compile's
    forwards, the cost measurement's eager forwards): such a synchronization invalidates a capture in progress on
    another thread, in any capture mode (:meth:`~bcg_core.runners.cuda_graph.CudaGraphRunner._record`)."""

    def prepare(self, keys: Iterable[BucketKey] | None = None, defer_compiles: bool = False) -> None:
        """Make ``keys`` (every bucket when None) ready; idempotent. With compiled kernels and ``defer_compiles``, a
        bucket whose compiled blocks are not in the compile cache is made ready on eager kernels and marked
        :attr:`BucketEntry.pending` (:mod:`bcg_core.runners.background` compiles it later)."""
        ...

    def pending_compiles(self) -> list[BucketKey]:
        """Buckets marked :attr:`BucketEntry.pending`, in preparation order."""
        ...

    def swap_in(self, old: BucketEntry, new: BucketEntry) -> float | None:
        """Serve bucket ``old.key`` from ``new`` (compiled and checked on buffers of its own) from the next forward
        on; returns the new forward's time over the old one's where measured (a CUDA graph replay), else None.

        Raises:
            Exception: the swap failed (``old`` keeps serving); ``KeyError`` where ``old`` no longer serves."""
        ...

    def prepared(self) -> set[BucketKey]:
        """Buckets made ready so far."""
        ...

    def run(self, key: BucketKey | None, inputs: DenoiseInputs, eager: bool = False) -> torch.Tensor:
        """One forward: (inputs.rows, inputs.image_tokens, out_channels), a new tensor; unpadded when ``key``
        is None or ``eager`` (counted as an eager forward of ``key``)."""
        ...

    def run_piece(self, key: BucketKey | None, inputs: DenoiseInputs, phase, split,
                  eager: bool = False) -> torch.Tensor:
        """One half of a step-cache step (``phase``: a :class:`~bcg_core.step_cache.split.HeadPhase` or
        :class:`~bcg_core.step_cache.split.TailPhase` of ``split``) on bucket ``key``, as :meth:`run` runs a whole
        forward; ``phase`` receives the half's outputs (:mod:`bcg_core.runners.piecewise`)."""
        ...

    @property
    def piece_shares(self) -> dict[BucketKey, tuple[float, float]]:
        """Per bucket whose step-cache halves were captured and timed, ``(head, tail)`` over its whole forward
        (:meth:`~bcg_core.runners.piecewise.PiecewiseReplay.time_pieces`); empty where none was."""
        ...

    def describe(self) -> list[dict]:
        """Per-bucket state for ``/v1/buckets``: key, mode, pool_bytes, capture_s, note."""
        ...

    def fuses(self, key: BucketKey) -> bool:
        """True when :meth:`run_fused` runs ``key`` as one fused step (a captured fused graph under CUDA graphs;
        any prepared bucket of a runner built with ``fused=True`` on the eager runner)."""
        ...

    def run_fused(self, key: BucketKey, inputs: DenoiseInputs, meta: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """One fused step on bucket ``key`` (:func:`bcg_core.runners.fused.fused_update`): ``meta`` (4, m) and ``dt``
        (m,) for the forward's ``m`` images; returns their next latents, (m, ...), a new tensor."""
        ...


def fused_buffers(batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The fused step's static buffers of a ``batch``-row bucket: ``meta`` (4, B) and ``dt`` (B,), fp32."""
    from bcg_core.runners.fused import META_ROWS

    return {"meta": torch.zeros(META_ROWS, batch, device=device), "dt": torch.zeros(batch, device=device)}


def fill_fused(fused: dict[str, torch.Tensor], meta: torch.Tensor, dt: torch.Tensor) -> None:
    """Write a forward's ``meta`` (4, m) and ``dt`` (m,) into a bucket's fused buffers, pad entries zeroed
    (cond and uncond row 0, no CFG, dt 0). ``meta`` may be a pinned CPU tensor (copied without a host sync)."""
    m = meta.shape[1]
    buf_meta, buf_dt = fused["meta"], fused["dt"]
    if m > buf_meta.shape[1] or dt.shape != (m,):
        raise ValueError(f"a fused step of {m} images (dt {tuple(dt.shape)}) does not fit a bucket of "
                         f"{buf_meta.shape[1]} rows")
    buf_meta[:, :m].copy_(meta, non_blocking=True)
    buf_meta[:, m:].zero_()
    buf_dt[:m].copy_(dt)
    buf_dt[m:].zero_()


def entry_kernels(kernels, entry: BucketEntry):
    """The context a padded forward of ``entry`` runs in: ``kernels`` (a
    :class:`~bcg_core.runners.kernels.CompiledKernels`) switched on when the bucket runs compiled kernels, under the
    bucket's SDPA backend (the key its compiled functions were kept under), else SDPA's default priority order on
    CUDA (:func:`sdpa_default_order`)."""
    if entry.kernels is KernelTier.COMPILED and kernels is not None:
        return kernels.active(attention=entry.attention.backend if entry.attention is not None else None)
    latents = entry.buffers.get("latents")
    return sdpa_default_order(latents.device if latents is not None else torch.device("cpu"))


def sdpa_default_order(device: torch.device):
    """The context of a forward that picks its SDPA kernel at run time: on CUDA it holds
    :data:`~bcg_core.runners.attention.ORDER_LOCK` (never a background compile's priority order); elsewhere nothing,
    since PyTorch's CPU SDPA picks its kernel in a fixed order (flash, then math) whatever the priority order says."""
    return ORDER_LOCK if torch.device(device).type == "cuda" else contextlib.nullcontext()


def eager_forward(adapter: DiTAdapter, inputs: DenoiseInputs, device: torch.device) -> torch.Tensor:
    """``adapter.forward_eager(inputs)``, a new tensor, on ``device`` under SDPA's default priority order
    (:func:`sdpa_default_order`): an unpadded eager forward, diffusers' bits."""
    with sdpa_default_order(device):
        return adapter.forward_eager(inputs).clone()


def static_forward(adapter: DiTAdapter, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs, *,
                   plain: bool) -> torch.Tensor:
    """Fill a bucket's static buffers from ``inputs``, run the padded forward eagerly, return the real part.
    With ``plain`` (LoRA adapters), a forward in which no row has one (``inputs.lora_slots`` None) runs without the
    deltas (:func:`padded_forward`), as the CUDA graph runner replays its plain graph.

    Returns:
        (inputs.rows, inputs.image_tokens, out_channels), a new tensor (never a view of a buffer).
    """
    failpoints.forward_error()
    adapter.fill(buffers, inputs)
    return adapter.unpad(padded_forward(adapter, buffers, inputs, plain=plain), inputs).clone()


def padded_forward(adapter: DiTAdapter, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs, *,
                   plain: bool) -> torch.Tensor:
    """The padded forward over a bucket's filled ``buffers``: ``adapter.forward``, or with ``plain`` (the adapter is
    a :class:`~bcg_core.capabilities.PlainForward`, a LoRA deployment's, as the runner answered where it was built)
    without the deltas when no row of ``inputs`` has an adapter (``lora_slots`` None:
    :meth:`~bcg_core.lora.rows.LoRAAdapter.forward_plain`).

    Returns:
        The bucket's padded output (a view of no buffer, but shaped as the bucket: unpad it)."""
    if plain and inputs.lora_slots is None:
        return adapter.forward_plain(buffers)
    return adapter.forward(buffers)


def capture_order(keys: list[BucketKey]) -> list[BucketKey]:
    """Buckets largest first: by padded tokens per forward, then rows, then exact before masked.

    Capturing the largest graph first sizes the shared pool once; every smaller graph then reuses its
    free blocks (docs/DESIGN.md section 3).
    """
    return sorted(keys, key=lambda k: (-k.tokens, -k.batch, k.image_mask, k.latent_hw or (0, 0)))


def budget_allows(pool_bytes: int, estimate_bytes: int, budget_bytes: int | None) -> bool:
    """Whether a bucket whose forward peaks at ``estimate_bytes`` fits the shared-pool budget.

    In one shared pool, captured largest first, a new graph reuses the pool's free blocks: the pool grows
    by at most ``max(0, estimate - pool)``. So the pool after capture is at most
    ``max(pool_bytes, estimate_bytes)``.

    Args:
        pool_bytes: the shared pool's size before this capture.
        estimate_bytes: peak activation bytes of the bucket's forward (measured in warm-up).
        budget_bytes: the graph-memory budget; None means no budget.
    """
    return budget_bytes is None or max(pool_bytes, estimate_bytes) <= budget_bytes


@dataclass
class CaptureStats:
    """Totals of one runner's captures (shown in ``/v1/buckets`` and by ``bcg profile``)."""

    captured: int = 0
    failed: int = 0
    dropped_oom: int = 0
    over_budget: int = 0
    lazy_captures: int = 0
    unprepared_forwards: int = 0
    """CUDA graph runner: forwards of a bucket not captured yet (or not owned here), run unpadded and eager."""
    lazy_prepares: int = 0
    """Eager runner (CPU): buckets whose static buffers were allocated at their first forward (not prepared yet, or
    not owned here)."""
    replay_errors: int = 0
    """Forwards whose replay raised at run time (not out of memory): the bucket was demoted to unpadded eager."""
    capture_s: float = 0.0
    pool_bytes: int = 0
    compile_failed: int = 0
    """Buckets that asked for compiled kernels and run eager ones: the compile or the compiled capture raised."""
    piece_captures: int = 0
    """Buckets whose step-cache graphs (head and tail halves, :mod:`bcg_core.runners.piecewise`) were captured."""
    piece_failures: int = 0
    """Buckets whose step-cache graphs failed to capture or to replay: their halves run unpadded and eager."""
    swaps: int = 0
    """Buckets whose graph of eager kernels was replaced by one of compiled kernels, compiled in the background
    (:mod:`bcg_core.runners.background`)."""
