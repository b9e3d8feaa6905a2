"""The official ``openai`` client talks to the server unchanged (OpenAI Images API compatibility)."""

from __future__ import annotations

import base64
import io
import os

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


@pytest.mark.parametrize("fmt,pil", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_openai_client_gets_every_output_format(client, fmt, pil):
    result = client.images.generate(
        prompt="a lighthouse at dusk", size="256x256", n=1, output_format=fmt, quality="low",
        output_compression=None if fmt == "png" else 60, extra_body={"seed": 1})
    assert result.output_format == fmt and result.size == "256x256"
    assert result.usage.input_tokens == result.usage.input_tokens_details.text_tokens > 0
    assert result.usage.output_tokens == 256 and result.model_extra["bcg"]["steps"] == 2  # quality low: 2 steps
    with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as img:
        img.load()
        assert img.format == pil and img.size == (256, 256)


def test_openai_client_lists_the_served_model(client):
    models = list(client.models.list())
    assert len(models) == 1 and models[0].object == "model"
    assert models[0].model_extra["bcg"]["buckets"]["resolutions"] == ["256x256", "512x512"]
    assert client.models.retrieve(models[0].id).id == models[0].id


def test_openai_client_refuses_gif_with_the_allowed_values(client):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.images.generate(prompt="x", size="256x256", output_format="gif")
    assert "output_format" in str(info.value) and "'png', 'jpeg', 'webp'" in str(info.value)


def test_openai_client_size_auto_is_the_default_size(client):
    result = client.images.generate(prompt="a lighthouse at dusk", size="auto", extra_body={"num_inference_steps": 1})
    assert result.size == "512x512" and "_i1024_" in result.model_extra["bcg"]["bucket"]
    with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as img:
        assert img.size == (512, 512)


@pytest.mark.parametrize("quality,served,steps", [("standard", "medium", 4), ("hd", "high", 8)])
def test_openai_client_dall_e_qualities_are_served_as_medium_and_high(client, quality, served, steps):
    result = client.images.generate(prompt="a lighthouse at dusk", size="256x256", quality=quality)
    assert result.quality == served and result.model_extra["bcg"]["steps"] == steps  # the tiny default's steps


def _png(side: int = 256) -> bytes:
    """A PNG of noise (incompressible: ~3 MiB at 1024 px)."""
    buf = io.BytesIO()
    Image.frombytes("RGB", (side, side), os.urandom(3 * side * side)).save(buf, format="PNG")
    return buf.getvalue()


def _mask(side: int = 256) -> bytes:
    """OpenAI's mask: opaque keeps, fully transparent (the left half) is edited."""
    im = Image.new("RGBA", (side, side), (0, 0, 0, 255))
    im.paste((0, 0, 0, 0), (0, 0, side // 2, side))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def test_openai_client_edits_an_image(client):
    """images.edit: image-to-image as JSON, inpainting streamed, a bad mask and two images refused (422 naming the
    field), then the server still serves."""
    import openai

    image = _png()
    result = client.images.edit(image=("photo.png", image, "image/png"), prompt="a lighthouse at dusk",
                                size="256x256", extra_body={"num_inference_steps": 2, "strength": 0.5, "seed": 3})
    assert result.size == "256x256" and result.model_extra["bcg"]["steps"] == 1  # int(2 x 0.5)
    assert result.usage.input_tokens_details.image_tokens == 256
    with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as img:
        assert img.format == "PNG" and img.size == (256, 256)

    stream = client.images.edit(image=("photo.png", image, "image/png"), mask=("mask.png", _mask(), "image/png"),
                                prompt="a red door", stream=True, partial_images=1, output_format="jpeg",
                                extra_body={"num_inference_steps": 4, "strength": 0.5})  # no size: the image's
    events = list(stream)
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert events[1].size == "256x256" and events[1].model_extra["bcg"]["steps"] == 2
    with Image.open(io.BytesIO(base64.b64decode(events[1].b64_json))) as img:
        assert img.format == "JPEG" and img.size == (256, 256)

    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.images.edit(image=image, mask=_mask(128), prompt="x")
    assert info.value.body["param"] == "mask" and "same size" in info.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.images.edit(image=[image, image], prompt="x")
    assert info.value.body["param"] == "image" and "edits one image" in info.value.body["message"]
    again = client.images.edit(image=image, prompt="x", extra_body={"num_inference_steps": 1})
    assert again.size == "256x256" and again.model_extra["bcg"]["steps"] == 1  # int(1 x 0.6) = 0: at least 1


def test_openai_client_create_variation_gets_the_clear_not_supported_error(client):
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        client.images.create_variation(image=("noise.png", _png(1024), "image/png"), n=1)  # the body is not read
    err = info.value.body
    assert info.value.status_code == 404 and err["code"] == "unsupported_endpoint"
    assert err["message"].startswith("POST /v1/images/variations: image variations are not supported")
    assert "POST /v1/images/edits" in err["message"]
