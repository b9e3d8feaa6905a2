"""The 4xx messages of the HTTP API say each thing once, without Ray: a body with several unknown fields names them
all before one list of the allowed fields; a refused value is quoted once (the schema's size, model and ``lora``
count, the validator's size and prompt length, the ingress's unknown adapter); an enumeration's values (quality,
response_format, style, background, moderation, output_format) are listed once, in ``allowed``; faults inside
``lora`` share one ``allowed``. Every answer keeps its status, OpenAI's error shape and the field in ``param``."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from deployments.http_errors import validation_error_response
from deployments.schemas import ImageEditRequest, ImageGenerationRequest, RequestLimits
from deployments.settings import ServeConfig
from ingress_fakes import FakeDiT, bare_ingress, http_request

FIELDS = ", ".join(ImageGenerationRequest.model_fields)


@pytest.fixture(scope="module")
def ingress(tmp_path_factory):
    loras = tmp_path_factory.mktemp("loras")  # no adapter in it: every name is unknown
    config = ServeConfig.model_validate({"buckets": {"batch_sizes": [1, 2], "resolutions": ["256x256", "512x512"]},
                                         "lora": {"dir": str(loras), "max_per_request": 2, "max_scale": 4.0}})
    return bare_ingress(FakeDiT(), config)


def _post(ingress, body: dict) -> tuple[int, dict]:
    answer = asyncio.run(ingress.generate(http_request(body)))
    error = json.loads(answer.body)
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "invalid_request_error"
    return answer.status_code, error["error"]


def test_two_unknown_fields_are_both_named_before_one_list_of_the_fields(ingress):
    status, err = _post(ingress, {"prompt": "a cat", "foo": 1, "bar": 2})
    assert (status, err["param"]) == (422, "foo")
    assert err["message"] == f"unknown fields 'foo', 'bar'; allowed fields: {FIELDS}"
    assert err["message"].count("allowed fields") == 1 and err["message"].count("true_cfg_scale") == 1


def test_one_unknown_field_reads_as_before(ingress):
    status, err = _post(ingress, {"prompt": "a cat", "foo": 1})
    assert (status, err["param"], err["message"]) == (422, "foo", f"unknown field 'foo'; allowed fields: {FIELDS}")


def test_unknown_fields_beside_another_fault_still_give_the_fields_once(ingress):
    status, err = _post(ingress, {"prompt": "a cat", "foo": 1, "n": "2", "bar": 2, "baz": 3})
    assert status == 422
    message = err["message"]
    assert "unknown fields 'foo', 'bar', 'baz'; allowed fields: " in message and message.count("allowed fields") == 1
    assert "invalid 'n' (got '2'): Input should be a valid integer; allowed: an integer from 1 to 10" in message


def test_an_edits_unknown_fields_are_named_together_too():
    with pytest.raises(ValidationError) as e:
        ImageEditRequest.model_validate({"prompt": "a cat", "image": b"x", "input_fidelity": "high", "foo": "1"})
    answer = validation_error_response(e.value, RequestLimits(), ImageEditRequest)
    err = json.loads(answer.body)["error"]
    assert (answer.status_code, err["param"]) == (422, "input_fidelity")
    fields = ", ".join(ImageEditRequest.model_fields)
    assert err["message"] == f"unknown fields 'input_fidelity', 'foo'; allowed fields: {fields}"


# (body, param, the message's start, a text the message holds exactly once)
QUOTED_ONCE = [
    ({"size": "abc"}, "size", "invalid 'size' (got 'abc'): not of the form 'WxH' with positive integer pixels "
                              "(for example '512x512'); allowed: 'auto'", "'abc'"),
    ({"size": "500x500"}, "size", "invalid 'size' (got '500x500'): width 500 is not a multiple of 16; use 496 or 512; "
                                  "allowed: 'auto'", "500x500"),
    ({"model": "dall-e-3"}, "model", "invalid 'model' (got 'dall-e-3'): not served here; allowed: 'bcg-tiny-flux'",
     "dall-e-3"),
    ({"prompt": "x" * 4001}, "prompt", "invalid 'prompt' (got '4001 characters'): too long; allowed: a non-empty "
                                       "string of at most 4000 characters", "4001"),
    ({"lora": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}, "lora",
     "invalid 'lora' (got a list of 3 entries): more entries than lora.max_per_request 2; allowed: ", "3"),
    ({"lora": [{"name": "nope"}]}, "lora", "invalid 'lora': no adapter 'nope' in lora.dir (adapters: none; GET "
                                           "/v1/models lists them); allowed: ", "nope"),
    ({"quality": "ultra"}, "quality", "invalid 'quality' (got 'ultra'): not a served value; allowed: 'low', 'medium', "
                                      "'high', 'auto', 'standard'", "'low'"),
    ({"response_format": "url"}, "response_format", "invalid 'response_format' (got 'url'): not a served value; "
                                                    "allowed: 'b64_json'", "'b64_json'"),
    ({"style": "natural"}, "style", "invalid 'style' (got 'natural'): not a served value; allowed: 'vivid'", "'vivid'"),
    ({"background": "transparent"}, "background", "invalid 'background' (got 'transparent'): not a served value; "
                                                  "allowed: 'auto', 'opaque'", "'opaque'"),
    ({"moderation": "high"}, "moderation", "invalid 'moderation' (got 'high'): not a served value; allowed: 'auto', "
                                           "'low'", "'low'"),
    ({"output_format": "tiff"}, "output_format", "invalid 'output_format' (got 'tiff'): not a served value; allowed: "
                                                 "'png', 'jpeg', 'webp'", "'webp'"),
]


@pytest.mark.parametrize("body,param,starts,once", QUOTED_ONCE, ids=[f"{q[1]}-{q[3]}" for q in QUOTED_ONCE])
def test_a_refused_value_and_the_allowed_values_are_each_said_once(ingress, body, param, starts, once):
    status, err = _post(ingress, {"prompt": "a cat", **body})
    assert (status, err["param"]) == (422, param), err
    assert err["message"].startswith(starts), err["message"]
    assert err["message"].count(once) == 1, err["message"]
    assert err["message"].count("allowed") == 1, err["message"]


@pytest.mark.parametrize("entries,faults", [
    ([{"name": "a", "scale": "x"}, {"name": "b", "scale": "y"}],
     "got 'x' at lora[0].scale: Input should be a valid number; got 'y' at lora[1].scale: Input should be a valid "
     "number"),
    ([{"name": "a", "q": 1, "r": 2}], "unknown key 'q' at lora[0]; unknown key 'r' at lora[0]"),
])
def test_faults_inside_lora_share_one_allowed_and_name_a_key_once(ingress, entries, faults):
    status, err = _post(ingress, {"prompt": "a cat", "lora": entries})
    assert (status, err["param"]) == (422, "lora")
    assert err["message"].startswith(f"invalid 'lora' ({faults}); allowed: a list of at most 2 "), err["message"]
    assert err["message"].count("allowed") == 1
