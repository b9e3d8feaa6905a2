"""Z-Image reference gate: bcg-serve gives what diffusers' ``ZImagePipeline`` gives from the same folder, request and
seed, and its fixed-shape bucket forward equals the transformer's own list forward.

Tiny random-weight checkpoint in the real layout (``tests/tiny/zimage.py``: Qwen3 encoder, ``ZImageTransformer2DModel``
with non-zero pad tokens, FLUX.1 VAE). Final latents within 1e-5 relative and PNG bytes (``reference_gate.assert_same``;
byte-equal where the latents are bit-identical): a request alone at an exact bucket, padded rows, a padded caption
bucket, the model's own image pad tokens (a 10 x 9 grid, 90 tokens padded to 96 inside the model), a request joining
one that started earlier, CFG (on above guidance 0, not 1) with the default and a given negative prompt,
``cfg_truncation`` / ``cfg_normalization`` as the checkpoint's defaults and as request fields (a request with each,
beside a plain one, in one forward per step: each equals its own diffusers run), and their refusals. A prompt over
``max_sequence_length`` is refused (the pipeline would cut it silently).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
from diffusers import ZImagePipeline

from bcg_core import BucketConfig, BucketMetrics, BucketTable, EagerBucketRunner, GenerationRequest, LimitsConfig
from bcg_core.errors import RequestError
from bcg_core.families import family_class
from bcg_core.families.state import concat_rows
from bcg_core.families.zimage import ZImageAdapter, ZImageFamily
from bcg_core.padding import DenoiseInputs
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases
from closeness import RTOL, assert_close
from reference_gate import assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run
from tiny.zimage import build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["32x32", "40x36"], text_lengths=[32, 64])
CPU = torch.device("cpu")
SHORT = "a photo of a cat"  # 14 templated tokens: one 32-token caption block inside the model
LONG = "an astronaut riding a horse on the moon, digital art, a watercolor painting of a lighthouse at dusk"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("zimage"))


@pytest.fixture(scope="module")
def pipe(folder):
    return bcg_pipeline(folder, BUCKETS)


def _req(**kw) -> GenerationRequest:
    base = dict(prompt=SHORT, n=2, width=32, height=32, num_inference_steps=2, seed=11)
    return GenerationRequest(**{**base, **kw})


def _validated(pipe, req):
    return pipe.validator.validate(req).request


def test_the_pipeline_loads_as_the_zimage_family_with_its_defaults(pipe):
    fam, spec = pipe.model, pipe.model.spec
    assert family_class(spec.pipeline_class) is ZImageFamily and isinstance(fam.adapter, ZImageAdapter)
    assert (spec.default_steps, spec.default_guidance_scale, spec.default_true_cfg_scale) == (50, 5.0, None)
    assert spec.rules.grid_keyed and spec.rules.native_text_tokens is None and spec.rules.pixels_per_token == 4
    assert spec.default_size == (1024, 1024) and spec.max_prompt_tokens == spec.max_text_tokens == 512
    assert (spec.default_cfg_normalization, spec.default_cfg_truncation) == (False, 1.0)  # ZImagePipeline's
    assert pipe.validator.validate(_req(n=1)).request.guidance_scale == 5.0
    for guidance, rows in ((5.0, 2), (0.5, 2), (0.0, 1)):  # do_classifier_free_guidance is guidance_scale > 0
        assert pipe.validator.validate(_req(n=1, guidance_scale=guidance)).lookup.query.batch == rows


def test_an_exact_bucket_alone_equals_diffusers_bit_for_bit(pipe, folder):
    req = _validated(pipe, _req(guidance_scale=0.0))  # Z-Image-Turbo's way: no CFG
    assert str(pipe.validator.validate(req).lookup.key) == "b2_i64_t32_g8x8"
    assert_same(bcg_run(pipe, req), diffusers_run(ZImagePipeline, folder, req), exact=True)


def test_padded_rows_a_padded_caption_and_the_models_own_image_pads_equal_diffusers(pipe, folder):
    rows = _validated(pipe, _req(n=3, guidance_scale=0.0))  # 3 rows in the 4-row bucket, pad rows copy row 0
    assert str(pipe.validator.validate(rows).lookup.key) == "b4_i64_t32_g8x8"
    assert_same(bcg_run(pipe, rows), diffusers_run(ZImagePipeline, folder, rows))
    # a 36-token caption in the 64 bucket beside the 32-slot negative "": the model's mask and ours both hide slots
    mixed = _validated(pipe, _req(n=1, prompt=LONG, guidance_scale=4.0))
    v = pipe.validator.validate(mixed)
    assert 32 < v.lookup.query.text_tokens <= 64 and str(v.lookup.key) == "b2_i64_t64_g8x8"
    assert_same(bcg_run(pipe, mixed), diffusers_run(ZImagePipeline, folder, mixed))
    odd = _validated(pipe, _req(n=1, width=40, height=36, guidance_scale=0.0))  # 10 x 9 = 90 tokens, 96 in the model
    assert str(pipe.validator.validate(odd).lookup.key) == "b1_i90_t32_g9x10"
    assert_same(bcg_run(pipe, odd), diffusers_run(ZImagePipeline, folder, odd))


def test_cfg_with_the_default_and_a_given_negative_prompt_equals_diffusers(pipe, folder):
    plain = _validated(pipe, _req(n=1, guidance_scale=0.5))  # below 1 and still CFG, against ""
    assert_same(bcg_run(pipe, plain), diffusers_run(ZImagePipeline, folder, plain))
    neg = _validated(pipe, _req(n=2, guidance_scale=3.0, negative_prompt="blurry, low quality", seed=5))
    assert str(pipe.validator.validate(neg).lookup.key) == "b4_i64_t32_g8x8"
    assert_same(bcg_run(pipe, neg), diffusers_run(ZImagePipeline, folder, neg))


def test_a_request_joining_a_running_one_equals_diffusers(pipe, folder):
    a = _validated(pipe, _req(n=1, seed=3, num_inference_steps=3, guidance_scale=0.0))
    b = _validated(pipe, _req(n=1, prompt=LONG, seed=40, num_inference_steps=4, guidance_scale=2.0))
    ours_a, ours_b = bcg_run_joined(pipe, a, b, head_start=2)  # 1 + 2 rows of captions 14 and 36 tokens long
    assert_same(ours_a, diffusers_run(ZImagePipeline, folder, a))
    assert_same(ours_b, diffusers_run(ZImagePipeline, folder, b))


@pytest.fixture(scope="module")
def cfg_options(folder, tmp_path_factory):
    """The tiny checkpoint served with ``cfg_truncation`` 0.3 and ``cfg_normalization`` 1.0 (``model_index.json``)."""
    other = tmp_path_factory.mktemp("zimage-cfg") / "zimage"
    shutil.copytree(folder, other)
    index = json.loads((other / "model_index.json").read_text())
    index.update(bcg_cfg_truncation=0.3, bcg_cfg_normalization=1.0)
    (other / "model_index.json").write_text(json.dumps(index))
    return other, bcg_pipeline(other, BUCKETS)


def test_cfg_truncation_and_normalization_equal_diffusers(cfg_options, pipe, folder):
    other, cut = cfg_options
    assert (cut.model.spec.default_cfg_truncation, cut.model.spec.default_cfg_normalization) == (0.3, 1.0)
    assert cut.validator.defaults["cfg_truncation"] == 0.3 and cut.validator.defaults["cfg_normalization"] == 1.0
    req = _validated(cut, _req(n=1, guidance_scale=4.0, num_inference_steps=3))
    assert (req.cfg_truncation, req.cfg_normalization) == (0.3, 1.0)  # the checkpoint's, filled in
    v = cut.validator.validate(req)
    state, rows = cut.start(v), []
    while not state.done:  # shift 3: t = 1000, 857, 600, so (1000 - t) / 1000 = 0, 0.14, 0.4: the last is cut
        rows.append(state.rows)
        cut.step([state], cut.decider.for_states([state]))
    assert rows == [2, 2, 1]
    ours = bcg_run(cut, req)
    ref = diffusers_run(ZImagePipeline, other, req, cfg_truncation=0.3, cfg_normalization=1.0)
    assert_same(ours, ref)
    off = replace(req, cfg_truncation=1.0, cfg_normalization=False)  # both change the result: the gate can fail
    assert not torch.allclose(diffusers_run(ZImagePipeline, folder, off, images=False).latents, ref.latents, rtol=1e-3)
    for kw in (dict(cfg_truncation=0.3), dict(cfg_normalization=1.0)):
        one = diffusers_run(ZImagePipeline, folder, replace(off, **kw), images=False)
        assert not torch.allclose(one.latents, ref.latents, rtol=1e-3)


@pytest.fixture(scope="module")
def pipe8(folder):
    """The tiny checkpoint with an 8-row bucket at 32x32: three CFG requests share one forward per step."""
    return bcg_pipeline(folder, dict(batch_sizes=[1, 8], resolutions=["32x32"], text_lengths=[64]))


def test_cfg_options_per_request_in_one_step_each_equal_their_own_diffusers_run(pipe8, folder):
    """A request with ``cfg_truncation`` 0.3, one with ``cfg_normalization`` 1.0 and a plain one (the defaults), all
    CFG, step together: one 8-row forward per step (6 rows, then 5 once the truncated request's uncond rows leave),
    each request's guidance combined with its own settings, each equal to its own ``ZImagePipeline`` call."""
    pipe = pipe8
    reqs = {"plain": _req(n=1, guidance_scale=4.0, num_inference_steps=3, seed=21),
            "trunc": _req(n=1, guidance_scale=4.0, num_inference_steps=3, seed=22, prompt=LONG, cfg_truncation=0.3),
            "norm": _req(n=1, guidance_scale=6.0, num_inference_steps=3, seed=23, cfg_normalization=1.0)}
    validated = {k: pipe.validator.validate(r) for k, r in reqs.items()}
    filled = {k: v.request for k, v in validated.items()}
    assert {k: (r.cfg_normalization, r.cfg_truncation) for k, r in filled.items()} == {
        "plain": (False, 1.0), "trunc": (False, 0.3), "norm": (1.0, 1.0)}
    states = [pipe.start(validated[k]) for k in reqs]
    seen = []
    while not all(s.done for s in states):
        forwards = pipe.decider.for_states(states)
        seen.append(([s.rows for s in states], [str(c.key) for c in forwards.chunks]))
        pipe.step(states, forwards)
    # shift 3: (1000 - t) / 1000 = 0, 0.14, 0.4 at the three steps: the truncated request's last step is unguided
    assert seen == [([2, 2, 2], ["b8_i64_t64_g8x8"])] * 2 + [([2, 1, 2], ["b8_i64_t64_g8x8"])]
    ours = dict(zip(reqs, (s.latents.float().cpu() for s in states), strict=True))  # final latents (no decode)
    for k in reqs:
        assert_close(ours[k], diffusers_run(ZImagePipeline, folder, filled[k], images=False).latents)
    # the gate can fail: without its setting each request's diffusers run moves away from ours
    for k, off in (("trunc", dict(cfg_truncation=1.0)), ("norm", dict(cfg_normalization=False))):
        moved = diffusers_run(ZImagePipeline, folder, replace(filled[k], **off), images=False)
        assert not torch.allclose(moved.latents, ours[k], rtol=1e-3), k
    assert not pipe.capabilities.fused_step  # the host path applies each request's settings (no fused update)


@pytest.mark.parametrize(("kw", "field", "needle"), [
    (dict(cfg_normalization=-0.5), "cfg_normalization", "out of range"),
    (dict(cfg_normalization=math.nan), "cfg_normalization", "out of range"),
    (dict(cfg_normalization="yes"), "cfg_normalization", "not a boolean or a number"),
    (dict(cfg_truncation=math.inf), "cfg_truncation", "out of range"),
    (dict(cfg_truncation=-1), "cfg_truncation", "out of range"),
    (dict(cfg_truncation=True), "cfg_truncation", "not a number"),
    (dict(cfg_truncation=0.5, guidance_scale=0.0), "cfg_truncation", "runs no classifier-free guidance"),
])
def test_bad_cfg_options_are_refused_naming_the_field_and_its_values(pipe, kw, field, needle):
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(**kw))
    assert e.value.field == field and e.value.status == 422
    assert needle in e.value.message and "allowed: " in e.value.message and "Z-Image only" in e.value.message


def test_cfg_options_are_listed_accepted_over_http_and_refused_by_other_models(pipe):
    from bcg_core.config import EngineConfig
    from bcg_core.table import ShapeRules
    from bcg_core.validation import RequestValidator
    from deployments.schemas import ImageGenerationRequest

    assert pipe.validator.defaults == {"num_inference_steps": 50, "guidance_scale": 5.0, "cfg_normalization": False,
                                       "cfg_truncation": 1.0}  # GET /v1/models bcg.defaults
    body = ImageGenerationRequest.model_validate_json(
        '{"prompt": "a cat", "size": "32x32", "cfg_normalization": true, "cfg_truncation": 0}')
    filled = pipe.validator.validate(body.engine_request()).request  # the OpenAI client's extra_body: top level
    assert (filled.cfg_normalization, filled.cfg_truncation) == (True, 0.0)
    rules = ShapeRules(pixels_per_token=16, grid_keyed=False, native_text_tokens=32)  # a model of another family
    tiny = RequestValidator(EngineConfig(buckets=BucketConfig(batch_sizes=[1], resolutions=["256x256"],
                                                              text_lengths=[32])), rules, lambda s, negative=False: 3)
    assert "cfg_normalization" not in tiny.defaults
    for name in ("cfg_normalization", "cfg_truncation"):
        with pytest.raises(RequestError) as e:
            tiny.validate(GenerationRequest(prompt="a cat", width=256, height=256, **{name: 0.5}))
        assert e.value.field == name and "not an option of" in e.value.message and "Z-Image only" in e.value.message


def test_token_counts_are_what_the_encoder_reads_and_longer_prompts_are_refused(pipe, folder):
    fam = pipe.model
    seen = []
    hook = fam.pipe.text_encoder.register_forward_pre_hook(
        lambda m, args, kw: seen.append(int(kw["attention_mask"].sum())), with_kwargs=True)
    ingress = ZImageFamily.token_counter(folder, {"_class_name": "ZImagePipeline"})
    try:
        for prompt in [SHORT, LONG, "  spaced  ", ""]:
            rows = fam.encode(prompt)
            assert fam.count_tokens(prompt) == ingress(prompt) == seen[-1] == rows.tokens, prompt
    finally:
        hook.remove()
    long = " ".join(["a watercolor painting of a lighthouse"] * 90)
    assert fam.count_tokens(long) > 512
    with torch.inference_mode():  # what the pipeline would do with it: cut to 512 tokens without a word
        (cut,), _ = fam.pipe.encode_prompt(prompt=[long], device=CPU, do_classifier_free_guidance=False)
    assert cut.shape[0] == 512
    with pytest.raises(RequestError, match="at most 512 tokens") as e:
        pipe.validator.validate(_req(prompt=long))
    assert e.value.field == "prompt" and e.value.status == 422
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(negative_prompt=long))
    assert e.value.field == "negative_prompt"
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(true_cfg_scale=2.0))
    assert e.value.field == "true_cfg_scale"


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(pipe):
    adapter = pipe.model.adapter
    table = BucketTable(BucketConfig(**BUCKETS), adapter.rules)
    runner = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    runner.prepare()
    cases = boundary_cases(table, LimitsConfig(min_side_px=16, max_side_px=64))
    assert {c.key for c in cases} == set(table.keys)
    verdicts = verify_runner(adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def _mixed_rows(adapter: ZImageAdapter, lengths: list[int], grid=(9, 10)) -> DenoiseInputs:
    """Rows whose captions have ``lengths`` real tokens, masked to the longest (as ``concat_rows`` joins them)."""
    g = torch.Generator().manual_seed(7)
    parts = []
    for i, n in enumerate(lengths):
        text = torch.randn(1, n, adapter.seq_dim, generator=g)
        parts.append(DenoiseInputs(adapter.example_latents(1, grid, g), text, text.new_zeros(1, 0),
                                   torch.tensor([0.1 + 0.3 * i]), grid, text_mask=torch.ones(1, n, dtype=torch.bool)))
    return concat_rows(parts)


def test_rows_of_different_caption_lengths_equal_the_transformers_own_masked_forward(pipe):
    """Captions of 5, 40 and 64 tokens (32, 64 and 64 slots in the model) in one 4-row bucket of 64 caption slots,
    against ``ZImageTransformer2DModel.forward`` on the per-row lists (its own padding and batch mask)."""
    adapter = pipe.model.adapter
    table = BucketTable(BucketConfig(**BUCKETS), adapter.rules)
    key = next(k for k in table.keys if k.batch == 4 and k.text_tokens == 64 and k.latent_hw == (9, 10))
    x = _mixed_rows(adapter, [5, 40, 64])
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        assert buf["cap_keep"].sum(dim=1).tolist() == [32, 64, 64, 32]  # the pad row copies row 0
        assert buf["img_ids"][:, 0, 0].tolist() == [33, 65, 65, 33] and not buf["img_ids"][:, 90:].any()
        ref = adapter.forward_eager(x)
        clean = adapter.unpad(adapter.forward(buf), x).clone()
        assert_close(clean, ref)
        g = torch.Generator().manual_seed(9)  # garbage in the pad row and in the slots the key mask hides
        buf["text"][0, 32:] = 1e2 * torch.randn(buf["text"][0, 32:].shape, generator=g)
        for name in ("latents", "text", "timestep"):
            buf[name][3:] = 1e2 * torch.randn(buf[name][3:].shape, generator=g)
        assert_close(adapter.unpad(adapter.forward(buf), x), clean)


def test_without_the_key_mask_or_the_models_own_pads_the_output_would_change(pipe):
    """The counter-tests: the key mask is load-bearing (bcg-serve's padding attended changes the image), and so are
    the model's own attended pad tokens (hiding them from attention changes it too)."""
    adapter = pipe.model.adapter
    table = BucketTable(BucketConfig(**BUCKETS), adapter.rules)
    key = next(k for k in table.keys if k.batch == 1 and k.text_tokens == 64 and k.latent_hw == (8, 8))
    x = _mixed_rows(adapter, [5], grid=(8, 8))
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        ref = adapter.forward_eager(x)
        assert_close(adapter.forward(buf), ref)
        keep = buf["cap_keep"].clone()
        buf["cap_keep"].fill_(True)  # bcg-serve's slots [32, 64) attended
        assert not torch.allclose(adapter.forward(buf), ref, rtol=1e-3)
        buf["cap_keep"].copy_(keep & buf["text_mask"])  # the model's own cap_pad_token slots [5, 32) hidden
        assert not torch.allclose(adapter.forward(buf), ref, rtol=1e-3)


def test_the_planner_counts_rows_as_the_pipeline_runs_them(pipe):
    """A replica's shape histogram replayed by the planner (``traffic_from_histogram``): requests recorded without
    CFG plan one row per image (guidance 0: Z-Image runs CFG at any scale above 0, so the planner's usual 1.0 would
    have doubled them), those with CFG two; the fused step's check asks for the same rows."""
    from bcg_core.planning.samples import traffic_from_histogram
    from bcg_core.planning.traffic import TrafficHistogram
    from bcg_core.verify_fused import _check_request

    hist = TrafficHistogram()
    for guidance in (0.0, 0.0, 5.0):
        hist.record(pipe.validator.validate(_req(n=2, guidance_scale=guidance)))
    traffic = traffic_from_histogram(pipe.config, hist.snapshot())
    assert sorted((d.query.batch, d.images, d.weight) for d in traffic.demands) == [(2, 2, 2.0), (4, 2, 1.0)]
    key = pipe.table.keys[0]
    for cfg in (False, True):
        assert pipe.model.spec.uses_cfg(pipe.validator.validate(_check_request(pipe, key, cfg)).request) == cfg
