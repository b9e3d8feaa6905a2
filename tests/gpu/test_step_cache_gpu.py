"""The step cache on a GPU: each bucket's halves replayed as graphs of their own, equal to diffusers' own cache.

The tiny FLUX.1 checkpoint with 2 double and 2 single blocks (``tests/tiny/flux.py``), fp32 on CUDA, served with
CUDA graphs on padded buckets: requests with different First Block Cache thresholds, one with TaylorSeer and one
without share every step, against diffusers' ``FluxPipeline`` with ``enable_cache(...)`` on CUDA. Same steps
computed; latents within 1e-4 relative (the GPU gate's bound, ``tests/gpu/test_family_gate.py``); the halves ran
as graph replays (``step_cache_graphs`` in ``/v1/buckets``' bucket entries) and the whole-forward graphs still
serve the steps without a cache.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline

from bcg_core import GenerationRequest
from bcg_core.step_cache import FirstBlockCache, NoCache, TaylorSeerCache, request_cache, to_diffusers
from reference_gate import GateRun, assert_same, bcg_pipeline, diffusers_run
from tiny import flux as tiny_flux

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("no_tf32")]

BUCKETS = {"resolutions": ["64x64"], "batch_sizes": [1, 2, 4, 8], "text_lengths": [tiny_flux.TEXT_TOKENS]}
STEPS = 12


def _request(threshold, **kw) -> GenerationRequest:
    fields = dict(prompt="a red fox in the snow", n=1, width=64, height=64, num_inference_steps=STEPS, seed=3,
                  guidance_scale=3.5, cache=NoCache() if threshold is None else threshold if isinstance(
                      threshold, TaylorSeerCache) else FirstBlockCache(threshold=threshold))
    fields.update(kw)
    return GenerationRequest(**fields)


def _reference(folder, request):
    calls = [0]

    def setup(pipe):
        if isinstance(request.cache, FirstBlockCache | TaylorSeerCache):
            pipe.transformer.enable_cache(to_diffusers(request.cache))
        pipe.transformer.single_transformer_blocks[-1].proj_out.register_forward_hook(
            lambda *_: calls.__setitem__(0, calls[0] + 1))

    from dataclasses import replace

    run = diffusers_run(FluxPipeline, folder, replace(request, cache=None), device="cuda", setup=setup,
                        max_sequence_length=tiny_flux.TEXT_TOKENS)
    return run, calls[0] // 2


def test_cached_steps_replay_their_halves_and_equal_diffusers(tmp_path):
    folder = tiny_flux.build(tmp_path / "flux", "dev", layers=(2, 2))
    pipe = bcg_pipeline(folder, BUCKETS, device="cuda")
    taylor = TaylorSeerCache(cache_interval=3, max_order=2, disable_cache_before_step=2, taylor_factors_dtype="float32")
    requests = [_request(0.5, n=2, seed=11), _request(2.0, seed=5), _request(None, seed=7), _request(taylor, seed=9)]
    states = [None] * 4
    joins = {1: 0, 0: 3, 2: 5, 3: 1}
    step = 0
    while True:
        for i, r in enumerate(requests):
            if states[i] is None and step >= joins[i]:
                states[i] = pipe.start(pipe.validator.validate(r))
        live = [s for s in states if s is not None and not s.done]
        if not live and all(s is not None for s in states):
            break
        pipe.step(live, pipe.decider.for_states(live))
        step += 1
    graphs = [b for b in pipe.runner.describe() if b["step_cache_graphs"]]
    assert graphs, pipe.runner.describe()
    assert pipe.runner.stats.piece_captures == len(graphs) and pipe.runner.stats.piece_failures == 0
    # each captured bucket's halves were timed against its whole forward, and the cost model prices cached steps
    # with those shares (the head over a row: what a reused row costs)
    shares = pipe.runner.piece_shares
    assert set(shares) == {b["key"] for b in graphs} or {str(k) for k in shares} == {b["key"] for b in graphs}
    assert all(0 < head < 1 and 0 < tail <= 1.2 for head, tail in shares.values()), shares
    assert pipe.decider.costs.piece_shares == shares
    assert "step_cache_shares" in pipe.decider.costs.describe()
    for request, state in zip(requests, states, strict=True):
        ref, computed = _reference(folder, request)
        cache = request_cache(state)
        if cache is not None:
            assert sum(c["computed"] for c in cache.describe()["steps"].values()) == computed
        assert_same(GateRun(state.latents.float().cpu(), pipe.finish(state)), ref, rtol=1e-4, pixel_share=1e-2)
