"""SD3 edits against diffusers: image to image equals ``StableDiffusion3Img2ImgPipeline`` and inpainting
``StableDiffusion3InpaintPipeline`` from the same tiny checkpoint (``tests/tiny/sd3.py``), image, mask, prompt, seed,
strength and steps.

The mask is sent as OpenAI defines it (a PNG whose fully transparent pixels mark where to edit); diffusers gets
the same region as its own mask (white = repaint), drawn here, not converted by bcg-serve. Alone at an exact
bucket, at a padded batch (3 images in the 4-row bucket) and inside the forward of a text-to-image request that
started two steps earlier: final latents within 1e-5 relative and the same images (``reference_gate.assert_same``).

Two deliberate deviations (``bcg_core/families/sd3_edit.py``) are pinned here: image to image of ``n > 1`` equals
the pipeline given the image ``n`` times (diffusers fails on one image with a generator per image), and inpainting
images are the pipeline's latents decoded as every other SD3 pipeline decodes them (``z / scaling + shift``), not
as ``StableDiffusion3InpaintPipeline`` 0.42.1 does (without the shift).
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    StableDiffusion3Pipeline,
)
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from bcg_core import GenerationRequest
from bcg_core.errors import RequestError
from bcg_core.families.sd3 import SD3_EDIT_PIPELINES, SD3Family
from reference_gate import (
    GateRun,
    assert_same,
    bcg_pipeline,
    bcg_run,
    bcg_run_joined,
    bcg_state,
    diffusers_run,
    edit_masks,
    png_bytes,
)
from tiny.sd3 import build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["32x32"], text_lengths=[333])
BOX = (8, 4, 24, 20)  # the region to edit: x0, y0, x1, y1 (pixels of the 32x32 image)


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd3-edits")
    folder = build(root / "sd3", variant="sd3")
    dynamic = build(root / "dynamic", variant="sd3", dynamic_shifting=True)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    mask, theirs = edit_masks((32, 32), BOX)  # OpenAI's (transparent edits) and diffusers' (white repaints)
    return dict(folder=folder, dynamic=dynamic, pipe=bcg_pipeline(folder, BUCKETS),
                dynamic_pipe=bcg_pipeline(dynamic, BUCKETS), pil=image, image=png_bytes(image),
                mask=mask, theirs=theirs)


def _req(image: bytes | None = None, **kw) -> GenerationRequest:
    base = dict(prompt="a photo of a cat sitting on a red chair", n=1, num_inference_steps=5, seed=11, image=image)
    return GenerationRequest(**{**base, **kw})


def _decoded_as_sd3(folder, latents: torch.Tensor) -> list[bytes]:
    """PNGs of ``latents`` decoded as ``StableDiffusion3Pipeline`` decodes (``vae.decode(z / scaling_factor +
    shift_factor)``, ``postprocess(output_type="pil")``), with the checkpoint's own VAE and diffusers' processor."""
    vae = AutoencoderKL.from_pretrained(str(folder / "vae"), torch_dtype=torch.float32, local_files_only=True).eval()
    processor = VaeImageProcessor(vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
                                  vae_latent_channels=vae.config.latent_channels)
    with torch.inference_mode():
        image = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
    return [png_bytes(im) for im in processor.postprocess(image, output_type="pil")]


def test_sd3_checkpoints_serve_both_edits_with_the_edit_pipelines_defaults(sd3):
    pipe = sd3["pipe"]
    assert pipe.model.spec.edit_pipelines == SD3_EDIT_PIPELINES
    for extra in ({}, {"mask": sd3["mask"]}):
        r = pipe.validator.validate(GenerationRequest(prompt="a cat", image=sd3["image"], **extra)).request
        # StableDiffusion3Img2ImgPipeline / StableDiffusion3InpaintPipeline.__call__: 50 steps (text to image: 28),
        # guidance 7.0, strength 0.6; the size is the image's
        assert (r.num_inference_steps, r.guidance_scale, r.strength, r.width, r.height) == (50, 7.0, 0.6, 32, 32)


def test_image_to_image_equals_diffusers_alone_and_padded(sd3):
    pipe, folder, image = sd3["pipe"], sd3["folder"], sd3["image"]
    validated = pipe.validator.validate(_req(image))
    assert str(validated.lookup.key).startswith("b2_")  # cond + uncond rows (guidance 7.0), an exact bucket
    state = pipe.start(validated)
    assert len(state.timesteps) == 3  # 5 x 0.6 steps run (steps - int(steps - steps x strength))
    step = pipe.model.euler_step(state)  # the fused form starts at the strength's first step, uncond rows first
    assert step is not None and step.cond == 1 and step.uncond == 0
    assert torch.equal(step.dt, state.scheduler.sigmas[3] - state.scheduler.sigmas[2])
    ref = diffusers_run(StableDiffusion3Img2ImgPipeline, folder, validated.request)
    assert_same(bcg_run(pipe, validated.request), ref, exact=True)
    # 3 images without CFG: 3 rows padded to the 4-row bucket; diffusers takes the image once per generator
    three = pipe.validator.validate(_req(image, n=3, seed=4, strength=0.8, guidance_scale=1.0)).request
    ours = bcg_run(pipe, three)
    assert_same(ours, diffusers_run(StableDiffusion3Img2ImgPipeline, folder, three, image=[sd3["pil"]] * 3))
    one = bcg_run(pipe, dataclasses.replace(three, n=1, seed=5))  # image 1 of the three is the edit of seed 5 alone
    assert ((ours.latents[1:2] - one.latents).abs().max() / one.latents.abs().max()).item() < 1e-5


def test_one_image_with_a_generator_per_image_fails_in_diffusers_image_to_image(sd3):
    """Why ``n > 1`` is checked against the image given ``n`` times: diffusers 0.42.1 encodes ``image[i : i + 1]``
    for every generator, an empty batch from one image. If this starts passing, diffusers fixed it: compare the
    ``n > 1`` gate with the one image instead."""
    req = sd3["pipe"].validator.validate(_req(sd3["image"], n=2, num_inference_steps=2, guidance_scale=1.0)).request
    with pytest.raises(RuntimeError):
        diffusers_run(StableDiffusion3Img2ImgPipeline, sd3["folder"], req)


def test_dynamic_shifting_takes_mu_from_the_edit_size_as_diffusers(sd3):
    req = sd3["dynamic_pipe"].validator.validate(_req(sd3["image"], strength=0.7)).request
    ours = bcg_run(sd3["dynamic_pipe"], req)
    assert_same(ours, diffusers_run(StableDiffusion3Img2ImgPipeline, sd3["dynamic"], req), exact=True)
    # same weights, no shift: another result
    plain = sd3["pipe"].validator.validate(_req(sd3["image"], strength=0.7)).request
    assert (bcg_run(sd3["pipe"], plain).latents - ours.latents).abs().max() > 1e-3


def test_inpainting_with_an_openai_mask_equals_diffusers_latents_and_decodes_with_the_vae_shift(sd3):
    pipe, folder = sd3["pipe"], sd3["folder"]
    req = pipe.validator.validate(_req(sd3["image"], mask=sd3["mask"], n=2, seed=3)).request
    state = bcg_state(pipe, req)
    assert pipe.model.euler_step(state) is None  # the known-region blend runs on the host after every step
    mask, image_latents, _ = state.extras["inpaint"]
    keep = (mask == 0).expand_as(state.latents)
    assert keep.any() and (~keep).any()
    assert torch.equal(state.latents[keep], image_latents[keep])  # after the last step: the image itself
    ours = GateRun(state.latents.float().cpu(), pipe.finish(state))
    ref = diffusers_run(StableDiffusion3InpaintPipeline, folder, req, mask_image=sd3["theirs"])
    decoded = GateRun(ref.latents, _decoded_as_sd3(folder, ref.latents))
    assert_same(ours, decoded, exact=True)
    assert decoded.pngs != ref.pngs, ("StableDiffusion3InpaintPipeline now decodes with the VAE's shift_factor "
                                      "(diffusers issue #13611): compare the images with its own again")
    plain = bcg_run(pipe, dataclasses.replace(req, mask=None))  # image to image differs outside the region too
    assert (plain.latents - ours.latents)[keep].abs().max() > 1e-3


def test_an_inpainting_edit_joining_a_text_to_image_request_equals_diffusers(sd3):
    pipe, folder = sd3["pipe"], sd3["folder"]
    # strength 1.0: the start is pure noise (is_strength_max), the image still gives the known region
    edit = pipe.validator.validate(_req(sd3["image"], mask=sd3["mask"], seed=8, strength=1.0, num_inference_steps=4,
                                  guidance_scale=1.0)).request
    text = pipe.validator.validate(GenerationRequest(prompt="an astronaut", n=1, width=32, height=32,
                                               num_inference_steps=5, guidance_scale=1.0, seed=9)).request
    ours_edit, ours_text = bcg_run_joined(pipe, edit, text, head_start=2)  # 1 + 1 rows share each forward
    ref = diffusers_run(StableDiffusion3InpaintPipeline, folder, edit, mask_image=sd3["theirs"])
    assert_same(ours_edit, GateRun(ref.latents, _decoded_as_sd3(folder, ref.latents)))
    assert_same(ours_text, diffusers_run(StableDiffusion3Pipeline, folder, text))


@pytest.mark.parametrize("change, field, words", [
    (dict(image=b"not an image"), "image", "is not an image file"),
    (dict(strength=0.0), "strength", "out of range"),
    (dict(image=None), "image", "needs an 'image'"),
])
def test_bad_edit_fields_are_refused_naming_the_field(sd3, change, field, words):
    with pytest.raises(RequestError) as e:
        sd3["pipe"].validator.validate(_req(**{"image": sd3["image"], "mask": sd3["mask"], **change}))
    assert e.value.field == field and words in e.value.message, e.value.message


def test_an_inpainting_only_transformer_is_refused_at_load(sd3, tmp_path):
    folder = tmp_path / "inpaint33"
    shutil.copytree(sd3["folder"], folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "in_channels": 33}))
    index = json.loads((folder / "model_index.json").read_text())
    with pytest.raises(ValueError, match="in_channels 33 .* inpainting-only"):
        SD3Family.describe(folder, index)
