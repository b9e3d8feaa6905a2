"""Recording one bucket's forward into a CUDA graph: the mechanics under
:class:`~bcg_core.runners.cuda_graph.CudaGraphRunner`, which decides what to capture and what a failure costs.

:class:`GraphRecorder` holds the steps every capture takes, as PyTorch's CUDA graph notes prescribe them
(https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs):

- :meth:`~GraphRecorder._warmup`: warm-up forwards on a side stream before the capture (kernels and workspaces
  are set up outside it); their peak memory above the starting allocation, in bytes, is the bucket's estimate
  for the graph-memory budget. One side stream serves every warm-up: each new stream gets (and keeps) its own
  cuBLAS workspace.
- :meth:`~GraphRecorder._record`: the capture into the runner's shared pool, with the bucket's kernels and in
  ``thread_local`` error mode (captures happen while other threads serve), under the sync debug mode for the first
  capture (:meth:`~GraphRecorder._sync_debug`).
- :meth:`~GraphRecorder._capture_plain`: with LoRA adapters, the bucket's second graph, without the deltas.

Apart from cuda_graph.py so that the runner reads as its policy (capture order, budget, degrading on failure,
replay); the methods keep their names on the runner (tests wrap ``CudaGraphRunner._record`` and ``_forward``).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from bcg_core.errors import first_line
from bcg_core.padding import DiTAdapter
from bcg_core.runners.base import BucketEntry, entry_kernels
from bcg_core.runners.kernels import CompiledKernels

__all__ = ["GraphRecorder"]

log = logging.getLogger("bcg_core.runners.cuda_graph")  # the runner's logger: its warnings read as they did


class GraphRecorder:
    """The capture steps of :class:`~bcg_core.runners.cuda_graph.CudaGraphRunner` (a base class of it: see the
    module docstring). It reads the runner's attributes below; the runner sets them in its ``__init__`` (and
    :attr:`pool` in its first ``prepare``)."""

    adapter: DiTAdapter
    device: torch.device
    kernels: CompiledKernels | None
    pool: object | None
    """The shared memory pool (``torch.cuda.graph_pool_handle()``) every graph is captured into."""
    warmup_iters: int
    _side: torch.cuda.Stream | None
    """The side stream of every warm-up, made at the first."""

    def _forward(self, buffers: dict[str, torch.Tensor], fused: dict[str, torch.Tensor] | None, plain: bool = False):
        """The work a bucket's graph holds: the forward (``plain``: without LoRA rows), then with ``fused`` the
        fused step's update."""
        out = self.adapter.forward_plain(buffers) if plain else self.adapter.forward(buffers)
        if fused is None:
            return out, None
        from bcg_core.runners.fused import fused_update

        return out, fused_update(out, buffers["latents"], fused["meta"], fused["dt"])

    def _warmup(self, buffers: dict[str, torch.Tensor], fused: dict[str, torch.Tensor] | None = None,
                iters: int | None = None) -> int:
        """``iters`` (default ``warmup_iters``) warm-up forwards on a side stream; returns their peak memory above
        the starting allocation."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        # One side stream for every warm-up: each new stream would get (and keep) its own cuBLAS workspace.
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(self.warmup_iters if iters is None else iters):
                self._forward(buffers, fused)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    def _record(self, graph, entry: BucketEntry, sync_debug: bool, plain: bool = False):
        """Capture ``entry``'s forward (with its kernels) into ``graph`` in the shared pool; its static outputs.

        The capture's error mode is ``thread_local``: calls that are unsafe during a capture are refused on this
        thread only. A replica captures while it serves (shapes newly assigned when a peer leaves,
        ``deployments/dit.py``; lazy captures). The denoising thread waits meanwhile (``run`` takes this runner's
        lock), but the decode, preview and edit-encode threads and the LoRA loader go on; under the default
        ``global`` mode a ``cudaMalloc`` or a stream synchronization of theirs would fail during the capture. Their
        work is on streams of their own (PyTorch's streams are non-blocking), so none of it is recorded into the
        graph. A device-wide synchronization (``torch.cuda.synchronize()``, which the decode's background compile
        makes while inductor times kernels) still invalidates a capture in any mode: that capture fails and its
        bucket runs eager-only, as any failed capture. While another thread allocates, ``pool_bytes`` (reserved
        memory before and after the capture) can count its allocations too."""
        with (self._sync_debug(sync_debug), torch.inference_mode(), entry_kernels(self.kernels, entry),
              torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local")):
            output, nxt = self._forward(entry.buffers, entry.fused, plain)
        torch.cuda.synchronize(self.device)
        return output, nxt

    def _capture_plain(self, entry: BucketEntry) -> None:
        """With LoRA adapters: capture ``entry``'s forward without the deltas as its second graph, over the same
        buffers and pool (``entry.plain``), so forwards whose rows carry no adapter cost what they cost without
        ``lora.dir`` (the deltas read each layer's input and rewrite its output: about 11% of a forward at
        FLUX.1-dev width, docs/BENCHMARKS.md). A failure leaves the bucket on its one graph, which serves those
        rows too (slot 0): noted and logged, never raised."""
        graph = torch.cuda.CUDAGraph()
        try:  # no warm-up of its own: its kernels are the LoRA graph's, warmed up and compiled before it
            output, nxt = self._record(graph, entry, False, plain=True)
        except Exception as e:  # noqa: BLE001 - the bucket still serves every row through its LoRA graph
            torch.cuda.synchronize(self.device)
            entry.note = "; ".join(n for n in (entry.note, f"no graph without LoRA: {type(e).__name__}: "
                                                           f"{first_line(e, '')}"[:200]) if n)
            log.warning("bucket %s: no graph without LoRA deltas: %s", entry.key, entry.note)
            return
        entry.plain = (graph, output, nxt)

    @contextlib.contextmanager
    def _sync_debug(self, on: bool):
        if not on:
            yield
            return
        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(old)
