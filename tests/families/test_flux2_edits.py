"""FLUX.2 reference edits against diffusers: ``Flux2Pipeline`` / ``Flux2KleinPipeline`` called with ``image`` (one
reference image or a list) from the same tiny checkpoint (``tests/tiny/flux2.py``), prompt, seed, size and steps.

The tiny VAE has 2x2 latent pixels and 2x2 packing: 4 pixels a token side, so a 32x32 target is 64 tokens, a 64x64
reference 256 and an 80x64 one 320; the table's ``64x80`` tier is 320 tokens (a 32x32 target with one 64x64 reference
exactly) and ``128x128`` 1,024 (masked: larger streams pad into it). Each case compares the final packed latents
(diffusers' step-end callback at the last step) within 1e-5 relative and the PNGs (``reference_gate.assert_same``,
byte-equal where the latents are bit-identical): one reference alone at an exact bucket (every variant; the fused step
too), two references padded into a masked tier at the first reference's size, [klein] with classifier-free guidance,
and two edits and a text-to-image request served together by the step scheduler (the edits sharing forwards, their
references encoded in one VAE call). The validator's mirror of the pipeline's reference sizes is checked against the
sizes diffusers' own ``__call__`` gives, and what the pipeline refuses (or what a reference edit has no use for) is
refused naming the field.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from PIL import Image

from bcg_core import GenerationRequest
from bcg_core.errors import BucketMissError, RequestError
from bcg_core.families import concat_rows
from bcg_core.scheduler.step_scheduler import StepScheduler
from reference_gate import RTOL, GateRun, assert_same, bcg_pipeline, bcg_run, diffusers_run, png_bytes
from tiny.flux2 import TEXT_TOKENS, build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["32x32", "64x80", "128x128"], text_lengths=[TEXT_TOKENS])
PIPELINES = {"dev": Flux2Pipeline, "klein": Flux2KleinPipeline, "klein-distilled": Flux2KleinPipeline}
PROMPT = "a photo of a cat sitting on a red chair"
TIMEOUT_S = 60.0


def _noise(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return png_bytes(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``variant -> (folder, pipeline)``: each tiny checkpoint built and served once for the module."""
    built = {}

    def get(variant: str):
        if variant not in built:
            folder = build(tmp_path_factory.mktemp(f"flux2-edit-{variant}"), variant)
            built[variant] = folder, bcg_pipeline(folder, BUCKETS)
        return built[variant]
    return get


def _differs(a: GateRun, b: GateRun) -> bool:
    """Latents that the gate would tell apart: more than ten times its tolerance apart."""
    return ((a.latents - b.latents).abs().max() / b.latents.abs().max()).item() > 10 * RTOL


def _req(image, **kw) -> GenerationRequest:
    base = dict(prompt=PROMPT, n=1, width=32, height=32, num_inference_steps=2, seed=11, image=image)
    return GenerationRequest(**{**base, **kw})


def reference(variant: str, folder, pipe, req: GenerationRequest) -> GateRun:
    """Diffusers' own run of ``req``: its packed final latents (step-end callback at the last step, the target's
    tokens only) and PNGs; its ``output_type="latent"`` answer checked against them ([klein]: unpacked and
    un-normalised, as :meth:`Flux2Family.unpacked_latents` makes them)."""
    last = []

    def keep(p, i, t, tensors):
        if i == p.num_timesteps - 1:
            last.append(tensors["latents"].float().clone())
        return {}

    run = diffusers_run(PIPELINES[variant], folder, req, max_sequence_length=TEXT_TOKENS, callback_on_step_end=keep)
    assert len(last) == 2 and torch.equal(last[0], last[1])
    assert last[0].shape[1] == req.width * req.height // 16  # the target's tokens, no reference token
    if variant == "dev":
        assert torch.equal(run.latents, last[0])
    else:
        ids = Flux2Pipeline._prepare_latent_ids(torch.empty(req.n, 0, req.height // 4, req.width // 4))
        assert torch.equal(pipe.model.unpacked_latents(last[0], ids), run.latents)
    return GateRun(last[0], run.pngs)


@pytest.mark.parametrize("variant", list(PIPELINES))
def test_one_reference_alone_at_an_exact_bucket_equals_diffusers_bit_for_bit(checkpoints, variant):
    folder, pipe = checkpoints(variant)
    spec = pipe.model.spec
    assert spec.references.max_images == (6 if variant == "dev" else 4) and spec.edit_pipelines is None
    validated = pipe.validator.validate(_req(_noise(64, 64, 0), guidance_scale=1.0 if variant == "klein" else 3.0))
    assert validated.references == ((16, 16),) and validated.request.strength is None
    assert str(validated.lookup.key) == f"b1_i320_t{TEXT_TOKENS}"  # 64 target + 256 reference tokens, unmasked
    assert validated.steps_run == 2
    assert_same(bcg_run(pipe, validated.request), reference(variant, folder, pipe, validated.request), exact=True)
    plain = bcg_run(pipe, dataclasses.replace(validated.request, image=None))  # the reference conditions the image
    assert _differs(plain, bcg_run(pipe, validated.request))


@pytest.mark.parametrize("variant", ["dev", "klein"])
def test_two_references_at_the_first_ones_size_in_a_masked_tier_equal_diffusers(checkpoints, variant):
    folder, pipe = checkpoints(variant)
    images = (_noise(67, 66, 1), _noise(80, 64, 2))  # sides off the 4-pixel multiple: cut down to 64x64
    validated = pipe.validator.validate(_req(images, width=None, height=None, n=2, guidance_scale=1.0))
    r = validated.request
    assert (r.width, r.height) == (64, 64)  # no size: the first reference's, as the pipeline cuts it
    assert validated.references == ((16, 16), (16, 20))
    key = validated.lookup.key
    assert (key.batch, key.image_tokens, key.image_mask) == (2, 1024, True)  # 256 + 256 + 320 = 832 tokens, padded
    assert validated.lookup.query.image_tokens == 832
    assert_same(bcg_run(pipe, r), reference(variant, folder, pipe, r))
    swapped = bcg_run(pipe, dataclasses.replace(r, image=images[::-1], width=64, height=64))
    assert _differs(swapped, bcg_run(pipe, r))  # order matters: time index 10, then 20


def test_klein_with_classifier_free_guidance_carries_the_references_in_its_uncond_rows(checkpoints):
    variant = "klein"  # classifier-free guidance: [klein] without is_distilled only
    folder, pipe = checkpoints(variant)
    validated = pipe.validator.validate(_req(_noise(64, 64, 3), guidance_scale=3.5, seed=5))
    assert validated.lookup.query.batch == 2 and str(validated.lookup.key) == f"b2_i320_t{TEXT_TOKENS}"
    state = pipe.start(validated)
    rows = pipe.model.model_rows(state)
    assert rows.latents.shape == (2, 320, 128) and torch.equal(rows.latents[0], rows.latents[1])
    assert_same(bcg_run(pipe, validated.request), reference(variant, folder, pipe, validated.request))


def test_the_fused_step_keeps_only_the_targets_tokens(checkpoints):
    variant = "dev"
    folder, _ = checkpoints(variant)
    pipe = bcg_pipeline(folder, BUCKETS, fused_step="always")
    assert pipe.fused.on, pipe.fused.note
    req = pipe.validator.validate(_req(_noise(64, 64, 4), num_inference_steps=3)).request
    before = pipe.fused.steps
    ours = bcg_run(pipe, req)
    assert pipe.fused.steps == before + 3 and ours.latents.shape == (1, 64, 128)
    assert_same(ours, reference(variant, folder, pipe, req), exact=True)


def test_edits_and_text_to_image_served_together_equal_diffusers(checkpoints):
    """Through the step scheduler: two edits of one layout (a 32x32 target, a 64x64 reference) share every forward,
    their references encoded in one VAE call; a text-to-image request runs beside them in forwards of its own (the
    transformer takes one set of image ids per forward). Each equals diffusers."""
    variant = "dev"
    folder, pipe = checkpoints(variant)
    edits = [pipe.validator.validate(_req(_noise(64, 64, 10 + i), prompt=p, seed=20 + i, num_inference_steps=3))
             for i, p in enumerate((PROMPT, "an astronaut riding a horse"))]
    text = pipe.validator.validate(GenerationRequest(PROMPT, width=32, height=32, num_inference_steps=3, seed=30))
    with pytest.raises(ValueError, match="different reference images"):  # what keeps them apart
        concat_rows([pipe.model.model_rows(pipe.start(edits[0])), pipe.model.model_rows(pipe.start(text))])
    sched = StepScheduler(pipe)
    sched._loop.edit_starter.batch_images = 8  # as on CUDA
    sched._loop.edit_starter.gather_s = TIMEOUT_S  # the round waits for both starts
    latents, together = {}, []
    put, step = sched._finisher.put, pipe.step

    def record(item):
        latents[item.validated.request.seed] = item.state.latents.float().clone()
        put(item)

    def recorded_step(states, forwards, *a, **kw):
        together.append(sorted(s.request.seed for s in states))
        return step(states, forwards, *a, **kw)

    sched._finisher.put, pipe.step = record, recorded_step

    async def main():
        with sched.flight.cv:  # admitted at one step boundary
            tasks = [asyncio.ensure_future(sched.submit(v)) for v in (*edits, text)]
            await asyncio.sleep(0)
        return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)

    try:
        results = asyncio.run(main())
        stats = sched.stats()
    finally:
        sched.close()
        pipe.step = step
    assert stats["edit_start"]["vae_calls"] == 1 and stats["edit_start"]["images_encoded"] == 2
    assert [20, 21] in together and not any(30 in seeds and len(seeds) > 1 for seeds in together)
    for v, result in zip((*edits, text), results, strict=True):
        r = v.request
        assert_same(GateRun(latents[r.seed], result.image_bytes), reference(variant, folder, pipe, r))


def test_the_validators_reference_sizes_are_the_pipelines_own(checkpoints):
    """Diffusers' ``__call__`` stopped at ``prepare_image_latents``: the reference tensors it would encode and the
    size it generates without ``height``/``width`` are those :class:`ReferenceImages` predicts."""
    folder, pipe = checkpoints("dev")  # one pipeline's __call__: both share these lines
    rules = pipe.model.spec.references
    theirs = Flux2Pipeline.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True)
    theirs.set_progress_bar_config(disable=True)
    seen = {}

    class Stop(Exception):
        pass

    def size(self, **kw):
        seen["size"] = (kw["width"], kw["height"])
        return Flux2Pipeline.prepare_latents(self, **kw)

    def images(self, images, **kw):
        seen["images"] = [tuple(im.shape[-2:][::-1]) for im in images]
        raise Stop

    theirs.prepare_latents = size.__get__(theirs)
    theirs.prepare_image_latents = images.__get__(theirs)
    sizes = [(67, 130), (1100, 1000), (2000, 600), (64, 512)]  # off the multiple, above 1 MP, both, 8:1
    pil = [Image.new("RGB", s) for s in sizes]
    with pytest.raises(Stop):
        theirs(prompt="a cat", image=pil, num_inference_steps=1, max_sequence_length=TEXT_TOKENS)
    assert seen["images"] == [rules.size(*s) for s in sizes] and seen["size"] == rules.size(*sizes[0])
    assert seen["images"][1] == (1072, 976)  # 1100 x 1000 resized to 1 MP (1074 x 976), cut to multiples of 4
    validated = pipe.validator.validate(_req(tuple(png_bytes(im) for im in pil[:1]) + (png_bytes(pil[3]),),
                                             width=None, height=None))
    assert (validated.request.width, validated.request.height) == seen["size"]
    assert validated.references == (rules.grid(*sizes[0]), rules.grid(*sizes[3]))


@pytest.mark.parametrize("change, field, words", [
    (dict(strength=0.6), "strength", "reference edits, whose image starts from pure noise"),
    (dict(mask=b"\x89PNG"), "mask", "reference edits"),
    (dict(image=(_noise(64, 64, 0),) * 7), "image", "7 reference images were sent; Flux2Pipeline takes at most 6"),
    (dict(image=_noise(48, 64, 0)), "image", "at least 64 pixels"),
    (dict(image=_noise(64, 576, 0)), "image", "aspect ratio 9.0:1"),
    (dict(image=(_noise(64, 64, 0), b"not an image")), "image", "'image' (image 2 of 2) is not an image file"),
    (dict(image=()), "image", "'image' holds no file"),
])
def test_what_a_reference_edit_cannot_be_is_refused_naming_the_field(checkpoints, change, field, words):
    _, pipe = checkpoints("dev")
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(_req(**{"image": _noise(64, 64, 0), **change}))
    assert (e.value.field, e.value.status) == (field, 422) and words in e.value.message, e.value.message


def test_a_stream_above_every_tier_is_a_miss_naming_its_reference_tokens(checkpoints):
    folder, _ = checkpoints("dev")
    pipe = bcg_pipeline(folder, {**BUCKETS, "resolutions": ["32x32", "64x64"], "miss_policy": "reject"})
    with pytest.raises(BucketMissError) as e:  # 64 + 256 tokens: above the 256-token tier
        pipe.validator.validate(_req(_noise(64, 64, 0)))
    assert e.value.field == "size" and "with its reference images' 256 tokens (320 image tokens in all" in \
        e.value.message
