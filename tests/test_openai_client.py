"""The official ``openai`` client talks to the server unchanged (OpenAI Images API compatibility)."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

pytestmark = pytest.mark.serve


@pytest.fixture
def client(serve_apps):
    """An ``OpenAI`` client on the local server; no retries, and no proxy from the environment (loopback)."""
    from openai import OpenAI

    with httpx.Client(trust_env=False, timeout=120.0) as http:
        yield OpenAI(base_url=f"{serve_apps.base_url}/v1", api_key="unused", max_retries=0, http_client=http)


def test_openai_client_generates_a_png(client):
    result = client.images.generate(
        prompt="a lighthouse at dusk",
        size="256x256",
        n=1,
        response_format="b64_json",
        extra_body={"num_inference_steps": 1, "seed": 1},
    )
    assert len(result.data) == 1
    raw = base64.b64decode(result.data[0].b64_json)
    assert raw.startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(io.BytesIO(raw)) as img:
        assert img.size == (256, 256)


def test_openai_client_raises_its_bad_request_type_on_a_bad_size(client):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.images.generate(prompt="x", size="100x100", n=1, response_format="b64_json")
    assert info.value.status_code == 422
    assert "size" in str(info.value)
