"""A JSON body with a key sent twice is refused before the model reads it (``deployments/uploads.py``): a JSON
parser keeps the last one, so ``{"n": 11, "n": 1}`` would be served as n=1 while ``{"n": 1, "n": 11}`` is a 422."""

from starlette.requests import Request

from deployments.uploads import json_body_refusal, repeated_json_key


def _request(content_type: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/images/generations",
                    "headers": [(b"content-type", content_type.encode())]})


def test_a_key_sent_twice_at_any_depth_is_named_and_other_bodies_pass_through():
    assert repeated_json_key(b'{"prompt": "a", "n": 11, "n": 1}') == "n"
    assert repeated_json_key(b'{"prompt": "a", "lora": [{"name": "ink", "name": "pen"}]}') == "lora[0].name"
    assert repeated_json_key(b'{"cache": {"method": "first_block", "method": "none"}}') == "cache.method"
    assert repeated_json_key(b'{"a": {"b": 1}, "lora": [{"n": 1}, {"x": 1, "x": 2}]}') == "lora[1].x"
    assert repeated_json_key(b'{"prompt": "a", "n": 2}') is None
    assert repeated_json_key(b'{"prompt": ') is None  # not JSON: the model's parser says what is wrong
    assert repeated_json_key(b"[" * 100000) is None  # too deep for the parser: left to the model too


def test_the_refusal_is_a_422_naming_the_field_and_a_form_body_still_a_415():
    json_type = _request("application/json")
    assert json_body_refusal(json_type, b'{"prompt": "a", "n": 1, "n": 11}') == (
        422, "'n' is sent more than once in the JSON body; send each field once", "n")
    assert json_body_refusal(json_type, b'{"prompt": "a", "n": 1}') is None
    assert json_body_refusal(json_type, b'{"cache": {"method": "first_block", "method": "none"}}') == (
        422, "'cache.method' is sent more than once in the JSON body; send each field once", "cache")
    status, message, param = json_body_refusal(_request("multipart/form-data; boundary=x"), b"--x--")
    assert (status, param) == (415, None) and "/v1/images/edits" in message
