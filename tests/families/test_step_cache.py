"""The step cache's gate: the same steps computed and the same latents as diffusers' own First Block Cache.

For each request, diffusers' pipeline runs on the same tiny checkpoint with ``transformer.enable_cache(
FirstBlockCacheConfig(threshold))`` (``bcg_core.step_cache.to_diffusers``), and bcg-serve serves the request with
``cache={"method": "first_block", "threshold": ...}`` through :class:`~bcg_core.DiTPipeline` on padded buckets
(``reference_gate.bcg_pipeline``). The gate: final latents within 1e-5 relative (fp32, CPU), and the same number of
steps whose remaining blocks ran. diffusers' count is the number of forwards of the last block's ``proj_out`` (the
skipped blocks' layers never run); bcg-serve's is the request's ``bcg.cache`` report
(:meth:`~bcg_core.step_cache.RequestCache.describe`).

Cases: FLUX.1 (2 double and 2 single blocks, so blocks sit between the first and the last) alone at thresholds from
all computed to nearly all reused; true CFG, whose cond and uncond rows decide apart as FluxPipeline's two cache
contexts; three requests with different caches (one without) sharing every step's forwards, one of them started
steps earlier, each equal to its own diffusers run; Qwen-Image alone; and the contexts dropped with the request.

FLUX.2 (``tests/tiny/flux2.py``): diffusers 0.42.1 runs TaylorSeer on [klein] only. [klein] (2 double and 2 single
blocks) with TaylorSeer alone at an exact bucket is bit-identical to diffusers (three configs); its CFG rows decide as
the pipeline's ``cond`` and ``uncond`` contexts; requests with different caches (one without) share steps; a reference
edit's prediction covers the reference tokens; bf16 with CFG at an exact bucket gives diffusers' bf16 bits. First
Block Cache on FLUX.2 and any cache on [dev] are refused, and diffusers' own failures there are checked.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import Flux2KleinPipeline, FluxPipeline, QwenImagePipeline

from bcg_core import GenerationRequest
from bcg_core.step_cache import FirstBlockCache, NoCache, TaylorSeerCache, request_cache, to_diffusers
from reference_gate import GateRun, assert_same, bcg_pipeline, diffusers_run
from tiny import flux as tiny_flux, flux2 as tiny_flux2, qwenimage as tiny_qwen

FLUX_BUCKETS = {"resolutions": ["64x64"], "batch_sizes": [1, 2, 4, 8], "text_lengths": [tiny_flux.TEXT_TOKENS]}
QWEN_BUCKETS = {"batch_sizes": [1, 2, 4], "resolutions": ["64x64"], "text_lengths": [16, 32]}
STEPS = 12


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory) -> Path:
    return tiny_flux.build(tmp_path_factory.mktemp("flux-cache") / "tiny-flux", "dev", layers=(2, 2))


@pytest.fixture(scope="module")
def flux_pipe(flux_folder):
    return bcg_pipeline(flux_folder, FLUX_BUCKETS)


def _diffusers_cached(pipeline_cls, folder, request: GenerationRequest, last_block, **kwargs) -> tuple[GateRun, int]:
    """diffusers' run of ``request`` with its cache enabled on the transformer; ``(run, steps computed)`` (one
    pipeline call's forwards of the last block's ``proj_out``: its contexts' computed steps summed)."""
    calls: list[int] = [0]

    def setup(pipe):
        if isinstance(request.cache, FirstBlockCache | TaylorSeerCache):
            pipe.transformer.enable_cache(to_diffusers(request.cache))
        last_block(pipe.transformer).register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    run = diffusers_run(pipeline_cls, folder, replace(request, cache=None), setup=setup, **kwargs)
    assert calls[0] % 2 == 0  # diffusers_run calls the pipeline twice (latents, then images)
    return run, calls[0] // 2


def _flux_last(transformer):
    return transformer.single_transformer_blocks[-1].proj_out


def _computed(state) -> int:
    cache = request_cache(state)
    return sum(c["computed"] for c in cache.describe()["steps"].values())


def _serve(pipe, requests: list[GenerationRequest], head_start: dict[int, int] | None = None) -> list:
    """Serve ``requests`` sharing every step (request ``i`` joins after ``head_start[i]`` steps of the first);
    their finished states."""
    head_start = head_start or {}
    states = [None] * len(requests)
    steps = 0
    while True:
        for i, r in enumerate(requests):
            if states[i] is None and steps >= head_start.get(i, 0):
                states[i] = pipe.start(pipe.validator.validate(r))
        live = [s for s in states if s is not None and not s.done]
        if not live and all(s is not None for s in states):
            return states
        pipe.step(live, pipe.decider.for_states(live))
        steps += 1


def _flux_request(threshold, **kw) -> GenerationRequest:
    """A FLUX.1 request; ``threshold``: a First Block Cache threshold, a cache spec, or None (no cache)."""
    fields = dict(prompt="a red fox in the snow", n=1, width=64, height=64, num_inference_steps=STEPS, seed=3,
                  guidance_scale=3.5)
    fields.update(kw)
    cache = (NoCache() if threshold is None else threshold if not isinstance(threshold, float | int)
             else FirstBlockCache(threshold=threshold))
    return GenerationRequest(**fields, cache=cache)


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.6, 2.0])
def test_flux_alone_computes_the_steps_diffusers_computes(flux_folder, flux_pipe, threshold):
    request = _flux_request(threshold)
    ref, ref_computed = _diffusers_cached(FluxPipeline, flux_folder, request, _flux_last,
                                          max_sequence_length=tiny_flux.TEXT_TOKENS)
    (state,) = _serve(flux_pipe, [request])
    assert _computed(state) == ref_computed
    assert_same(GateRun(state.latents.float().cpu(), flux_pipe.finish(state)), ref)
    if threshold >= 0.6:
        assert ref_computed < STEPS  # the case reuses steps
    if threshold == 0.05:
        assert ref_computed == STEPS


def test_flux_true_cfg_decides_cond_and_uncond_apart(flux_folder, flux_pipe):
    request = _flux_request(0.5, n=2, negative_prompt="blurry, dark", true_cfg_scale=2.0)
    ref, ref_computed = _diffusers_cached(FluxPipeline, flux_folder, request, _flux_last,
                                          max_sequence_length=tiny_flux.TEXT_TOKENS)
    (state,) = _serve(flux_pipe, [request])
    steps = request_cache(state).describe()["steps"]
    assert set(steps) == {"cond", "uncond"}
    assert all(s["computed"] + s["reused"] == STEPS for s in steps.values())
    assert _computed(state) == ref_computed
    assert ref_computed < 2 * STEPS
    assert_same(GateRun(state.latents.float().cpu(), flux_pipe.finish(state)), ref)


def test_requests_with_different_caches_share_steps_and_each_equals_its_own_run(flux_folder, flux_pipe):
    requests = [_flux_request(0.5, n=2, seed=11, prompt="a lighthouse at dusk"),
                _flux_request(2.0, seed=5, prompt="a bowl of ramen"),
                _flux_request(None, seed=7, prompt="a paper boat")]
    states = _serve(flux_pipe, requests, head_start={1: 0, 0: 3, 2: 5})
    for request, state in zip(requests, states, strict=True):
        ref, ref_computed = _diffusers_cached(FluxPipeline, flux_folder, request, _flux_last,
                                              max_sequence_length=tiny_flux.TEXT_TOKENS)
        if isinstance(request.cache, FirstBlockCache):
            assert _computed(state) == ref_computed
        else:
            assert request_cache(state) is None and ref_computed == STEPS
        assert_same(GateRun(state.latents.float().cpu(), flux_pipe.finish(state)), ref)
    assert _computed(states[1]) < STEPS  # the shared steps mixed rows that reused with rows that computed


def test_qwenimage_alone_computes_the_steps_diffusers_computes(tmp_path):
    folder = tiny_qwen.build(tmp_path / "tiny-qwen-image")
    pipe = bcg_pipeline(folder, QWEN_BUCKETS)
    request = GenerationRequest(prompt="a cat on a windowsill", n=1, width=64, height=64, num_inference_steps=STEPS,
                                seed=2, cache=FirstBlockCache(threshold=0.6))
    ref, ref_computed = _diffusers_cached(QwenImagePipeline, folder, request,
                                          lambda t: t.transformer_blocks[-1].img_mlp)
    (state,) = _serve(pipe, [request])
    assert _computed(state) == ref_computed < STEPS
    assert_same(GateRun(state.latents.float().cpu(), pipe.finish(state)), ref)


def test_a_request_without_cache_has_no_contexts_and_a_cached_one_holds_device_tensors(flux_pipe):
    plain, cached = _serve(flux_pipe, [_flux_request(None), _flux_request(0.6, seed=9)])
    assert request_cache(plain) is None
    cache = request_cache(cached)
    assert cache.nbytes > 0
    cache.free()
    assert cache.nbytes == 0 and all(c.previous is None for c in cache.contexts)


def test_the_split_blocks_run_unchanged_outside_a_phase(flux_folder):
    from bcg_core.step_cache import installed_split

    pipe = bcg_pipeline(flux_folder, FLUX_BUCKETS)  # a model of its own: no split installed yet
    state = pipe.start(pipe.validator.validate(_flux_request(None, seed=4)))
    inputs = pipe.model.model_rows(state)
    with torch.inference_mode():
        before = pipe.model.adapter.forward_eager(inputs)
        split = installed_split(pipe.model.adapter.model)
        after = pipe.model.adapter.forward_eager(inputs)
    assert split is installed_split(pipe.model.adapter.model)  # installed once per transformer
    assert split.names[0] == "transformer_blocks.0" and split.names[-1] == "single_transformer_blocks.1"
    assert torch.equal(before, after)


def test_admission_counts_the_cache_from_the_start_and_the_reserve_is_what_it_holds(flux_pipe):
    from bcg_core.scheduler.admission import tensor_bytes

    plain = flux_pipe.start(flux_pipe.validator.validate(_flux_request(None, seed=1)))
    cached = flux_pipe.start(flux_pipe.validator.validate(_flux_request(0.6, seed=1, n=2, negative_prompt="dark",
                                                                        true_cfg_scale=2.0)))
    cache = request_cache(cached)
    assert cache.nbytes == 0 < cache.reserved_bytes
    assert tensor_bytes(cached) - tensor_bytes(plain) > cache.reserved_bytes  # 4 rows of latents and text too
    flux_pipe.step([cached], flux_pipe.decider.for_states([cached]))  # the first step computes every context
    assert cache.nbytes == cache.reserved_bytes == cache.budget_bytes


@pytest.mark.parametrize("costs", ["buckets", "eager"])
def test_metrics_count_reused_and_computed_rows_per_bucket(flux_folder, costs):
    """Every cached row of every step is counted, under the bucket its step ran on; with ``eager`` costs each step
    runs unpadded (as a CPU's cost model often chooses), counted under the shape's bucket as its forwards are."""
    from bcg_core.costs import CostModel

    pipe = bcg_pipeline(flux_folder, FLUX_BUCKETS)
    if costs == "eager":  # bucket forwards priced far above unpadded ones: every chunk runs unpadded
        shapes = {k.shape for k in pipe.table.keys}
        pipe.decider.set_costs(CostModel({k: 1e6 for k in pipe.table.keys},
                                         {s: {r: 1.0 * r for r in (1, 2, 4, 8)} for s in shapes}), merge=False)
    a, b, c = _serve(pipe, [_flux_request(2.0, n=2, seed=21), _flux_request(None, seed=22),
                            _flux_request(TAYLOR[0], seed=23)])
    snap = pipe.metrics.snapshot()
    rows = [*snap["buckets"], snap["misses"]]
    reused = sum(bk["cache_reused_rows"] for bk in rows)
    computed = sum(bk["cache_computed_rows"] for bk in rows)
    fbc, taylor = request_cache(a).describe()["steps"]["cond"], request_cache(c).describe()["steps"]["cond"]
    assert reused == 2 * fbc["reused"] + taylor["reused"] and fbc["reused"] > 0 and taylor["reused"] > 0
    assert computed == 2 * fbc["computed"] + taylor["computed"]
    assert snap["misses"]["cache_reused_rows"] == 0  # no miss here: every row under a bucket
    modes = {m for bk in snap["buckets"] for m, n in bk["forwards_by_mode"].items() if n}
    assert modes == ({"eager"} if costs == "eager" else {"static_eager"})
    assert request_cache(b) is None


def test_compiled_kernels_installed_after_the_split_go_under_it(flux_folder):
    from bcg_core.runners.kernels import CompiledKernels
    from bcg_core.step_cache import installed_split

    pipe = bcg_pipeline(flux_folder, FLUX_BUCKETS)
    transformer = pipe.model.adapter.model
    (before,) = _serve(pipe, [_flux_request(0.6, seed=31)])  # installs the split
    split = installed_split(transformer)
    given = []

    def compile_fn(fn, **options):
        given.append(fn)
        return fn

    kernels = split.around(lambda: CompiledKernels(transformer, compile_fn=compile_fn, precompile=False))
    assert given and not any(getattr(fn, "bcg_block_split", False) for fn in given)  # the blocks, not the switch
    blocks = [transformer.transformer_blocks[0], transformer.single_transformer_blocks[-1]]
    assert all(getattr(b.forward, "bcg_block_split", False) for b in blocks)
    with kernels.active():
        (after,) = _serve(pipe, [_flux_request(0.6, seed=31)])
    assert request_cache(after).describe() == request_cache(before).describe()
    assert torch.equal(after.latents, before.latents)


TAYLOR = [TaylorSeerCache(), TaylorSeerCache(cache_interval=3, max_order=2, disable_cache_before_step=2),
          TaylorSeerCache(cache_interval=4, disable_cache_before_step=1, disable_cache_after_step=9,
                          taylor_factors_dtype="float32")]
"""TaylorSeer configs: diffusers' defaults, a second order, fp32 factors with a cool-down. Alone at an exact bucket
each is bit-identical to diffusers. Where rows share a forward (CFG rows, other requests) the forward differs from
diffusers' separate calls by ~1e-7 (fp32 reduction order), which can move a factor across a bfloat16 rounding
boundary (diffusers' default ``taylor_factors_dtype``): 4e-4 relative in the final latents was measured (FLUX.2
[klein] with CFG: 1.8e-3). The shared cases therefore keep fp32 factors, where the 1e-5 gate holds."""
TAYLOR_FP32 = [t.model_copy(update={"taylor_factors_dtype": "float32"}) for t in TAYLOR]


@pytest.mark.parametrize("spec", TAYLOR, ids=["defaults", "order2", "fp32-cooldown"])
def test_flux_taylorseer_computes_and_predicts_as_diffusers(flux_folder, flux_pipe, spec):
    request = _flux_request(spec)
    ref, ref_computed = _diffusers_cached(FluxPipeline, flux_folder, request, _flux_last,
                                          max_sequence_length=tiny_flux.TEXT_TOKENS)
    (state,) = _serve(flux_pipe, [request])
    assert _computed(state) == ref_computed == sum(spec.computes(i) for i in range(STEPS)) < STEPS
    assert_same(GateRun(state.latents.float().cpu(), flux_pipe.finish(state)), ref)


def test_taylorseer_first_block_and_plain_requests_share_steps(flux_folder, flux_pipe):
    requests = [_flux_request(TAYLOR_FP32[1], n=2, seed=41, negative_prompt="grey", true_cfg_scale=2.0),
                _flux_request(0.6, seed=42, prompt="a glass of water"),
                _flux_request(None, seed=43, prompt="a kite"),
                _flux_request(TAYLOR_FP32[0], seed=44, prompt="an old map")]
    states = _serve(flux_pipe, requests, head_start={0: 0, 1: 1, 2: 2, 3: 4})
    for request, state in zip(requests, states, strict=True):
        ref, ref_computed = _diffusers_cached(FluxPipeline, flux_folder, request, _flux_last,
                                              max_sequence_length=tiny_flux.TEXT_TOKENS)
        assert (_computed(state) if request_cache(state) else STEPS) == ref_computed
        assert_same(GateRun(state.latents.float().cpu(), flux_pipe.finish(state)), ref)


def test_qwenimage_taylorseer_as_diffusers(tmp_path):
    folder = tiny_qwen.build(tmp_path / "tiny-qwen-image")
    pipe = bcg_pipeline(folder, QWEN_BUCKETS)
    request = GenerationRequest(prompt="a cat on a windowsill", n=1, width=64, height=64, num_inference_steps=STEPS,
                                seed=2, negative_prompt="blurry", cache=TAYLOR_FP32[1])
    ref, ref_computed = _diffusers_cached(QwenImagePipeline, folder, request,
                                          lambda t: t.transformer_blocks[-1].img_mlp)
    (state,) = _serve(pipe, [request])
    assert _computed(state) == ref_computed < 2 * STEPS
    assert_same(GateRun(state.latents.float().cpu(), pipe.finish(state)), ref)


def test_taylorseer_refuses_what_it_does_not_serve():
    from pydantic import ValidationError

    from bcg_core.step_cache import parse_cache

    with pytest.raises(ValidationError, match="lite mode"):
        parse_cache({"method": "taylor_seer", "use_lite_mode": False})
    with pytest.raises(ValidationError, match="disable_cache_before_step"):
        parse_cache({"method": "taylor_seer", "disable_cache_before_step": 0, "cache_interval": 3})
    assert parse_cache({"method": "taylor_seer", "disable_cache_before_step": 0, "cache_interval": 1}).computes(0)


def test_taylorseer_reserve_is_what_its_factors_hold(flux_pipe):
    state = flux_pipe.start(flux_pipe.validator.validate(_flux_request(TAYLOR[1], seed=8, n=2)))
    cache = request_cache(state)
    for _ in range(4):  # steps 0, 1 and 3 compute (2 predicts): the third computed step fills the second order
        flux_pipe.step([state], flux_pipe.decider.for_states([state]))
    assert cache.nbytes == cache.reserved_bytes > 0


@pytest.mark.parametrize("cache", [FirstBlockCache(threshold=0.6), TAYLOR[1]], ids=["first_block", "taylor_seer"])
def test_qwenimage_image_to_image_with_a_cache_as_diffusers(tmp_path, cache):
    import numpy as np
    from diffusers import QwenImageImg2ImgPipeline
    from PIL import Image

    from reference_gate import png_bytes

    folder = tiny_qwen.build(tmp_path / "tiny-qwen-image")
    pipe = bcg_pipeline(folder, QWEN_BUCKETS)
    image = png_bytes(Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    request = pipe.validator.validate(GenerationRequest(prompt="a cat on a windowsill", n=1, num_inference_steps=16,
                                                        seed=5, image=image, strength=0.8, cache=cache)).request
    ref, ref_computed = _diffusers_cached(QwenImageImg2ImgPipeline, folder, request,
                                          lambda t: t.transformer_blocks[-1].img_mlp)
    (state,) = _serve(pipe, [request])
    assert _computed(state) == ref_computed < len(state.timesteps)
    assert_same(GateRun(state.latents.float().cpu(), pipe.finish(state)), ref)


@pytest.mark.parametrize("cache", [FirstBlockCache(threshold=0.6), TAYLOR[1]], ids=["first_block", "taylor_seer"])
def test_bf16_alone_at_an_exact_bucket_is_bit_identical_to_diffusers_bf16_with_its_cache(flux_folder, cache):
    """The bf16 gate's cached case: FLUX.1's latents are batch-exact in diffusers, so a request alone at an exact
    bucket must give diffusers' bf16 bits, decisions included (they are taken in the tensors' dtype on both sides)."""
    pipe = bcg_pipeline(flux_folder, FLUX_BUCKETS, dtype="bfloat16")
    request = _flux_request(cache, seed=13)
    ref_pipe = FluxPipeline.from_pretrained(str(flux_folder), torch_dtype=torch.bfloat16, local_files_only=True)
    ref_pipe.set_progress_bar_config(disable=True)
    ref_pipe.transformer.enable_cache(to_diffusers(cache))
    with torch.inference_mode():
        ref = ref_pipe(prompt=request.prompt, width=64, height=64, num_inference_steps=STEPS, guidance_scale=3.5,
                       generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent",
                       max_sequence_length=tiny_flux.TEXT_TOKENS).images
    (state,) = _serve(pipe, [request])
    assert sum(s["reused"] for s in request_cache(state).describe()["steps"].values()) > 0
    assert torch.equal(state.latents.to(ref.dtype), ref)


def test_bf16_requests_with_different_caches_sharing_steps_are_bit_identical_to_diffusers_bf16(flux_folder):
    """The bf16 gate's shared case: three FLUX.1 requests (two First Block Cache thresholds, one without a cache)
    share steps at an exact bucket, joining at different steps, so reused and computed rows of different requests
    run in one head forward and computed rows in one tail forward. FLUX.1's latents are batch-exact in diffusers, so
    each must give diffusers' bf16 bits alone with its own cache, and the same computed steps."""
    pipe = bcg_pipeline(flux_folder, FLUX_BUCKETS, dtype="bfloat16")
    requests = [_flux_request(0.6, n=2, seed=11, prompt="a lighthouse at dusk"),
                _flux_request(2.0, seed=5, prompt="a bowl of ramen"),
                _flux_request(None, seed=7, prompt="a paper boat")]
    states = _serve(pipe, requests, head_start={1: 0, 0: 2, 2: 3})
    ref_pipe = FluxPipeline.from_pretrained(str(flux_folder), torch_dtype=torch.bfloat16, local_files_only=True)
    ref_pipe.set_progress_bar_config(disable=True)
    for request, state in zip(requests, states, strict=True):
        if isinstance(request.cache, FirstBlockCache):
            ref_pipe.transformer.enable_cache(to_diffusers(request.cache))
        computed = []
        hook = _flux_last(ref_pipe.transformer).register_forward_hook(lambda *a, out=computed: out.append(1))
        with torch.inference_mode():
            ref = ref_pipe(prompt=request.prompt, num_images_per_prompt=request.n, width=64, height=64,
                           num_inference_steps=STEPS, guidance_scale=3.5, output_type="latent",
                           generator=[torch.Generator("cpu").manual_seed(request.seed + i) for i in range(request.n)],
                           max_sequence_length=tiny_flux.TEXT_TOKENS).images  # bcg-serve: image i's seed is seed + i
        hook.remove()
        if isinstance(request.cache, FirstBlockCache):
            ref_pipe.transformer.disable_cache()
            assert _computed(state) == len(computed)
        assert torch.equal(state.latents.to(ref.dtype), ref), request.prompt
    assert _computed(states[1]) < STEPS  # the shared steps mixed rows that reused with rows that computed


def test_the_graph_halves_static_buffers_give_what_the_per_row_halves_give(flux_pipe):
    """The halves as the CUDA graph runner captures them (``bcg_core/runners/piecewise.py``: padded static
    buffers filled by ``pad_rows`` before each replay, ``HeadPhase(static=...)``, ``TailPhase(static=True)``) compute
    what the per-row halves of the eager path compute, bit for bit, on a bucket with padded rows."""
    from bcg_core.step_cache import installed_split
    from bcg_core.step_cache.split import HeadPhase, TailPhase, pad_rows

    pipe = flux_pipe
    split = installed_split(pipe.model.adapter.model)
    key = next(k for k in pipe.table.keys if k.batch == 4)
    inputs = pipe.example_inputs(key, 3, seed=7)  # 3 real rows in a 4-row bucket
    buffers = pipe.model.adapter.allocate(key, pipe.model.device, pipe.model.dtype)
    pipe.model.adapter.fill(buffers, inputs)
    adapter, k, t = pipe.model.adapter, inputs.image_tokens, inputs.text_tokens
    with torch.inference_mode():
        probe = HeadPhase()
        with split.phase(probe):
            adapter.forward(buffers)
        gen = torch.Generator().manual_seed(0)
        residuals = {i: (torch.randn(k, probe.hidden.shape[-1], generator=gen),
                         torch.randn(t, probe.encoder.shape[-1], generator=gen)) for i in (0, 2)}  # row 1: none
        lazy = HeadPhase(residuals)
        with split.phase(lazy):
            lazy_out = adapter.forward(buffers)
        static = HeadPhase(static=(pad_rows(torch.empty_like(probe.hidden), {i: h for i, (h, _) in residuals.items()}),
                                   pad_rows(torch.empty_like(probe.encoder),
                                            {i: e for i, (_, e) in residuals.items()})))
        with split.phase(static):
            static_out = adapter.forward(buffers)
        assert torch.equal(lazy_out, static_out) and torch.equal(lazy.residual, static.residual)
        rows = [0, 2]
        lazy_tail = TailPhase(lazy.hidden[rows, :k], lazy.encoder[rows, :t])
        sub = inputs.select(rows)
        sub_buffers = adapter.allocate(key, pipe.model.device, pipe.model.dtype)
        adapter.fill(sub_buffers, sub)
        with split.phase(lazy_tail):
            lazy_tail_out = adapter.forward(sub_buffers)
        static_tail = TailPhase(pad_rows(torch.empty_like(probe.hidden), dict(enumerate(lazy.hidden[rows, :k]))),
                                pad_rows(torch.empty_like(probe.encoder), dict(enumerate(lazy.encoder[rows, :t]))),
                                static=True)
        with split.phase(static_tail):
            static_tail_out = adapter.forward(sub_buffers)
    assert torch.equal(lazy_tail_out, static_tail_out)
    assert torch.equal(lazy_tail.residual_hidden, static_tail.residual_hidden)
    assert torch.equal(lazy_tail.residual_encoder, static_tail.residual_encoder)


# -- FLUX.2: TaylorSeer on [klein]; First Block Cache and [dev] refused, as diffusers fails on them -------------------

FLUX2_BUCKETS = {"resolutions": ["32x32", "64x80"], "batch_sizes": [1, 2, 4], "text_lengths": [tiny_flux2.TEXT_TOKENS]}
"""32x32: 64 tokens (text to image); 64x80: 320 tokens, a 32x32 target with one 64x64 reference exactly."""


@pytest.fixture(scope="module")
def klein_folder(tmp_path_factory) -> Path:
    return tiny_flux2.build(tmp_path_factory.mktemp("flux2-cache") / "tiny-klein", "klein", layers=(2, 2))


@pytest.fixture(scope="module")
def klein_pipe(klein_folder):
    return bcg_pipeline(klein_folder, FLUX2_BUCKETS)


def _klein_request(cache, **kw) -> GenerationRequest:
    """A [klein] request (no CFG unless ``guidance_scale`` > 1 is given); ``cache`` a spec or None (no cache)."""
    fields = dict(prompt="a red fox in the snow", n=1, width=32, height=32, num_inference_steps=STEPS, seed=3,
                  guidance_scale=1.0)
    return GenerationRequest(**{**fields, **kw}, cache=NoCache() if cache is None else cache)


def _klein_reference(folder, request: GenerationRequest, dtype=torch.float32) -> tuple[GateRun, int]:
    """diffusers' ``Flux2KleinPipeline`` run of ``request`` with its cache enabled: its packed final latents (the
    step-end callback at the last step; ``output_type="latent"`` unpacks them), PNGs, and its computed steps (forwards
    of the last block's attention: a predicted step's blocks return zeros without running; CFG's two contexts
    summed)."""
    last = []

    def keep(p, i, t, tensors):
        if i == p.num_timesteps - 1:
            last.append(tensors["latents"].float().clone())
        return {}

    run, computed = _diffusers_cached(Flux2KleinPipeline, folder, request,
                                      lambda t: t.single_transformer_blocks[-1].attn,
                                      max_sequence_length=tiny_flux2.TEXT_TOKENS, callback_on_step_end=keep)
    assert len(last) == 2 and torch.equal(last[0], last[1])  # the latent call and the pil call
    return GateRun(last[0], run.pngs), computed


@pytest.mark.parametrize("spec", TAYLOR, ids=["defaults", "order2", "fp32-cooldown"])
def test_flux2_klein_taylorseer_alone_at_an_exact_bucket_is_diffusers_bit_for_bit(klein_folder, klein_pipe, spec):
    request = _klein_request(spec)
    ref, ref_computed = _klein_reference(klein_folder, request)
    (state,) = _serve(klein_pipe, [request])
    assert str(klein_pipe.validator.validate(request).lookup.key) == f"b1_i64_t{tiny_flux2.TEXT_TOKENS}"  # exact
    assert _computed(state) == ref_computed == sum(spec.computes(i) for i in range(STEPS)) < STEPS
    assert_same(GateRun(state.latents.float().cpu(), klein_pipe.finish(state)), ref, exact=True)


def test_flux2_klein_cfg_cond_and_uncond_contexts_as_diffusers(klein_folder, klein_pipe):
    request = _klein_request(TAYLOR_FP32[1], n=2, guidance_scale=4.0, seed=5)
    ref, ref_computed = _klein_reference(klein_folder, request)
    (state,) = _serve(klein_pipe, [request])
    steps = request_cache(state).describe()["steps"]
    assert set(steps) == {"cond", "uncond"} and all(s["computed"] + s["reused"] == STEPS for s in steps.values())
    assert _computed(state) == ref_computed < 2 * STEPS
    assert_same(GateRun(state.latents.float().cpu(), klein_pipe.finish(state)), ref)


def test_flux2_klein_requests_with_different_caches_share_steps_and_each_equals_its_own_run(klein_folder,
                                                                                            klein_pipe):
    requests = [_klein_request(TAYLOR_FP32[1], n=2, guidance_scale=3.0, seed=11, prompt="a lighthouse at dusk"),
                _klein_request(TAYLOR_FP32[2], seed=5, prompt="a bowl of ramen"),
                _klein_request(None, seed=7, prompt="a paper boat")]
    states = _serve(klein_pipe, requests, head_start={1: 0, 0: 2, 2: 3})
    for request, state in zip(requests, states, strict=True):
        ref, ref_computed = _klein_reference(klein_folder, request)
        assert (_computed(state) if request_cache(state) else STEPS) == ref_computed
        assert_same(GateRun(state.latents.float().cpu(), klein_pipe.finish(state)), ref)


def test_flux2_klein_reference_edit_predicts_the_whole_image_stream_as_diffusers(klein_folder, klein_pipe):
    """A reference edit's rows carry the reference tokens after the target's; TaylorSeer's prediction covers them (the
    output of ``proj_out`` over the whole stream, as diffusers' hook predicts it), and only the target's tokens
    advance."""
    import numpy as np
    from PIL import Image

    from reference_gate import png_bytes

    image = png_bytes(Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    validated = klein_pipe.validator.validate(_klein_request(TAYLOR_FP32[1], image=image, guidance_scale=3.5))
    assert str(validated.lookup.key) == f"b2_i320_t{tiny_flux2.TEXT_TOKENS}"  # 64 target + 256 reference tokens
    ref, ref_computed = _klein_reference(klein_folder, validated.request)
    (state,) = _serve(klein_pipe, [validated.request])
    assert request_cache(state).contexts[0].factors[0].shape[1] == 320  # the references' tokens predicted too
    assert _computed(state) == ref_computed < 2 * STEPS
    assert_same(GateRun(state.latents.float().cpu(), klein_pipe.finish(state)), ref)


def test_flux2_klein_bf16_cfg_alone_at_an_exact_bucket_is_bit_identical_to_diffusers_bf16(klein_folder):
    """The bf16 gate's cached FLUX.2 case: [klein]'s cond and uncond rows share one forward where diffusers runs two;
    its latents are batch-exact in diffusers (``tests/families/test_bf16.py``), so diffusers' bf16 bits are demanded,
    with TaylorSeer's defaults (bfloat16 factors)."""
    pipe = bcg_pipeline(klein_folder, FLUX2_BUCKETS, dtype="bfloat16")
    request = _klein_request(TAYLOR[0], guidance_scale=4.0, seed=13)
    ref_pipe = Flux2KleinPipeline.from_pretrained(str(klein_folder), torch_dtype=torch.bfloat16, local_files_only=True)
    ref_pipe.set_progress_bar_config(disable=True)
    ref_pipe.transformer.enable_cache(to_diffusers(request.cache))
    last = []

    def keep(p, i, t, tensors):
        if i == p.num_timesteps - 1:
            last.append(tensors["latents"].clone())
        return {}

    with torch.inference_mode():
        ref_pipe(prompt=request.prompt, width=32, height=32, num_inference_steps=STEPS, guidance_scale=4.0,
                 generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent",
                 max_sequence_length=tiny_flux2.TEXT_TOKENS, callback_on_step_end=keep)
    (state,) = _serve(pipe, [request])
    assert state.latents.dtype == torch.bfloat16 and request_cache(state).describe()["steps"]["uncond"]["reused"] > 0
    assert torch.equal(state.latents, last[0])


def test_flux2_takes_what_diffusers_runs_and_refuses_the_rest_naming_the_models_that_take_it(tmp_path, klein_folder,
                                                                                              klein_pipe):
    """diffusers 0.42.1 runs no First Block Cache on FLUX.2 (its single-stream last block breaks the hook's tail
    residual) and no cache at all on [dev] (``Flux2Pipeline`` sets no cache context): bcg-serve refuses what has no
    diffusers result to equal, with a 422 on ``cache``. Each refusal's cause is checked in diffusers itself, so a
    diffusers that runs them fails here."""
    from diffusers import FirstBlockCacheConfig, Flux2Pipeline

    from bcg_core.errors import RequestError
    from bcg_core.step_cache import installed_split

    dev_folder = tiny_flux2.build(tmp_path / "tiny-dev", "dev")
    dev = bcg_pipeline(dev_folder, FLUX2_BUCKETS)
    assert klein_pipe.model.spec.cache_methods == ("taylor_seer",) and dev.model.spec.cache_methods == ()
    with pytest.raises(RequestError) as e:
        klein_pipe.validator.validate(_klein_request(FirstBlockCache(threshold=0.3)))
    assert (e.value.field, e.value.status) == ("cache", 422)
    assert "Flux2KleinPipeline (family flux2) takes only taylor_seer (first_block is served for FLUX.1, Qwen-Image, " \
           "Wan 2.1 (FluxPipeline, QwenImagePipeline and WanPipeline checkpoints) and the tiny default)" \
           in e.value.message
    for cache in (FirstBlockCache(), TaylorSeerCache()):
        with pytest.raises(RequestError, match=r"Flux2Pipeline \(family flux2\) takes no step cache.*FLUX\.2 \[kle"):
            dev.validator.validate(_klein_request(cache, guidance_scale=4.0))
    assert request_cache(dev.start(dev.validator.validate(_klein_request(None, guidance_scale=4.0)))) is None
    with pytest.raises(ValueError, match="differ in stream layout"):  # the split refuses FLUX.2's transformer
        installed_split(klein_pipe.model.adapter.model)

    def run(cls, folder, config):
        pipe = cls.from_pretrained(str(folder), local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer.enable_cache(config)
        with torch.inference_mode():
            pipe(prompt="a fox", width=32, height=32, num_inference_steps=2, output_type="latent",
                 max_sequence_length=tiny_flux2.TEXT_TOKENS)

    with pytest.raises(TypeError, match="unsupported operand"):
        run(Flux2KleinPipeline, klein_folder, FirstBlockCacheConfig(threshold=0.3))
    for config in (FirstBlockCacheConfig(threshold=0.3), to_diffusers(TaylorSeerCache())):
        with pytest.raises(ValueError, match="No cache context is set"):
            run(Flux2Pipeline, dev_folder, config)
