"""FLUX.2 reference gate: bcg-serve gives what diffusers' ``Flux2Pipeline`` / ``Flux2KleinPipeline`` give from the
same folder, request and seed.

Tiny random-weight checkpoints in the real layouts (``tests/tiny/flux2.py``): [dev] (Mistral-family encoder,
guidance embedding), [klein] (Qwen3-family encoder, CFG against ``""`` by default) and distilled [klein]
(``is_distilled``: no CFG). Each case compares the final packed latents (diffusers' from its step-end callback at the
last step: ``Flux2KleinPipeline(output_type="latent")`` returns them unpacked and un-normalised) within 1e-5 relative
and the PNG bytes (``reference_gate.assert_same``; byte-equal where the latents are bit-identical): a request alone at
an exact bucket, padded rows and a size padded into a masked image tier, a request joining one that started two steps
earlier, and [klein]'s CFG with the default and a given negative prompt (diffusers: ``negative_prompt_embeds``).
A prompt over ``max_sequence_length`` is refused, never cut; a negative prompt where no CFG runs is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from bcg_core import BucketConfig, BucketMetrics, BucketTable, EagerBucketRunner, GenerationRequest, LimitsConfig
from bcg_core.errors import RequestError
from bcg_core.families import family_class
from bcg_core.families.flux2 import Flux2Adapter, Flux2Family
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases, bucket_inputs
from closeness import RTOL, assert_close
from reference_gate import GateRun, assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run
from tiny.flux2 import TEXT_TOKENS, build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["32x32", "64x64"], text_lengths=[TEXT_TOKENS])
PIPELINES = {"dev": Flux2Pipeline, "klein": Flux2KleinPipeline, "klein-distilled": Flux2KleinPipeline}
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=list(PIPELINES))
def flux2(request, tmp_path_factory):
    folder = build(tmp_path_factory.mktemp(f"flux2-{request.param}"), request.param)
    return request.param, folder, bcg_pipeline(folder, BUCKETS)


def _req(**kw) -> GenerationRequest:
    base = dict(prompt="a photo of a cat sitting on a red chair", n=2, width=32, height=32, num_inference_steps=2,
                seed=11)
    return GenerationRequest(**{**base, **kw})


def _validated(pipe, req):
    return pipe.validator.validate(req).request


def reference(variant: str, folder, pipe, req: GenerationRequest, **kw) -> GateRun:
    """Diffusers' own run of ``req``: its packed final latents (step-end callback at the last step) and PNGs; and
    its ``output_type="latent"`` answer checked against them ([dev]: the same tensor; [klein]: unpacked and
    un-normalised, which :meth:`Flux2Family.unpacked_latents` must reproduce bit for bit)."""
    last = []

    def keep(p, i, t, tensors):
        if i == p.num_timesteps - 1:
            last.append(tensors["latents"].float().clone())
        return {}

    run = diffusers_run(PIPELINES[variant], folder, req, max_sequence_length=TEXT_TOKENS, callback_on_step_end=keep,
                        **kw)
    assert len(last) == 2 and torch.equal(last[0], last[1])  # the latent call and the pil call
    if variant == "dev":
        assert torch.equal(run.latents, last[0])
    else:
        ids = Flux2Pipeline._prepare_latent_ids(torch.empty(req.n, 0, *pipe.model.rules.grid(req.width, req.height)))
        assert torch.equal(pipe.model.unpacked_latents(last[0], ids), run.latents)
    return GateRun(last[0], run.pngs)


def test_both_pipelines_load_as_the_flux2_family_with_their_defaults(flux2):
    variant, folder, pipe = flux2
    fam, spec = pipe.model, pipe.model.spec
    assert family_class(spec.pipeline_class) is Flux2Family and isinstance(fam.adapter, Flux2Adapter)
    assert (spec.default_steps, spec.default_guidance_scale, spec.default_true_cfg_scale) == (50, 4.0, None)
    assert spec.rules.native_text_tokens == TEXT_TOKENS and spec.rules.pixels_per_token == 4
    assert spec.default_size == (256, 256)  # default_sample_size 128 x the tiny VAE's factor 2
    assert spec.guidance_embeds is (variant == "dev") and fam.adapter.guidance_embeds is (variant == "dev")
    assert spec.cfg_rule == ("guidance_scale" if variant == "klein" else "none")
    assert spec.quality_steps == ((2, 4, 8) if variant == "klein-distilled" else (20, 30, 50))
    validated = pipe.validator.validate(_req(n=1))  # guidance_scale 4.0 by default: CFG on [klein] only
    assert validated.request.guidance_scale == 4.0
    assert validated.lookup.query.batch == (2 if variant == "klein" else 1)


def test_an_exact_bucket_alone_equals_diffusers_bit_for_bit(flux2):
    variant, folder, pipe = flux2
    req = _validated(pipe, _req(guidance_scale=1.0 if variant == "klein" else 3.0))  # [klein]: no CFG here
    assert str(pipe.validator.validate(req).lookup.key) == f"b2_i64_t{TEXT_TOKENS}"
    assert_same(bcg_run(pipe, req), reference(variant, folder, pipe, req), exact=True)


def test_padded_rows_and_a_masked_image_tier_equal_diffusers(flux2):
    variant, folder, pipe = flux2
    rows = _validated(pipe, _req(n=3, guidance_scale=1.0))  # 3 rows in the 4-row bucket, pad rows copy row 0
    assert str(pipe.validator.validate(rows).lookup.key) == f"b4_i64_t{TEXT_TOKENS}"
    assert_same(bcg_run(pipe, rows), reference(variant, folder, pipe, rows))
    below = _validated(pipe, _req(n=1, width=64, height=60))  # 16 x 15 = 240 tokens in the masked 256 tier
    key = pipe.validator.validate(below).lookup.key
    assert (key.image_tokens, key.image_mask) == (256, True)
    assert_same(bcg_run(pipe, below), reference(variant, folder, pipe, below))


def test_a_request_joining_a_running_one_equals_diffusers(flux2):
    variant, folder, pipe = flux2
    a = _validated(pipe, _req(n=1, seed=3, num_inference_steps=3, guidance_scale=5.0))
    b = _validated(pipe, _req(n=1, prompt="an astronaut riding a horse", seed=40, num_inference_steps=4,
                              guidance_scale=1.0))
    ours_a, ours_b = bcg_run_joined(pipe, a, b, head_start=2)
    assert_same(ours_a, reference(variant, folder, pipe, a))
    assert_same(ours_b, reference(variant, folder, pipe, b))


def test_klein_cfg_with_the_default_and_a_given_negative_prompt_equals_diffusers(flux2):
    variant, folder, pipe = flux2
    if variant != "klein":
        with pytest.raises(RequestError) as e:  # no uncond forward: a negative prompt is refused, not ignored
            pipe.validator.validate(_req(negative_prompt="blurry"))
        assert e.value.field == "negative_prompt" and e.value.status == 422
        return
    plain = _validated(pipe, _req(n=1, guidance_scale=3.5))  # the pipeline's own negative prompt, ""
    assert pipe.validator.validate(plain).lookup.query.batch == 2
    assert_same(bcg_run(pipe, plain), reference(variant, folder, pipe, plain))
    neg = _validated(pipe, _req(n=2, guidance_scale=3.5, negative_prompt="blurry, low quality", seed=5))
    assert str(pipe.validator.validate(neg).lookup.key) == f"b4_i64_t{TEXT_TOKENS}"
    with torch.inference_mode():  # as a diffusers user passes a negative prompt to Flux2KleinPipeline
        embeds, _ = pipe.model.pipe.encode_prompt(prompt=neg.negative_prompt, device=CPU,
                                                  max_sequence_length=TEXT_TOKENS)
    ref = reference(variant, folder, pipe, dataclasses.replace(neg, negative_prompt=None),
                    negative_prompt_embeds=embeds)
    assert_same(bcg_run(pipe, neg), ref)


def test_the_fused_step_equals_diffusers(flux2):
    """``runner.fused_step: always`` (CFG and the Euler update inside the bucket forward; on a GPU inside its graph):
    the same latents as diffusers, bit for bit alone at an exact bucket."""
    variant, folder, _ = flux2
    pipe = bcg_pipeline(folder, BUCKETS, fused_step="always")
    assert pipe.fused.on, pipe.fused.note
    req = _validated(pipe, _req(n=1, guidance_scale=3.5, num_inference_steps=3))  # [klein]: 2 rows with CFG
    before = pipe.fused.steps
    ours = bcg_run(pipe, req)
    assert pipe.fused.steps == before + 3
    assert_same(ours, reference(variant, folder, pipe, req), exact=variant != "klein")
    a = _validated(pipe, _req(n=1, seed=3, num_inference_steps=3, guidance_scale=5.0))
    b = _validated(pipe, _req(n=1, prompt="an astronaut riding a horse", seed=40, num_inference_steps=4,
                              guidance_scale=1.0))
    ours_a, ours_b = bcg_run_joined(pipe, a, b, head_start=2)
    assert pipe.fused.steps == before + 3 + 2 + 3  # b alone twice, then a and b together three times
    assert_same(ours_a, reference(variant, folder, pipe, a))
    assert_same(ours_b, reference(variant, folder, pipe, b))


def test_token_counts_are_what_the_encoder_reads_and_longer_prompts_are_refused(flux2):
    variant, folder, pipe = flux2
    fam = pipe.model
    seen = []
    hook = fam.pipe.text_encoder.register_forward_pre_hook(
        lambda m, args, kw: seen.append(int(kw["attention_mask"].sum())), with_kwargs=True)
    ingress = Flux2Family.token_counter(folder, {"_class_name": fam.spec.pipeline_class})
    try:
        for prompt in ["a photo of a cat", "blurry, low quality, watermark, text", "  spaced  "]:
            with torch.inference_mode():
                fam.pipe.encode_prompt(prompt=prompt, device=CPU, max_sequence_length=4 * TEXT_TOKENS)
            assert fam.count_tokens(prompt) == ingress(prompt) == seen[-1] < TEXT_TOKENS, prompt
    finally:
        hook.remove()
    long = " ".join(["a watercolor painting of a lighthouse"] * 12)
    assert fam.count_tokens(long) > TEXT_TOKENS  # the pipeline would cut it to TEXT_TOKENS silently
    with pytest.raises(RequestError, match=f"at most {TEXT_TOKENS} tokens") as e:
        pipe.validator.validate(_req(prompt=long))
    assert e.value.field == "prompt" and e.value.status == 422
    if variant == "klein":
        with pytest.raises(RequestError) as e:
            pipe.validator.validate(_req(negative_prompt=long))
        assert e.value.field == "negative_prompt"
    for bad, field in ((dict(true_cfg_scale=2.0), "true_cfg_scale"), (dict(image=b"x"), "image")):
        with pytest.raises(RequestError) as e:
            pipe.validator.validate(_req(**bad))
        assert e.value.field == field


@pytest.fixture(scope="module")
def dev_adapter(tmp_path_factory) -> Flux2Adapter:
    folder = build(tmp_path_factory.mktemp("flux2-adapter"), "dev")
    return bcg_pipeline(folder, BUCKETS).model.adapter


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(dev_adapter):
    table = BucketTable(BucketConfig(**BUCKETS), dev_adapter.rules)
    runner = EagerBucketRunner(dev_adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    runner.prepare()
    cases = boundary_cases(table, LimitsConfig(min_side_px=16))
    assert {c.key for c in cases} == set(table.keys)
    assert any(c.key.image_mask and c.grid[0] * c.grid[1] < c.key.image_tokens for c in cases)
    verdicts = verify_runner(dev_adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_garbage_in_pad_rows_and_masked_pad_tokens_changes_nothing_and_ids_stay_int64(dev_adapter):
    table = BucketTable(BucketConfig(**BUCKETS), dev_adapter.rules)
    key = next(k for k in table.keys if k.image_mask and k.batch == 4 and k.image_tokens == 256)
    x = bucket_inputs(dev_adapter, key, CPU, torch.float32).select(slice(0, 3))  # 3 rows, grid 16 x 15
    buf = dev_adapter.allocate(key, CPU, torch.float32)
    assert buf["img_ids"].dtype == buf["txt_ids"].dtype == torch.int64
    with torch.inference_mode():
        dev_adapter.fill(buf, x)
        k = x.image_tokens
        assert buf["txt_ids"][:, 3].tolist() == list(range(TEXT_TOKENS))
        assert buf["img_ids"][k - 1].tolist() == [0, 15, 14, 0] and not buf["img_ids"][k:].any()  # pads: zero ids
        clean = dev_adapter.unpad(dev_adapter.forward(buf), x).clone()
        g = torch.Generator().manual_seed(9)
        buf["latents"][:, k:] = 1e3 * torch.randn(buf["latents"][:, k:].shape, generator=g)
        for name in ("latents", "text", "timestep", "guidance"):
            buf[name][3:] = 1e2 * torch.randn(buf[name][3:].shape, generator=g)
        dirty = dev_adapter.unpad(dev_adapter.forward(buf), x)
        assert_close(dirty, clean)
        assert_close(clean, dev_adapter.forward_eager(x))
