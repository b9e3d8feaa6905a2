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

import enum
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
import logging
from typing import Protocol

import torch

from . import failpoints
from .buckets import BucketKey
from .metrics import BucketMetrics
from .padding import DenoiseInputs, DiTAdapter

__all__ = ["BucketEntry", "BucketFault", "BucketRunner", "EagerBucketRunner", "RunMode", "demote", "fill_fused",
           "fused_buffers", "is_out_of_memory", "static_forward"]


log = logging.getLogger(__name__)


class BucketFault(RuntimeError):
    """A bucket's padded forward (a graph replay, or the static-buffer forward) raised at run time, other than
    running out of memory; the bucket now runs unpadded and eager (:func:`demote`). Raised by ``run_fused``, whose
    caller then runs the step on the host path; ``run`` recovers by itself."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device out-of-memory error (``torch.OutOfMemoryError``, or a ``RuntimeError`` whose message
    says so, as some allocators raise), which :func:`demote` must not swallow: it is the request's to answer."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def demote(entry: "BucketEntry", exc: BaseException, metrics: BucketMetrics) -> None:
    """After a runtime error in bucket ``entry.key``'s padded forward (a CUDA error mid-replay, say): drop its
    graph and static buffers, so that every later forward of the bucket runs unpadded and eager, note why (shown in
    ``/v1/buckets``), count the fault (:meth:`BucketMetrics.record_fault`, ``ray_bcg_bucket_faults_total``) and log
    it. A sticky CUDA error (the context is lost) fails the eager forward too; that request then fails and the
    replica's health check restarts it."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    entry.mode = RunMode.STATIC_EAGER
    entry.graph = None
    entry.output = None
    entry.buffers = {}
    entry.fused = None
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
    """

    key: BucketKey
    buffers: dict[str, torch.Tensor]
    mode: RunMode = RunMode.STATIC_EAGER
    output: torch.Tensor | None = None
    graph: object | None = None
    pool_bytes: int = 0
    capture_s: float = 0.0
    note: str = ""
    forwards: int = field(default=0)
    fused: dict[str, torch.Tensor] | None = None
    """With a fused step (:mod:`bcg_core.fused`): its ``meta`` (4, B) and ``dt`` (B,) fp32 buffers, and under a
    captured graph its static ``next`` latents output; None otherwise."""


class BucketRunner(Protocol):
    """What the pipeline needs from a runner (see the module docstring)."""

    def prepare(self, keys: Iterable[BucketKey] | None = None) -> None:
        """Make ``keys`` (every bucket when None) ready; idempotent."""
        ...

    def prepared(self) -> set[BucketKey]:
        """Buckets made ready so far."""
        ...

    def run(self, key: BucketKey | None, inputs: DenoiseInputs, eager: bool = False) -> torch.Tensor:
        """One forward: (inputs.rows, inputs.image_tokens, out_channels), a new tensor; unpadded when ``key``
        is None or ``eager`` (counted as an eager forward of ``key``)."""
        ...

    def describe(self) -> list[dict]:
        """Per-bucket state for ``/v1/buckets``: key, mode, pool_bytes, capture_s, note."""
        ...

    def fuses(self, key: BucketKey) -> bool:
        """True when :meth:`run_fused` runs ``key`` as one fused step (a captured fused graph under CUDA graphs;
        any prepared bucket of a runner built with ``fused=True`` on the eager runner)."""
        ...

    def run_fused(self, key: BucketKey, inputs: DenoiseInputs, meta: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """One fused step on bucket ``key`` (:func:`bcg_core.fused.fused_update`): ``meta`` (4, m) and ``dt``
        (m,) for the forward's ``m`` images; returns their next latents, (m, ...), a new tensor."""
        ...


def fused_buffers(batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The fused step's static buffers of a ``batch``-row bucket: ``meta`` (4, B) and ``dt`` (B,), fp32."""
    from .fused import META_ROWS

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


def static_forward(adapter: DiTAdapter, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> torch.Tensor:
    """Fill a bucket's static buffers from ``inputs``, run the padded forward eagerly, return the real part.

    Returns:
        (inputs.rows, inputs.image_tokens, out_channels), a new tensor (never a view of a buffer).
    """
    failpoints.forward_error()
    adapter.fill(buffers, inputs)
    return adapter.unpad(adapter.forward(buffers), inputs).clone()


class EagerBucketRunner:
    """Runs each bucket eagerly on its static padded buffers (CPU development and CI).

    Padding, masking and unpadding are exercised exactly as under CUDA graph replay; only capture and
    replay themselves need a GPU.

    Args:
        adapter: the model family's adapter.
        keys: the buckets to serve.
        metrics: counters to record forwards into.
        device, dtype: where the static buffers live (the model's device and dtype).
        fused: serve :meth:`run_fused` (the fused step computed eagerly on the static buffers, as the CUDA
            graph runner replays it).
    """

    def __init__(self, adapter: DiTAdapter, keys: list[BucketKey], metrics: BucketMetrics,
                 device: torch.device, dtype: torch.dtype, fused: bool = False):
        self.adapter = adapter
        self.fused = fused
        self.keys = sorted(keys, key=lambda k: (-k.tokens, -k.batch, k.image_mask))  # largest first, as capture
        self._key_set = frozenset(self.keys)
        self.lazy_prepares = 0
        self.metrics = metrics
        self.device, self.dtype = device, dtype
        self.entries: dict[BucketKey, BucketEntry] = {}
        self._lock = threading.Lock()

    def prepare(self, keys: Iterable[BucketKey] | None = None) -> None:
        """Allocate the static buffers of ``keys`` (every bucket when None), largest first. Idempotent.

        Raises:
            KeyError: a key that is not one of this runner's buckets.
        """
        with self._lock:
            todo = self.keys if keys is None else sorted(keys, key=lambda k: (-k.tokens, -k.batch, k.image_mask))
            unknown = [str(k) for k in todo if k not in self._key_set]
            if unknown:
                raise KeyError(f"buckets {unknown} are not served by this runner")
            for key in todo:
                if key not in self.entries:
                    self.entries[key] = BucketEntry(key, self.adapter.allocate(key, self.device, self.dtype))

    def prepared(self) -> set[BucketKey]:
        """Buckets whose static buffers exist."""
        with self._lock:
            return set(self.entries)

    @torch.inference_mode()
    def run(self, key: BucketKey | None, inputs: DenoiseInputs, eager: bool = False) -> torch.Tensor:
        """One forward on bucket ``key`` (padded) or, for ``key=None`` or ``eager``, unpadded.

        Args:
            key: the bucket, None for a miss.
            inputs: the forward's real rows.
            eager: run unpadded even though ``key`` holds the shape (the step scheduler's cost model chose
                eager); counted as an ``eager`` forward of ``key``.

        Raises:
            KeyError: if ``key`` is not one of this runner's buckets.
            ValueError: if ``inputs`` do not fit the bucket.
        """
        with self._lock:
            if key is None or eager:
                if key is not None and key not in self._key_set:
                    raise KeyError(f"bucket {key} is not one of this runner's {len(self.keys)} buckets")
                out = self.adapter.forward_eager(inputs).clone()
            else:
                entry = self.entries.get(key)
                if entry is None:
                    if key not in self._key_set:
                        raise KeyError(f"bucket {key} is not one of this runner's {len(self.keys)} buckets")
                    # Not owned here (routed to a non-owner after the fallback wait): allocate now, counted.
                    entry = self.entries[key] = BucketEntry(key, self.adapter.allocate(key, self.device, self.dtype))
                    self.lazy_prepares += 1
                mode = "static_eager"
                if not entry.buffers:  # demoted after a fault: unpadded
                    out, mode = self.adapter.forward_eager(inputs).clone(), "eager"
                else:
                    try:
                        out = static_forward(self.adapter, entry.buffers, inputs)
                    except RuntimeError as e:
                        if is_out_of_memory(e):
                            raise
                        demote(entry, e, self.metrics)
                        out, mode = self.adapter.forward_eager(inputs).clone(), "eager"
                entry.forwards += 1
        self.metrics.record_forward(key, "eager" if key is None or eager else mode)
        return out

    def fuses(self, key: BucketKey) -> bool:
        """True for a prepared bucket of a runner built with ``fused=True``."""
        return self.fused and key in self.entries and bool(self.entries[key].buffers)

    @torch.inference_mode()
    def run_fused(self, key: BucketKey, inputs: DenoiseInputs, meta: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """One fused step on bucket ``key``'s static buffers, eagerly (see :meth:`BucketRunner.run_fused`).

        Raises:
            KeyError: ``key`` is not prepared (or the runner was built without ``fused``).
            ValueError: ``inputs`` or ``meta`` do not fit the bucket.
        """
        from .fused import fused_update

        with self._lock:
            entry = self.entries.get(key) if self.fused else None
            if entry is None:
                raise KeyError(f"bucket {key} has no fused step here")
            if not entry.buffers:
                raise KeyError(f"bucket {key} has no fused step here: {entry.note}")
            if entry.fused is None:
                entry.fused = fused_buffers(key.batch, self.device)
            try:
                self.adapter.fill(entry.buffers, inputs)
                fill_fused(entry.fused, meta, dt)
                out = self.adapter.forward(entry.buffers)
                nxt = fused_update(out, entry.buffers["latents"], entry.fused["meta"], entry.fused["dt"])
            except RuntimeError as e:
                if is_out_of_memory(e):
                    raise
                demote(entry, e, self.metrics)
                raise BucketFault(f"bucket {key}: {entry.note}") from e
            result = self.adapter.unpad(nxt, inputs)[: meta.shape[1]].clone()
            entry.forwards += 1
        self.metrics.record_forward(key, "static_eager")
        return result

    def describe(self) -> list[dict]:
        """Per-bucket state, largest bucket first."""
        return [
            {"key": str(e.key), "mode": e.mode.value, "pool_bytes": e.pool_bytes, "capture_s": e.capture_s,
             "forwards": e.forwards, "note": e.note}
            for e in self.entries.values()
        ]
