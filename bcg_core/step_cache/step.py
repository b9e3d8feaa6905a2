"""One denoising step of several requests with their step caches, decided per request inside the batched step.

:func:`cached_forward` replaces the step's transformer forwards (:meth:`bcg_core.pipeline.DiTPipeline.step`) when a
request in it has a cache. TaylorSeer contexts decide by their step alone, before any forward: those that predict
take their rows' output from their Taylor expansion and leave the step's forwards; those that compute run their
rows' whole forward and update the expansion from it. First Block Cache contexts then run:

1. **Head.** Every row runs the transformer's first block (:class:`~bcg_core.step_cache.split.HeadPhase`) in the
   step's own forwards. Rows whose context holds a cached residual get it added to the head's output, so the head
   forward's output is already each such row's *reused* step.
2. **Decide.** Each cache context of each request (:class:`~bcg_core.step_cache.state.ContextCache`: its cond rows,
   its uncond rows) compares its head residual with the one of its last computed step, over its own rows and real
   tokens, as diffusers' ``FBCHeadBlockHook._should_compute_remaining_blocks`` does for a pipeline call:
   ``mean|r - r_prev| / mean|r_prev|`` in the tensors' dtype; it computes where that is above the threshold, or
   where it has no previous step. One host synchronization reads every context's decision.
3. **Tail.** The rows that compute (those of contexts that compute, and every row of a request without a cache) run
   the remaining blocks (:class:`~bcg_core.step_cache.split.TailPhase`) in the forwards the step decider chooses for
   that many rows (:meth:`~bcg_core.costs.StepDecider.decide` for the tail half: the smallest buckets that hold
   them, priced by the halves' measured shares, :attr:`~bcg_core.costs.CostModel.piece_shares`), and their contexts
   keep the new residuals.

A row's result is diffusers' output of the same step for that request: the reused step adds the same residual to
the same head output, and the computed step runs the same blocks on it. On a CUDA graph runner each half of a bucket
replays a graph of its own, captured at the bucket's first cached step (:mod:`bcg_core.runners.piecewise`); on the
eager runner the halves run on the bucket's static buffers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from bcg_core.families.state import RequestState
from bcg_core.padding import DenoiseInputs
from bcg_core.step_cache.spec import FirstBlockCache, TaylorSeerCache
from bcg_core.step_cache.split import BlockSplit, HeadPhase, TailPhase
from bcg_core.step_cache.state import ContextCache, RequestCache

__all__ = ["CACHE_EXTRA", "cached_forward", "request_cache"]

CACHE_EXTRA = "step_cache"
"""Key of a request's :class:`~bcg_core.step_cache.state.RequestCache` in ``RequestState.extras``."""


def request_cache(state: RequestState) -> RequestCache | None:
    """The step cache of ``state``, or None (the request asked for none)."""
    return state.extras.get(CACHE_EXTRA)


def _contexts(states: Sequence[RequestState], parts: Sequence[DenoiseInputs]) -> list[tuple]:
    """``(context, its rows among the step's rows, its request's own text tokens, its cache spec)`` of every cached
    request."""
    out, offset = [], 0
    for state, part in zip(states, parts, strict=True):
        cache = request_cache(state)
        if cache is not None:
            for c in cache.contexts:
                out.append((c, slice(offset + c.rows.start, offset + c.rows.stop), part.text_tokens, cache.spec))
        offset += part.rows
    return out


def _head(pipe, split: BlockSplit, inputs: DenoiseInputs, forwards, contexts) -> tuple:
    """Step 1: the head forwards. Returns ``(reused output (N, S, C), head hidden (N, S, D), head encoder (N, T, D)
    or None, head residual (N, S, D))`` over the step's ``N`` rows and real tokens."""
    residual_of: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for c, rows, *_ in contexts:
        if c.hidden is not None:
            for j, r in enumerate(range(rows.start, rows.stop)):
                residual_of[r] = (c.hidden[j], None if c.encoder is None else c.encoder[j])
    outs, hidden, encoder, residual = [], [], [], []
    k, t, a = inputs.image_tokens, inputs.text_tokens, 0
    for chunk in forwards.chunks:
        b = a + chunk.rows
        rows = inputs.select(slice(a, b)) if len(forwards.chunks) > 1 else inputs
        phase = HeadPhase({r - a: residual_of[r] for r in range(a, b) if r in residual_of})
        outs.append(_run(pipe, split, chunk, forwards, rows, phase))
        hidden.append(phase.hidden[: chunk.rows, :k])
        residual.append(phase.residual[: chunk.rows, :k])
        if phase.encoder is not None:
            encoder.append(phase.encoder[: chunk.rows, :t])
        a = b
    return _cat(outs), _cat(hidden), _cat(encoder), _cat(residual)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The chunks' tensors in row order (the one tensor itself where there is one; None for none)."""
    return (torch.cat(parts) if len(parts) > 1 else parts[0]) if parts else None


def _run(pipe, split: BlockSplit, chunk, forwards, rows: DenoiseInputs, phase) -> torch.Tensor:
    """One half-forward of a chunk (:meth:`~bcg_core.runners.BucketRunner.run_piece`): a replay of its bucket's graph
    of that half, a forward on its static buffers, or unpadded (a miss or an eager chunk)."""
    return pipe.runner.run_piece(chunk.key or chunk.home or forwards.home, rows, phase, split, eager=chunk.key is None)


def _decide(contexts, residual: torch.Tensor) -> list[bool]:
    """Step 2: whether each context computes its remaining blocks (see the module docstring): always without a
    previous computed step, else where its change is above its threshold."""
    # diffusers' FBCHeadBlockHook._should_compute_remaining_blocks, in the tensors' dtype
    ratios = {i: (residual[rows] - c.previous).abs().mean() / c.previous.abs().mean()
              for i, (c, rows, *_) in enumerate(contexts) if c.previous is not None}
    # one host synchronization reads every context's ratio
    values = dict(zip(ratios, torch.stack(list(ratios.values())).tolist(), strict=True)) if ratios else {}
    return [i not in values or values[i] > spec.threshold for i, (*_, spec) in enumerate(contexts)]


def _count(pipe, forwards, cached: list[bool | None]) -> None:
    """Count the First Block Cache rows per bucket their first block ran on, an unpadded chunk under its shape's
    bucket as its forward is counted (:meth:`~bcg_core.metrics.BucketMetrics.record_cache`; a miss: the miss
    counters)."""
    a = 0
    for chunk in forwards.chunks:
        rows = cached[a : a + chunk.rows]
        if any(r is not None for r in rows):
            pipe.metrics.record_cache(chunk.key or chunk.home or forwards.home, rows.count(False), rows.count(True))
        a += chunk.rows


def _first_block(pipe, split: BlockSplit, states, inputs: DenoiseInputs, forwards, contexts) -> torch.Tensor:
    """Steps 1-3 of the module docstring over ``inputs`` (``contexts``: the First Block Cache ones, their rows among
    ``inputs``' rows; every other row computes). Returns the rows' outputs, (N, S, C)."""
    reused, hidden, encoder, residual = _head(pipe, split, inputs, forwards, contexts)
    decisions = _decide(contexts, residual)
    cached = [None] * inputs.rows  # per row of a cached request: whether it computes (the others always do)
    for (c, rows, *_), computes in zip(contexts, decisions, strict=True):
        if not computes:
            c.reused += 1
        for r in range(rows.start, rows.stop):
            cached[r] = computes
    _count(pipe, forwards, cached)
    idx = [r for r, computes in enumerate(cached) if computes is not False]
    if not idx:
        return reused
    sub = inputs.select(idx)
    tail_forwards = pipe.decider.for_states(states, rows=len(idx), phase="tail")
    outs, res_hidden, res_encoder, a = [], [], [], 0
    k, t = inputs.image_tokens, inputs.text_tokens
    for chunk in tail_forwards.chunks:
        b = a + chunk.rows
        pick = idx[a:b]
        phase = TailPhase(hidden[pick], None if encoder is None else encoder[pick])
        outs.append(_run(pipe, split, chunk, tail_forwards, sub.select(slice(a, b)), phase))
        res_hidden.append(phase.residual_hidden[: chunk.rows, :k])
        if phase.residual_encoder is not None:
            res_encoder.append(phase.residual_encoder[: chunk.rows, :t])
        a = b
    res_hidden_all, res_encoder_all = _cat(res_hidden), _cat(res_encoder)
    out = reused  # a new tensor of this step's: the computed rows replace their reused outputs in it
    out[idx] = _cat(outs).to(out.dtype)
    at = {r: i for i, r in enumerate(idx)}
    for (c, rows, own_text, _), computes in zip(contexts, decisions, strict=True):
        if computes:
            pos = [at[r] for r in range(rows.start, rows.stop)]
            c.previous = residual[rows].clone()
            c.hidden = res_hidden_all[pos].clone()
            c.encoder = None if res_encoder_all is None else res_encoder_all[pos, :own_text].clone()
            c.computed += 1
    return out


def _taylor_update(c: ContextCache, spec: TaylorSeerCache, output: torch.Tensor, step: int) -> None:
    """A computed step's output ``(rows, S, C)`` into the context's Taylor factors, as diffusers'
    ``TaylorSeerState.update``: divided differences up to ``max_order`` over the steps since the last update, kept
    in ``taylor_factors_dtype``."""
    dtype = spec.factors_dtype
    factors = [output]
    if c.last_update is not None:
        delta = step - c.last_update
        for j in range(spec.max_order):
            prev = c.factors[j] if j < len(c.factors) else None
            if prev is None or prev.shape != factors[j].shape:
                break
            factors.append((factors[j] - prev.to(output.dtype)) / delta)
    c.factors = [f.to(dtype) for f in factors]
    c.last_update = step


def _taylor_predict(c: ContextCache, step: int, dtype: torch.dtype) -> torch.Tensor:
    """The context's predicted output at ``step``, ``(rows, S, C)`` in ``dtype``, as diffusers'
    ``TaylorSeerState.predict``: ``sum_i factor_i * offset**i / i!``, ``offset`` the steps since the last update."""
    offset = step - c.last_update
    out = torch.zeros_like(c.factors[0], dtype=dtype)
    for order, factor in enumerate(c.factors):
        out = out + factor.to(dtype) * (offset**order / math.factorial(order))
    return out


def cached_forward(pipe, split: BlockSplit | None, states: Sequence[RequestState], parts: Sequence[DenoiseInputs],
                   inputs: DenoiseInputs, forwards) -> torch.Tensor:
    """The step's transformer output with each request's step cache (see the module docstring).

    TaylorSeer contexts (:class:`~bcg_core.step_cache.TaylorSeerCache`) decide by their step alone: a context that
    predicts this step gets its rows' output from its Taylor expansion and runs no forward; one that computes runs
    its rows' whole forward with the others and updates its expansion from the output. First Block Cache contexts
    decide as steps 1-3 say. The rows left to run (every row but the predicted ones) run in the step's forwards, or,
    where rows were predicted, in those the step decider chooses for the rest.

    Args:
        pipe: the :class:`~bcg_core.pipeline.DiTPipeline` (its runner, step decider and metrics).
        split: the transformer's :class:`~bcg_core.step_cache.split.BlockSplit`; None where no request of the step
            has a First Block Cache (TaylorSeer runs whole forwards: a transformer the split refuses takes it).
        states, parts: the step's requests and their rows (:meth:`~bcg_core.families.Family.model_rows`).
        inputs: the step's rows, ``parts`` concatenated.
        forwards: the step's forwards.

    Returns:
        (inputs.rows, inputs.image_tokens, out_channels): each row's output, as :meth:`runner.run
        <bcg_core.runners.BucketRunner.run>` returns it; every context's counts and state updated.

    Raises:
        ValueError: a First Block Cache context with ``split`` None.
    """
    pipe.decider.observe_pieces(pipe.runner)  # halves captured at an earlier cached step: their measured shares
    contexts = _contexts(states, parts)
    if split is None and any(isinstance(spec, FirstBlockCache) for *_, spec in contexts):  # before any state moves
        raise ValueError("a First Block Cache step needs the transformer's block split (split is None)")
    predicted: dict[int, torch.Tensor] = {}  # row -> its predicted output (S, C)
    updates = []  # TaylorSeer contexts that compute: (context, spec, rows, step)
    for c, rows, _, spec in contexts:
        if not isinstance(spec, TaylorSeerCache):
            continue
        step = c.calls
        c.calls += 1
        if spec.computes(step):
            updates.append((c, spec, rows, step))
            c.computed += 1
            continue
        c.reused += 1
        for j, out in enumerate(_taylor_predict(c, step, pipe.model.dtype)):
            predicted[rows.start + j] = out
    if updates or predicted:  # TaylorSeer rows, under the step's bucket (its home; a miss: the miss counters)
        pipe.metrics.record_cache(forwards.home or forwards.chunks[0].key, len(predicted),
                                  sum(rows.stop - rows.start for _, _, rows, _ in updates))
    run = [r for r in range(inputs.rows) if r not in predicted]
    first_block = [e for e in contexts if isinstance(e[3], FirstBlockCache)]
    out_run = None
    if run:
        sub, sub_forwards = inputs, forwards
        if predicted:
            sub, sub_forwards = inputs.select(run), pipe.decider.for_states(states, rows=len(run))
        pos = {r: i for i, r in enumerate(run)}
        remap = lambda rows: slice(pos[rows.start], pos[rows.start] + rows.stop - rows.start)  # noqa: E731
        out_run = (_first_block(pipe, split, states, sub, sub_forwards,
                                [(c, remap(rows), text, spec) for c, rows, text, spec in first_block])
                   if first_block else pipe.run_forwards(sub, sub_forwards))
        for c, spec, rows, step in updates:
            _taylor_update(c, spec, out_run[remap(rows)], step)
        if not predicted:
            return out_run
    like = out_run if out_run is not None else next(iter(predicted.values()))
    per_row = like.shape[1:] if out_run is not None else like.shape  # (S, C) packed; (C, F, H, W) a latent video
    out = like.new_empty((inputs.rows, *per_row))
    for r, o in predicted.items():
        out[r] = o.to(out.dtype)
    if out_run is not None:
        out[run] = out_run.to(out.dtype)
    return out
