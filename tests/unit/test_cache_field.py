"""A request's step cache through the validator (``bcg_core/cache_field.py``): the config's ``cache.default`` filled in
where the model takes it, a request's own value winning (``NoCache`` over the default), a method the model does not
take refused on ``cache`` naming the families that take one, a Python caller's mapping read and its faults named by
key, and validation idempotent (the ingress validates, and a validated request validated again keeps its cache).
No weights: validators are built on a bare :class:`~bcg_core.families.ModelSpec`."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest

from bcg_core import BucketConfig, GenerationRequest, RequestError, RequestValidator, ShapeRules
from bcg_core.config import EngineConfig
from bcg_core.families.base import ModelSpec
from bcg_core.step_cache import FirstBlockCache, NoCache

RULES = ShapeRules(pixels_per_token=16, grid_keyed=False, native_text_tokens=32)
FLUX = ModelSpec("flux-model", "flux", "FluxPipeline", RULES, cache_methods=("first_block",))
SD3 = ModelSpec("sd3-model", "sd3", "StableDiffusion3Pipeline", RULES)  # takes no cache
DEFAULT = {"method": "first_block", "threshold": 0.12}


def _validator(spec: ModelSpec = FLUX, default: dict | None = None) -> RequestValidator:
    cfg = EngineConfig.model_validate({
        "buckets": BucketConfig(batch_sizes=[1, 2], resolutions=["256x256"], text_lengths=[32]).model_dump(),
        "cache": {"default": default}})
    return RequestValidator(cfg, spec, count_tokens=lambda s, negative=False: len(s.split()) + 2)


def _cache(validator: RequestValidator, cache=None):
    return validator.validate(GenerationRequest("a cat", width=256, height=256, cache=cache)).request.cache


def test_a_request_without_cache_gets_the_configs_default_where_the_model_takes_it():
    assert _cache(_validator(default=DEFAULT)) == FirstBlockCache(threshold=0.12)
    assert _cache(_validator()) == NoCache()  # no default: no cache, never None
    assert _cache(_validator(default={"method": "none"})) == NoCache()
    assert _cache(_validator(default={"method": "first_block"})) == FirstBlockCache(threshold=0.05)  # diffusers'


def test_the_requests_own_cache_wins_over_the_default_and_none_turns_it_off():
    v = _validator(default=DEFAULT)
    assert _cache(v, NoCache()) == NoCache()
    assert _cache(v, FirstBlockCache(threshold=0.3)) == FirstBlockCache(threshold=0.3)
    assert _cache(_validator(), FirstBlockCache()) == FirstBlockCache(threshold=0.05)


def test_a_default_for_a_model_without_cache_is_ignored_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="bcg_core.validation"):
        v = _validator(SD3, default=DEFAULT)
    assert _cache(v) == NoCache() and v.default_cache == NoCache()
    assert "cache.default {'method': 'first_block', 'threshold': 0.12} is ignored: StableDiffusion3Pipeline (family " \
           "sd3)" in caplog.text
    assert _cache(v, NoCache()) == NoCache()  # asking for none is served everywhere


def test_a_cache_on_a_model_without_one_is_refused_on_cache_naming_the_families_that_take_one():
    with pytest.raises(RequestError) as e:
        _cache(_validator(SD3, default=DEFAULT), FirstBlockCache(threshold=0.2))
    err = e.value
    assert (err.field, err.status) == ("cache", 422)
    assert err.message.startswith("invalid 'cache' (got {'method': 'first_block', 'threshold': 0.2}): "
                                  "StableDiffusion3Pipeline (family sd3) takes no step cache; allowed: "), err.message
    assert ("FLUX.1, Qwen-Image, Wan 2.1 (FluxPipeline, QwenImagePipeline and WanPipeline checkpoints) and the tiny "
            "default") in err.message
    assert "{\"method\": \"none\"} or null, or omit 'cache'" in err.message
    assert "FirstBlockCache" not in err.message  # the value as sent, not the model's repr


def test_a_method_the_model_lacks_is_refused_even_where_it_takes_another():
    other = replace(FLUX, cache_methods=("taylor_seer",))
    with pytest.raises(RequestError, match=r"\(family flux\) takes only taylor_seer") as e:
        _cache(_validator(other), FirstBlockCache())
    assert e.value.field == "cache"


@pytest.mark.parametrize("spec,default,cache", [
    (FLUX, DEFAULT, None), (FLUX, DEFAULT, NoCache()), (FLUX, None, FirstBlockCache(threshold=0.7)), (FLUX, None, None),
    (SD3, DEFAULT, None), (SD3, None, NoCache()), (FLUX, DEFAULT, {"method": "first_block", "threshold": 0.4}),
])
def test_validating_a_validated_request_again_keeps_its_cache(spec, default, cache):
    v = _validator(spec, default)
    once = v.validate(GenerationRequest("a cat", width=256, height=256, cache=cache))
    twice = v.validate(once.request)
    assert once.request.cache is not None and twice.request.cache == once.request.cache
    assert twice.request == once.request  # nothing else moved either


def test_a_python_callers_mapping_is_read_and_its_faults_are_named_by_key():
    v = _validator()
    assert _cache(v, {"method": "first_block", "threshold": 0.25}) == FirstBlockCache(threshold=0.25)
    assert _cache(v, {"method": "none"}) == NoCache()
    for cache, says in [({"method": "first_block", "threshold": 11}, "cache.threshold: Input should be less than or "
                                                                     "equal to 10"),
                        ({"method": "first_block", "threshold": "high"}, "cache.threshold: Input should be a valid "
                                                                         "number"),
                        ({"method": "fbc"}, "cache.method 'fbc' is not a served method"),
                        ({"threshold": 0.1}, "cache.method is missing"),
                        ({"method": "none", "threshold": 0.1}, "unknown key 'threshold' in cache"),
                        ("first_block", "not a mapping")]:
        with pytest.raises(RequestError) as e:
            _cache(v, cache)
        assert e.value.field == "cache" and says in e.value.message, e.value.message
        assert "allowed: {\"method\": \"first_block\", \"threshold\": a number from 0 to 10 (omitted: 0.05)}" \
            in e.value.message
        assert not any(word in e.value.message for word in ("FirstBlockCache", "NoCache", "pydantic", "union_tag"))


def test_the_result_reports_the_finished_states_cache_and_none_without_one():
    from bcg_core.metrics import BucketMetrics
    from bcg_core.results import build_result
    from bcg_core.step_cache import RequestCache
    from bcg_core.step_cache.state import ContextCache
    from bcg_core.step_cache.step import CACHE_EXTRA

    v = _validator(default=DEFAULT)
    validated = v.validate(GenerationRequest("a cat", width=256, height=256))
    cache = RequestCache(FirstBlockCache(threshold=0.12), [ContextCache("cond", slice(0, 1), computed=3, reused=1)])
    timings = {"total": 1.0}

    def result(state):
        return build_result(validated, [b"png"], validated.key, 1, 1, BucketMetrics(v.table.keys), timings,
                            state=state)

    assert result(SimpleNamespace(extras={CACHE_EXTRA: cache})).cache == {
        "method": "first_block", "threshold": 0.12, "steps": {"cond": {"computed": 3, "reused": 1}}}
    assert result(SimpleNamespace(extras={})).cache is None
    assert result(None).cache is None
