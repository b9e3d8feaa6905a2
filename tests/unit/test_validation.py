"""Request validation: each bad field gets an error naming it and the allowed values."""

import pytest

from bcg_core import BucketConfig, Dim, GenerationRequest, MissPolicy, RequestError, RequestValidator, ShapeRules
from bcg_core.config import EngineConfig

RULES = ShapeRules(pixels_per_token=16, grid_keyed=False, native_text_tokens=32)


def _validator(policy=MissPolicy.EAGER) -> RequestValidator:
    cfg = EngineConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4, 8], resolutions=["256x256", "512x512"],
                                           text_lengths=[32], miss_policy=policy))
    return RequestValidator(cfg, RULES, count_tokens=lambda s, negative=False: len(s.split()) + 2)


@pytest.mark.parametrize(
    "kw,field,needle",
    [
        (dict(prompt=""), "prompt", "non-empty"),
        (dict(prompt="   "), "prompt", "non-empty"),
        (dict(prompt=123), "prompt", "non-empty string"),
        (dict(prompt="x" * 4001), "prompt", "at most 4000"),
        (dict(prompt="word " * 31), "prompt", "at most 32 tokens"),
        (dict(n=0), "n", "from 1 to 10"),
        (dict(n=11), "n", "from 1 to 10"),
        (dict(n="two"), "n", "integer"),
        (dict(n=True), "n", "integer"),
        (dict(width=500), "size", "not a multiple of 16; use 496 or 512"),
        (dict(width=128), "size", "from 256 to 2048"),
        (dict(height=4096), "size", "from 256 to 2048"),
        (dict(num_inference_steps=0), "num_inference_steps", "from 1 to 50"),
        (dict(num_inference_steps=51), "num_inference_steps", "from 1 to 50"),
        (dict(num_inference_steps=2.5), "num_inference_steps", "integer"),
        (dict(guidance_scale=-1.0), "guidance_scale", "from 0 to 30"),
        (dict(guidance_scale="high"), "guidance_scale", "number"),
        (dict(negative_prompt=5), "negative_prompt", "string"),
        (dict(negative_prompt="word " * 40), "negative_prompt", "at most 32 tokens"),
        (dict(seed=-1), "seed", "integer from 0"),
        (dict(seed=2**64), "seed", "integer from 0"),
    ],
)
def test_bad_fields_are_named_with_allowed_values(kw, field, needle):
    req = GenerationRequest(**{"prompt": "a cat", **kw})
    with pytest.raises(RequestError) as e:
        _validator().validate(req)
    assert e.value.field == field and needle in e.value.message and e.value.status == 422


def test_defaults_are_filled_and_cfg_doubles_the_rows():
    p = _validator().validate(GenerationRequest("a cat", n=3))
    r = p.request
    assert r.num_inference_steps == 4 and r.guidance_scale == 3.5 and r.negative_prompt is None and r.seed is not None
    assert p.lookup.query.batch == 6 and p.lookup.key.batch == 8
    assert p.lookup.query.text_tokens == 32  # fixed-length text: always the native length
    q = _validator().validate(GenerationRequest("a cat", n=3, guidance_scale=1.0))
    assert q.lookup.query.batch == 3 and q.lookup.key.batch == 4


def test_unset_defaults_are_the_familys_and_set_ones_win():
    from bcg_core.families import ModelSpec
    from bcg_core.families.tiny import tiny_spec

    assert (tiny_spec().default_steps, tiny_spec().default_guidance_scale) == (4, 3.5)  # the embedded default's
    buckets = BucketConfig(batch_sizes=[1, 2], resolutions=["256x256"], text_lengths=[32])
    sd3_like = ModelSpec("m", "sd3", "StableDiffusion3Pipeline", RULES, default_steps=28, default_guidance_scale=7.0)
    qwen_like = ModelSpec("m", "qwenimage", "QwenImagePipeline", RULES, cfg_rule="true_cfg",
                          default_true_cfg_scale=4.0, default_steps=50, default_guidance_scale=None)
    count = lambda s, negative=False: 3  # noqa: E731

    def filled(spec, **limits):
        validator = RequestValidator(EngineConfig(buckets=buckets, limits=limits), spec, count)
        return validator, validator.validate(GenerationRequest("a cat", seed=0)).request

    validator, r = filled(sd3_like)
    assert (r.num_inference_steps, r.guidance_scale) == (28, 7.0)
    assert validator.defaults == {"num_inference_steps": 28, "guidance_scale": 7.0}
    validator, r = filled(qwen_like)
    assert (r.num_inference_steps, r.guidance_scale) == (50, None)  # QwenImagePipeline's guidance_scale=None
    assert validator.defaults == {"num_inference_steps": 50, "guidance_scale": None, "true_cfg_scale": 4.0}
    assert filled(sd3_like, default_steps=6, default_guidance_scale=1.0)[1].num_inference_steps == 6
    assert filled(sd3_like, default_steps=6, default_guidance_scale=1.0)[1].guidance_scale == 1.0
    _, r = filled(sd3_like, max_steps=20, max_guidance_scale=5.0)  # the family's above the limits: clipped
    assert (r.num_inference_steps, r.guidance_scale) == (20, 5.0)


def test_eager_policy_returns_a_counted_miss_and_reject_policy_an_error_naming_the_field():
    miss = _validator().validate(GenerationRequest("a cat", width=768, height=768))
    assert not miss.lookup.hit and miss.lookup.missed == (Dim.IMAGE,) and miss.shape is None
    with pytest.raises(RequestError) as e:
        _validator(MissPolicy.REJECT).validate(GenerationRequest("a cat", width=768, height=768))
    assert e.value.field == "size" and "256x256, 512x512" in e.value.message
    split = _validator(MissPolicy.REJECT).validate(GenerationRequest("a cat", n=5))  # 10 rows: split, never refused
    assert not split.lookup.hit and split.lookup.missed == (Dim.BATCH,) and split.shape == "i1024_t32"


def test_sizes_between_tiers_round_up():
    p = _validator().validate(GenerationRequest("a cat", width=512, height=320))
    assert p.lookup.query.image_tokens == 32 * 20 and p.lookup.key.image_tokens == 1024


def test_a_miss_in_several_dimensions_names_them_all():
    with pytest.raises(RequestError) as e:
        _validator(MissPolicy.REJECT).validate(GenerationRequest("a cat", n=5, width=768, height=768))
    assert e.value.field == "size" and "fits no resolution bucket" in e.value.message and "n=" not in e.value.message
    assert e.value.missed == ("image_tokens",)  # the rows of n=5 would be split: the batch never misses


def test_exact_padding_miss_explains_the_exact_rule():
    cfg = EngineConfig(buckets=BucketConfig(batch_sizes=[1, 2], resolutions=["256x256", "512x512"], text_lengths=[32],
                                           miss_policy="reject", image_padding="exact"))
    with pytest.raises(RequestError) as e:
        RequestValidator(cfg, RULES, count_tokens=lambda s, negative=False: 3).validate(
            GenerationRequest("a", width=384, height=512))
    assert "exactly a tier's number of image tokens" in e.value.message


@pytest.mark.parametrize("rule,guidance_embeds", [("guidance_scale", False), ("true_cfg", False),
                                                  ("guidance_positive", False), ("none", True)])
def test_cfg_fields_make_requests_that_run_as_asked(rule, guidance_embeds):
    """``ModelSpec.cfg_fields``: the fields a tool gives a request of a given shape so that the family runs it with
    or without classifier-free guidance (uncond rows), under each rule."""
    from bcg_core.families import ModelSpec

    spec = ModelSpec("m", "x", "XPipeline", RULES, cfg_rule=rule, guidance_embeds=guidance_embeds,
                     default_true_cfg_scale=1.0 if rule == "true_cfg" else None)
    for cfg in (False, True):
        if cfg and rule == "none":
            with pytest.raises(ValueError, match="runs no classifier-free guidance"):
                spec.cfg_fields(cfg)
            continue
        req = GenerationRequest("a cat", seed=0, **{"guidance_scale": 3.5, **spec.cfg_fields(cfg)})
        assert spec.uses_cfg(req) == cfg, (rule, cfg)


def test_a_default_size_outside_the_side_limits_is_fitted_into_them():
    from bcg_core.families import ModelSpec
    from bcg_core.table import fit_size

    assert fit_size((1024, 1024), 256, 2048, 16) == (1024, 1024)  # fits: unchanged
    assert fit_size((1024, 1024), 256, 512, 16) == (512, 512)
    assert fit_size((832, 480), 256, 512, 16) == (512, 288)  # aspect kept, sides multiples of 16
    assert fit_size((1024, 1024), 256, 500, 16) == (496, 496)
    assert fit_size((512, 128), 256, 2048, 16) == (1024, 256)  # a short side below the minimum is scaled up
    assert fit_size((4096, 256), 256, 1024, 16) == (1024, 256)  # both bounds at once: kept within the limits
    buckets = BucketConfig(batch_sizes=[1], resolutions=["512x512"], text_lengths=[32])
    zimage_like = ModelSpec("m", "zimage", "ZImagePipeline", RULES, default_size=(1024, 1024))
    validator = RequestValidator(EngineConfig(buckets=buckets, limits=dict(max_side_px=512)), zimage_like,
                                 lambda s, negative=False: 3)
    assert validator.default_size == (512, 512)
    r = validator.validate(GenerationRequest("a cat", seed=0)).request  # no size: served, not refused
    assert (r.width, r.height) == (512, 512)
    with pytest.raises(RequestError, match="1024 is out of range") as e:  # a size sent is still checked
        validator.validate(GenerationRequest("a cat", seed=0, width=1024, height=1024))
    assert e.value.field == "size"
