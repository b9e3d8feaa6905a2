"""CUDA graph bucket runner: capture every bucket at start into one shared memory pool, then replay.

Lifecycle (the contract of :class:`~bcg_core.runners.base.BucketRunner`):

- :meth:`CudaGraphRunner.prepare` runs before the replica reports ready. Buckets are captured largest
  first (by padded tokens) into one shared memory pool (``torch.cuda.graph_pool_handle``), so smaller
  buckets reuse the larger ones' pool blocks. Per bucket: static buffers, warm-up forwards on a side
  stream (their peak memory is the bucket's estimate), a budget check, then the capture (the steps of one
  capture are :class:`~bcg_core.runners.graph_record.GraphRecorder`'s, a base class of the runner). The first
  capture of the first ``prepare`` runs under ``torch.cuda.set_sync_debug_mode("error")`` to surface hidden
  host syncs. It is
  idempotent and says per bucket whether a graph exists (:attr:`BucketEntry.mode`).
- :meth:`CudaGraphRunner.run` copies every input element into the bucket's static buffers, replays, and
  clones the real rows and tokens out of the static output before returning.
- Failure never kills the replica: a capture that raises marks its bucket eager-only (static buffers,
  eager forward; reason logged and counted); an out-of-memory error drops the bucket (its requests run
  unpadded and eager); a bucket whose estimate exceeds the graph-memory budget is not captured.
- Serving captures only buckets handed to ``prepare`` again (shapes a replica gains while it serves) or,
  with ``lazy``, a bucket on its first forward (each lazy capture is counted and logged).
- With compiled kernels (:class:`~bcg_core.runners.kernels.CompiledKernels`), the warm-up forwards compile the
  bucket's shapes and the capture records the compiled kernels. A compile that raises, or a capture of compiled
  kernels that raises, leaves the bucket on eager kernels under its graph (noted and counted in
  :attr:`CaptureStats.compile_failed`), as does a compile that passes ``runner.compile_timeout_s`` or whose
  forward deviates from the eager one beyond the tier's tolerance (:func:`~bcg_core.verify.compile_entry`);
  out of memory while compiling drops the bucket as during capture.

No random numbers are drawn inside a graph: the pipeline draws noise on the CPU before the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import torch

from bcg_core import failpoints
from bcg_core.capabilities import GraphReplay, supports_plain_forward
from bcg_core.devices import cuda_ms
from bcg_core.keys import BucketKey
from bcg_core.metrics import BucketMetrics, ForwardMode
from bcg_core.padding import DenoiseInputs, DiTAdapter

from bcg_core.runners.base import (  # isort: skip (500-line cap); re-exports capture_order, budget_allows, CaptureStats
    BucketEntry, BucketFault, CaptureStats, RunMode, budget_allows, capture_order, demote, eager_forward, entry_kernels,
    fill_fused, fused_buffers, is_out_of_memory, static_forward)
from bcg_core.runners.graph_record import GraphRecorder
from bcg_core.runners.kernels import CompiledKernels, CompileFailed, KernelTier
from bcg_core.runners.piecewise import PiecewiseReplay
from bcg_core.runners.precompiled import NotPrecompiled
from bcg_core.verify import compile_entry

__all__ = ["CaptureStats", "CudaGraphRunner", "budget_allows", "capture_order"]

log = logging.getLogger(__name__)

MiB = 1 << 20


class CudaGraphRunner(GraphRecorder, PiecewiseReplay, GraphReplay):
    """One CUDA graph per bucket, all in one shared memory pool.

    Args:
        adapter: the model family's adapter (its model on ``device``).
        keys: the buckets to serve.
        metrics: counters to record forwards into.
        device, dtype: the model's CUDA device and dtype.
        budget_bytes: graph-memory budget for the shared pool; None: 90% of free memory at :meth:`prepare`.
        lazy: capture a bucket on its first request instead of in :meth:`prepare`.
        warmup_iters: warm-up forwards on a side stream before each capture.
        sync_debug: run the first capture of the first :meth:`prepare` under
            ``torch.cuda.set_sync_debug_mode("error")``. The mode is process-wide, so it is used only there, before
            the replica serves; captures after that (shapes gained while serving, lazy captures) never use it:
            the replica's other threads would have their own synchronizations refused meanwhile.
        fused: capture each bucket's fused step (:mod:`bcg_core.runners.fused`) in its graph after the forward: one
            replay gives both the transformer output (:meth:`run`) and every image's next latents
            (:meth:`run_fused`).
        kernels: compiled kernels to capture (``runner.kernels: compiled``), or None for eager kernels.

    Raises:
        ValueError: if ``device`` is not a CUDA device.
    """

    def __init__(self, adapter: DiTAdapter, keys: list[BucketKey], metrics: BucketMetrics, device: torch.device,
                 dtype: torch.dtype, budget_bytes: int | None = None, lazy: bool = False, warmup_iters: int = 2,
                 sync_debug: bool = True, fused: bool = False, kernels: CompiledKernels | None = None):
        if torch.device(device).type != "cuda":
            raise ValueError(f"CudaGraphRunner needs a CUDA device, got {device}; use EagerBucketRunner on CPU")
        self.adapter = adapter
        self.plain_forward = supports_plain_forward(adapter)
        """The adapter is a :class:`~bcg_core.capabilities.PlainForward` (LoRA): each bucket also captures its plain
        graph."""
        self.keys = capture_order(keys)
        self._key_set = frozenset(self.keys)
        self.metrics = metrics
        self.device, self.dtype = torch.device(device), dtype
        self.budget_bytes = budget_bytes
        self.lazy = lazy
        self.warmup_iters = warmup_iters
        self.sync_debug = sync_debug
        self.fused = fused
        self.kernels = kernels
        self.entries: dict[BucketKey, BucketEntry] = {}
        self.stats = CaptureStats()
        self.pool = None
        self._side: torch.cuda.Stream | None = None
        self._prepared = False
        self._lock = threading.RLock()
        self.gate = threading.RLock()
        """Held by a capture, and by a background compile while it runs forwards (:mod:`bcg_core.runners.background`):
        a device-wide synchronization of the one invalidates the other (:meth:`_record`)."""

    # -- capture ----------------------------------------------------------------------------------

    def prepare(self, keys: Iterable[BucketKey] | None = None, defer_compiles: bool = False) -> None:
        """Capture ``keys`` (every bucket when None), largest first, into the shared pool; with ``lazy`` and
        ``keys=None`` only set up. Idempotent; a replica that gains buckets later calls it again with them. With
        compiled kernels and ``defer_compiles``, a bucket not in the compile cache is captured with eager kernels
        and left :attr:`~bcg_core.runners.base.BucketEntry.pending` (:mod:`bcg_core.runners.background`).

        Raises:
            KeyError: a key that is not one of this runner's buckets.
        """
        with self._lock:
            if not self._prepared:
                self.pool = torch.cuda.graph_pool_handle()
                if self.budget_bytes is None:
                    free, _ = torch.cuda.mem_get_info(self.device)
                    self.budget_bytes = int(0.9 * free)
                self._prepared = True
            if keys is None and self.lazy:
                self.sync_debug = False  # lazy captures happen while serving (see the class docstring)
                return
            todo = self.keys if keys is None else capture_order(list(keys))
            unknown = [str(k) for k in todo if k not in self._key_set]
            if unknown:
                raise KeyError(f"buckets {unknown} are not served by this runner")
            try:
                for key in todo:
                    self.capture(key, defer_compiles)
            finally:
                self.sync_debug = False  # only the first prepare, before serving (see the class docstring)
            log.info("captured %d of %d buckets in %.2f s; shared pool %.1f MiB (budget %.1f MiB)",
                     self.stats.captured, len(self.keys), self.stats.capture_s, self.stats.pool_bytes / MiB,
                     self.budget_bytes / MiB)

    def prepared(self) -> set[BucketKey]:
        """Buckets that are ready to serve as buckets (captured, eager-only, or dropped after OOM)."""
        with self._lock:
            return set(self.entries)

    def capture(self, key: BucketKey, defer_compiles: bool = False) -> BucketEntry:
        """Capture bucket ``key`` (if not already done) and return its entry; never raises on failure. Waits for a
        background compile's GPU work (:attr:`gate`): its synchronizations would invalidate the capture."""
        with self._lock, self.gate:
            if key in self.entries:
                return self.entries[key]
            entry = self._capture(key, defer_compiles)
            self.entries[key] = entry
            if entry.mode is RunMode.GRAPH:
                self.metrics.record_capture(key, entry.capture_s)
            return entry

    def _eager_kernels(self, entry: BucketEntry, why: str) -> None:
        """``entry`` keeps eager kernels from now on: noted, counted and logged."""
        entry.kernels = KernelTier.EAGER
        entry.note = why[:300]
        self.stats.compile_failed += 1
        log.warning("bucket %s runs eager kernels: %s", entry.key, why)

    def _warm(self, entry: BucketEntry, defer_compiles: bool = False) -> int:
        """Warm-up forwards of ``entry`` (compiling its shapes first with compiled kernels); their peak memory.

        With compiled kernels and their check (``kernels.rtol`` set), one warm-up forward fewer: after the
        warm-up the check runs the bucket's compiled forward once more on its buffers, then the eager one
        (:func:`compile_entry`), so the compiled code has still run ``warmup_iters`` times before the capture. It
        saves one compiled forward per bucket at every start (on a warm start with the 12-graph FLUX.1-dev table,
        docs/BENCHMARKS.md, its forwards are most of the prepare time)."""
        if entry.kernels is KernelTier.COMPILED:
            iters = self.warmup_iters
            if self.kernels.rtol is not None and iters > 1:
                iters -= 1
            try:
                with self.kernels.cached_only(defer_compiles):
                    return compile_entry(self.kernels, self.adapter, entry,
                                         lambda: self._warmup(entry.buffers, entry.fused, iters))
            except CompileFailed as e:
                self._eager_kernels(entry, str(e))
            except NotPrecompiled:  # a cold cache: eager kernels now, compiled in the background
                entry.defer_compile()
        return self._warmup(entry.buffers, entry.fused)

    def _capture(self, key: BucketKey, defer_compiles: bool = False) -> BucketEntry:
        t0 = time.perf_counter()
        try:
            buffers = self.adapter.allocate(key, self.device, self.dtype)
            entry = BucketEntry(key, buffers)
            if self.kernels is not None:
                entry.kernels = KernelTier.COMPILED
            if self.fused:
                entry.fused = fused_buffers(key.batch, self.device)
            estimate = self._warm(entry, defer_compiles)
        except torch.cuda.OutOfMemoryError as e:
            return self._dropped(key, f"out of memory while warming up: {e}".splitlines()[0])
        if not budget_allows(self.stats.pool_bytes, estimate, self.budget_bytes):
            self.stats.over_budget += 1
            entry.note = (f"over_budget: forward peaks at {estimate / MiB:.1f} MiB, shared pool "
                          f"{self.stats.pool_bytes / MiB:.1f} MiB, budget {self.budget_bytes / MiB:.1f} MiB")
            log.warning("bucket %s not captured: %s", key, entry.note)
            return entry
        graph = torch.cuda.CUDAGraph()
        # Release cached (unused) blocks so that reserved-memory growth is the graph pool's growth alone.
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        first = self.stats.captured == 0 and self.sync_debug
        try:
            try:
                output, nxt = self._record(graph, entry, first)
            except Exception as e:  # noqa: BLE001 - compiled kernels that do not capture: capture eager ones
                if entry.kernels is not KernelTier.COMPILED or isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                torch.cuda.synchronize(self.device)
                self._eager_kernels(entry, f"compiled capture failed: {type(e).__name__}: {e}".splitlines()[0])
                graph = torch.cuda.CUDAGraph()
                self._warmup(buffers, entry.fused)
                output, nxt = self._record(graph, entry, first)
        except torch.cuda.OutOfMemoryError as e:
            graph = None  # drop the partial capture
            return self._dropped(key, f"out of memory during capture: {e}".splitlines()[0])
        except Exception as e:  # noqa: BLE001 - any capture failure must leave the replica serving
            graph = None  # drop the partial capture
            torch.cuda.synchronize(self.device)
            self.stats.failed += 1
            entry.note = f"capture_failed: {type(e).__name__}: {e}".splitlines()[0][:300]
            log.warning("bucket %s runs eager-only: %s", key, entry.note)
            return entry
        if self.plain_forward:
            self._capture_plain(entry)
        torch.cuda.empty_cache()
        grown = max(0, torch.cuda.memory_reserved(self.device) - reserved)
        entry.mode, entry.graph, entry.output = RunMode.GRAPH, graph, output
        if nxt is not None:
            entry.fused["next"] = nxt
        entry.pool_bytes = grown
        entry.capture_s = time.perf_counter() - t0
        entry.note = "; ".join(n for n in (entry.note, f"estimate {estimate / MiB:.1f} MiB") if n)
        self.stats.captured += 1
        self.stats.capture_s += entry.capture_s
        self.stats.pool_bytes += grown
        return entry

    def _dropped(self, key: BucketKey, why: str) -> BucketEntry:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.stats.dropped_oom += 1
        entry = BucketEntry(key, {}, note=f"dropped: {why}"[:300])
        log.warning("bucket %s dropped: %s", key, why)
        return entry

    # -- serving ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, key: BucketKey | None, inputs: DenoiseInputs, eager: bool = False) -> torch.Tensor:
        """One forward on bucket ``key``: replay if captured, else eager (see the module docstring); with
        ``eager`` unpadded and eager (the step scheduler's cost model chose it), counted under ``key``.

        Returns:
            (inputs.rows, inputs.image_tokens, out_channels), a new tensor.

        Raises:
            KeyError: ``key`` is not one of this runner's buckets.
            ValueError: ``inputs`` do not fit the bucket.
        """
        with self._lock:
            mode = ForwardMode.EAGER  # a miss, an unprepared bucket or a dropped one: unpadded
            if key is None or eager:
                if key is not None and key not in self._key_set:
                    raise KeyError(f"bucket {key} is not served by this runner")
                out = eager_forward(self.adapter, inputs, self.device)
            else:
                entry = self.entries.get(key)
                if entry is None:
                    if key not in self.keys:
                        raise KeyError(f"bucket {key} is not served by this runner")
                    if not self.lazy:
                        # Not owned here (a request routed to a non-owner after the fallback wait): run it
                        # unpadded and eager rather than capture on the request path; counted.
                        self.stats.unprepared_forwards += 1
                        out = eager_forward(self.adapter, inputs, self.device)
                        self.metrics.record_forward(key, mode)
                        return out
                    entry = self.capture(key)
                    self.stats.lazy_captures += 1
                    log.info("lazy capture of bucket %s (%d so far): %s", key, self.stats.lazy_captures,
                             entry.mode.value)
                try:
                    if entry.mode is RunMode.GRAPH:
                        failpoints.forward_error()
                        graph, output = entry.graph, entry.output
                        if entry.plain is not None and inputs.lora_slots is None:  # no row has an adapter
                            graph, output = entry.plain[0], entry.plain[1]
                        self.adapter.fill(entry.buffers, inputs)
                        graph.replay()
                        out = self.adapter.unpad(output, inputs).clone()
                        mode = ForwardMode.GRAPH
                    elif entry.buffers:  # eager-only: capture failed or over budget
                        with entry_kernels(self.kernels, entry):
                            out = static_forward(self.adapter, entry.buffers, inputs, plain=self.plain_forward)
                        mode = ForwardMode.STATIC_EAGER
                    else:  # dropped after OOM, or demoted after a runtime error: unpadded eager
                        out = eager_forward(self.adapter, inputs, self.device)
                except RuntimeError as e:
                    if is_out_of_memory(e) or not (entry.mode is RunMode.GRAPH or entry.buffers):
                        raise
                    demote(entry, e, self.metrics)  # e.g. a CUDA error mid-replay: this bucket runs eager from now
                    self.stats.replay_errors += 1
                    out, mode = eager_forward(self.adapter, inputs, self.device), ForwardMode.EAGER
                entry.forwards += 1
        self.metrics.record_forward(key, mode)
        return out

    def fuses(self, key: BucketKey) -> bool:
        """True when bucket ``key`` holds a captured graph with its fused step."""
        entry = self.entries.get(key)
        return entry is not None and entry.mode is RunMode.GRAPH and entry.fused is not None and "next" in entry.fused

    @torch.inference_mode()
    def run_fused(self, key: BucketKey, inputs: DenoiseInputs, meta: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """One replay of bucket ``key``'s fused graph (see :meth:`~bcg_core.runners.base.BucketRunner.run_fused`).

        Returns:
            (meta.shape[1], ...) the images' next latents, a new tensor.

        Raises:
            KeyError: ``key`` holds no fused graph (:meth:`fuses`).
            ValueError: ``inputs`` or ``meta`` do not fit the bucket.
        """
        with self._lock:
            if not self.fuses(key):
                raise KeyError(f"bucket {key} holds no fused graph")
            entry = self.entries[key]
            graph, nxt = entry.graph, entry.fused["next"]
            if entry.plain is not None and entry.plain[2] is not None and inputs.lora_slots is None:
                graph, nxt = entry.plain[0], entry.plain[2]  # no row has an adapter
            try:
                failpoints.forward_error()
                self.adapter.fill(entry.buffers, inputs)
                fill_fused(entry.fused, meta, dt)
                graph.replay()
            except RuntimeError as e:
                if is_out_of_memory(e):
                    raise
                demote(entry, e, self.metrics)
                self.stats.replay_errors += 1
                raise BucketFault(f"bucket {key}: {entry.note}") from e
            out = self.adapter.unpad(nxt, inputs)[: meta.shape[1]].clone()
            entry.forwards += 1
        self.metrics.record_forward(key, ForwardMode.GRAPH)
        return out

    def pending_compiles(self) -> list[BucketKey]:
        """Buckets serving eager kernels until their background compile swaps them (capture order)."""
        with self._lock:
            return [k for k in self.keys if k in self.entries and self.entries[k].pending]

    def swap_in(self, old: BucketEntry, new: BucketEntry) -> float | None:
        """Capture ``new`` (its compiled blocks already compiled and checked on its own buffers,
        :func:`~bcg_core.runners.background.compile_pending`) into the shared pool and serve bucket ``old.key`` from
        it from the next forward on, between two forwards (the runner's lock); with LoRA adapters its graph without
        the deltas too. A bucket without a graph (eager-only, over budget) takes ``new``'s buffers on its static
        eager forward. The old graph is freed once dropped (its pool blocks serve later captures).

        Returns:
            The new graph's replay time over the old one's (CUDA events, median of 3 each, on their own buffers);
            None without a graph.

        Raises:
            KeyError: ``old`` no longer serves its bucket (demoted, dropped or replaced meanwhile).
            Exception: the capture raised; ``old`` keeps serving.
        """
        with self._lock, self.gate:
            if self.entries.get(old.key) is not old or not old.buffers:
                raise KeyError(f"bucket {old.key} no longer serves from the entry compiled for")
            new.forwards, new.capture_s, new.pending = old.forwards, old.capture_s, False
            if old.mode is not RunMode.GRAPH:
                new.mode, new.note = old.mode, "compiled in the background"
                self.entries[old.key] = new
                return None
            t0, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
            graph = torch.cuda.CUDAGraph()
            new.output, nxt = self._record(graph, new, False)
            if nxt is not None:
                new.fused["next"] = nxt
            new.mode, new.graph = RunMode.GRAPH, graph
            if self.plain_forward:
                self._capture_plain(new)
            new.pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved)
            new.capture_s += time.perf_counter() - t0
            factor = cuda_ms(graph.replay, 3, 1) / max(1e-6, cuda_ms(old.graph.replay, 3, 1))
            new.note = "; ".join(n for n in (new.note, "compiled in the background", f"replay x{factor:.3f}") if n)
            self.entries[old.key] = new
            self.stats.swaps += 1
            self.stats.pool_bytes += new.pool_bytes
            return factor

    @property
    def graph_count(self) -> int:
        """Buckets that hold a captured graph."""
        return sum(1 for e in self.entries.values() if e.mode is RunMode.GRAPH)

    def describe(self) -> list[dict]:
        """Per-bucket state, capture order."""
        return [
            {"key": str(e.key), "mode": e.mode.value if e.buffers or e.mode is RunMode.GRAPH else "dropped",
             "kernels": e.kernels.value, "pool_bytes": e.pool_bytes, "capture_s": round(e.capture_s, 4),
             "compile_rel_err": e.compile_err_json, "attention": e.attention_json, "forwards": e.forwards,
             "pending": e.pending, "step_cache_graphs": e.pieces is not None and e.pieces is not False,
             **({"plain_graph": e.plain is not None} if self.plain_forward else {}),
             "note": e.note}
            for e in self.entries.values()
        ]
