"""``POST /v1/images/edits`` without Ray: the official ``openai`` client's multipart body (``images.edit``, through an
``httpx.MockTransport`` into the ingress's route) mapped onto ``GenerationRequest``, ``lora`` in its two multipart
forms, every bad input answered 4xx in OpenAI's error shape naming the field (the image and mask checks are the
validator's, :mod:`bcg_core.edits`), the body bound (413 before the upload is read whole), ``image_edit.*`` events,
``bcg.edits`` of ``GET /v1/models`` and ``/v1/images/variations`` naming the edits endpoint. Served for real:
``tests/serve/test_openai_client.py::test_openai_client_edits_an_image``."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import json
import struct
import zlib

import httpx
import pytest
from PIL import Image
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request

from bcg_core.request import GenerationResult
from deployments.schemas import ImageEditRequest
from deployments.settings import ServeConfig
from deployments.uploads import FormError, edit_fields
from ingress_fakes import FakeDiT, bare_ingress
from sse import parse_sse

BUCKETS = {"batch_sizes": [1, 2], "resolutions": ["256x256", "512x512"], "text_lengths": [256]}
KEY = "sk-edits-0b6e1d2c9a"


def _png(size=(256, 256), mode="RGB", color=(200, 30, 30), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


def _mask(size=(256, 256), hole=True) -> bytes:
    """OpenAI's mask: opaque keeps, fully transparent (the top-left quarter) is edited."""
    im = Image.new("RGBA", size, (0, 0, 0, 255))
    if hole:
        im.paste((0, 0, 0, 0), (0, 0, size[0] // 2, size[1] // 2))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _noise_png(size=(256, 256)) -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", size, bytes(range(256)) * (3 * size[0] * size[1] // 256)).effect_spread(9).save(
        buf, format="PNG")
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG of a signature, an IHDR claiming ``width`` x ``height`` and IEND: tiny, decoding to gigapixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


def _broken_png() -> bytes:
    """A PNG whose IDAT length is cut short, so the next chunk header is pixel data: Pillow's loader raises
    SyntaxError ("broken PNG file"), which bcg_core.edits does not catch; the ingress answers 422 all the same."""
    buf = io.BytesIO()
    Image.frombytes("RGB", (64, 48), bytes(range(256)) * 36).save(buf, format="PNG")
    png = buf.getvalue()
    i = png.index(b"IDAT")
    return (png[:i - 4] + struct.pack(">I", 20) + b"IDAT" + png[i + 4:i + 24] + b"\0\0\0\0\x9e\x0c\xca\xca"
            + png[i + 24:])


def _ingress(dit=None, **config):
    return bare_ingress(dit or FakeDiT(), ServeConfig.model_validate(
        {"buckets": BUCKETS, "routing": {"shape_aware": False}, **config}))


def _starlette(method: str, path: str, headers, chunks: list[bytes] | None = None, forever: bytes | None = None,
               reads: list | None = None) -> Request:
    """A Starlette request whose body arrives as ``chunks`` (or ``forever`` the same chunk); ``reads`` counts them."""
    chunks = list(chunks or [])

    async def receive():
        if reads is not None:
            reads.append(1)
        if forever is not None:
            return {"type": "http.request", "body": forever, "more_body": True}
        if not chunks:
            return {"type": "http.disconnect"}
        body = chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    return Request({"type": "http", "method": method, "path": path,
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}, receive)


async def _answer(ingress, request: httpx.Request) -> httpx.Response:
    """The ingress's answer to an httpx request, as an httpx response (a route returns a model, JSONResponse or
    StreamingResponse)."""
    path = request.url.path
    route = ingress.edits if path.endswith("/images/edits") else ingress.variations
    ans = await route(_starlette(request.method, path, request.headers.items(), [request.read()]))
    if hasattr(ans, "model_dump_json"):
        return httpx.Response(200, content=ans.model_dump_json(), headers={"content-type": "application/json"})
    if hasattr(ans, "body_iterator"):
        body = b"".join([c async for c in ans.body_iterator])
        return httpx.Response(ans.status_code, content=body, headers={"content-type": ans.media_type})
    return httpx.Response(ans.status_code, content=ans.body, headers=dict(ans.headers))


def _client(ingress):
    from openai import OpenAI

    transport = httpx.MockTransport(lambda request: asyncio.run(_answer(ingress, request)))
    return OpenAI(base_url="http://bcg.test/v1", api_key="unused", max_retries=0,
                  http_client=httpx.Client(transport=transport))


def _post(ingress, files=None, data=None, content=None, headers=None) -> tuple[int, dict]:
    """POST /v1/images/edits with an httpx-encoded body; ``(status, error)`` of the answer."""
    request = httpx.Request("POST", "http://bcg.test/v1/images/edits", files=files, data=data, content=content,
                            headers=headers)
    answer = asyncio.run(_answer(ingress, request))
    return answer.status_code, answer.json().get("error")


@pytest.fixture(scope="module")
def ingress():
    return _ingress()


@pytest.fixture
def recorded():
    dit = FakeDiT()
    return dit, _ingress(dit)


# -- the official client's body, mapped ------------------------------------------------------------------------


def test_the_clients_fields_and_extensions_reach_the_engine_request(recorded):
    dit, ingress = recorded
    image, mask = _png((300, 260)), _mask((300, 260))
    result = _client(ingress).images.edit(
        image=("photo.png", image, "image/png"), mask=("mask.png", mask, "image/png"), prompt="a blue door", n=2,
        size="256x256", output_format="webp", output_compression=70, quality="low", response_format="b64_json",
        user="u1", extra_body={"seed": 7, "num_inference_steps": 4, "guidance_scale": 2.5, "negative_prompt": "fog",
                               "strength": 0.5})
    (_, validated), = dit.sent
    r = validated.request
    assert (r.prompt, r.n, r.width, r.height, r.seed, r.negative_prompt) == ("a blue door", 2, 256, 256, 7, "fog")
    assert (r.num_inference_steps, r.guidance_scale, r.strength, validated.steps_run) == (4, 2.5, 0.5, 2)
    assert (r.output_format, r.output_compression, r.quality, r.partial_images) == ("webp", 70, "low", 0)
    assert r.image == image and r.mask == mask  # the files' bytes, untouched
    assert result.size == "256x256" and result.usage.input_tokens_details.image_tokens == 256  # the input image
    assert result.usage.input_tokens == result.usage.input_tokens_details.text_tokens + 256


def test_an_edit_without_size_takes_its_images_size_rounded_down_to_the_token_size(recorded):
    dit, ingress = recorded
    result = _client(ingress).images.edit(image=_png((300, 260)), prompt="x")
    (_, validated), = dit.sent
    assert (validated.request.width, validated.request.height) == (288, 256) and result.size == "288x256"
    assert validated.request.mask is None and validated.request.strength == 0.6  # image-to-image, the default strength


def test_a_photo_tagged_as_turned_is_edited_upright_as_it_is_shown(recorded):
    """A 640x480 JPEG whose EXIF orientation is 6 (shown turned a quarter, 480x640, as a phone's portrait photo) is
    edited upright: its default size is 480x640, and a mask drawn on the upright picture (480x640) fits it."""
    dit, ingress = recorded
    im = Image.new("RGB", (640, 480), (10, 200, 30))
    exif = im.getexif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif)
    photo = buf.getvalue()
    result = _client(ingress).images.edit(image=photo, prompt="x")
    assert result.size == "480x640" and (dit.sent[0][1].request.width, dit.sent[0][1].request.height) == (480, 640)
    result = _client(ingress).images.edit(image=photo, mask=_mask((480, 640)), prompt="x")
    assert result.size == "480x640"
    status, err = _post(ingress, files={"image": ("p.jpg", photo), "mask": ("m.png", _mask((640, 480)))},
                        data={"prompt": "x"})
    assert status == 422 and "'mask' is 640x480, the image 480x640" in err["message"]


@pytest.mark.parametrize("image, want", [((2600, 1950), (2048, 1536)),  # a photo larger than max_side_px 2048
                                         ((200, 150), (336, 256)),  # smaller than min_side_px 256
                                         ((4000, 200), (2048, 256))])  # cannot keep its aspect: both bounds hold
def test_an_edit_without_size_is_scaled_to_fit_the_side_limits(recorded, image, want):
    dit, ingress = recorded
    result = _client(ingress).images.edit(image=_png(image), prompt="x")
    (_, validated), = dit.sent
    assert (validated.request.width, validated.request.height) == want and result.size == "{}x{}".format(*want)


def test_lora_from_extra_body_arrives_as_bracketed_fields_and_is_read(tmp_path):
    import openai

    folder = tmp_path / "loras"
    folder.mkdir()
    for name in ("ink", "water"):
        (folder / f"{name}.safetensors").write_bytes(b"x")
    dit = FakeDiT()
    client = _client(_ingress(dit, lora={"dir": str(folder)}))
    client.images.edit(image=_png(), prompt="x", extra_body={"lora": [{"name": "ink", "scale": 0.5},
                                                                      {"name": "water", "scale": 1}]})
    client.images.edit(image=_png(), prompt="x", extra_body={"lora": [{"name": "ink"}, {"name": "water"}]})
    client.images.edit(image=_png(), prompt="x", extra_body={"lora": json.dumps([{"name": "ink"},
                                                                                 {"name": "water", "scale": -1}])})
    assert [validated.request.lora for _, validated in dit.sent] == [
        (("ink", 0.5), ("water", 1.0)), (("ink", 1.0), ("water", 1.0)), (("ink", 1.0), ("water", -1.0))]
    # the client sends every name, then every scale: an entry without a scale beside one with cannot be placed
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.images.edit(image=_png(), prompt="x", extra_body={"lora": [{"name": "ink"},
                                                                          {"name": "water", "scale": -1}]})
    assert e.value.body["param"] == "lora" and "give every entry a scale" in e.value.body["message"]


def test_cache_from_extra_body_arrives_as_bracketed_fields_and_is_read():
    import openai

    from bcg_core.step_cache import FirstBlockCache, NoCache

    dit = FakeDiT()
    client = _client(_ingress(dit))
    client.images.edit(image=_png(), prompt="x", extra_body={"cache": {"method": "first_block", "threshold": 0.12}})
    client.images.edit(image=_png(), prompt="x", extra_body={"cache": json.dumps({"method": "none"})})
    client.images.edit(image=_png(), prompt="x")
    assert [validated.request.cache for _, validated in dit.sent] == [FirstBlockCache(threshold=0.12), NoCache(),
                                                                      NoCache()]
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.images.edit(image=_png(), prompt="x", extra_body={"cache": {"method": "first_block", "threshold": "x"}})
    assert e.value.body["param"] == "cache" and "got 'x' at cache.threshold" in e.value.body["message"]
    assert len(dit.sent) == 3
    for items, says in [([("cache", "{method: none}")], "it is not JSON"),
                        ([("cache", "{}"), ("cache[method]", "none")], "both as JSON and as bracketed fields"),
                        ([("cache[method]", "none"), ("cache[method]", "first_block")], "sent more than once")]:
        with pytest.raises(FormError) as e:
            asyncio.run(edit_fields(_form(("image", b"x"), *items)))
        assert e.value.field == "cache" and says in e.value.message


def _form(*items) -> FormData:
    return FormData([(k, UploadFile(io.BytesIO(v), filename="f") if isinstance(v, bytes) else v) for k, v in items])


def test_lora_forms_json_brackets_and_indices():
    read = lambda *items: asyncio.run(edit_fields(_form(("image", b"x"), *items)))["lora"]  # noqa: E731
    assert read(("lora", '[{"name": "a", "scale": 0.8}]')) == [{"name": "a", "scale": 0.8}]
    assert read(("lora", "null")) is None
    assert read(("lora[][name]", "a"), ("lora[][name]", "b"), ("lora[][scale]", "0.8"), ("lora[][scale]", "2")) == [
        {"name": "a", "scale": 0.8}, {"name": "b", "scale": 2.0}]
    assert read(("lora[1][name]", "b"), ("lora[0][name]", "a"), ("lora[0][scale]", "2")) == [
        {"name": "a", "scale": 2.0}, {"name": "b"}]  # placed by index, not by the order sent
    assert read(("lora[][scale]", "heavy"), ("lora[][name]", "a")) == [{"scale": "heavy", "name": "a"}]
    req = ImageEditRequest.model_validate({"prompt": "x", "image": b"x", "lora": read(
        ("lora[][name]", "a"), ("lora[][name]", "b"))})
    assert req.lora_entries() == (("a", 1.0), ("b", 1.0))


@pytest.mark.parametrize("items,field,says", [
    ([("lora", "[{name: a}]")], "lora", "not JSON"),
    ([("lora", "[]"), ("lora[][name]", "a")], "lora", "both as JSON and as bracketed"),
    ([("lora[][name]", "a"), ("lora[0][name]", "b")], "lora", "more than one form"),
    ([("lora[][name]", "a"), ("lora[][name]", "b"), ("lora[][scale]", "1")], "lora", "give every entry a scale"),
    ([("lora[0][name]", "a"), ("lora[5][name]", "b")], "lora",
     "indices must count from 0 without gaps or repeats (got 0, 5)"),
    ([("lora[99999999999999999999][name]", "a")], "lora", "indices must count from 0"),
    ([("lora[0][name]", "a"), ("lora[00][scale]", "1")], "lora", "without gaps or repeats"),
    ([("lora[0][name]", "a"), ("lora[0][name]", "b")], "lora", "'lora[0][name]' is sent more than once"),
    ([("mask", b"m"), ("mask", b"n")], "mask", "2 masks were sent"),
    ([("mask", "not a file")], "mask", "'mask' must be a file part"),
    ([("prompt", b"a file")], "prompt", "'prompt' was sent as a file"),
    ([("markup", b"png")], "markup", "the files are 'image' (several images: one 'image[]' part each) and 'mask'"),
    ([("images", b"png")], "images", "unknown field 'images' (sent as a file; the files are 'image'"),
    ([("images", b"png")], "images", "allowed fields: prompt, model, n, size"),
    ([("prompt", b"a file")], "prompt", "but it is a text field"),
    ([("n", "1"), ("n", "2")], "n", "sent more than once"),
    ([("stream", "yes")], "stream", "'stream' is 'yes'; allowed: true or false"),
])
def test_form_shapes_no_request_can_have_are_422_naming_the_field(items, field, says):
    with pytest.raises(FormError) as e:
        asyncio.run(edit_fields(_form(("image", b"x"), *items)))
    assert (e.value.status, e.value.field) == (422, field) and says in e.value.message


def test_several_images_are_read_in_order_and_a_model_that_edits_one_refuses_them(recorded):
    """The form reads every image part in the order sent (FLUX.2's reference images); the validator, which knows the
    model, refuses several for a family that edits one image (the tiny default: FLUX.1's edit pipelines)."""
    assert asyncio.run(edit_fields(_form(("image[]", b"x"), ("image[]", b"y"), ("image[]", b"z"))))["image"] == [
        b"x", b"y", b"z"]
    assert asyncio.run(edit_fields(_form(("image", b"x"))))["image"] == b"x"
    dit, ingress = recorded
    got, err = _post(ingress, files=[("prompt", (None, "a cat")), ("image[]", ("a.png", _png(), "image/png")),
                                     ("image[]", ("b.png", _png(), "image/png"))])
    assert (got, err["param"]) == (422, "image") and "2 images were sent" in err["message"]
    assert "edits one image (several reference images are served for FLUX.2" in err["message"]
    assert not dit.sent


# -- bad input: each a 4xx in OpenAI's shape naming the field ----------------------------------------------------


def _edit(ingress, image=None, mask=None, **fields) -> tuple[int, dict]:
    """POST /v1/images/edits, multipart, with ``image`` and ``mask`` files (when given) and the text ``fields``
    (prompt "a cat" unless given; a field given as "" is left out)."""
    parts = [(k, (None, v)) for k, v in {"prompt": "a cat", **fields}.items() if v != ""]
    parts += [(k, (f"{k}.png", v, "image/png")) for k, v in (("image", image), ("mask", mask)) if v is not None]
    return _post(ingress, files=parts)


BAD = [
    ("not an image", dict(image=b"GIF? no, just text"), 422, "image", "not an image file"),
    ("zero bytes", dict(image=b""), 422, "image", "non-empty"),
    ("truncated", dict(image=_noise_png()[:3000]), 422, "image", "truncated or corrupt"),
    ("broken chunks", dict(image=_broken_png()), 422, "image", "does not decode"),
    ("a GIF", dict(image=_png(fmt="GIF", mode="L", color=3)), 422, "image", "is a GIF file"),
    ("over max_input_pixels", dict(image=_png_header(5000, 5000)), 422, "image", "above limits.max_input_pixels"),
    ("a decompression bomb", dict(image=_png_header(60000, 60000)), 422, "image", "claims more pixels"),
    ("a mask of another size", dict(image=_png(), mask=_mask((128, 128))), 422, "mask", "must have the same size"),
    ("a mask without alpha", dict(image=_png(), mask=_png()), 422, "mask", "no alpha channel"),
    ("a JPEG mask", dict(image=_png(), mask=_png(fmt="JPEG")), 422, "mask",
     "'mask' is a JPEG file; allowed: PNG or WebP with an alpha channel"),
    ("a mask that is no image", dict(image=_png(), mask=b"text"), 422, "mask",
     "not an image file; allowed: PNG or WebP"),
    ("a mask with nothing to edit", dict(image=_png(), mask=_mask(hole=False)), 422, "mask", "nothing to edit"),
    ("strength 0", dict(image=_png(), strength="0"), 422, "strength", "out of range"),
    ("strength 1.5", dict(image=_png(), strength="1.5"), 422, "strength", "out of range"),
    ("strength nan", dict(image=_png(), strength="nan"), 422, "strength", "out of range"),
    ("strength a word", dict(image=_png(), strength="strong"), 422, "strength", "a number above 0"),
    # above 0, yet steps x strength is below one float step of steps: no step would run (the API fuzzer found a 500)
    ("strength 1.6e-254", dict(image=_png(), strength="1.5967678037237953e-254"), 422, "strength",
     "runs no denoising step"),
    ("strength 1e-17", dict(image=_png(), strength="1e-17"), 422, "strength", "below the float resolution"),
    ("n a word", dict(image=_png(), n="two"), 422, "n", "an integer from 1 to 10"),
    ("no prompt", dict(image=_png(), prompt=""), 422, "prompt", "'prompt' is required"),
    ("no image", dict(), 422, "image", "'image' is required: one PNG, JPEG or WebP file"),
    ("an unknown field", dict(image=_png(), input_fidelity="high"), 422, "input_fidelity", "unknown field"),
    ("a size out of range", dict(image=_png(), size="4096x4096"), 422, "size", "out of range"),
]


@pytest.mark.parametrize("case,kwargs,status,field,says", BAD, ids=[b[0] for b in BAD])
def test_every_bad_input_is_a_4xx_naming_the_field(ingress, case, kwargs, status, field, says):
    got, err = _edit(ingress, **kwargs)
    assert (got, err["param"]) == (status, field), err
    assert says in err["message"] and err["type"] == "invalid_request_error"


@functools.cache
def _zeros_deflated(mb: int) -> bytes:
    """A zlib stream of ``mb`` MiB of zeros (200 MiB: about 200 KB), made a MiB at a time."""
    z = zlib.compressobj(9)
    return b"".join(z.compress(bytes(1 << 20)) for _ in range(mb)) + z.flush()


def _png_with(before: bytes = b"", after: bytes = b"") -> bytes:
    """An 8x8 RGB PNG with the raw chunks ``before`` and ``after`` its pixel data (IDAT)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = _png((8, 8))
    i = png.index(b"IDAT") - 4
    j = png.index(b"IEND") - 4
    return png[:i] + b"".join(chunk(*c) for c in before) + png[i:j] + b"".join(chunk(*c) for c in after) + png[j:]


_BOMB = [
    # (case, chunks before IDAT, chunks after IDAT, what the message names)
    ("zTXt of 200 MB", [(b"zTXt", b"Comment\0\0" + _zeros_deflated(200))], [], "zTXt chunk (compressed text"),
    ("iCCP of 200 MB", [(b"iCCP", b"icc\0\0" + _zeros_deflated(200))], [], "iCCP chunk (ICC colour profile"),
    ("compressed iTXt of 200 MB", [(b"iTXt", b"Comment\0\1\0\0\0" + _zeros_deflated(200))], [],
     "iTXt chunk (international text"),
    ("zTXt of 200 MB after the pixels", [], [(b"zTXt", b"Comment\0\0" + _zeros_deflated(200))],
     "zTXt chunk (compressed text"),
]


@pytest.mark.parametrize("field", ["image", "mask"])
@pytest.mark.parametrize("case,before,after,names", _BOMB, ids=[b[0] for b in _BOMB])
def test_a_png_whose_ancillary_chunk_inflates_too_far_is_refused_naming_the_chunk_and_limit(
        ingress, field, case, before, after, names):
    """Pillow refuses to inflate an ancillary chunk past ``PngImagePlugin.MAX_TEXT_CHUNK`` (ValueError): the
    answer says so, naming the chunk, the limit in bytes and that it is a PNG, not "not an image file"."""
    from PIL import PngImagePlugin

    bomb = _png_with(before, after)
    assert len(bomb) < 300_000  # a small upload
    files = dict(image=bomb) if field == "image" else dict(image=_png((8, 8)), mask=bomb)
    got, err = _edit(ingress, **files, size="256x256")
    assert (got, err["param"]) == (422, field), err
    assert err["message"].startswith(f"'{field}' is a PNG whose {names}, an ancillary chunk) inflates to more than "
                                     f"{PngImagePlugin.MAX_TEXT_CHUNK} bytes"), err
    assert "not an image file" not in err["message"] and "corrupt" not in err["message"]


def test_a_png_whose_text_chunks_inflate_too_far_together_is_refused_naming_the_total_limit(ingress):
    """80 zTXt chunks of 900 KiB each: every one within MAX_TEXT_CHUNK, 70 MiB together above MAX_TEXT_MEMORY."""
    from PIL import PngImagePlugin

    each = zlib.compress(bytes(900 << 10), 9)
    bomb = _png_with([(b"zTXt", b"C%d\0\0" % i + each) for i in range(80)])
    got, err = _edit(ingress, image=bomb, size="256x256")
    assert (got, err["param"]) == (422, "image"), err
    assert err["message"].startswith(f"'image' is a PNG whose text chunks (tEXt, zTXt, iTXt: ancillary chunks) "
                                     f"inflate to more than {PngImagePlugin.MAX_TEXT_MEMORY} bytes together"), err


def test_a_png_with_small_text_chunks_is_still_edited(recorded):
    """The same chunks inflating within the limits: the image is read as any other."""
    dit, ingress = recorded
    small = _png_with([(b"zTXt", b"Comment\0\0" + zlib.compress(b"x" * 1000)),
                       (b"iCCP", b"icc\0\0" + zlib.compress(bytes(3000)))])
    got, body = _edit(ingress, image=small, size="256x256")
    assert got == 200, body
    (_, validated), = dit.sent
    assert validated.request.image == small


def test_the_image_is_read_by_its_header_before_any_decoding(ingress, monkeypatch):
    from PIL import ImageFile

    def no_decoding(self, *a, **k):
        raise AssertionError("an image over the bound was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    got, err = _edit(ingress, image=_png_header(5000, 5000))
    assert got == 422 and "5000x5000 = 25000000 pixels" in err["message"]


def test_a_family_without_edits_refuses_the_image_naming_those_that_edit():
    ingress = _ingress()
    ingress._validator.spec = dataclasses.replace(ingress._validator.spec, edit_pipelines=None, default_strength=None)
    got, err = _edit(ingress, image=_png())
    assert (got, err["param"]) == (422, "image") and "edits are served for FLUX.1" in err["message"]


@pytest.mark.parametrize("content,ctype", [(b'{"prompt": "x", "image": "aGk="}', "application/json"),
                                           (b"prompt=x", "application/x-www-form-urlencoded"), (b"", None)])
def test_another_content_type_is_415_naming_multipart(ingress, content, ctype):
    got, err = _post(ingress, content=content, headers={"content-type": ctype} if ctype else {})
    assert got == 415 and "multipart/form-data" in err["message"] and (ctype or "without a Content-Type") in \
        err["message"]


@pytest.mark.parametrize("ctype", ["multipart/form-data; boundary=x", "application/x-www-form-urlencoded"])
def test_a_form_sent_to_generations_is_415_naming_json_and_the_edits_route(ingress, ctype):
    part = b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx\r\n--x--\r\n'
    body = b"prompt=x" if "urlencoded" in ctype else part
    answer = asyncio.run(ingress.generate(_starlette("POST", "/v1/images/generations", [("content-type", ctype)],
                                                     [body])))
    err = json.loads(answer.body)["error"]
    assert answer.status_code == 415 and "takes a JSON body" in err["message"]
    assert "POST /v1/images/edits (multipart/form-data)" in err["message"]


def test_json_sent_as_a_urlencoded_form_is_still_read_as_json(recorded):
    """``curl -d '{...}'`` without a Content-Type header sends ``application/x-www-form-urlencoded``."""
    dit, ingress = recorded
    body = json.dumps({"prompt": "x", "size": "256x256"}).encode()
    answer = asyncio.run(ingress.generate(_starlette("POST", "/v1/images/generations", [
        ("content-type", "application/x-www-form-urlencoded")], [body])))
    assert getattr(answer, "status_code", 200) == 200 and dit.sent[0][1].request.prompt == "x"


@pytest.mark.parametrize("body,ctype,says", [
    (b"", "multipart/form-data", "Missing boundary"),
    (b"garbage", "multipart/form-data; boundary=x", "Invalid multipart data"),
    (b"--x\r\nBad header\r\n\r\nhi\r\n--x--\r\n", "multipart/form-data; boundary=x", "Invalid multipart data"),
    (b"--x\r\nContent-Disposition: form-data\r\n\r\nhi\r\n--x--\r\n", "multipart/form-data; boundary=x", "name"),
])
def test_an_unreadable_multipart_body_is_400(ingress, body, ctype, says):
    got, err = _post(ingress, content=body, headers={"content-type": ctype})
    assert got == 400 and "the multipart/form-data body could not be read" in err["message"] and says in \
        err["message"]


def test_a_body_cut_mid_form_is_read_as_far_as_it_goes(ingress):
    got, err = _post(ingress, content=b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi',
                     headers={"content-type": "multipart/form-data; boundary=x"})
    assert got == 422 and err["param"] == "prompt"  # the part never ended: neither prompt nor image arrived


def test_a_declared_body_over_the_bound_is_413_unread(ingress):
    reads: list = []
    request = _starlette("POST", "/v1/images/edits", [("content-type", "multipart/form-data; boundary=x"),
                                                      ("content-length", str(2**40))], reads=reads)
    answer = asyncio.run(ingress.edits(request))
    err = json.loads(answer.body)["error"]
    assert answer.status_code == 413 and not reads and "over the limit of 67108864 bytes" in err["message"]
    assert f"request body of {2**40} bytes" in err["message"]  # the declared length


def test_a_chunked_body_is_refused_once_it_passes_the_bound():
    ingress = _ingress(limits={"max_upload_bytes": 256 * 1024})
    reads: list = []
    head = b'--x\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
    request = _starlette("POST", "/v1/images/edits", [("content-type", "multipart/form-data; boundary=x")],
                         forever=head + b"\0" * (64 * 1024 - len(head)), reads=reads)
    answer = asyncio.run(ingress.edits(request))
    assert answer.status_code == 413 and len(reads) == 5  # 4 chunks of 64 KiB fill the bound; the 5th passes it
    assert (f"request body of at least {5 * 64 * 1024} bytes (read no further) is over the limit of {256 * 1024}"
            in json.loads(answer.body)["error"]["message"])  # what was read, not a length never sent


def test_the_key_is_checked_before_the_body_is_read():
    ingress = _ingress(auth={"api_keys": [KEY]})
    reads: list = []
    request = _starlette("POST", "/v1/images/edits", [("content-type", "multipart/form-data; boundary=x")],
                         forever=b"x", reads=reads)
    answer = asyncio.run(ingress.edits(request))
    assert answer.status_code == 401 and not reads


# -- streaming, the model card, variations ---------------------------------------------------------------------


class _StreamDiT:
    """A DiT handle streaming its acceptance, one preview and the result."""

    def options(self, **kwargs):
        return self

    @property
    def generate_stream(self):
        return self

    def remote(self, validated):
        self.validated = validated
        return self

    def __aiter__(self):
        return self._events()

    def cancel(self):
        pass

    async def _events(self):
        from bcg_core.preview import PartialImage
        from deployments.routing import ACCEPTED

        yield ACCEPTED
        if self.validated.request.partial_images:
            yield PartialImage(0, 0, 1, b"preview")
        yield GenerationResult(image_bytes=[b"final"], seed=1, bucket=None, hit=False, missed=["batch"],
                               real_tokens=1, padded_tokens=1, steps=self.validated.steps_run, timings_ms={})


def test_a_streamed_edit_sends_image_edit_events_the_client_parses():
    ingress = _ingress(_StreamDiT())
    stream = _client(ingress).images.edit(image=_png(), prompt="x", stream=True, partial_images=1,
                                          extra_body={"num_inference_steps": 4, "strength": 0.5})
    events = list(stream)
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert type(events[1]).__name__ == "ImageEditCompletedEvent" and events[1].model_extra["bcg"]["steps"] == 2
    assert events[1].model_extra["bcg"]["lora"] is None  # no adapters asked for
    raw = asyncio.run(_answer(ingress, httpx.Request(
        "POST", "http://bcg.test/v1/images/edits", files={"image": ("i.png", _png())},
        data={"prompt": "x", "stream": "true"}))).content
    assert [name for name, _ in parse_sse(raw)] == ["image_edit.completed"]


def test_the_model_card_says_which_edits_are_served(ingress):
    edits = ingress._model_card().bcg["edits"]
    assert edits["modes"] == ["image-to-image", "inpainting"]
    assert edits["pipelines"] == {"image-to-image": "FluxImg2ImgPipeline", "inpainting": "FluxInpaintPipeline"}
    assert edits["defaults"]["inpainting"] == {"num_inference_steps": 4, "guidance_scale": 3.5, "strength": 0.6}
    assert edits["max_input_pixels"] == 4096 * 4096 and edits["max_upload_bytes"] == 64 * 2**20
    spec = ingress._validator.spec
    from deployments.uploads import edits_card

    assert edits_card(dataclasses.replace(spec, edit_pipelines=None), ingress._config.limits) is None
    # SD3's edit pipelines default to 50 steps: the card says what the validator gives, capped at max_steps
    sd3 = dataclasses.replace(spec, edit_pipelines=("StableDiffusion3Img2ImgPipeline",
                                                    "StableDiffusion3InpaintPipeline"), default_strength=None)
    limits = ingress._config.limits.model_copy(update={"max_steps": 30})
    card = edits_card(sd3, limits)["defaults"]["image-to-image"]
    assert card == {"num_inference_steps": 30, "guidance_scale": 7.0, "strength": 0.6}


def test_variations_name_the_edits_endpoint(ingress):
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        _client(ingress).images.create_variation(image=_png())
    err = info.value.body
    assert err["code"] == "unsupported_endpoint" and "POST /v1/images/edits" in err["message"]


def test_the_openapi_schema_documents_the_multipart_body():
    from deployments.ingress import app

    op = app.openapi()["paths"]["/v1/images/edits"]["post"]
    body = op["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert op["requestBody"]["required"] is True and set(body["required"]) == {"prompt", "image"}
    assert body["properties"]["image"] == {**body["properties"]["image"], "type": "string", "format": "binary"}
    assert body["properties"]["mask"]["format"] == "binary" and body["properties"]["lora"]["type"] == "string"
    assert not any("anyOf" in p for p in body["properties"].values())  # a form part is sent or omitted
    assert {"200", "400", "401", "413", "415", "422"} <= set(op["responses"])
