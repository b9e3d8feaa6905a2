"""Qwen-Image edits against diffusers: image-to-image equals ``QwenImageImg2ImgPipeline`` and inpainting
``QwenImageInpaintPipeline`` from the same tiny checkpoint (``tests/tiny/qwenimage.py``), image, mask, prompt,
negative prompt, seed, strength and steps.

The input image is 70x50, not a multiple of the 16-pixel token: the edit's size is its image's rounded down
(64x48, a 3x4 grid) and both sides resize it there. The mask is sent as OpenAI defines it (a PNG whose fully
transparent pixels mark where to edit); diffusers gets the same region as its own mask (white = repaint), drawn
here, not converted by bcg-serve. Alone at an exact bucket (bit-identical, byte-equal PNGs), at a padded batch,
with true CFG (norm-rescaled, text padded), with every default left to the validator against every default left to
diffusers, and inside the forward of a text-to-image request that started two steps earlier: final latents within
1e-5 relative and the same images (``reference_gate.assert_same``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline, QwenImagePipeline
from PIL import Image

from bcg_core import GenerationRequest
from bcg_core.errors import RequestError
from bcg_core.families.defaults import pipeline_defaults
from reference_gate import assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run, edit_masks, png_bytes
from tiny.qwenimage import build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["64x48"], text_lengths=[16, 32])
SIZE = (70, 50)  # the input image (width, height); served at 64x48
BOX = (16, 8, 48, 40)  # the region to edit: x0, y0, x1, y1 (pixels of the input image)
PROMPT = "a photo of a cat on a red chair"  # 16 tokens: exactly the text bucket


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("qwen-edits") / "tiny-qwen-image")
    w, h = SIZE
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    mask, theirs = edit_masks((w, h), BOX)  # OpenAI's (transparent edits) and diffusers' (white repaints)
    return folder, bcg_pipeline(folder, BUCKETS), png_bytes(image), mask, theirs


def _req(image: bytes | None = None, **kw) -> GenerationRequest:
    base = dict(prompt=PROMPT, n=1, num_inference_steps=5, seed=11, image=image, strength=0.6)
    return GenerationRequest(**{**base, **kw})


def test_the_edit_pipelines_and_their_defaults_are_diffusers_own(qwen):
    folder, pipe, image, mask, _ = qwen
    assert pipe.model.spec.edit_pipelines == ("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")
    for cls in pipe.model.spec.edit_pipelines:  # read from the installed diffusers' __call__ signatures
        assert pipeline_defaults(cls) == {"default_steps": 50, "default_guidance_scale": None,
                                          "default_true_cfg_scale": 4.0, "default_strength": 0.6}, cls
    for m in (None, mask):
        req = pipe.validator.validate(GenerationRequest(prompt=PROMPT, image=image, mask=m, seed=1)).request
        assert (req.width, req.height, req.num_inference_steps, req.strength) == (64, 48, 50, 0.6)
        assert req.guidance_scale is None and req.true_cfg_scale is None  # the family's true CFG default: 4.0
        assert pipe.validator.validate(req).lookup.key.batch == 1  # no negative prompt: no CFG, as diffusers
        neg = pipe.validator.validate(dataclasses.replace(req, negative_prompt="")).request
        assert pipe.model.spec.uses_cfg(neg) and pipe.model.spec.cfg_scale(neg) == 4.0


def test_image_to_image_equals_diffusers_alone_and_padded(qwen):
    folder, pipe, image, _, _ = qwen
    validated = pipe.validator.validate(_req(image))
    assert str(validated.lookup.key) == "b1_i12_t16_g3x4"
    assert len(pipe.start(validated).timesteps) == 3  # 5 x 0.6 steps run (steps - int(steps - steps x strength))
    ours = bcg_run(pipe, validated.request)
    assert_same(ours, diffusers_run(QwenImageImg2ImgPipeline, folder, validated.request), exact=True)
    three = pipe.validator.validate(_req(image, n=3, seed=4, strength=0.8)).request  # 3 rows in the 4-row bucket
    assert pipe.validator.validate(three).lookup.key.batch == 4
    assert_same(bcg_run(pipe, three), diffusers_run(QwenImageImg2ImgPipeline, folder, three))


def test_inpainting_with_an_openai_mask_equals_diffusers_and_keeps_the_known_region(qwen):
    folder, pipe, image, mask, theirs = qwen
    validated = pipe.validator.validate(_req(image, mask=mask, seed=3))
    ours = bcg_run(pipe, validated.request)
    assert_same(ours, diffusers_run(QwenImageInpaintPipeline, folder, validated.request, mask_image=theirs), exact=True)
    keep, image_latents, _ = pipe.start(validated).extras["inpaint"]
    keep = keep == 0  # packed (1, 12, 64): tokens outside the region, every channel
    assert keep.any() and not keep.all()
    assert torch.equal(ours.latents[keep], image_latents[keep])  # after the last step: the image's own latents
    assert (ours.latents[~keep] - image_latents[~keep]).abs().max() > 1e-2
    plain = bcg_run(pipe, dataclasses.replace(validated.request, mask=None))  # image to image moves the kept region too
    assert (plain.latents[keep] - ours.latents[keep]).abs().max() > 1e-3


def test_inpainting_with_every_default_equals_diffusers_with_every_default(qwen):
    # Nothing but prompt, image, mask, size, seed and an empty negative prompt: the validator's defaults (50 steps,
    # strength 0.6: 30 run; true CFG 4.0 with the norm rescale) against what QwenImageInpaintPipeline does for a
    # call that omits them (diffusers_run passes only what the request sets). 2 images x [cond, uncond] = 4 rows,
    # the negative prompt's text padded to the prompt's 16 tokens.
    folder, pipe, image, mask, theirs = qwen
    raw = GenerationRequest(prompt=PROMPT, image=image, mask=mask, n=2, width=64, height=48, negative_prompt="",
                            seed=5)
    validated = pipe.validator.validate(raw)
    assert str(validated.lookup.key) == "b4_i12_t16_g3x4" and len(pipe.start(validated).timesteps) == 30
    assert_same(bcg_run(pipe, raw), diffusers_run(QwenImageInpaintPipeline, folder, raw, mask_image=theirs))


def test_edits_joining_a_text_to_image_request_equal_diffusers(qwen):
    # The edit (true CFG 2.5, 2 rows) starts while a text-to-image request (1 row) is 2 steps in: one 3-row forward
    # in the 4-row bucket per step, each request at its own timestep.
    folder, pipe, image, mask, theirs = qwen
    text = pipe.validator.validate(GenerationRequest(prompt="an astronaut riding a horse", width=64, height=48,
                                               num_inference_steps=5, seed=9)).request
    for m in (None, mask):
        edit = pipe.validator.validate(_req(image, mask=m, seed=8, strength=1.0, num_inference_steps=4,
                                      negative_prompt="blurry", true_cfg_scale=2.5)).request
        ours_edit, ours_text = bcg_run_joined(pipe, edit, text, head_start=2)
        cls, kw = (QwenImageImg2ImgPipeline, {}) if m is None else (QwenImageInpaintPipeline, {"mask_image": theirs})
        assert_same(ours_edit, diffusers_run(cls, folder, edit, **kw))
    assert_same(ours_text, diffusers_run(QwenImagePipeline, folder, text))


@pytest.mark.parametrize("change, field, words", [
    (dict(image=b"not an image"), "image", "is not an image file"),
    (dict(strength=0.0), "strength", "out of range"),
    (dict(strength=1.5), "strength", "out of range"),
    (dict(image=None), "image", "needs an 'image'"),
])
def test_bad_edit_fields_are_refused_naming_the_field(qwen, change, field, words):
    folder, pipe, image, mask, _ = qwen
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(**{"image": image, "mask": mask, **change}))
    assert e.value.field == field and words in e.value.message, e.value.message


def test_a_strength_that_leaves_no_step_is_refused_at_start_too(qwen):
    folder, pipe, image, _, _ = qwen
    validated = pipe.validator.validate(_req(image))
    validated = dataclasses.replace(validated, request=dataclasses.replace(validated.request, strength=0.0))
    with pytest.raises(ValueError, match="leaves 0 steps"):
        pipe.start(validated)
