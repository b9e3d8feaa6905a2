"""``POST /v1/images/edits`` of each family that edits, served for real without Ray: the official ``openai`` client's
``images.edit`` (through an ``httpx.MockTransport`` into the ingress's route, as ``test_edits_http.py``) against the
tiny FLUX.1, SD3 and Qwen-Image checkpoints (``tests/tiny/``), with and without a mask, streamed and not.

The ingress (:func:`ingress_fakes.bare_ingress`, its routes as plain methods) validates each request and sends it to
:class:`_EngineDiT`, a DiT handle whose "replica" is this process: a real :class:`~bcg_core.DiTPipeline` on the
checkpoint and its :class:`~bcg_core.scheduler.StepScheduler`, which serves the validated request as
``DiTReplica.generate`` and ``generate_stream`` do (pickled on the way, as Ray sends it; a streamed request's
acceptance, previews, then its result). Each answer must hold the image at the requested size, report ``bcg.steps`` as
the steps the strength runs (:func:`bcg_core.request.steps_run`, fewer than asked for), and be the very image the
engine gives for the same request validated from the client's fields in this process (``DiTPipeline.generate``):
byte-equal PNGs. Whether a masked edit keeps the opaque region of its input is up to the model (diffusers' own
inpainting pipelines blend latents, not pixels), so it is not asserted; ``tests/families/test_*_edits.py`` gate the
engine against diffusers.

A family without edit pipelines (PixArt-Sigma, SANA: their tiny checkpoints' JSON configs, no weights loaded) is
answered 422 with param ``image``, naming the families that edit. A FLUX.2 reference edit of two images (``image[]``
parts) answers the engine's image (``tests/families/test_flux2_edits.py`` gates it against diffusers).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import importlib
import io
import pickle
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from PIL import Image

from bcg_core.request import GenerationRequest, steps_run
from deployments.settings import ServeConfig
from ingress_fakes import FakeDiT, bare_ingress
from reference_gate import edit_masks, png_bytes

PROMPT = "a photo of a cat on a red chair"  # 16 Qwen-Image tokens: its smaller text bucket
SIZE = 32  # the input image, the mask and the answer: 32x32 (a 2x2 token grid for every family here)
STEPS, STRENGTH = 4, 0.6  # steps_run(4, 0.6) = 3: the strength's steps, not the 4 asked for
BOX = (8, 4, 24, 20)  # the mask's fully transparent region (edit here): x0, y0, x1, y1

# family -> (tests/tiny module, build kwargs, text buckets)
FAMILIES = {
    "flux": ("flux", {"variant": "dev"}, [32]),
    "sd3": ("sd3", {"variant": "sd3"}, [333]),
    "qwenimage": ("qwenimage", {}, [16, 32]),
}


def _inputs() -> tuple[bytes, bytes]:
    """A seeded noise image and OpenAI's mask for it (opaque keeps; :data:`BOX` fully transparent: edit there)."""
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    return png_bytes(image), edit_masks((SIZE, SIZE), BOX)[0]


def _config(folder, text_lengths: list[int]) -> ServeConfig:
    return ServeConfig.model_validate({
        "model": {"path": str(folder), "device": "cpu", "dtype": "float32"},
        "buckets": {"batch_sizes": [1, 2, 4], "resolutions": [f"{SIZE}x{SIZE}"], "text_lengths": text_lengths},
        "limits": {"min_side_px": 16, "max_side_px": 1024},
        "routing": {"shape_aware": False}})


class _Streamed:
    """What ``handle.options(stream=True).generate_stream.remote(validated)`` returns: an async iterator of the
    replica's
    events that the caller may ``cancel()`` (which closes the scheduler's stream: the request stops at its next
    step)."""

    def __init__(self, events):
        self._events = events
        self.cancelled = False

    def __aiter__(self):
        return self._events

    def cancel(self) -> None:
        self.cancelled = True
        asyncio.get_running_loop().create_task(self._events.aclose())


class _EngineDiT:
    """A DiT deployment handle served in this process by ``pipe`` and its step scheduler, as ``DiTReplica`` serves a
    validated request (``generate``: the result; ``generate_stream``: ``ACCEPTED``, the previews, the result).
    ``received``: the validated requests received, after a pickle round trip (what Ray does to them)."""

    def __init__(self, pipe):
        from bcg_core.scheduler import StepScheduler

        self.pipe = pipe
        self.scheduler = StepScheduler.from_pipeline(pipe)
        self.received: list = []

    def options(self, multiplexed_model_id: str = "", stream: bool = False):
        return SimpleNamespace(generate=SimpleNamespace(remote=self._generate),
                               generate_stream=SimpleNamespace(remote=lambda v: _Streamed(self._stream(v))))

    def _received(self, validated):
        validated = pickle.loads(pickle.dumps(validated))
        self.received.append(validated)
        return validated

    async def _generate(self, validated):
        return await self.scheduler.submit(self._received(validated))

    async def _stream(self, validated):
        from deployments.routing import ACCEPTED

        validated = self._received(validated)
        yield ACCEPTED
        async for event in self.scheduler.submit_stream(validated):
            yield event


async def _answer(ingress, request: httpx.Request) -> httpx.Response:
    """The ingress's answer to an httpx request to ``/v1/images/edits``, as an httpx response (the route returns a
    model, a JSONResponse or a StreamingResponse, whose body is read whole here)."""
    from starlette.requests import Request

    body = [request.read()]

    async def receive():
        return {"type": "http.request", "body": body.pop(), "more_body": False} if body else \
            {"type": "http.disconnect"}

    ans = await ingress.edits(Request({"type": "http", "method": "POST", "path": request.url.path, "headers": [
        (k.lower().encode(), v.encode()) for k, v in request.headers.items()]}, receive))
    if hasattr(ans, "model_dump_json"):
        return httpx.Response(200, content=ans.model_dump_json(), headers={"content-type": "application/json"})
    if hasattr(ans, "body_iterator"):
        content = b"".join([c if isinstance(c, bytes) else c.encode() async for c in ans.body_iterator])
        return httpx.Response(ans.status_code, content=content, headers={"content-type": ans.media_type})
    return httpx.Response(ans.status_code, content=ans.body, headers=dict(ans.headers))


def _client(ingress):
    """The official client, its requests answered by ``ingress`` in this process."""
    from openai import OpenAI

    transport = httpx.MockTransport(lambda request: asyncio.run(_answer(ingress, request)))
    return OpenAI(base_url="http://bcg.test/v1", api_key="unused", max_retries=0,
                  http_client=httpx.Client(transport=transport))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    """One family's tiny checkpoint served: ``(family, client, dit, image, mask)``; the step scheduler is closed
    after the family's tests."""
    from bcg_core import DiTPipeline

    module, kwargs, texts = FAMILIES[request.param]
    folder = importlib.import_module(f"tiny.{module}").build(tmp_path_factory.mktemp(request.param) / "ckpt",
                                                               **kwargs)
    config = _config(folder, texts)
    dit = _EngineDiT(DiTPipeline.from_config(config))
    image, mask = _inputs()
    try:
        yield request.param, _client(bare_ingress(dit, config)), dit, image, mask
    finally:
        dit.scheduler.close()


def _mask_part(mask: bytes, masked: bool) -> dict:
    """``images.edit``'s ``mask`` argument, or none (the client refuses ``mask=None``)."""
    return {"mask": ("mask.png", mask, "image/png")} if masked else {}


def _decoded(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


@pytest.mark.parametrize("masked", [False, True], ids=["image-to-image", "inpainting"])
def test_an_edit_answers_the_engines_image_at_its_size_after_the_strengths_steps(served, masked):
    family, client, dit, image, mask = served
    seed = 21 if masked else 5
    result = client.images.edit(
        image=("photo.png", image, "image/png"), **_mask_part(mask, masked),
        prompt=PROMPT, n=2, size=f"{SIZE}x{SIZE}", response_format="b64_json",
        extra_body={"seed": seed, "num_inference_steps": STEPS, "strength": STRENGTH})
    sent = dit.received[-1]
    assert (sent.request.mask is not None) is masked and sent.request.image == image
    pngs = [base64.b64decode(d.b64_json, validate=True) for d in result.data]
    assert [(_decoded(p).format, _decoded(p).size) for p in pngs] == [("PNG", (SIZE, SIZE))] * 2
    assert result.size == f"{SIZE}x{SIZE}" and result.model_extra["bcg"]["steps"] == steps_run(STEPS, STRENGTH) == 3
    pipe = dit.pipe
    validated = pipe.validator.validate(GenerationRequest(PROMPT, n=2, width=SIZE, height=SIZE,
                                                          num_inference_steps=STEPS, seed=seed, image=image,
                                                          mask=mask if masked else None, strength=STRENGTH))
    assert dataclasses.asdict(sent.request) == dataclasses.asdict(validated.request)  # the client's fields, mapped
    assert validated.steps_run == 3
    expected = pipe.generate(validated)
    assert expected.steps == 3 and pngs == expected.image_bytes  # the engine's images, byte for byte
    assert pngs[0] != pngs[1]  # image i has its own noise (seed + i)


@pytest.mark.parametrize("masked", [False, True], ids=["image-to-image", "inpainting"])
def test_a_streamed_edit_sends_a_preview_then_the_engines_image(served, masked):
    family, client, dit, image, mask = served
    seed = 33 if masked else 8
    stream = client.images.edit(
        image=("photo.png", image, "image/png"), **_mask_part(mask, masked),
        prompt=PROMPT, stream=True, partial_images=1,
        extra_body={"seed": seed, "num_inference_steps": STEPS, "strength": STRENGTH})
    events = list(stream)
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"], family
    preview, done = events
    assert type(done).__name__ == "ImageEditCompletedEvent" and done.size == f"{SIZE}x{SIZE}"
    assert _decoded(base64.b64decode(preview.b64_json)).size == (SIZE, SIZE)
    assert done.model_extra["bcg"]["steps"] == steps_run(STEPS, STRENGTH)
    final = base64.b64decode(done.b64_json, validate=True)
    assert _decoded(final).size == (SIZE, SIZE)
    sent = dit.received[-1]
    # no size sent: the edit's size is its image's (32x32, already a multiple of the token size)
    assert (sent.request.width, sent.request.height, sent.request.partial_images) == (
        SIZE, SIZE, 1)
    validated = dit.pipe.validator.validate(GenerationRequest(PROMPT, num_inference_steps=STEPS, seed=seed,
                                                              image=image, mask=mask if masked else None,
                                                              strength=STRENGTH, partial_images=1))
    assert dataclasses.asdict(sent.request) == dataclasses.asdict(validated.request)
    assert [final] == dit.pipe.generate(validated).image_bytes


@pytest.mark.parametrize("family, resolution", [("pixart", "256x256"), ("sana", "512x512")])  # an aspect-ratio bin
def test_a_family_without_edits_answers_422_naming_the_families_that_edit(family, resolution, tmp_path):
    import openai

    folder = importlib.import_module(f"tiny.{family}").build(tmp_path / family)
    config = ServeConfig.model_validate({
        "model": {"path": str(folder), "device": "cpu", "dtype": "float32"},
        "buckets": {"batch_sizes": [1], "resolutions": [resolution], "text_lengths": [32]},
        "limits": {"min_side_px": 16, "max_side_px": 1024}, "routing": {"shape_aware": False}})
    dit = FakeDiT()
    ingress = bare_ingress(dit, config)
    assert ingress._model_card().bcg["edits"] is None
    image, mask = _inputs()
    for extra in ({}, {"mask": ("mask.png", mask, "image/png")}):
        with pytest.raises(openai.UnprocessableEntityError) as e:
            _client(ingress).images.edit(image=("photo.png", image, "image/png"), prompt=PROMPT, **extra)
        err = e.value.body
        assert err["param"] == "image" and err["type"] == "invalid_request_error"
        assert f"(family {family}) is not served for edits" in err["message"]
        assert "edits are served for FLUX.1, SD3/SD3.5 and Qwen-Image" in err["message"]
    assert not dit.sent  # refused by the validator, before any replica


def test_a_flux2_reference_edit_of_two_images_answers_the_engines_image(tmp_path):
    """FLUX.2 [dev]: the official client's ``images.edit(image=[a, b])`` sends two ``image[]`` parts; the engine gets
    both, in order, as reference images (no strength, no mask), and the answer is the engine's own image at the size
    sent, its usage counting the references' tokens as input. The card says the edits are reference edits; a strength
    is refused naming it (the image starts from noise)."""
    import openai

    from bcg_core import DiTPipeline
    from tiny.flux2 import TEXT_TOKENS, build

    folder = build(tmp_path / "flux2", "dev")
    config = ServeConfig.model_validate({
        "model": {"path": str(folder), "device": "cpu", "dtype": "float32"},
        "buckets": {"batch_sizes": [1, 2], "resolutions": [f"{SIZE}x{SIZE}", "128x128"],
                    "text_lengths": [TEXT_TOKENS]},
        "limits": {"min_side_px": 16, "max_side_px": 1024}, "routing": {"shape_aware": False}})
    dit = _EngineDiT(DiTPipeline.from_config(config))
    rng = np.random.default_rng(3)
    refs = [png_bytes(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for w, h in ((64, 64),
                                                                                                      (80, 64))]
    try:
        ingress = bare_ingress(dit, config)
        card = ingress._model_card().bcg["edits"]
        assert card["modes"] == ["reference"] and card["max_reference_images"] == 6
        assert card["pipelines"] == {"reference": "Flux2Pipeline"} and card["defaults"]["reference"]["strength"] is None
        client = _client(ingress)
        result = client.images.edit(image=[("a.png", refs[0], "image/png"), ("b.png", refs[1], "image/png")],
                                    prompt=PROMPT, size=f"{SIZE}x{SIZE}", response_format="b64_json",
                                    extra_body={"seed": 4, "num_inference_steps": 2})
        sent = dit.received[-1]
        assert sent.request.image == tuple(refs) and sent.references == ((16, 16), (16, 20))
        assert str(sent.lookup.key) == f"b1_i1024_m_t{TEXT_TOKENS}"  # 64 + 256 + 320 tokens in the masked tier
        png = base64.b64decode(result.data[0].b64_json, validate=True)
        assert _decoded(png).size == (SIZE, SIZE) and result.model_extra["bcg"]["steps"] == 2
        assert result.usage.input_tokens_details.image_tokens == 576 and result.usage.output_tokens == 64
        validated = dit.pipe.validator.validate(GenerationRequest(PROMPT, width=SIZE, height=SIZE, seed=4,
                                                                  num_inference_steps=2, image=tuple(refs)))
        assert [png] == dit.pipe.generate(validated).image_bytes  # the engine's image, byte for byte
        with pytest.raises(openai.UnprocessableEntityError) as e:
            client.images.edit(image=("a.png", refs[0], "image/png"), prompt=PROMPT, extra_body={"strength": 0.5})
        assert e.value.body["param"] == "strength" and "reference edits" in e.value.body["message"]
    finally:
        dit.scheduler.close()
