"""FLUX.1 edits against diffusers: image-to-image equals ``FluxImg2ImgPipeline`` and inpainting ``FluxInpaintPipeline``
from the same tiny checkpoint (``tests/tiny/flux.py``), image, mask, prompt, seed, strength and steps.

The mask is sent as OpenAI defines it (a PNG whose fully transparent pixels mark where to edit); diffusers gets
the same region as its own mask (white = repaint), drawn here, not converted by bcg-serve. Alone at an exact
bucket, at a padded batch (3 images in the 4-row bucket) and inside the forward of a text-to-image request that
started two steps earlier: final latents within 1e-5 relative and the same images (``reference_gate.assert_same``).
"""

import dataclasses
import io
import zlib

import numpy as np
import pytest
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline
from PIL import Image

from bcg_core import GenerationRequest
from bcg_core.errors import RequestError
from reference_gate import assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run, edit_masks, png_bytes
from tiny.flux import TEXT_TOKENS, build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["32x32", "64x64"], text_lengths=[TEXT_TOKENS])
REF = dict(max_sequence_length=TEXT_TOKENS)
BOX = (8, 4, 24, 20)  # the region to edit: x0, y0, x1, y1 (pixels of the 32x32 image)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("flux-edits"), "dev")
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    mask, theirs = edit_masks((32, 32), BOX)  # OpenAI's (transparent edits) and diffusers' (white repaints)
    return folder, bcg_pipeline(folder, BUCKETS), png_bytes(image), mask, theirs


def _req(image: bytes | None = None, **kw) -> GenerationRequest:
    base = dict(prompt="a photo of a cat sitting on a red chair", n=1, num_inference_steps=5, seed=11, image=image,
                strength=0.6)
    return GenerationRequest(**{**base, **kw})


def test_image_to_image_equals_diffusers_alone_and_padded(flux):
    folder, pipe, image, _, _ = flux
    validated = pipe.validator.validate(_req(image))
    assert (validated.request.width, validated.request.height) == (32, 32)  # an edit's size: its image's
    assert validated.request.guidance_scale == 7.0  # FluxImg2ImgPipeline's default, not FluxPipeline's 3.5
    assert str(validated.lookup.key) == "b1_i64_t32"
    ours = bcg_run(pipe, validated.request)
    # 5 x 0.6 steps run (rounded up: steps - int(steps - steps x strength))
    assert len(pipe.start(validated).timesteps) == 3
    assert_same(ours, diffusers_run(FluxImg2ImgPipeline, folder, validated.request, **REF), exact=True)
    three = pipe.validator.validate(_req(image, n=3, seed=4, strength=0.8, guidance_scale=3.0)).request
    assert_same(bcg_run(pipe, three), diffusers_run(FluxImg2ImgPipeline, folder, three, **REF))


def test_inpainting_with_an_openai_mask_equals_diffusers(flux):
    folder, pipe, image, mask, theirs = flux
    req = pipe.validator.validate(_req(image, mask=mask, n=2, seed=3)).request
    ours = bcg_run(pipe, req)
    ref = diffusers_run(FluxInpaintPipeline, folder, req, mask_image=theirs, **REF)
    assert_same(ours, ref)
    plain = bcg_run(pipe, dataclasses.replace(req, mask=None))  # image to image differs outside the region too
    assert (plain.latents - ours.latents).abs().max() > 1e-3


def test_an_edit_joining_a_text_to_image_request_equals_diffusers(flux):
    folder, pipe, image, mask, theirs = flux
    edit = pipe.validator.validate(_req(image, mask=mask, seed=8, strength=1.0, num_inference_steps=4)).request
    text = pipe.validator.validate(GenerationRequest(prompt="an astronaut", n=1, width=32, height=32,
                                               num_inference_steps=5, seed=9)).request
    ours_edit, ours_text = bcg_run_joined(pipe, edit, text, head_start=2)
    assert_same(ours_edit, diffusers_run(FluxInpaintPipeline, folder, edit, mask_image=theirs, **REF))
    from diffusers import FluxPipeline

    assert_same(ours_text, diffusers_run(FluxPipeline, folder, text, **REF))


@pytest.mark.parametrize("change, field, words", [
    (dict(image=b"not an image"), "image", "is not an image file"),
    (dict(mask=b"\x89PNG\r\n\x1a\n broken"), "mask", "is not an image file"),
    (dict(strength=0.0), "strength", "out of range"),
    (dict(strength=1.5), "strength", "out of range"),
    (dict(image=None), "image", "needs an 'image'"),
])
def test_bad_edit_fields_are_refused_naming_the_field(flux, change, field, words):
    folder, pipe, image, mask, _ = flux
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(**{"image": image, "mask": mask, **change}))
    assert e.value.field == field and words in e.value.message, e.value.message


def test_masks_that_are_not_served_are_refused(flux):
    folder, pipe, image, _, _ = flux
    opaque = png_bytes(Image.new("RGB", (32, 32)))
    other = png_bytes(Image.new("RGBA", (16, 16)))
    nothing = png_bytes(Image.new("RGBA", (32, 32), (0, 0, 0, 255)))
    for mask, words in ((opaque, "no alpha channel"), (other, "the same size"), (nothing, "nothing to edit")):
        with pytest.raises(RequestError) as e:
            pipe.validator.validate(_req(image, mask=mask))
        assert e.value.field == "mask" and words in e.value.message, e.value.message
    big = Image.new("RGB", (1, 1))
    buf = io.BytesIO()
    big.save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = (100000).to_bytes(4, "big") + (100000).to_bytes(4, "big")  # the header claims 10^10 pixels
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # a valid IHDR chunk (its CRC)
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(bytes(data)))
    assert e.value.field == "image" and "max_input_pixels" in e.value.message
