"""Wan 2.2's two experts: bcg-serve gives what diffusers' ``WanPipeline`` gives on a checkpoint with ``transformer``
(high noise), ``transformer_2`` (low noise) and ``boundary_ratio``.

Tiny random-weight checkpoint in Wan 2.2 A14B's layout (``tests/tiny/wan.py`` with ``boundary_ratio`` 0.875: at 4
steps the timesteps 999, 900 run ``transformer`` and 750, 500 ``transformer_2``). Final latents (``output_type=
"latent"``), fp32: a video alone without CFG bit for bit, each step on its expert's runner; a CFG video with its own
``guidance_scale_2`` within 1e-5; two videos through the step scheduler, the second joining a step later, so that one
step has one row on each expert (stepped apart) and every row's video equals its own diffusers run within 1e-5, with
each expert's runner running exactly its own steps' bucket forwards. Also: ``guidance_scale_2``'s refusals, and the
checkpoint layouts refused at describe.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from diffusers import WanPipeline

from bcg_core import EngineConfig, GenerationRequest
from bcg_core.errors import RequestError
from closeness import RTOL
from reference_gate import bcg_pipeline, bcg_state
from tiny.wan import build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["48x32"], text_lengths=[512], frames=[5])
RATIO = 0.875


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("wan22"), boundary_ratio=RATIO)


@pytest.fixture(scope="module")
def pipe(folder):
    return bcg_pipeline(folder, BUCKETS)


@pytest.fixture(scope="module")
def ref(folder):
    p = WanPipeline.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True)
    p.set_progress_bar_config(disable=True)
    return p


def _req(**kw) -> GenerationRequest:
    base = dict(prompt="a photo of a cat", n=1, width=48, height=32, num_frames=5, num_inference_steps=4, seed=11)
    return GenerationRequest(**{**base, **kw})


def _latents(ref, r: GenerationRequest, **kw) -> torch.Tensor:
    """``WanPipeline`` itself on ``r``, ``output_type="latent"`` (``guidance_scale_2`` passed where set)."""
    gens = [torch.Generator("cpu").manual_seed(r.seed + i) for i in range(r.n)]
    args = dict(prompt=r.prompt, height=r.height, width=r.width, num_frames=r.num_frames, num_videos_per_prompt=r.n,
                num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale, generator=gens,
                output_type="latent")
    if r.negative_prompt is not None:
        args["negative_prompt"] = r.negative_prompt
    if r.guidance_scale_2 is not None:
        args["guidance_scale_2"] = r.guidance_scale_2
    with torch.inference_mode():
        return ref(**{**args, **kw}).frames


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _forwards(runner) -> dict[str, int]:
    return {str(k): e.forwards for k, e in runner.entries.items() if e.forwards}


def _reset(pipe) -> None:
    for runner in pipe.runners:
        for entry in runner.entries.values():
            entry.forwards = 0


def test_a_video_alone_runs_each_step_on_its_expert_and_equals_diffusers(pipe, ref):
    fam, spec = pipe.model, pipe.model.spec
    assert spec.boundary_ratio == RATIO and spec.cache_methods == () and len(pipe.runners) == 2
    assert [a.model for a in fam.experts] == [fam.pipe.transformer, fam.pipe.transformer_2]
    assert pipe.runners[1].adapter is fam.experts[1] and fam.boundary == RATIO * 1000
    _reset(pipe)
    r = pipe.validator.validate(_req(guidance_scale=1.0)).request  # no CFG: one row, bit for bit
    assert r.guidance_scale_2 is None
    state = bcg_state(pipe, r)
    assert state.timesteps.tolist() == [999, 900, 750, 500] and state.extras["experts"] == [0, 0, 1, 1]
    assert torch.equal(state.latents, _latents(ref, r))
    assert [_forwards(x) for x in pipe.runners] == [{"b1_i12_t512_g2x2x3": 2}] * 2  # two steps on each expert

    cfg = pipe.validator.validate(_req(guidance_scale=4.0, guidance_scale_2=2.0, negative_prompt="blurry",
                                       seed=5)).request
    theirs = _latents(ref, cfg)
    assert _rel(bcg_state(pipe, cfg).latents, theirs) < RTOL
    # the gate can fail: the low-noise expert's scale, and that expert itself, move the result
    assert _rel(_latents(ref, cfg, guidance_scale_2=4.0), theirs) > 1e-3
    one = WanPipeline(tokenizer=ref.tokenizer, text_encoder=ref.text_encoder, vae=ref.vae, scheduler=ref.scheduler,
                      transformer=ref.transformer, transformer_2=ref.transformer, boundary_ratio=RATIO)
    one.set_progress_bar_config(disable=True)
    assert _rel(_latents(one, cfg), theirs) > 1e-3


def test_two_videos_at_different_experts_in_one_step_each_equal_their_own_diffusers_run(pipe, ref):
    """The replica's path (``StepScheduler``): video b is queued after video a's first step, so at the third iteration a
    is at t = 750 (``transformer_2``) and b at t = 900 (``transformer``): their rows run apart, each on its expert's
    runner, and each video equals its own diffusers run."""
    from bcg_core.scheduler import StepScheduler

    a = pipe.validator.validate(_req(guidance_scale=4.0, guidance_scale_2=2.5, negative_prompt="blurry", seed=5))
    b = pipe.validator.validate(_req(prompt="a lighthouse at dusk", guidance_scale=1.0, seed=40))
    sched = StepScheduler(pipe, max_rows=8, trim_idle_s=None, decode_batch_images=8)
    fam, finals = pipe.model, {}
    decode = fam.decode
    fam.decode = lambda state: finals.__setitem__(state.request.seed, state.latents.clone()) or decode(state)
    _reset(pipe)

    async def both():
        loop, tasks = asyncio.get_running_loop(), []

        def after_a_step(progress):  # on the denoising thread: queue b before the next iteration admits
            if progress.step == 1:
                loop.call_soon_threadsafe(lambda: tasks.append(asyncio.ensure_future(sched.submit(b))))
                deadline = time.monotonic() + 10
                while not sched.flight.admission.waiting and time.monotonic() < deadline:
                    time.sleep(0.001)

        first = asyncio.ensure_future(sched.submit(a, on_step=after_a_step))
        while not tasks:
            await asyncio.sleep(0.01)
        return await asyncio.wait_for(asyncio.gather(first, tasks[0]), 60)

    try:
        asyncio.run(both())
        stats = sched.stats()
    finally:
        sched.close()
        del fam.decode
    assert stats["expert_splits"] == 1
    # a: 999 900 | 750 500 alone then with b; b: 999 900 | 750 500 a step later (rows: a 2, b 1)
    assert _forwards(pipe.runners[0]) == {"b2_i12_t512_g2x2x3": 1, "b4_i12_t512_g2x2x3": 1, "b1_i12_t512_g2x2x3": 1}
    assert _forwards(pipe.runners[1]) == {"b2_i12_t512_g2x2x3": 1, "b4_i12_t512_g2x2x3": 1, "b1_i12_t512_g2x2x3": 1}
    for v in (a, b):
        assert _rel(finals[v.request.seed], _latents(ref, v.request)) < RTOL, v.request.prompt


def test_guidance_scale_2_is_refused_where_it_would_do_nothing_and_out_of_range(pipe, tmp_path):
    assert pipe.validator.validate(_req(guidance_scale=3.0)).request.guidance_scale_2 == 3.0  # diffusers' default
    for kw, why in ((dict(guidance_scale=4.0, guidance_scale_2=-1.0), "out of range"),
                    (dict(guidance_scale=4.0, guidance_scale_2=float("nan")), "out of range"),
                    (dict(guidance_scale=4.0, guidance_scale_2=True), "out of range"),
                    (dict(guidance_scale=1.0, guidance_scale_2=3.0), "runs no classifier-free guidance")):
        with pytest.raises(RequestError, match=why) as e:
            pipe.validator.validate(_req(**kw))
        assert e.value.field == "guidance_scale_2" and "allowed: a number from 0 to" in str(e.value)
    with pytest.raises(RequestError, match="step cache") as e:
        pipe.validator.validate(_req(cache={"method": "first_block", "threshold": 0.1}))
    assert e.value.field == "cache"


def test_wan_2_1_refuses_guidance_scale_2_and_inconsistent_layouts_are_refused_at_describe(folder, tmp_path):
    """A Wan 2.1 checkpoint refuses ``guidance_scale_2`` (diffusers raises there too); ``transformer_2`` without
    ``boundary_ratio`` (diffusers would never run it), experts of different widths and TI2V's ``expand_timesteps``
    are refused before any weight loads, naming why."""
    import shutil

    from bcg_core.config import ModelConfig
    from bcg_core.models import CheckpointError, describe_model
    from bcg_core.validation import RequestValidator

    spec = describe_model(ModelConfig(path=str(folder)))
    index = json.loads((folder / "model_index.json").read_text())
    wan21 = tmp_path / "wan21"
    shutil.copytree(folder, wan21)
    (wan21 / "model_index.json").write_text(json.dumps({**index, "transformer_2": [None, None],
                                                        "boundary_ratio": None}))
    cfg = EngineConfig(model=ModelConfig(path=str(wan21)), buckets=BUCKETS, limits={"min_side_px": 16})
    one = RequestValidator.from_config(cfg)
    assert one.spec.boundary_ratio is None and spec.boundary_ratio == RATIO
    with pytest.raises(RequestError, match="one transformer") as e:
        one.validate(_req(guidance_scale=4.0, guidance_scale_2=2.0))
    assert e.value.field == "guidance_scale_2"
    from router.ownership import demands_for_config

    graphs = [{s: d.graph_bytes for s, d in demands_for_config(c).items()}
              for c in (cfg, cfg.model_copy(update={"model": ModelConfig(path=str(folder))}))]
    assert graphs[1] == {s: 2 * b for s, b in graphs[0].items()} and graphs[0]  # a pool per expert
    cases = [({"boundary_ratio": None}, "transformer_2 set with boundary_ratio None"),
             ({"boundary_ratio": 1.5}, "boundary_ratio 1.5"),
             ({"expand_timesteps": True}, "expand_timesteps")]
    for change, why in cases:
        (wan21 / "model_index.json").write_text(json.dumps({**index, **change}))
        with pytest.raises((ValueError, CheckpointError), match=why):
            describe_model(ModelConfig(path=str(wan21)))
    (wan21 / "model_index.json").write_text(json.dumps(index))
    tr2 = json.loads((wan21 / "transformer_2" / "config.json").read_text())
    (wan21 / "transformer_2" / "config.json").write_text(json.dumps({**tr2, "num_attention_heads": 4}))
    with pytest.raises((ValueError, CheckpointError), match="differ in num_attention_heads"):
        describe_model(ModelConfig(path=str(wan21)))


def test_bcg_verify_checks_each_experts_runner(pipe):
    """``bcg verify`` on the two-expert checkpoint: every bucket of each expert's runner, padded against its own
    transformer's unpadded forward."""
    import io

    from rich.console import Console

    from deployments.cli.commands import run_verify

    out = io.StringIO()
    assert run_verify(pipe.config, console=Console(file=out, width=200), progress=io.StringIO())
    text = out.getvalue()
    assert "b4_i12_t512_g2x2x3 (transformer_2)" in text and "6 of 6 buckets passed (2 experts' runners)" in text
