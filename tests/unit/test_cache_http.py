"""The step cache over HTTP without Ray: ``cache`` in a generation's JSON body (and from the Python handle) reaching the
engine's request, the config's default and ``null``, the 422s of a bad value (named by key, ``cache.threshold``,
``cache.method``, with what ``cache`` accepts, in OpenAI's error shape, without pydantic's type names or links) and of
a model that takes no cache, ``bcg.cache`` in the answer and ``cache_methods`` in ``GET /v1/models``. An edit's form
fields: ``tests/unit/test_edits_http.py``; served on the engine: ``tests/engine/test_cache_result.py``."""

from __future__ import annotations

import asyncio
import json

import pytest

from bcg_core.cache_field import cache_phrase
from bcg_core.errors import RequestError
from bcg_core.request import GenerationResult
from bcg_core.step_cache import METHODS, FirstBlockCache, NoCache, TaylorSeerCache
from deployments.answers import bcg_info
from deployments.settings import ServeConfig
from ingress_fakes import FakeDiT, bare_ingress, http_request

BUCKETS = {"batch_sizes": [1, 2], "resolutions": ["256x256"], "text_lengths": [256]}
ACCEPTS = f"allowed: {cache_phrase()}"  # every method served: the schema runs before the model is asked
FIRST_BLOCK = '{"method": "first_block", "threshold": a number from 0 to 10 (omitted: 0.05)}'
NONE = '{"method": "none"} or null for no cache; omitted: the server\'s cache.default'


def test_the_phrase_of_cache_names_each_method_its_keys_ranges_and_defaults():
    assert ACCEPTS.startswith(f"allowed: {FIRST_BLOCK}, or ") and ACCEPTS.endswith(NONE)
    assert all(f'"method": "{m}"' in ACCEPTS for m in METHODS)
NOT_SAID = ("FirstBlockCache", "NoCache", "pydantic", "union_tag", "tagged", "discriminator", "https://")


def _ingress(dit=None, default: dict | None = None, **config):
    return bare_ingress(dit or FakeDiT(), ServeConfig.model_validate(
        {"buckets": BUCKETS, "routing": {"shape_aware": False}, "cache": {"default": default}, **config}))


def _post(ingress, body: dict):
    return asyncio.run(ingress.generate(http_request({"prompt": "a cat", "size": "256x256", **body})))


def _error(answer) -> tuple[int, dict]:
    error = json.loads(answer.body)
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    return answer.status_code, error["error"]


def _sent_cache(body: dict, default: dict | None = None):
    dit = FakeDiT()
    answer = _post(_ingress(dit, default), body)
    assert len(answer.data) == 1
    (_, validated), = dit.sent
    return validated.request.cache


@pytest.fixture(scope="module")
def ingress():
    return _ingress()


def test_a_valid_cache_reaches_the_engine_request():
    assert _sent_cache({"cache": {"method": "first_block", "threshold": 0.12}}) == FirstBlockCache(threshold=0.12)
    assert _sent_cache({"cache": {"method": "first_block"}}) == FirstBlockCache(threshold=0.05)  # diffusers' default
    assert _sent_cache({"cache": {"method": "first_block", "threshold": 1}}) == FirstBlockCache(threshold=1.0)
    assert _sent_cache({"cache": {"method": "none"}}) == NoCache()
    assert _sent_cache({}) == NoCache()  # no default configured


def test_omitted_gets_the_servers_default_and_null_or_none_turn_it_off():
    default = {"method": "first_block", "threshold": 0.2}
    assert _sent_cache({}, default) == FirstBlockCache(threshold=0.2)
    assert _sent_cache({"cache": None}, default) == NoCache()
    assert _sent_cache({"cache": {"method": "none"}}, default) == NoCache()
    own = {"cache": {"method": "first_block", "threshold": 0.5}}
    assert _sent_cache(own, default) == FirstBlockCache(threshold=0.5)


# (cache sent, the fault as the message names it)
BAD = [
    ({"method": "fbc"}, "got 'fbc' at cache.method: not a served method"),
    ({"method": None}, "got null at cache.method: not a served method"),
    ({"threshold": 0.1}, "cache.method is missing"),
    ({"method": "first_block", "threshold": 11}, "got 11 at cache.threshold: Input should be less than or equal to 10"),
    ({"method": "first_block", "threshold": -0.1}, "got -0.1 at cache.threshold: Input should be greater than or "
                                                   "equal to 0"),
    ({"method": "first_block", "threshold": "0.1"}, "got '0.1' at cache.threshold: Input should be a valid number"),
    ({"method": "first_block", "threshold": True}, "got true at cache.threshold: Input should be a valid number"),
    ({"method": "first_block", "threshold": [1]}, "got [1] at cache.threshold: Input should be a valid number"),
    ({"method": "first_block", "every": 2}, "unknown key 'every' at cache"),
    ({"method": "none", "threshold": 0.1}, "unknown key 'threshold' at cache"),
]


@pytest.mark.parametrize("cache,fault", BAD, ids=[str(c) for c, _ in BAD])
def test_a_bad_cache_is_422_naming_the_key_and_what_cache_accepts(ingress, cache, fault):
    status, err = _error(_post(ingress, {"cache": cache}))
    assert (status, err["param"], err["type"]) == (422, "cache", "invalid_request_error")
    assert err["message"] == f"invalid 'cache' ({fault}); {ACCEPTS}", err["message"]
    assert not any(word in err["message"] for word in NOT_SAID)


@pytest.mark.parametrize("cache", ["first_block", 0.1, ["first_block"], True])
def test_a_cache_that_is_not_an_object_is_422_saying_so(ingress, cache):
    status, err = _error(_post(ingress, {"cache": cache}))
    assert (status, err["param"]) == (422, "cache")
    assert err["message"].startswith("invalid 'cache' (got ") and f"): not an object; {ACCEPTS}" in err["message"]
    assert not any(word in err["message"] for word in NOT_SAID)


def test_a_bad_cache_beside_another_fault_is_named_once_each(ingress):
    status, err = _error(_post(ingress, {"n": "2", "cache": {"method": "first_block", "threshold": 20}}))
    assert status == 422 and err["param"] == "n"
    assert "got 20 at cache.threshold" in err["message"] and err["message"].count("cache.default") == 1


def test_the_python_handle_takes_a_mapping_and_refuses_a_bad_one():
    dit = FakeDiT()
    ingress = _ingress(dit)
    asyncio.run(ingress.images({"prompt": "x", "width": 256, "height": 256,
                                "cache": {"method": "first_block", "threshold": 0.3}}))
    asyncio.run(ingress.images({"prompt": "x", "width": 256, "height": 256, "cache": NoCache()}))
    assert [v.request.cache for _, v in dit.sent] == [FirstBlockCache(threshold=0.3), NoCache()]
    with pytest.raises(RequestError) as e:
        asyncio.run(ingress.images({"prompt": "x", "width": 256, "height": 256,
                                    "cache": {"method": "first_block", "threshold": "x"}}))
    assert e.value.field == "cache" and "cache.threshold" in e.value.message and len(dit.sent) == 2


def test_the_answer_reports_what_the_cache_did_in_bcg():
    report = {"method": "first_block", "threshold": 0.12, "steps": {"cond": {"computed": 3, "reused": 1}}}

    class CachedDiT(FakeDiT):
        async def remote(self, validated):
            result = await super().remote(validated)
            result.cache = report
            return result

    answer = _post(_ingress(CachedDiT()), {"cache": {"method": "first_block", "threshold": 0.12}})
    assert answer.bcg.cache == report and answer.model_dump()["bcg"]["cache"] == report
    assert _post(_ingress(), {}).bcg.cache is None  # ran without one
    plain = GenerationResult(image_bytes=[], seed=1, bucket=None, hit=False, missed=[], real_tokens=1,
                             padded_tokens=1, steps=1, timings_ms={}, cache=report)
    dit = FakeDiT()
    _post(_ingress(dit), {})
    assert bcg_info(plain, {}, 0, dit.sent[0][1]).cache == report  # what a streamed answer's completed events carry


def test_the_model_card_lists_the_cache_methods_and_the_default():
    card = asyncio.run(_ingress().models(http_request({}))).data[0].bcg
    assert card["cache_methods"] == list(METHODS) and "first_block" in METHODS and card["cache_default"] is None
    card = _ingress(default={"method": "first_block", "threshold": 0.2})._model_card().bcg
    assert card["cache_default"] == {"method": "first_block", "threshold": 0.2}


def test_a_model_without_a_step_cache_lists_none_ignores_the_default_and_refuses_one(tmp_path):
    from tiny import pixart

    folder = pixart.build(tmp_path / "pixart")
    dit = FakeDiT()
    ingress = _ingress(dit, default={"method": "first_block"}, model={"path": str(folder), "device": "cpu",
                                                                       "dtype": "float32"},
                       buckets={"batch_sizes": [1], "resolutions": ["256x256"], "text_lengths": [32]},
                       limits={"min_side_px": 16, "max_side_px": 1024})
    card = ingress._model_card().bcg
    assert card["cache_methods"] == [] and card["cache_default"] is None
    status, err = _error(_post(ingress, {"cache": {"method": "first_block", "threshold": 0.1}}))
    assert (status, err["param"]) == (422, "cache") and not dit.sent
    assert "PixArtSigmaPipeline (family pixart) takes no step cache" in err["message"]
    assert "it is served for FLUX.1, Qwen-Image, Wan 2.1 (FluxPipeline, QwenImagePipeline and WanPipeline " \
           "checkpoints) and the tiny default" in err["message"]
    assert "{\"method\": \"none\"} or null, or omit 'cache'" in err["message"]
    _post(ingress, {})
    _post(ingress, {"cache": {"method": "none"}})
    assert [v.request.cache for _, v in dit.sent] == [NoCache(), NoCache()]  # the default ignored, none served


def test_the_openapi_body_schema_has_the_cache_models_inline_each_requiring_its_method():
    from deployments.ingress import app

    schema = app.openapi()["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]
    cache = schema["schema"]["properties"]["cache"]
    assert "$ref" not in json.dumps(cache) and "$defs" not in json.dumps(cache)
    union = next(o for o in cache["anyOf"] if "oneOf" in o)
    assert union["discriminator"] == {"propertyName": "method"}
    assert all(m["required"] == ["method"] for m in union["oneOf"])
    assert {m["properties"]["method"]["const"] for m in union["oneOf"]} == {*METHODS, "none"}


@pytest.mark.parametrize("variant", ["dev", "klein"])
def test_flux2_lists_what_diffusers_runs_on_it_and_refuses_first_block(tmp_path, variant):
    """FLUX.2 [klein] takes TaylorSeer only (diffusers' First Block Cache fails on FLUX.2's blocks), [dev] no cache
    (its pipeline sets no cache context): ``GET /v1/models`` says so, a default of another method is ignored, and a
    request for one is a 422 on ``cache`` naming the models that take it."""
    from tiny import flux2

    folder = flux2.build(tmp_path / variant, variant)
    dit = FakeDiT()
    ingress = _ingress(dit, default={"method": "taylor_seer"}, model={"path": str(folder), "device": "cpu",
                                                                      "dtype": "float32"},
                       limits={"min_side_px": 16, "max_side_px": 1024},
                       buckets={**BUCKETS, "text_lengths": [flux2.TEXT_TOKENS]})
    card = ingress._model_card().bcg
    taylor = variant == "klein"
    assert card["cache_methods"] == (["taylor_seer"] if taylor else [])
    assert card["cache_default"] == ({"method": "taylor_seer", "cache_interval": 5, "disable_cache_before_step": 3,
                                      "disable_cache_after_step": None, "max_order": 1,
                                      "taylor_factors_dtype": "bfloat16", "use_lite_mode": True} if taylor else None)
    status, err = _error(_post(ingress, {"cache": {"method": "first_block", "threshold": 0.1}}))
    assert (status, err["param"]) == (422, "cache") and not dit.sent
    if taylor:
        assert "Flux2KleinPipeline (family flux2) takes only taylor_seer (first_block is served for FLUX.1, " \
               "Qwen-Image, Wan 2.1 (FluxPipeline, QwenImagePipeline and WanPipeline checkpoints) and the tiny " \
               "default)" in err["message"]
        assert '"method": "taylor_seer"' in err["message"] and '"method": "first_block"' not in err["message"]
    else:
        assert "Flux2Pipeline (family flux2) takes no step cache" in err["message"]
        assert "taylor_seer alone for FLUX.2 [klein] (Flux2KleinPipeline checkpoints)" in err["message"]
    _post(ingress, {})
    assert dit.sent[0][1].request.cache == (TaylorSeerCache() if taylor else NoCache())
