"""The fused step (bcg_core/runners/fused.py): CFG combination and flow-match Euler update in the bucket's forward.

On the CPU the eager runner computes the fused step on the static buffers exactly as a CUDA graph replays it
(``runner.fused_step: always``), so everything but the capture is exercised here; ``tests/gpu`` replays it.
The claim is bit-equality: the fused update reproduces every rounding of diffusers'
``FlowMatchEulerDiscreteScheduler.step`` and the pipelines' CFG combination, so a step fused and the same
step on the host give identical latents (``torch.equal``, not a tolerance), in bf16 as in fp32.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

import bcg_core.runners.fused as fused_mod
from bcg_core import BucketConfig, BucketKey, DiTPipeline, GenerationRequest, ModelConfig, build_tiny
from bcg_core.config import EngineConfig
from bcg_core.costs import Chunk, StepForwards
from bcg_core.families.tiny import TINY_TEXT_TOKENS
from bcg_core.runners.fused import fused_update
from reference_gate import assert_same, bcg_pipeline, bcg_run, diffusers_run
from scheduling import ValidatingScheduler
from tiny.sd3 import build as build_sd3

T = TINY_TEXT_TOKENS
BUCKETS = BucketConfig(batch_sizes=[1, 2, 4, 8], resolutions=["256x256"], text_lengths=[T])


def _config(fused: str) -> EngineConfig:
    return EngineConfig(buckets=BUCKETS, runner={"fused_step": fused})


@pytest.fixture(scope="module")
def bf16():
    return build_tiny(ModelConfig(dtype="bfloat16"))


@pytest.fixture(scope="module")
def tiny_fp32():
    return build_tiny()


def _req(n=1, guidance=1.0, steps=3, seed=0, prompt="a red cube") -> GenerationRequest:
    return GenerationRequest(prompt, n=n, width=256, height=256, num_inference_steps=steps, guidance_scale=guidance,
                             seed=seed)


def _twin(state):
    """An independent copy of a request state (own latents and scheduler)."""
    import dataclasses

    return dataclasses.replace(state, latents=state.latents.clone(), scheduler=copy.deepcopy(state.scheduler),
                               step_ms=[])


def test_fused_update_is_bitwise_the_schedulers_step_and_cfg_in_bf16():
    """Three images (one with CFG) in a 6-row bucket against ``u + s * (c - u)`` then
    ``FlowMatchEulerDiscreteScheduler.step``, each image with its own schedule position."""
    g = torch.Generator().manual_seed(0)
    out = torch.randn(6, 16, 8, generator=g).to(torch.bfloat16)
    lat = torch.randn(6, 16, 8, generator=g).to(torch.bfloat16)
    rows = [(0, 0, None, 1.0, 0), (1, 4, True, 4.5, 2), (2, 2, None, 1.0, 5)]  # cond, uncond, cfg, scale, index
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(8)
    meta = torch.zeros(4, 6)
    dt = torch.zeros(6)
    for j, (c, u, cfg, s, i) in enumerate(rows):
        meta[:, j] = torch.tensor([c, u, float(bool(cfg)), s])
        dt[j] = sched.sigmas[i + 1] - sched.sigmas[i]
    got = fused_update(out, lat, meta, dt)
    for j, (c, u, cfg, s, i) in enumerate(rows):
        noise = out[u] + s * (out[c] - out[u]) if cfg else out[c]
        mine = copy.deepcopy(sched)
        mine._step_index = i
        want = mine.step(noise[None], sched.timesteps[i], lat[c][None], return_dict=False)[0][0]
        assert got.dtype == want.dtype and torch.equal(got[j], want), j


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_steps_equal_host_steps_bit_for_bit(dtype, bf16, tiny_fp32):
    """Mixed steps, CFG and not, several requests in one forward and a plan that splits them: the latents of
    every step equal those of the host path exactly; counters say which steps fused."""
    model = bf16 if dtype == "bfloat16" else tiny_fp32
    fused, host = DiTPipeline(_config("always"), model), DiTPipeline(_config("never"), model)
    assert fused.stats()["fused_step"]["enabled"] and fused.fused.note.startswith("on: bitwise equal")
    assert host.stats()["fused_step"] == {"enabled": False, "note": "off: runner.fused_step or the family has no "
                                          "fused step", "steps": 0, "host_steps": {}}
    reqs = [_req(n=2, steps=4, seed=1), _req(guidance=3.5, steps=3, seed=2, prompt="a blue sphere"), _req(seed=3, n=1)]
    a = [fused.start(fused.validator.validate(r)) for r in reqs]
    b = [_twin(s) for s in a]
    fused.step(a[:1], fused.decider.for_states(a[:1]))
    host.step(b[:1], host.decider.for_states(b[:1]))  # the first request is one step ahead: later forwards mix steps
    key4, key8 = (BucketKey(k, 256, T) for k in (4, 8))
    split = StepForwards((Chunk(key4, 4, 0.0), Chunk(key4, 1, 0.0)), home=key8)  # 2 + 2 | 1 rows: pairs intact
    while not all(s.done for s in a):
        live = [i for i, s in enumerate(a) if not s.done]
        fa, hb = [a[i] for i in live], [b[i] for i in live]
        split_now = sum(s.rows for s in fa) == 5
        fused.step(fa, split if split_now else fused.decider.for_states(fa))
        host.step(hb, split if split_now else host.decider.for_states(hb))
        for i in live:
            assert torch.equal(a[i].latents, b[i].latents) and a[i].step_index == b[i].step_index
            assert a[i].scheduler.step_index == b[i].scheduler.step_index
    assert fused.fused.steps >= 3 and not fused.fused.host_steps
    assert host.fused.steps == 0


def test_a_split_that_parts_an_image_from_its_uncond_row_runs_on_the_host(tiny_fp32):
    pipe = DiTPipeline(_config("always"), tiny_fp32)
    state = pipe.start(pipe.validator.validate(_req(n=3, guidance=2.0)))  # rows c0 c1 c2 u0 | u1 u2
    twin = _twin(state)
    key4, key8 = BucketKey(4, 256, T), BucketKey(8, 256, T)
    plan = StepForwards((Chunk(key4, 4, 0.0), Chunk(BucketKey(2, 256, T), 2, 0.0)), home=key8)
    pipe.step([state], plan)
    pipe.step([twin], plan, fused=False)
    assert pipe.fused.host_steps == {"cfg_pair_split": 1} and pipe.fused.steps == 0
    assert torch.equal(state.latents, twin.latents)
    pipe.step([state], StepForwards((Chunk(key4, 4, 0.0), Chunk(None, 2, 0.0)), home=key8))
    assert pipe.fused.host_steps["no_fused_graph"] == 1  # an unpadded eager chunk
    with pytest.raises(ValueError, match="cannot run fused: cfg_pair_split"):  # forced, as check_fused forces it
        pipe.step([state], plan, fused=True)
    assert pipe.fused.host_steps == {"cfg_pair_split": 1, "no_fused_graph": 1} and pipe.fused.steps == 0


def test_a_scheduler_the_fused_update_does_not_cover_runs_on_the_host(tiny_fp32):
    pipe = DiTPipeline(_config("always"), tiny_fp32)
    state = pipe.start(pipe.validator.validate(_req()))
    state.scheduler.register_to_config(stochastic_sampling=True)  # this request's own scheduler copy
    pipe.step([state], pipe.decider.for_states([state]))
    assert pipe.fused.host_steps == {"scheduler": 1}


def test_a_fused_step_that_differs_by_one_rounding_is_turned_off_and_serving_goes_on(bf16, monkeypatch):
    """``dt`` kept at fp32 instead of cast to bf16 (the rounding diffusers' 0-dim ``dt`` gets) changes the
    latents in the last bit: the start-up check finds it and the fused step stays off."""
    def unrounded(output, latents, meta, dt):
        shape = (-1,) + (1,) * (output.ndim - 1)
        c = output.index_select(0, meta[0].long())
        x = latents.index_select(0, meta[0].long())
        return (x.float() + (dt.view(shape) * c.float()).to(output.dtype).float()).to(output.dtype)

    monkeypatch.setattr(fused_mod, "fused_update", unrounded)
    pipe = DiTPipeline(_config("always"), bf16)
    info = pipe.stats()["fused_step"]
    assert not info["enabled"] and info["note"].startswith("off: the fused step differs from the host step")
    result = pipe.generate(pipe.validator.validate(_req(seed=5)))
    monkeypatch.undo()
    host = DiTPipeline(_config("never"), bf16)
    reference = host.generate(host.validator.validate(_req(seed=5)))
    assert result.image_bytes == reference.image_bytes and pipe.fused.steps == 0


def test_the_step_scheduler_serves_fused_steps_with_the_host_paths_images(tiny_fp32):
    """A burst through the step scheduler with the fused step on: the same PNG bytes as with it off (every
    request submitted alone, so each run's forwards are the same)."""
    reqs = [_req(n=2, seed=7), _req(guidance=4.0, seed=8, steps=2)]

    async def serve(pipe):
        sched = ValidatingScheduler(pipe)
        try:
            return [await sched.submit(r) for r in reqs], sched.stats()
        finally:
            sched.close()

    fused_pipe = DiTPipeline(_config("always"), tiny_fp32)
    on, stats = asyncio.run(asyncio.wait_for(serve(fused_pipe), 120))
    off, _ = asyncio.run(asyncio.wait_for(serve(DiTPipeline(_config("never"), tiny_fp32)), 120))
    assert [r.image_bytes for r in on] == [r.image_bytes for r in off]
    assert fused_pipe.fused.steps == 3 + 2 and fused_pipe.stats()["fused_step"]["steps"] == 5
    assert sum(s["completed"] for s in stats["shapes"].values()) == 2


def test_sd3_fused_step_uncond_rows_first_equals_diffusers(tmp_path):
    """SD3 puts the uncond rows first: fused, its images still equal ``StableDiffusion3Pipeline``'s."""
    folder = build_sd3(tmp_path / "sd3", variant="sd3")
    buckets = dict(batch_sizes=[1, 2, 4], resolutions=["64x64"], text_lengths=[333])
    pipe = bcg_pipeline(folder, buckets, fused_step="always")
    assert pipe.fused.on, pipe.fused.note
    for request in (GenerationRequest("a cat", n=1, width=64, height=64, num_inference_steps=3, guidance_scale=5.0,
                                      negative_prompt="blurry", seed=3),
                    GenerationRequest("a dog", n=2, width=64, height=64, num_inference_steps=2, guidance_scale=1.0,
                                      seed=4)):
        before = pipe.fused.steps
        ours = bcg_run(pipe, request)
        assert pipe.fused.steps == before + request.num_inference_steps
        ref = diffusers_run(StableDiffusion3Pipeline, folder, request)
        if request.n == 1:
            assert_same(ours, ref, exact=True)
        else:
            assert_same(ours, ref)
