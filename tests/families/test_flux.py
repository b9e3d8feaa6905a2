"""FLUX.1 reference gate: bcg-serve gives what diffusers' ``FluxPipeline`` gives from the same folder and seed.

Tiny random-weight ``FluxPipeline`` checkpoints (dev with the guidance embedding, schnell without), built
offline by ``tests/tiny/flux.py`` and loaded through ``model.path``. For each case the final packed latents
must be within 1e-5 relative of ``FluxPipeline(output_type="latent")`` and the images the same as
``output_type="pil"`` (``reference_gate.assert_same``: byte-equal PNGs at an exact bucket): at an exact bucket, padded
(rows 3 -> 4, and a size one token-row below a tier in its masked bucket), and inside a forward shared with a request
that started two steps earlier.
"""

import dataclasses

import pytest
from diffusers import FluxPipeline

from bcg_core import GenerationRequest
from reference_gate import assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run
from tiny.flux import TEXT_TOKENS, build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["32x32", "64x64"], text_lengths=[TEXT_TOKENS])
REF = dict(max_sequence_length=TEXT_TOKENS)


@pytest.fixture(scope="module", params=["dev", "schnell"])
def flux(request, tmp_path_factory):
    folder = build(tmp_path_factory.mktemp(f"flux-{request.param}"), request.param)
    return request.param, folder, bcg_pipeline(folder, BUCKETS)


def _req(**kw) -> GenerationRequest:
    base = dict(prompt="a photo of a cat sitting on a red chair", n=2, width=32, height=32,
                num_inference_steps=3, guidance_scale=3.5, seed=11)
    return GenerationRequest(**{**base, **kw})


def _validated(pipe, req):
    return pipe.validator.validate(req).request


def test_flux_exact_bucket_equals_diffusers(flux):
    variant, folder, pipe = flux
    req = _validated(pipe, _req())
    assert str(pipe.validator.validate(req).lookup.key) == "b2_i64_t32"
    assert_same(bcg_run(pipe, req), diffusers_run(FluxPipeline, folder, req, **REF), exact=True)


def test_flux_padded_rows_and_masked_image_tokens_equal_diffusers(flux):
    variant, folder, pipe = flux
    rows = _validated(pipe, _req(n=3))  # 3 rows in the 4-row bucket, pad rows copy row 0
    assert str(pipe.validator.validate(rows).lookup.key) == "b4_i64_t32"
    assert_same(bcg_run(pipe, rows), diffusers_run(FluxPipeline, folder, rows, **REF))
    below = _validated(pipe, _req(n=1, width=64, height=60))  # 16 x 15 = 240 tokens in the masked 256 tier
    assert str(pipe.validator.validate(below).lookup.key) == "b1_i256_m_t32"
    assert_same(bcg_run(pipe, below), diffusers_run(FluxPipeline, folder, below, **REF))


def test_flux_request_joining_a_running_one_equals_diffusers(flux):
    variant, folder, pipe = flux
    a = _validated(pipe, _req(n=1, seed=3, num_inference_steps=4, guidance_scale=5.0))
    b = _validated(pipe, _req(n=2, prompt="an astronaut riding a horse", seed=40, num_inference_steps=5))
    ours_a, ours_b = bcg_run_joined(pipe, a, b, head_start=2)
    assert_same(ours_a, diffusers_run(FluxPipeline, folder, a, **REF))
    assert_same(ours_b, diffusers_run(FluxPipeline, folder, b, **REF))


def test_flux_true_cfg_with_a_negative_prompt_equals_diffusers(flux):
    variant, folder, pipe = flux
    req = _validated(pipe, _req(n=1, negative_prompt="blurry, low quality", true_cfg_scale=2.5))
    assert pipe.validator.validate(req).lookup.query.batch == 2  # one cond and one uncond row
    assert_same(bcg_run(pipe, req), diffusers_run(FluxPipeline, folder, req, true_cfg_scale=2.5, **REF))
    # true_cfg_scale > 1 without a negative prompt is no CFG, as in diffusers
    plain = _validated(pipe, dataclasses.replace(req, negative_prompt=None))
    assert pipe.validator.validate(plain).lookup.query.batch == 1


def test_flux_guidance_scale_is_the_embedding_not_cfg(flux):
    variant, folder, pipe = flux
    validated = pipe.validator.validate(_req(n=1, guidance_scale=7.0))
    assert validated.lookup.query.batch == 1  # no uncond rows for guidance_scale, dev or schnell
    assert pipe.model.guidance_embeds is (variant == "dev")


def test_a_tokenizer_shorter_than_the_served_text_length_is_a_start_up_error(tmp_path):
    import json

    from bcg_core import CheckpointError, ModelConfig, describe_model

    folder = build(tmp_path / "short", "schnell")
    cfg = folder / "tokenizer_2" / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_max_length": 16}))
    with pytest.raises((CheckpointError, ValueError), match="tokenizer_2 holds at most 16 tokens .* bcg_text_tokens"):
        describe_model(ModelConfig(path=str(folder)))
