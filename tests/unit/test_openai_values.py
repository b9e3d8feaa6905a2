"""OpenAI's edge values without Ray: ``size: "auto"`` (the default size), ``quality: "standard"`` and ``"hd"``
(served as ``medium`` and ``high``), the allowed-values wording that names them, and ``POST /v1/images/variations``
answered 404 in OpenAI's error shape naming the edits endpoint (after the key check, the body never read; edits
themselves: ``tests/unit/test_edits_http.py``). The same through the official client on a running server:
``tests/serve/test_openai_client.py``."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError
from starlette.requests import Request

from bcg_core import BucketConfig, GenerationRequest, RequestError, RequestValidator, ShapeRules
from bcg_core.config import EngineConfig
from deployments.http_errors import validation_error_response
from deployments.ingress import app
from deployments.schemas import ImageGenerationRequest, RequestLimits
from deployments.settings import ServeConfig
from ingress_fakes import FakeDiT, bare_ingress, http_request as _http

RULES = ShapeRules(pixels_per_token=16, grid_keyed=False, native_text_tokens=32)
KEY = "sk-edits-5d1e7a90c3b2"


def _validator() -> RequestValidator:
    cfg = EngineConfig(buckets=BucketConfig(batch_sizes=[1, 2], resolutions=["256x256", "512x512"],
                                           text_lengths=[32]))
    return RequestValidator(cfg, RULES, count_tokens=lambda s, negative=False: 3)


def _ingress(dit=None, config: dict | None = None):
    config = ServeConfig.model_validate(config or {"buckets": {"batch_sizes": [1, 2], "resolutions": ["256x256",
                                                                                                     "512x512"]}})
    return bare_ingress(dit or FakeDiT(), config)


def _error(answer) -> tuple[int, dict]:
    return answer.status_code, json.loads(answer.body)["error"]


# -- size: "auto" ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [{"size": "auto"}, {}, {"size": None}])
def test_size_auto_omitted_and_null_leave_the_size_to_the_validator(body):
    req = ImageGenerationRequest.model_validate({"prompt": "x", **body})
    assert req.size == "auto" and req.width_height() == (None, None)


@pytest.mark.parametrize("size", ["AUTO", "Auto", "auto ", "512"])
def test_other_words_are_still_refused_naming_auto_and_wxh(size):
    with pytest.raises(ValidationError) as e:
        ImageGenerationRequest.model_validate({"prompt": "x", "size": size})
    status, err = _error(validation_error_response(e.value, RequestLimits()))
    assert status == 422 and err["param"] == "size"
    assert ("allowed: 'auto' (the model's default size, GET /v1/models: limits.default_size; for an edit the input "
            "image's) or a string 'WxH' with width and height from 256 to 2048") in err["message"]


def test_size_auto_is_resolved_by_the_validator_at_the_models_default_size_fitted_into_the_limits():
    dit = FakeDiT()
    answer = asyncio.run(_ingress(dit).generate(_http({"prompt": "x", "size": "auto", "num_inference_steps": 1})))
    (_, validated), = dit.sent
    r = validated.request
    assert (r.width, r.height) == (512, 512) and answer.size == "512x512"  # the tiny default's
    assert validated.lookup.key.image_tokens == 1024  # the 512x512 bucket: looked up like any size

    # a server whose sides stop at 256 serves 'auto' at the default fitted into its limits (table.fit_size), and
    # refuses a size sent outside them, naming the default it serves
    dit = FakeDiT()
    small = _ingress(dit, {"buckets": {"batch_sizes": [1], "resolutions": ["256x256"]},
                           "limits": {"min_side_px": 256, "max_side_px": 256}})
    answer = asyncio.run(small.generate(_http({"prompt": "x", "size": "auto", "num_inference_steps": 1})))
    (_, validated), = dit.sent
    assert (validated.request.width, validated.request.height) == (256, 256) and answer.size == "256x256"
    status, err = _error(asyncio.run(small.generate(_http({"prompt": "x", "size": "512x512"}))))
    assert status == 422 and "'auto'" not in err["message"].split("allowed:")[0]  # the note is for 'auto' only


# -- quality: "standard" and "hd" ------------------------------------------------------------------------------


@pytest.mark.parametrize("alias,served", [("standard", "medium"), ("hd", "high")])
def test_quality_aliases_are_validated_as_medium_and_high(alias, served):
    assert ImageGenerationRequest.model_validate({"prompt": "x", "quality": alias}).quality == alias
    validator = _validator()
    validated = validator.validate(GenerationRequest("a cat", quality=alias))
    same = validator.validate(GenerationRequest("a cat", quality=served))
    assert validated.request.quality == served  # a validated request holds a served value
    assert validated.request.num_inference_steps == same.request.num_inference_steps == {"medium": 4, "high": 8}[served]
    # the config's quality section sets them too (standard follows medium)
    cfg = EngineConfig(buckets=BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[32]),
                       quality={served: 7})
    validated = RequestValidator(cfg, RULES, count_tokens=lambda s, negative=False: 3).validate(
        GenerationRequest("a cat", width=256, height=256, quality=alias))
    assert validated.request.num_inference_steps == 7


@pytest.mark.parametrize("alias,served,steps", [("standard", "medium", 4), ("hd", "high", 8)])
def test_the_answer_reports_the_quality_served(alias, served, steps):
    dit = FakeDiT()
    answer = asyncio.run(_ingress(dit).generate(_http({"prompt": "x", "size": "256x256", "quality": alias})))
    (_, validated), = dit.sent
    assert answer.quality == served and validated.request.num_inference_steps == steps


ALLOWED_QUALITY = "'low', 'medium', 'high', 'auto', 'standard' (= 'medium'), 'hd' (= 'high')"


@pytest.mark.parametrize("quality", ["HD", "ultra", "xhigh", 3])
def test_a_bad_quality_names_every_allowed_value_on_both_paths(quality):
    with pytest.raises(ValidationError) as e:
        ImageGenerationRequest.model_validate({"prompt": "x", "quality": quality})
    status, err = _error(validation_error_response(e.value, RequestLimits()))
    assert status == 422 and err["param"] == "quality" and ALLOWED_QUALITY in err["message"]
    with pytest.raises(RequestError) as e:
        _validator().validate(GenerationRequest("a cat", quality=quality))
    assert e.value.field == "quality" and ALLOWED_QUALITY in e.value.message


def test_the_model_card_shows_the_default_size_and_the_aliases():
    card = _ingress()._model_card().bcg
    assert card["limits"]["default_size"] == "512x512"
    assert card["quality_aliases"] == {"standard": "medium", "hd": "high"}


# -- POST /v1/images/variations --------------------------------------------------------------------------------


def _unread(path: str, headers: list[tuple[bytes, bytes]]) -> Request:
    """A request whose body must never be read (a multipart upload the route has no parser for)."""

    async def receive():
        raise AssertionError("the route read the body")

    scope = {"type": "http", "method": "POST", "path": path, "headers": [
        (b"content-type", b"multipart/form-data; boundary=x"), (b"content-length", b"99999999"), *headers]}
    return Request(scope, receive)


ROUTES = [("variations", "/v1/images/variations", "image variations are not supported")]


@pytest.mark.parametrize("method,path,says", ROUTES)
def test_variations_answer_404_saying_what_is_supported(method, path, says):
    ingress = _ingress()
    status, err = _error(asyncio.run(getattr(ingress, method)(_unread(path, []))))
    assert status == 404 and err["type"] == "invalid_request_error" and err["code"] == "unsupported_endpoint"
    assert err["param"] is None and says in err["message"] and "POST /v1/images/edits" in err["message"]
    assert err["message"].startswith(f"POST {path}: ")


@pytest.mark.parametrize("method,path,says", ROUTES)
def test_variations_ask_for_the_key_first(method, path, says):
    ingress = _ingress(config={"buckets": {"batch_sizes": [1], "resolutions": ["256x256"]},
                               "auth": {"api_keys": [KEY]}})
    route = getattr(ingress, method)
    status, err = _error(asyncio.run(route(_unread(path, []))))
    assert status == 401 and "API key" in err["message"]
    status, err = _error(asyncio.run(route(_unread(path, [(b"authorization", b"Bearer sk-wrong")]))))
    assert status == 401 and err["code"] == "invalid_api_key"
    status, err = _error(asyncio.run(route(_unread(path, [(b"authorization", f"Bearer {KEY}".encode())]))))
    assert status == 404 and says in err["message"]


def test_the_openapi_schema_documents_variations_as_404():
    op = app.openapi()["paths"]["/v1/images/variations"]["post"]
    assert set(op["responses"]) == {"401", "404"}
    assert op["requestBody"]["required"] is False and "multipart/form-data" in op["requestBody"]["content"]
