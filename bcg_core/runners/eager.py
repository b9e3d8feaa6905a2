"""The eager bucket runner: each bucket's forward on its static padded buffers, no graph (CPU, CI, lazy capture).

It keeps the contract of :mod:`bcg_core.runners.base` (padding, masking and unpadding exactly as a graph replay
does them), so every bucket is exercised on a CPU; only capture and replay themselves need a GPU. With compiled
kernels (:mod:`bcg_core.runners.kernels`) each bucket's shapes are compiled when it is prepared (one forward on
its buffers) and its padded forwards run them; a compile that raises leaves the bucket on eager kernels (noted).
With ``defer_compiles``, a bucket whose compiled blocks are not in the cache serves eager kernels until
:mod:`bcg_core.runners.background` compiles them on buffers of its own and :meth:`EagerBucketRunner.swap_in`
swaps them in.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import torch

from bcg_core.capabilities import supports_plain_forward
from bcg_core.keys import BucketKey
from bcg_core.metrics import BucketMetrics, ForwardMode
from bcg_core.padding import DenoiseInputs, DiTAdapter
from bcg_core.runners.base import (
    BucketEntry,
    BucketFault,
    CaptureStats,
    demote,
    eager_forward,
    entry_kernels,
    fill_fused,
    fused_buffers,
    is_out_of_memory,
    padded_forward,
    static_forward,
)
from bcg_core.runners.kernels import CompiledKernels, CompileFailed, KernelTier
from bcg_core.runners.piecewise import eager_piece
from bcg_core.runners.precompiled import NotPrecompiled
from bcg_core.verify import compile_entry

__all__ = ["EagerBucketRunner"]

log = logging.getLogger(__name__)


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
        kernels: compiled kernels for the padded forwards (``runner.kernels: compiled``), or None: eager ones.
    """

    def __init__(self, adapter: DiTAdapter, keys: list[BucketKey], metrics: BucketMetrics,
                 device: torch.device, dtype: torch.dtype, fused: bool = False,
                 kernels: CompiledKernels | None = None):
        self.adapter = adapter
        self.plain_forward = supports_plain_forward(adapter)
        """The adapter is a :class:`~bcg_core.capabilities.PlainForward` (LoRA): forwards without adapter rows run
        without the deltas."""
        self.fused = fused
        self.kernels = kernels
        self.compile_failed = 0
        """Buckets that asked for compiled kernels and run eager ones (their compile raised)."""
        self.keys = sorted(keys, key=lambda k: (-k.tokens, -k.batch, k.image_mask))  # largest first, as capture
        self._key_set = frozenset(self.keys)
        self.stats = CaptureStats()
        """Its totals; only ``lazy_prepares`` counts here (nothing is captured)."""
        self.metrics = metrics
        self.device, self.dtype = device, dtype
        self.entries: dict[BucketKey, BucketEntry] = {}
        self._lock = threading.Lock()
        self.gate = threading.RLock()
        """Held by a background compile while it runs forwards (:mod:`bcg_core.runners.background`); nothing here
        captures, so nothing else waits on it."""

    def prepare(self, keys: Iterable[BucketKey] | None = None, defer_compiles: bool = False) -> None:
        """Allocate the static buffers of ``keys`` (every bucket when None), largest first. Idempotent. With compiled
        kernels and ``defer_compiles``, a bucket whose compiled blocks are not cached is left
        :attr:`~bcg_core.runners.base.BucketEntry.pending` on eager kernels.

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
                    self.entries[key] = self._entry(key, defer_compiles)

    def _entry(self, key: BucketKey, defer_compiles: bool = False) -> BucketEntry:
        """A new bucket's static buffers; with compiled kernels, its shapes compiled by one forward on them (with
        ``defer_compiles`` only loaded from the cache, else left pending)."""
        entry = BucketEntry(key, self.adapter.allocate(key, self.device, self.dtype))
        if self.kernels is not None:
            entry.kernels = KernelTier.COMPILED
            try:
                with torch.inference_mode(), self.kernels.cached_only(defer_compiles):
                    compile_entry(self.kernels, self.adapter, entry, lambda: self.adapter.forward(entry.buffers))
            except CompileFailed as e:
                entry.kernels, entry.note = KernelTier.EAGER, str(e)
                self.compile_failed += 1
                log.warning("bucket %s runs eager kernels: %s", key, e)
            except NotPrecompiled:  # a cold cache: eager kernels now, compiled in the background
                entry.defer_compile()
        return entry

    def pending_compiles(self) -> list[BucketKey]:
        """Buckets serving eager kernels until their background compile swaps them (largest first)."""
        with self._lock:
            return [k for k in self.keys if k in self.entries and self.entries[k].pending]

    def swap_in(self, old: BucketEntry, new: BucketEntry) -> None:
        """Serve bucket ``old.key`` from ``new`` (compiled and checked on its own buffers) from the next forward on.

        Returns:
            None: no replay time is measured here (:meth:`CudaGraphRunner.swap_in
            <bcg_core.runners.cuda_graph.CudaGraphRunner.swap_in>` measures one).

        Raises:
            KeyError: ``old`` no longer serves its bucket (demoted after a fault, or replaced).
        """
        with self._lock:
            if self.entries.get(old.key) is not old or not old.buffers:
                raise KeyError(f"bucket {old.key} no longer serves from the entry compiled for")
            new.forwards, new.pending = old.forwards, False
            new.note = "compiled in the background"
            self.entries[old.key] = new
        return None


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
                out = eager_forward(self.adapter, inputs, self.device)
            else:
                entry = self.entries.get(key)
                if entry is None:
                    if key not in self._key_set:
                        raise KeyError(f"bucket {key} is not one of this runner's {len(self.keys)} buckets")
                    # Not owned here (routed to a non-owner after the fallback wait): allocate now, counted.
                    entry = self.entries[key] = self._entry(key)
                    self.stats.lazy_prepares += 1
                mode = ForwardMode.STATIC_EAGER
                if not entry.buffers:  # demoted after a fault: unpadded
                    out, mode = eager_forward(self.adapter, inputs, self.device), ForwardMode.EAGER
                else:
                    try:
                        with entry_kernels(self.kernels, entry):
                            out = static_forward(self.adapter, entry.buffers, inputs, plain=self.plain_forward)
                    except RuntimeError as e:
                        if is_out_of_memory(e):
                            raise
                        demote(entry, e, self.metrics)
                        out, mode = eager_forward(self.adapter, inputs, self.device), ForwardMode.EAGER
                entry.forwards += 1
        self.metrics.record_forward(key, ForwardMode.EAGER if key is None or eager else mode)
        return out

    def run_piece(self, key: BucketKey | None, inputs: DenoiseInputs, phase, split,
                  eager: bool = False) -> torch.Tensor:
        """One half of a step-cache step: :meth:`run` under ``phase`` (:func:`~bcg_core.runners.piecewise.eager_piece`):
        on the bucket's static buffers, or unpadded for a miss or with ``eager``."""
        return eager_piece(self, key, inputs, phase, split, eager)

    @property
    def piece_shares(self) -> dict[BucketKey, tuple[float, float]]:
        """Measured step-cache half shares (:attr:`~bcg_core.runners.piecewise.PiecewiseReplay.piece_shares`): none
        here, the halves have no graphs of their own to time."""
        return {}

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
        from bcg_core.runners.fused import fused_update

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
                with entry_kernels(self.kernels, entry):
                    out = padded_forward(self.adapter, entry.buffers, inputs, plain=self.plain_forward)
                nxt = fused_update(out, entry.buffers["latents"], entry.fused["meta"], entry.fused["dt"])
            except RuntimeError as e:
                if is_out_of_memory(e):
                    raise
                demote(entry, e, self.metrics)
                raise BucketFault(f"bucket {key}: {entry.note}") from e
            result = self.adapter.unpad(nxt, inputs)[: meta.shape[1]].clone()
            entry.forwards += 1
        self.metrics.record_forward(key, ForwardMode.STATIC_EAGER)
        return result

    def describe(self) -> list[dict]:
        """Per-bucket state, largest bucket first."""
        return [
            {"key": str(e.key), "mode": e.mode.value, "kernels": e.kernels.value, "pool_bytes": e.pool_bytes,
             "capture_s": e.capture_s, "compile_rel_err": e.compile_err_json, "attention": e.attention_json,
             "forwards": e.forwards, "pending": e.pending, "note": e.note}
            for e in self.entries.values()
        ]
