"""Qwen-Image 2.1 reference gate: bcg-serve gives what diffusers' ``QwenImage21Pipeline`` gives from the same folder,
request and seed, and its fixed-shape bucket forward equals the transformer's own forward at every boundary.

Tiny random-weight checkpoint in the real layout (``tests/tiny/qwenimage21.py``: Qwen3-VL encoder and processor,
``QwenImage21Transformer2DModel``, the 16x RGBA VAE). Final latents within 1e-5 relative and PNG bytes
(``reference_gate.assert_same``; byte-equal where the latents are bit-identical): a request alone at an exact bucket
(diffusers with and without its prefix KV cache), padded rows, a padded text bucket, two requests sharing each step
(one joining the other), true CFG with a given negative prompt and with ``""`` (none without one or at the default
scale 1.0). Token counts are what the encoder reads; a prompt over the encoder's limit, one holding the encoder's
image token, a size off the 32-pixel multiple, JPEG output of the RGBA images and an edit are refused. The bucket
forward is checked at every boundary, with rows of different text lengths against the transformer's own forward
(and the counter-tests: unmasked pads, or diffusers' batch positions, change the output), and without
``causal_condition``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel

from bcg_core import BucketConfig, BucketMetrics, BucketTable, EagerBucketRunner, GenerationRequest, LimitsConfig
from bcg_core.errors import RequestError
from bcg_core.families import family_class
from bcg_core.families.qwenimage21 import QwenImage21Adapter, QwenImage21Family
from bcg_core.families.state import concat_rows
from bcg_core.padding import DenoiseInputs
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases
from closeness import RTOL, assert_close
from reference_gate import assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run, pixels
from tiny.qwenimage21 import build, without_torchvision

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["64x64", "96x64"], text_lengths=[14, 32])
CPU = torch.device("cpu")
SHORT = "a photo of a cat"  # 14 tokens kept after the system turn is dropped
LONG = "an astronaut riding a horse on the moon, digital art"
INDEX = {"_class_name": "QwenImage21Pipeline"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        without_torchvision(mp)
        yield build(tmp_path_factory.mktemp("qwenimage21"))


@pytest.fixture(scope="module")
def pipe(folder):
    with pytest.MonkeyPatch.context() as mp:
        without_torchvision(mp)
        yield bcg_pipeline(folder, BUCKETS)


@pytest.fixture(autouse=True)
def _processor(monkeypatch):
    without_torchvision(monkeypatch)


def _req(**kw) -> GenerationRequest:
    base = dict(prompt=SHORT, n=2, width=64, height=64, num_inference_steps=2, seed=5)
    return GenerationRequest(**{**base, **kw})


def _validated(pipe, req):
    return pipe.validator.validate(req).request


def _diffusers(folder, req, **kw):
    return diffusers_run(QwenImage21Pipeline, folder, req, **kw)


def test_the_pipeline_loads_as_the_qwenimage21_family_with_its_defaults(pipe):
    fam, spec = pipe.model, pipe.model.spec
    assert family_class(spec.pipeline_class) is QwenImage21Family and isinstance(fam.adapter, QwenImage21Adapter)
    assert (spec.default_steps, spec.default_guidance_scale, spec.default_true_cfg_scale) == (40, None, 1.0)
    assert spec.quality_steps == (20, 30, 40) and spec.cfg_rule == "true_cfg" and spec.edit_pipelines is None
    assert spec.rules.grid_keyed and spec.rules.pixels_per_token == 16 and spec.size_multiple == spec.size_step == 32
    assert spec.output_alpha and spec.default_size == (1024, 1024)
    # the tiny encoder's 2048 positions less the 26 system tokens it reads before the prompt
    assert spec.max_prompt_tokens == spec.max_text_tokens == 2048 - 26
    assert pipe.validator.validate(_req(n=1)).lookup.query.text_tokens == 14


def test_an_exact_bucket_alone_equals_diffusers_bit_for_bit_with_and_without_its_kv_cache(pipe, folder):
    req = _validated(pipe, _req())
    assert str(pipe.validator.validate(req).lookup.key) == "b2_i16_t14_g4x4"
    ours = bcg_run(pipe, req)
    assert_same(ours, _diffusers(folder, req), exact=True)  # use_kv_cache=True, the default
    assert_same(ours, _diffusers(folder, req, use_kv_cache=False), exact=True)
    assert pixels(ours.pngs[0]).shape == (64, 64, 4)  # RGBA, as diffusers' PIL images


def test_padded_rows_and_a_padded_text_bucket_equal_diffusers(pipe, folder):
    rows = _validated(pipe, _req(n=3))  # 3 rows in the 4-row bucket, pad rows copy row 0
    assert str(pipe.validator.validate(rows).lookup.key) == "b4_i16_t14_g4x4"
    assert_same(bcg_run(pipe, rows), _diffusers(folder, rows))
    short = _validated(pipe, _req(n=1, prompt="a cat", width=96))  # fewer text tokens in the 14 bucket, 4 x 6 grid
    v = pipe.validator.validate(short)
    assert v.lookup.query.text_tokens < 14 and str(v.lookup.key) == "b1_i24_t14_g4x6"
    assert_same(bcg_run(pipe, short), _diffusers(folder, short))
    longer = _validated(pipe, _req(n=1, prompt=LONG))
    v = pipe.validator.validate(longer)
    assert 14 < v.lookup.query.text_tokens < 32 and str(v.lookup.key) == "b1_i16_t32_g4x4"
    assert_same(bcg_run(pipe, longer), _diffusers(folder, longer))


def test_true_cfg_runs_only_with_a_negative_prompt_and_a_scale_above_one(pipe):
    fam = pipe.model
    for neg, scale, cfg in [(None, None, False), (None, 4.0, False), ("blurry", None, False), ("blurry", 1.0, False),
                            ("blurry", 1.5, True), ("", 4.0, True)]:
        v = pipe.validator.validate(_req(n=1, negative_prompt=neg, true_cfg_scale=scale))
        assert fam.spec.uses_cfg(v.request) is cfg and v.lookup.query.batch == (2 if cfg else 1), (neg, scale)


def test_true_cfg_with_a_given_and_an_empty_negative_prompt_equals_diffusers(pipe, folder):
    req = _validated(pipe, _req(n=1, true_cfg_scale=4.0, negative_prompt="blurry, low quality, watermark, text"))
    v = pipe.validator.validate(req)
    assert v.lookup.query.batch == 2 and v.lookup.key.text_tokens == 32  # cond and uncond rows, text padded
    ours = bcg_run(pipe, req)
    assert_same(ours, _diffusers(folder, req))
    assert not torch.allclose(ours.latents, _diffusers(folder, _req(n=1)).latents, rtol=1e-3)  # CFG changed it
    empty = _validated(pipe, _req(n=2, true_cfg_scale=3.0, negative_prompt="", seed=8))  # encoded as " ", as P does
    assert pipe.validator.validate(empty).lookup.query.batch == 4
    assert_same(bcg_run(pipe, empty), _diffusers(folder, empty))
    none = _validated(pipe, _req(n=1, true_cfg_scale=4.0))  # no negative prompt: no CFG, diffusers only warns
    assert_same(bcg_run(pipe, none), _diffusers(folder, none), exact=True)


def test_two_requests_sharing_each_step_equal_diffusers_each(pipe, folder):
    a = _validated(pipe, _req(n=1, prompt=LONG, seed=3, num_inference_steps=3))
    b = _validated(pipe, _req(n=1, true_cfg_scale=3.0, negative_prompt="a dog", seed=9, num_inference_steps=3))
    ra, rb = bcg_run_joined(pipe, a, b, head_start=1)
    assert_same(ra, _diffusers(folder, a))
    assert_same(rb, _diffusers(folder, b))


def test_token_counts_are_what_the_encoder_reads_less_the_dropped_system_turn(pipe, folder):
    fam = pipe.model
    seen = []
    hook = fam.pipe.text_encoder.register_forward_pre_hook(
        lambda m, args, kw: seen.append(int(kw["attention_mask"].sum())), with_kwargs=True)
    ingress = QwenImage21Family.token_counter(folder, INDEX)
    assert ingress.drop == fam.pipe._drop_idx == 26
    try:
        for prompt in [SHORT, LONG, "  spaced  ", ""]:
            rows = fam.encode(prompt)
            assert fam.count_tokens(prompt) == ingress(prompt) == seen[-1] - 26 == rows.tokens, prompt
    finally:
        hook.remove()
    assert ingress("") == ingress(" ")  # P encodes an empty prompt as " "


def test_over_long_prompts_and_the_encoders_image_token_are_refused(pipe, folder):
    long = "a cat " + "ж" * 1100  # 2 byte-level tokens a letter: over the limit in fewer than 4000 characters
    assert 2022 < pipe.model.count_tokens(long) and len(long) < pipe.validator.limits.max_prompt_chars
    with pytest.raises(RequestError, match="at most 2022 tokens") as e:
        pipe.validator.validate(_req(prompt=long))
    assert e.value.field == "prompt" and e.value.status == 422
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(negative_prompt=long, true_cfg_scale=2.0))
    assert e.value.field == "negative_prompt"
    image = "a cat <|image_pad|> on a chair"
    for kw, field in ((dict(prompt=image), "prompt"), (dict(negative_prompt=image, true_cfg_scale=2.0),
                                                       "negative_prompt")):
        with pytest.raises(RequestError, match="image token") as e:
            pipe.validator.validate(_req(**kw))
        assert e.value.field == field and e.value.status == 422
    with pytest.raises(ValueError, match="image_pad"):  # diffusers cannot run it either: its processor refuses it
        _diffusers(folder, _req(n=1, prompt=image, num_inference_steps=1))


def test_sizes_off_32_pixels_jpeg_output_and_edits_are_refused(pipe):
    for kw, field, match in ((dict(width=48), "size", "not a multiple of 32; use 32 or 64"),
                             (dict(height=80), "size", "not a multiple of 32; use 64 or 96"),
                             (dict(output_format="jpeg"), "output_format", "RGBA"),
                             (dict(image=b"x"), "image", "not served for edits")):
        with pytest.raises(RequestError, match=match) as e:
            pipe.validator.validate(_req(**kw))
        assert e.value.field == field and e.value.status == 422
    assert pipe.validator.validate(_req(output_format="webp")).request.output_format == "webp"
    assert pipe.validator._bad("size", "48x48", "x").message.count("multiple of 32") == 1  # the limits' wording
    cfg = BucketConfig(batch_sizes=[1], resolutions=["64x64", "48x48"], text_lengths=[32])
    with pytest.raises(ValueError, match=r"\['48x48'\].*multiples of 32"):
        pipe.model.spec.check_table(cfg)


@pytest.mark.parametrize("change, match", [
    (lambda d: _edit(d / "model_index.json", sample_sigmas=[1.0, 0.5]), "sample_sigmas"),
    (lambda d: _edit(d / "transformer" / "config.json", patch_size=2), "patch_size"),
    (lambda d: _edit(d / "model_index.json", _class_name="QwenImagePipeline"), "not a Qwen-Image 2.1"),
])
def test_checkpoints_this_family_cannot_serve_as_diffusers_runs_them_are_refused(folder, tmp_path, change, match):
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.safetensors"))  # describe reads configs only
    assert QwenImage21Family.describe(copy, INDEX).max_text_tokens == 2022
    change(copy)
    with pytest.raises(ValueError, match=match):
        QwenImage21Family.describe(copy, json.loads((copy / "model_index.json").read_text()))


def _edit(path, **over):
    path.write_text(json.dumps({**json.loads(path.read_text()), **over}))


# -- bucket equivalence of the adapter ------------------------------------------------------------------


def test_the_bucket_forward_equals_the_transformers_own_at_every_boundary(pipe):
    adapter = pipe.model.adapter
    table = BucketTable(BucketConfig(**BUCKETS), adapter.rules)
    runner = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    runner.prepare()
    cases = boundary_cases(table, LimitsConfig(min_side_px=32, max_side_px=96))
    assert {c.key for c in cases} == set(table.keys)
    assert {c.text_tokens for c in cases} >= {1, 13, 14, 15, 31, 32}  # text padded in every text bucket
    verdicts = verify_runner(adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def _mixed_rows(adapter: QwenImage21Adapter, lengths: list[int], grid=(4, 6)) -> DenoiseInputs:
    """Rows whose texts have ``lengths`` real tokens, masked to the longest (as ``concat_rows`` joins them)."""
    g = torch.Generator().manual_seed(7)
    parts = []
    for i, n in enumerate(lengths):
        text = torch.randn(1, n, adapter.seq_dim, generator=g)
        parts.append(DenoiseInputs(adapter.example_latents(1, grid, g), text, text.new_zeros(1, 0),
                                   torch.tensor([0.2 + 0.3 * i]), grid, text_mask=torch.ones(1, n, dtype=torch.bool)))
    return concat_rows(parts)


def _bucket(adapter: QwenImage21Adapter, rows: int, text: int, grid=(4, 6)):
    table = BucketTable(BucketConfig(**BUCKETS), adapter.rules)
    key = next(k for k in table.keys if k.batch == rows and k.text_tokens == text and k.latent_hw == grid)
    return key, adapter.allocate(key, CPU, torch.float32)


def test_rows_of_different_text_lengths_equal_the_transformers_own_forward_each(pipe):
    """Texts of 3, 20 and 32 tokens in one 4-row bucket of 32 text slots, against ``QwenImage21Transformer2DModel.
    forward`` on each row alone; garbage in the pad row and in the masked slots changes nothing."""
    adapter = pipe.model.adapter
    x = _mixed_rows(adapter, [3, 20, 32])
    _, buf = _bucket(adapter, 4, 32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        assert buf["text_mask"].sum(dim=1).tolist() == [3, 20, 32, 3]  # the pad row copies row 0
        freqs = adapter.model.pos_embed.freqs[0]
        assert torch.equal(buf["rotary"][:, 32, :2], freqs[torch.tensor([3, 20, 32, 3])])  # target frames at L
        ref = adapter.forward_eager(x)
        clean = adapter.unpad(adapter.forward(buf), x).clone()
        assert_close(clean, ref)
        g = torch.Generator().manual_seed(9)
        buf["text"][0, 3:] = 1e2 * torch.randn(buf["text"][0, 3:].shape, generator=g)
        for name in ("latents", "text", "timestep"):
            buf[name][3:] = 1e2 * torch.randn(buf[name][3:].shape, generator=g)
        assert_close(adapter.unpad(adapter.forward(buf), x), clean)


def test_without_the_key_mask_or_with_diffusers_batch_positions_the_output_would_change(pipe):
    """The counter-tests: the pads attended change a short row, and so does its target frame at the bucket's length
    (where diffusers puts every row of a right-padded batch) instead of its own."""
    adapter = pipe.model.adapter
    x = _mixed_rows(adapter, [5])
    _, buf = _bucket(adapter, 1, 32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        ref = adapter.forward_eager(x)
        assert_close(adapter.forward(buf), ref)
        buf["text_mask"].fill_(True)  # bcg-serve's pad slots [5, 32) attended
        assert not torch.allclose(adapter.forward(buf), ref, rtol=1e-3)
        adapter.fill(buf, x)
        f = adapter.model.pos_embed.freqs[0]
        buf["rotary"][:, 32:, : f.shape[1]] = f[32]  # frame at 32, as diffusers batches a 5-token prompt
        assert not torch.allclose(adapter.forward(buf), ref, rtol=1e-4)


def test_the_bucket_forward_holds_without_causal_condition(pipe):
    """A transformer without ``causal_condition`` (text modulated by the sampled timestep, no t = 0 row)."""
    tiny = pipe.model.adapter.model
    cfg = {k: v for k, v in tiny.config.items() if not k.startswith("_")}
    model = QwenImage21Transformer2DModel(**{**cfg, "causal_condition": False}).eval()
    model.load_state_dict(tiny.state_dict())  # the same weights
    adapter = QwenImage21Adapter(model)
    x = _mixed_rows(adapter, [7, 30])
    _, buf = _bucket(adapter, 2, 32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        out = adapter.unpad(adapter.forward(buf), x)
        assert_close(out, adapter.forward_eager(x))
        assert not torch.allclose(out, pipe.model.adapter.forward_eager(x), rtol=1e-3)  # the flag changes it


def test_over_http_background_and_formats_say_the_images_carry_alpha(folder):
    """The ingress of a Qwen-Image 2.1 checkpoint: its answers' ``background`` is ``transparent`` (RGBA images), a
    request asking for ``opaque`` is a 422 naming the values this model takes, and ``GET /v1/models`` lists no JPEG."""
    import asyncio

    from deployments.settings import ServeConfig
    from ingress_fakes import FakeDiT, bare_ingress, http_request

    config = ServeConfig.model_validate({
        "model": {"path": str(folder), "device": "cpu", "dtype": "float32"},
        "buckets": {"batch_sizes": [1, 2], "resolutions": ["64x64"], "text_lengths": [32]},
        "limits": {"min_side_px": 16, "max_side_px": 1024}, "routing": {"shape_aware": False}})
    ingress = bare_ingress(FakeDiT(), config)

    def answer(body):
        return asyncio.run(ingress.generate(http_request({"prompt": "a fox", "size": "64x64", "seed": 1, **body})))

    refused = answer({"background": "opaque"})
    assert refused.status_code == 422
    err = json.loads(refused.body)["error"]
    assert err["param"] == "background" and "allowed: 'auto', 'transparent'" in err["message"]
    for body in ({}, {"background": "transparent"}, {"background": "auto"}):
        assert answer(body).background == "transparent"
    card = asyncio.run(ingress.models(http_request({})))
    card = json.loads(card.body) if hasattr(card, "body") else card.model_dump()
    bcg = card["data"][0]["bcg"]
    assert bcg["background"] == "transparent" and "jpeg" not in bcg["output_formats"]
