"""Wan reference gate: bcg-serve gives what diffusers' ``WanPipeline`` gives from the same folder, request and seed.

Tiny random-weight Wan 2.1 checkpoint in the real layout (``tests/tiny/wan.py``: UMT5 encoder,
``WanTransformer3DModel``, ``AutoencoderKLWan``, UniPC with Wan's flow shift). Final latents (``output_type="latent"``)
within 1e-5 relative, fp32: a video alone at an exact bucket (bit-identical, and its frames equal diffusers' own
``output_type="pil"`` frames), and a video with CFG and a negative prompt sharing each step's forward with another
request of another prompt and seed that joined a step later, in one bucket with a pad row (its decoded frames equal
diffusers' decode of those latents). Also: the padded bucket forward against the unpadded one at every boundary, the
prompt limit, bf16 against diffusers' bf16, the engine's CPU entry (``DiTPipeline.generate``) and the step scheduler
returning frames, and a config without buckets (the family's table) in ``bcg config --check``, ``bcg plan`` and the
router. Wan 2.2's two experts: ``tests/families/test_wan_experts.py``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from bcg_core import BucketConfig, BucketMetrics, BucketTable, EagerBucketRunner, GenerationRequest, LimitsConfig
from bcg_core.errors import RequestError
from bcg_core.families import family_class
from bcg_core.families.wan import WanAdapter, WanFamily
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases
from closeness import RTOL
from reference_gate import bcg_pipeline, bcg_state
from tiny.wan import build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["48x32"], text_lengths=[512], frames=[5])
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("wan"))


@pytest.fixture(scope="module")
def pipe(folder):
    return bcg_pipeline(folder, BUCKETS)


@pytest.fixture(scope="module")
def ref(folder):
    p = WanPipeline.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True)
    p.set_progress_bar_config(disable=True)
    return p


def _req(**kw) -> GenerationRequest:
    base = dict(prompt="a photo of a cat", n=1, width=48, height=32, num_frames=5, num_inference_steps=3, seed=11)
    return GenerationRequest(**{**base, **kw})


def _call(ref, r: GenerationRequest, output_type: str):
    """``WanPipeline`` itself on ``r`` (one CPU generator per video, seeded ``seed + i``)."""
    gens = [torch.Generator("cpu").manual_seed(r.seed + i) for i in range(r.n)]
    kw = {} if r.negative_prompt is None else {"negative_prompt": r.negative_prompt}
    with torch.inference_mode():
        return ref(prompt=r.prompt, height=r.height, width=r.width, num_frames=r.num_frames, num_videos_per_prompt=r.n,
                   num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale, generator=gens,
                   output_type=output_type, **kw).frames


def _pil_frames(videos) -> list[np.ndarray]:
    """diffusers' ``output_type="pil"`` videos (lists of PIL frames) as (frames, H, W, 3) uint8 arrays."""
    return [np.stack([np.asarray(f) for f in video]) for video in videos]


def _decode_as_diffusers(ref, latents: torch.Tensor) -> list[np.ndarray]:
    """``WanPipeline.__call__``'s decode of ``latents`` (P:626-640), to PIL frames."""
    vae = ref.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    with torch.inference_mode():
        video = vae.decode(latents / std + mean, return_dict=False)[0]
    return _pil_frames(ref.video_processor.postprocess_video(video, output_type="pil"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_the_checkpoint_loads_as_the_wan_family_with_the_pipelines_defaults(pipe):
    fam, spec = pipe.model, pipe.model.spec
    assert family_class(spec.pipeline_class) is WanFamily and isinstance(fam.adapter, WanAdapter)
    assert (spec.default_steps, spec.default_guidance_scale, spec.default_size, spec.default_frames) == (
        50, 5.0, (832, 480), 81)
    assert spec.video and spec.rules.frame_stride == 4 and spec.rules.native_text_tokens == 512
    assert spec.rules.pixels_per_token == 16 and spec.max_prompt_tokens == 512
    assert spec.default_buckets == dict(batch_sizes=[1, 2], resolutions=["832x480"], text_lengths=[512], frames=[81])
    v = pipe.validator.validate(_req(num_frames=None, guidance_scale=None))
    assert (v.request.num_frames, v.request.guidance_scale, v.rows) == (81, 5.0, 2)  # CFG above 1: two rows
    assert v.grid == (21, 2, 3) and not v.lookup.hit  # 81 frames are no tier of this table


def test_a_video_alone_at_an_exact_bucket_equals_diffusers_bit_for_bit(pipe, ref):
    r = pipe.validator.validate(_req(guidance_scale=1.0)).request  # no CFG: one row, bucket b1
    v = pipe.validator.validate(r)
    assert str(v.key) == "b1_i12_t512_g2x2x3" and v.grid == (2, 2, 3)
    state = bcg_state(pipe, r)
    theirs = _call(ref, r, "latent")
    assert theirs.shape == (1, 16, 2, 4, 6) and torch.equal(state.latents, theirs)
    ours = pipe.finish_videos(state)
    want = _pil_frames(_call(ref, r, "pil"))
    assert len(ours) == 1 and ours[0].shape == (5, 32, 48, 3) and ours[0].dtype == np.uint8
    assert np.array_equal(ours[0], want[0])


def test_cfg_with_a_negative_prompt_beside_another_request_in_a_padded_bucket_equals_diffusers(pipe, ref):
    a = pipe.validator.validate(_req(guidance_scale=4.0, negative_prompt="blurry, low quality", seed=5,
                                     num_inference_steps=2)).request
    b = pipe.validator.validate(_req(prompt="a watercolor painting of a lighthouse at dusk", guidance_scale=1.0,
                                     seed=40)).request
    va, vb = pipe.validator.validate(a), pipe.validator.validate(b)
    sb = pipe.start(vb)
    pipe.step([sb], pipe.decider.for_states([sb]))  # b runs one step alone, then a joins it
    sa = pipe.start(va)
    keys = []
    while not (sa.done and sb.done):
        live = [s for s in (sa, sb) if not s.done]
        forwards = pipe.decider.for_states(live)
        keys.append((sum(s.rows for s in live), [str(c.key) for c in forwards.chunks]))
        pipe.step(live, forwards)
    assert keys[0] == (3, ["b4_i12_t512_g2x2x3"])  # a's cond and uncond rows, b's row and one pad row
    theirs = {}
    for state, r in ((sa, a), (sb, b)):
        theirs[r.seed] = _call(ref, r, "latent")
        assert _rel(state.latents, theirs[r.seed]) < RTOL, r.prompt
        ours = pipe.finish_videos(state)
        assert np.array_equal(ours[0], _decode_as_diffusers(ref, state.latents)[0])
    plain = _call(ref, replace(a, negative_prompt=None), "latent")  # the negative prompt matters: the gate can fail
    assert _rel(plain, theirs[a.seed]) > 1e-3


def test_two_videos_of_one_request_through_the_engines_cpu_entry(pipe, ref):
    """``DiTPipeline.generate``: the result carries the frames (``videos``), no image files; video i from seed + i."""
    r = pipe.validator.validate(_req(n=2, guidance_scale=1.0, seed=3))
    result = pipe.generate(r)
    assert result.image_bytes == [] and len(result.videos) == 2 and str(result.bucket) == "b2_i12_t512_g2x2x3"
    want = _pil_frames(_call(ref, r.request, "pil"))
    assert [v.shape for v in result.videos] == [(5, 32, 48, 3)] * 2
    for ours, theirs in zip(result.videos, want, strict=True):
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1  # a batch of 2: reduction order may differ
    assert not np.array_equal(result.videos[0], result.videos[1])
    with pytest.raises(TypeError, match="finish_videos"):
        pipe.finish(pipe.start(r))


def test_videos_through_the_step_scheduler_come_back_as_frames(pipe, ref):
    """The replica's path (``StepScheduler.submit``): two requests share steps, each result carries its frames from the
    decode thread (no image encoding), equal to diffusers' to one level; ``decode_batch_images`` counts a video's
    frames, so videos are decoded apart."""
    import asyncio

    from bcg_core.scheduler import StepScheduler

    reqs = [pipe.validator.validate(_req(guidance_scale=1.0, seed=s, num_inference_steps=2)) for s in (7, 8)]
    sched = StepScheduler(pipe, max_rows=4, trim_idle_s=None, decode_batch_images=8)
    vae, batches = pipe.model.vae, []
    decode = vae.decode
    vae.decode = lambda z, **kw: batches.append(z.shape[0]) or decode(z, **kw)

    async def both():
        return await asyncio.wait_for(asyncio.gather(*(sched.submit(v) for v in reqs)), 60)

    try:
        results = asyncio.run(both())
    finally:
        sched.close()
        vae.decode = decode
    assert batches == [1, 1]  # 5 frames each: two videos are 10 images, above decode_batch_images 8
    for v, result in zip(reqs, results, strict=True):
        assert result.image_bytes == [] and len(result.videos) == 1 and result.videos[0].shape == (5, 32, 48, 3)
        theirs = _pil_frames(_call(ref, v.request, "pil"))[0]
        assert np.abs(result.videos[0].astype(int) - theirs.astype(int)).max() <= 1


def test_bf16_cfg_rows_and_pad_rows_are_within_diffusers_own_batch_deviation(folder):
    """bf16, as users run it: a CFG video (cond and uncond rows in one forward, where diffusers runs two) and three
    videos padded to a 4-row bucket, against diffusers' bf16 ``WanPipeline``; bit-identical where diffusers' own
    result does not move when it batches (``num_videos_per_prompt`` 2 against 1), else within twice that move
    (``tests/reference_gate_bf16.py``'s rule)."""
    ours = bcg_pipeline(folder, BUCKETS, dtype="bfloat16")
    ref = WanPipeline.from_pretrained(str(folder), torch_dtype=torch.bfloat16, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    assert ours.model.adapter.model.dtype == torch.bfloat16
    cfg = ours.validator.validate(_req(guidance_scale=4.0, negative_prompt="blurry", num_inference_steps=2)).request
    padded = ours.validator.validate(_req(n=3, guidance_scale=1.0, num_inference_steps=2)).request
    assert str(ours.validator.validate(padded).key) == "b4_i12_t512_g2x2x3"
    for r in (cfg, padded):
        alone = _call(ref, replace(r, n=1), "latent")
        batched = _call(ref, replace(r, n=max(2, r.n)), "latent")
        theirs = alone if r.n == 1 else batched
        own = _rel(batched[:1], alone)  # diffusers' own move when it batches
        got = bcg_state(ours, r).latents
        assert torch.equal(got, theirs) if own == 0.0 else _rel(got, theirs) <= 2 * own, (r.n, own)


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(pipe):
    adapter = pipe.model.adapter
    table = BucketTable(BucketConfig(**BUCKETS), adapter.rules)
    runner = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    runner.prepare()
    cases = boundary_cases(table, LimitsConfig(min_side_px=16, max_side_px=64))
    assert {c.key for c in cases} == set(table.keys) and {c.grid for c in cases} == {(2, 2, 3)}
    verdicts = verify_runner(adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_token_counts_are_what_the_encoder_reads_and_longer_prompts_are_refused(pipe, folder):
    fam = pipe.model
    seen = []
    hook = fam.pipe.text_encoder.register_forward_pre_hook(lambda m, args: seen.append(int(args[1].sum())))
    ingress = WanFamily.token_counter(folder, {"_class_name": "WanPipeline"})
    try:
        for prompt in ["a photo of a cat", "  spaced   out  ", "an astronaut &amp; a horse"]:
            fam.encode(prompt)
            assert fam.count_tokens(prompt) == ingress(prompt) == seen[-1], prompt
    finally:
        hook.remove()
    long = " ".join(["a watercolor painting of a lighthouse"] * 90)
    assert fam.count_tokens(long) > 512
    with pytest.raises(RequestError, match="at most 512 tokens") as e:
        pipe.validator.validate(_req(prompt=long))
    assert e.value.field == "prompt"
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(true_cfg_scale=2.0))
    assert e.value.field == "true_cfg_scale"


def test_a_config_without_buckets_gets_the_family_table_in_config_check_plan_and_routing(folder, tmp_path, capsys):
    """``bcg config --check``, ``bcg plan`` and the router's demands on a Wan config without a ``buckets`` section:
    the family's table (832x480 at 81 frames), and a plan at those frames."""
    from deployments.cli.local import check_config
    from deployments.cli.main import main
    from router.ownership import demands_for_config

    config = tmp_path / "wan.yaml"
    config.write_text(f"model: {{path: {folder}, device: cpu}}\nlimits: {{min_side_px: 32}}\n")
    checked = check_config(config)
    assert (checked.buckets.resolutions, checked.buckets.frames, checked.buckets.batch_sizes) == (
        ["832x480"], [81], [1, 2])
    assert set(demands_for_config(checked)) == {"i32760_t512_g21x30x52"}
    krea = tmp_path / "krea.csv"
    krea.write_text("prompt,width,height,num_step,num_generations\na red cube,64,64,4,1\na cat,32,32,4,1\n"
                    "a lighthouse at dusk,64,64,4,1\n")
    report = tmp_path / "plan.json"
    assert main(["plan", "--config", str(config), "--krea", str(krea), "--max-graphs", "2", "--json",
                 str(report)]) in (0, 1)
    import json

    plan = json.loads(report.read_text())
    assert plan["buckets"]["frames"] == [81] and "64x64" in plan["buckets"]["resolutions"]
    assert plan["shapes"] and set(plan["shapes"]) <= {"i336_t512_g21x4x4", "i84_t512_g21x2x2", "miss"}


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """A 3-block tiny Wan (head, middle and tail blocks, as a step cache needs): its pipeline and diffusers'."""
    folder = build(tmp_path_factory.mktemp("wan-cache"), layers=3)
    ref = WanPipeline.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    return bcg_pipeline(folder, BUCKETS), ref


@pytest.mark.parametrize("cache,guidance", [("first_block", 1.0), ("taylor_seer", 4.0)])
def test_the_step_cache_computes_the_steps_diffusers_computes(cached, cache, guidance):
    """diffusers' First Block Cache and TaylorSeer on ``WanTransformer3DModel`` (a ``CacheMixin``): the same steps
    computed as ``transformer.enable_cache`` in ``WanPipeline``, its cond and uncond rows deciding apart as the
    pipeline's two cache contexts, and the same final latents (alone without CFG: bit for bit; CFG rows in one
    forward: within 1e-5)."""
    from bcg_core.step_cache import FirstBlockCache, TaylorSeerCache, request_cache, to_diffusers

    pipe, ref = cached
    spec = (FirstBlockCache(threshold=0.1) if cache == "first_block"
            else TaylorSeerCache(cache_interval=3, disable_cache_before_step=2, taylor_factors_dtype="float32"))
    r = pipe.validator.validate(_req(num_inference_steps=10, guidance_scale=guidance, cache=spec,
                                     negative_prompt="blurry" if guidance > 1 else None)).request
    state = bcg_state(pipe, r)
    computed = {k: v["computed"] for k, v in request_cache(state).describe()["steps"].items()}
    calls = [0]
    hook = ref.transformer.blocks[-1].ffn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ref.transformer.enable_cache(to_diffusers(spec))
    try:
        theirs = _call(ref, replace(r, cache=None), "latent")
    finally:
        ref.transformer.disable_cache()
        hook.remove()
    assert set(computed) == ({"cond", "uncond"} if guidance > 1 else {"cond"})
    assert sum(computed.values()) == calls[0] < 10 * len(computed)  # steps reused, as many as diffusers reuses
    assert torch.equal(state.latents, theirs) if guidance <= 1 else _rel(state.latents, theirs) < RTOL
