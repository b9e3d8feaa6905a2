"""Piecewise capture: a bucket's step-cache halves as two CUDA graphs of their own, beside its whole-forward graph.

A step in which some request caches (:mod:`bcg_core.step_cache.step`) runs the transformer in two halves: the head
(first block, each row's cached residual added: the reused step) over every row, then the tail (the remaining
blocks) over the rows that compute. :class:`PiecewiseReplay` (a base class of
:class:`~bcg_core.runners.cuda_graph.CudaGraphRunner`) captures each half of a bucket as a graph of its own, in the
runner's shared memory pool, the first time a cached step runs on that bucket, and replays them after:

- the head graph reads the bucket's input buffers and a padded residual buffer pair ``(B, S, D)`` / ``(B, T, D)``
  (filled before each replay: each row's cached residual, zeros elsewhere) and leaves the head block's outputs and
  residual and the reused output in the pool;
- the tail graph reads the bucket's input buffers and a padded head-output buffer pair and leaves the computed
  output and the remaining blocks' residuals.

Right after the capture, the bucket's whole-forward graph and each half are replayed and timed together with CUDA
events (:meth:`PiecewiseReplay.time_pieces`): the halves' shares of the whole forward
(:attr:`PiecewiseReplay.piece_shares`), which the cost model prices cached steps with
(:attr:`~bcg_core.costs.CostModel.piece_shares`) and ``/v1/buckets`` shows. The head's share is what a reused row
costs.

What a replay leaves in the pool is overwritten by the next replay of any graph of the pool, so every output is
cloned (its real rows and tokens) before the next replay. A step where no request caches replays the bucket's
whole-forward graph as before: requests that do not cache pay nothing. A bucket whose halves fail to capture (or
whose replay raises) runs them unpadded and eager (noted, counted in
:attr:`~bcg_core.runners.base.CaptureStats.piece_failures`). Such a capture runs on the request path while other
threads go on using the GPU, so a failure may be passing (another thread's device-wide synchronization invalidates a
capture in any mode; memory short for a moment under load): the capture is tried again at the bucket's next cached
step after :data:`PIECE_RETRY_S` seconds, then after twice that, at most :data:`PIECE_CAPTURE_ATTEMPTS` times in all
(:meth:`PiecewiseReplay.piece_retry_due`); after that the halves stay unpadded and eager.

:meth:`run_piece` is what the cached step calls, on every runner: the eager runner runs the half on the bucket's
static buffers (or unpadded) under the phase (:func:`eager_piece`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from bcg_core.errors import first_line
from bcg_core.keys import BucketKey
from bcg_core.metrics import ForwardMode
from bcg_core.padding import DenoiseInputs
from bcg_core.runners.base import RunMode, entry_kernels, is_out_of_memory
from bcg_core.step_cache.split import BlockSplit, HeadPhase, TailPhase, pad_rows

__all__ = ["CachePieces", "PiecewiseReplay", "eager_piece"]

log = logging.getLogger("bcg_core.runners.cuda_graph")


def eager_piece(runner, key: BucketKey | None, inputs: DenoiseInputs, phase: HeadPhase | TailPhase,
                split: BlockSplit, eager: bool) -> torch.Tensor:
    """One half of a cached step without a graph of its own: ``runner.run`` under ``phase`` (on the bucket's static
    buffers, or unpadded with ``eager`` or ``key`` None)."""
    with split.phase(phase):
        return runner.run(key, inputs, eager=eager)


@dataclass
class CachePieces:
    """A bucket's two step-cache graphs and their static buffers (see the module docstring)."""

    head: object
    head_phase: HeadPhase
    head_out: torch.Tensor
    tail: object
    tail_phase: TailPhase
    tail_out: torch.Tensor
    capture_s: float = 0.0
    shares: tuple[float, float] | None = None
    """The head's and the tail's replay time over the whole-forward graph's (:meth:`PiecewiseReplay.time_pieces`);
    None where the bucket has no whole-forward graph to compare with."""


PIECE_CAPTURE_ATTEMPTS = 3
"""Most captures of one bucket's step-cache graphs (module docstring): the first and two retries."""

PIECE_RETRY_S = 30.0
"""Seconds after a failed capture of a bucket's step-cache graphs before the next try; doubled after each failure
(30 s, then 60 s). A capture blocks the bucket's steps for about as long as its whole-forward capture took, so a
bucket whose captures keep failing costs at most two more of them, spread over the first minutes."""

PIECE_TIMING_ITERS = 3
"""Replays of each graph (whole, head, tail) timed at a bucket's piecewise capture; the median is kept. Three
after one warm-up: the replays are a few milliseconds each, and a capture happens once per bucket while serving."""


class PiecewiseReplay:
    """:meth:`run_piece` for a runner that replays CUDA graphs (a base class of
    :class:`~bcg_core.runners.cuda_graph.CudaGraphRunner`, which provides the attributes used here)."""

    @property
    def piece_shares(self) -> dict[BucketKey, tuple[float, float]]:
        """Per bucket whose halves are captured and timed: ``(head, tail)`` replay time over its whole forward's
        (:meth:`time_pieces`)."""
        return {k: e.pieces.shares for k, e in list(self.entries.items())
                if isinstance(e.pieces, CachePieces) and e.pieces.shares is not None}

    def run_piece(self, key: BucketKey | None, inputs: DenoiseInputs, phase: HeadPhase | TailPhase,
                  split: BlockSplit, eager: bool = False) -> torch.Tensor:
        """One half of a cached step on bucket ``key``: a replay of the bucket's graph of that half (captured on
        the bucket's first cached step), or unpadded and eager (a miss, ``eager``, a bucket without a graph, or
        one whose halves did not capture). ``phase`` receives the half's outputs over the real rows and tokens
        (new tensors).

        Returns:
            (inputs.rows, inputs.image_tokens, out_channels), a new tensor.
        """
        with self._lock:
            entry = None if key is None or eager else self.entries.get(key)
            if entry is None or entry.mode is not RunMode.GRAPH:
                return eager_piece(self, key, inputs, phase, split, eager=True)
            pieces = self._pieces_of(entry, split)
            if pieces is None:
                return eager_piece(self, key, inputs, phase, split, eager=True)
            try:
                out = self._replay_piece(entry, pieces, inputs, phase)
            except RuntimeError as e:
                if is_out_of_memory(e):
                    raise
                self._piece_failed(entry)
                entry.note = f"{entry.note}; step-cache graphs dropped: {type(e).__name__}: {first_line(e, '')}"[:300]
                log.error("bucket %s: a step-cache graph raised %s; its halves run unpadded and eager", key, e)
                return eager_piece(self, key, inputs, phase, split, eager=True)
            entry.forwards += 1
        self.metrics.record_forward(key, ForwardMode.GRAPH)
        return out

    def _replay_piece(self, entry, pieces: CachePieces, inputs: DenoiseInputs,
                      phase: HeadPhase | TailPhase) -> torch.Tensor:
        rows, k, t = inputs.rows, inputs.image_tokens, inputs.text_tokens
        self.adapter.fill(entry.buffers, inputs)
        if isinstance(phase, HeadPhase):
            static = pieces.head_phase
            res_hidden, res_encoder = static.static
            pad_rows(res_hidden, {i: h for i, (h, _) in phase.residuals.items()})
            if res_encoder is not None:
                pad_rows(res_encoder, {i: e for i, (_, e) in phase.residuals.items() if e is not None})
            pieces.head.replay()
            phase.hidden = static.hidden[:rows, :k].clone()
            phase.residual = static.residual[:rows, :k].clone()
            phase.encoder = None if static.encoder is None else static.encoder[:rows, :t].clone()
            return self.adapter.unpad(pieces.head_out, inputs).clone()
        static = pieces.tail_phase
        pad_rows(static.hidden, dict(enumerate(phase.hidden)))
        if static.encoder is not None:
            pad_rows(static.encoder, dict(enumerate(phase.encoder)))
        pieces.tail.replay()
        phase.residual_hidden = static.residual_hidden[:rows, :k].clone()
        phase.residual_encoder = None if static.residual_encoder is None else static.residual_encoder[:rows, :t].clone()
        return self.adapter.unpad(pieces.tail_out, inputs).clone()

    @staticmethod
    def piece_retry_due(entry) -> bool:
        """Whether ``entry``'s failed step-cache graphs may be captured again now (module docstring): fewer than
        :data:`PIECE_CAPTURE_ATTEMPTS` failures, and :data:`PIECE_RETRY_S` (doubled per failure) passed since the
        last one."""
        return entry.piece_attempts < PIECE_CAPTURE_ATTEMPTS and time.monotonic() >= entry.piece_retry_at

    def _piece_failed(self, entry) -> None:
        """Mark ``entry``'s step-cache graphs failed (its halves unpadded and eager) and schedule the next try."""
        entry.pieces = False
        entry.piece_attempts += 1
        entry.piece_retry_at = time.monotonic() + PIECE_RETRY_S * 2 ** (entry.piece_attempts - 1)
        self.stats.piece_failures += 1

    def _pieces_of(self, entry, split: BlockSplit) -> CachePieces | None:
        """The bucket's step-cache graphs, captured now if they are not yet (or again, where an earlier capture
        failed and :meth:`piece_retry_due`); None where they failed (noted)."""
        if entry.pieces is False and not self.piece_retry_due(entry):
            return None
        if entry.pieces:
            return entry.pieces
        with self.gate:
            try:
                entry.pieces = self._capture_pieces(entry, split)
            except Exception as e:  # noqa: BLE001 - the bucket's halves then run unpadded and eager
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                    if isinstance(e, torch.cuda.OutOfMemoryError):
                        torch.cuda.empty_cache()
                self._piece_failed(entry)
                entry.note = f"{entry.note}; no step-cache graphs: {type(e).__name__}: {first_line(e, '')}"[:300]
                log.warning("bucket %s: step-cache graphs not captured (attempt %d of %d: %s); its halves run unpadded "
                            "and eager%s", entry.key, entry.piece_attempts, PIECE_CAPTURE_ATTEMPTS, entry.note,
                            " until the next try" if entry.piece_attempts < PIECE_CAPTURE_ATTEMPTS else " from now on")
                return None
            if entry.piece_attempts:
                log.info("bucket %s: step-cache graphs captured at attempt %d", entry.key, entry.piece_attempts + 1)
        return entry.pieces

    def _capture_pieces(self, entry, split: BlockSplit) -> CachePieces:
        """Capture ``entry``'s head and tail graphs (see the module docstring) into the shared pool."""
        t0 = time.perf_counter()
        buffers = entry.buffers
        probe = HeadPhase()
        with torch.inference_mode(), entry_kernels(self.kernels, entry), split.phase(probe):
            self.adapter.forward(buffers)  # the halves' stream shapes
        zeros = lambda x: None if x is None else torch.zeros_like(x)  # noqa: E731
        head = HeadPhase(static=(zeros(probe.hidden), zeros(probe.encoder)))
        tail = TailPhase(zeros(probe.hidden), zeros(probe.encoder), static=True)
        del probe
        graphs, outs = [], []
        for phase in (head, tail):
            self._warm_piece(entry, split, phase)
            graph = torch.cuda.CUDAGraph()
            with (torch.inference_mode(), entry_kernels(self.kernels, entry), split.phase(phase),
                  torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local")):
                outs.append(self.adapter.forward(buffers))
            torch.cuda.synchronize(self.device)
            graphs.append(graph)
        pieces = CachePieces(graphs[0], head, outs[0], graphs[1], tail, outs[1], time.perf_counter() - t0)
        pieces.shares = self.time_pieces(entry, pieces)
        self.stats.piece_captures += 1
        log.info("bucket %s: step-cache graphs captured in %.2f s (head %s, tail %s of the whole forward)", entry.key,
                 pieces.capture_s, *(f"{x:.2f}" for x in pieces.shares or (float("nan"),) * 2))
        return pieces

    def time_pieces(self, entry, pieces: CachePieces, iters: int = PIECE_TIMING_ITERS) -> tuple[float, float] | None:
        """The head's and the tail's graph replay milliseconds over the bucket's whole-forward graph's, timed
        together with CUDA events (:func:`~bcg_core.devices.cuda_ms`, median of ``iters`` after one warm-up), right
        after the halves' capture, before anything reads the pool: what the replays leave there is overwritten by
        the step's own replays. None where the bucket has no whole-forward graph."""
        if entry.graph is None:
            return None
        from bcg_core.devices import cuda_ms

        whole = cuda_ms(entry.graph.replay, iters, warmup=1)
        if whole <= 0:
            return None
        head, tail = (cuda_ms(g.replay, iters, warmup=1) for g in (pieces.head, pieces.tail))
        return min(2.0, head / whole), min(2.0, tail / whole)

    def _warm_piece(self, entry, split: BlockSplit, phase) -> None:
        """Warm-up forwards of one half before its capture: every capture's side-stream warm-up
        (:meth:`~bcg_core.runners.graph_record.GraphRecorder._warmup`) under the bucket's kernels and the phase."""
        with entry_kernels(self.kernels, entry), split.phase(phase):
            self._warmup(entry.buffers)
