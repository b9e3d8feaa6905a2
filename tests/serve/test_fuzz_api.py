"""Schema fuzzing: schemathesis against the application's own OpenAPI schema, every route, with and without an
API key, streamed and not (``stream`` is a field of the request schema, so generated bodies set it).

Checks on every response: no 5xx (``not_a_server_error``); the status is one the schema declares; the content type
and the body match the schema, errors included; every 4xx is OpenAI's error shape and names the field at fault
(``param``) or, for a body-level error (malformed JSON, a missing or wrong key), says what to send. The app under
test has small limits (256 px sides, 2 images, 2 steps) so that the bodies the fuzzer makes valid generate quickly
on a CPU; ``max_examples`` bounds the run (a few minutes on 2 cores). Inputs it found that broke something are
regression cases in ``tests/serve/test_http_api.py`` and here.
"""

from __future__ import annotations

import io

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from PIL import Image
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

KEY = "sk-fuzz-0123456789abcdef"
FUZZ_CONFIG = {
    "buckets": {"batch_sizes": [1, 2, 4], "resolutions": ["256x256"], "text_lengths": [256]},
    "limits": {"min_side_px": 256, "max_side_px": 256, "max_images": 2, "max_steps": 2, "default_steps": 1},
    "routing": {"shape_aware": False},
    "auth": {"api_keys": [KEY]},
}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_EXAMPLES = 15
"""Generated cases per operation (each sent twice): the bound on the run's length."""
FIELD_FREE = ("JSON", "API key", "Authorization", "body", "not found", "Not Found", "Method Not Allowed",
              "not supported")
"""Words of a 4xx without ``param`` that still says what to send: the body as a whole (not JSON, not readable
multipart, another content type), the key, or the route (an OpenAI route not served, image variations, says which
one to use instead)."""


@pytest.fixture(scope="module")
def fuzz_url(serve_apps):
    from ray import serve

    from deployments import build_app

    serve.run(build_app({"config": FUZZ_CONFIG}), name="bcg-fuzz", route_prefix="/fuzz")
    try:
        yield f"{serve_apps.base_url}/fuzz"
    finally:
        serve.delete("bcg-fuzz")


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_url):
    schema = httpx.get(f"{fuzz_url}/openapi.json", timeout=60, trust_env=False).json()
    return schemathesis.openapi.from_dict(schema)


def check_error_names_the_field(response) -> None:
    """A 4xx is OpenAI's error shape, and names the field (``param``) or what to send instead."""
    if not 400 <= response.status_code < 500:
        return
    body = response.json()
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert err.get("param") or any(w in err["message"] for w in FIELD_FREE), body


@pytest.mark.serve
def test_every_route_answers_within_its_schema_with_and_without_a_key(fuzz_schema, fuzz_url):
    """Every operation of the schema, ``MAX_EXAMPLES`` generated cases each, each case sent with the key and
    without it (then 401, but ``/healthz``)."""
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    assert {op.label for op in operations} >= {"GET /healthz", "GET /v1/models", "GET /v1/models/{model_id}",
                                               "GET /v1/buckets", "POST /v1/images/generations",
                                               "POST /v1/images/edits", "POST /v1/images/variations"}
    seen: dict[str, set[int]] = {}
    for op in operations:
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            for headers in ({"Authorization": f"Bearer {KEY}"}, {}):
                response = case.call(base_url=fuzz_url, headers=headers, timeout=120)
                case.validate_response(response, checks=CHECKS)
                check_error_names_the_field(response)
                if not headers and case.path != "/healthz":
                    assert response.status_code == 401, (case.path, response.status_code)
                seen.setdefault(op.label, set()).add(response.status_code)  # noqa: B023 - run() runs at once

        run()
    # the fuzzer got past the key check to the field checks (its random bodies are almost never valid: the
    # test below sends valid ones, streamed and not, to the same server afterwards)
    assert {401, 422} <= seen["POST /v1/images/generations"], seen
    assert {401, 422} <= seen["POST /v1/images/edits"], seen  # multipart bodies, read and refused naming the field
    # whatever multipart body the fuzzer sends, variations answer the key check, then 404 (never read)
    assert seen["POST /v1/images/variations"] == {401, 404}, seen


@pytest.mark.serve
def test_the_server_still_serves_after_the_fuzzing(fuzz_url):
    r = httpx.post(f"{fuzz_url}/v1/images/generations", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"prompt": "a red cube", "size": "256x256", "num_inference_steps": 1}, trust_env=False)
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    with httpx.stream("POST", f"{fuzz_url}/v1/images/generations", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "a red cube", "size": "256x256", "num_inference_steps": 2, "stream": True,
                            "partial_images": 1}, timeout=120, trust_env=False) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    assert "image_generation.partial_image" in text and "image_generation.completed" in text
    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (20, 90, 200)).save(buf, format="PNG")
    r = httpx.post(f"{fuzz_url}/v1/images/edits", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   files={"image": ("blue.png", buf.getvalue(), "image/png")},
                   data={"prompt": "a red cube", "num_inference_steps": "1"}, trust_env=False)
    assert r.status_code == 200 and r.json()["size"] == "256x256"
