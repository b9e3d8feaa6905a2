"""The edit-start stage (bcg_core/scheduler/edit_start.py): an edit's start and its image's VAE encode run off the
denoising thread, the images of edits admitted together are encoded in one VAE call, and served through the step
scheduler an edit still equals diffusers' edit pipeline (final latents within 1e-5 relative, the same images).

Tiny FLUX.1 checkpoint (``tests/tiny/flux.py``), fp32 on the CPU, 32x32 images. A VAE encode held open (its
``encode`` replaced here, waiting on an event) stands for a slow encode at 1024² on a GPU.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline
from PIL import Image

from bcg_core import GenerationRequest, RequestCancelled
from bcg_core.scheduler.step_scheduler import StepScheduler
from reference_gate import GateRun, assert_same, bcg_pipeline, diffusers_run, edit_masks, png_bytes
from tiny.flux import TEXT_TOKENS, build

BUCKETS = dict(batch_sizes=[1, 2, 4], resolutions=["32x32", "64x64"], text_lengths=[TEXT_TOKENS])
REF = dict(max_sequence_length=TEXT_TOKENS)
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("flux-edit-start"), "dev")
    rng = np.random.default_rng(1)
    images = [png_bytes(Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))) for _ in range(2)]
    mask, theirs = edit_masks((32, 32), (8, 4, 24, 20))  # OpenAI's (transparent edits), diffusers' (white repaints)
    return folder, bcg_pipeline(folder, BUCKETS), images, mask, theirs


def _validated(pipe, image: bytes | None, **kw):
    base = dict(prompt="a photo of a cat", n=1, num_inference_steps=4, seed=11, image=image)
    if image is None:
        base.update(width=32, height=32)
    else:
        base["strength"] = 0.75
    return pipe.validator.validate(GenerationRequest(**{**base, **kw}))


def _hold_encode(monkeypatch, vae) -> tuple[threading.Event, threading.Event, list]:
    """``vae.encode`` held open until ``release`` is set; ``entered`` once it is called; the names of the threads
    it ran on and the seconds it was held, per call."""
    entered, release, calls = threading.Event(), threading.Event(), []
    encode = vae.encode

    def held(x, *a, **kw):
        t0 = time.perf_counter()
        entered.set()
        assert release.wait(TIMEOUT_S), "the test never released the encode"
        calls.append((threading.current_thread().name, time.perf_counter() - t0))
        return encode(x, *a, **kw)

    monkeypatch.setattr(vae, "encode", held)
    return entered, release, calls


async def _together(sched: StepScheduler, validated_requests) -> list[asyncio.Task]:
    """Submit ``validated_requests`` so that the denoising thread admits them at one step boundary."""
    with sched.flight.cv:
        tasks = [asyncio.ensure_future(sched.submit(p)) for p in validated_requests]
        await asyncio.sleep(0)
    return tasks


def test_edits_admitted_together_share_one_vae_encode_and_equal_diffusers(flux):
    """Image to image (2 images) and inpainting, admitted together: their images in one VAE call (the inpainting
    request's masked image after, alone), and each equals its diffusers pipeline, with ``edit_encode`` timed."""
    folder, pipe, (a, b), mask, theirs = flux
    img2img = _validated(pipe, a, n=2, seed=4)
    inpaint = _validated(pipe, b, mask=mask, seed=3)
    text = _validated(pipe, None, seed=9)
    sched = StepScheduler(pipe)
    assert sched.stats()["edit_start"]["batch_images"] == 1  # on a CPU each image alone (batching does not pay there)
    sched._loop.edit_starter.batch_images = 8  # as on CUDA
    sched._loop.edit_starter.gather_s = TIMEOUT_S  # the round waits for both starts: batching is not left to timing
    latents = {}
    put = sched._finisher.put

    def record(item):
        latents[item.validated.request.seed] = item.state.latents.float().clone()
        put(item)

    sched._finisher.put = record

    async def main():
        return await asyncio.wait_for(asyncio.gather(*await _together(sched, [img2img, inpaint, text])), TIMEOUT_S)

    try:
        r_img, r_inp, r_text = asyncio.run(main())
        stats = sched.stats()
    finally:
        sched.close()
    assert stats["edit_start"] == {"rounds": 1, "vae_calls": 2, "images_encoded": 3, "batch_requests": 8,
                                   "batch_images": 8}
    assert r_img.timings_ms["edit_encode"] > 0 and r_inp.timings_ms["edit_encode"] > 0
    assert "edit_encode" not in r_text.timings_ms
    assert_same(GateRun(latents[4], r_img.image_bytes),
                diffusers_run(FluxImg2ImgPipeline, folder, img2img.request, **REF))
    assert_same(GateRun(latents[3], r_inp.image_bytes),
                diffusers_run(FluxInpaintPipeline, folder, inpaint.request, mask_image=theirs, **REF))


def test_an_edit_held_in_its_vae_encode_does_not_delay_text_to_image(flux, monkeypatch):
    """While an edit's VAE encode is held open (on the edit-start thread, not the denoising thread), a text-to-image
    request is served to its answer; then the edit is too."""
    folder, pipe, (a, _), _, _ = flux
    entered, release, calls = _hold_encode(monkeypatch, pipe.model.vae)
    sched = StepScheduler(pipe)

    async def main():
        edit = asyncio.ensure_future(sched.submit(_validated(pipe, a, seed=21)))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, TIMEOUT_S)
        plain = await asyncio.wait_for(sched.submit(_validated(pipe, None, seed=22)), TIMEOUT_S)
        held = not edit.done() and sched.stats()["encoding"] == 1
        release.set()
        return plain, held, await asyncio.wait_for(edit, TIMEOUT_S)

    try:
        plain, held, edited = asyncio.run(main())
    finally:
        release.set()
        sched.close()
    assert held, "the text-to-image request waited for the edit's encode"
    (thread, held_s), = calls
    assert plain.image_bytes and edited.image_bytes and thread == "bcg-edit-start"
    assert edited.timings_ms["edit_encode"] >= held_s * 1e3  # its encode time counts the time it was held
    assert edited.timings_ms["encode"] >= edited.timings_ms["edit_encode"]


def test_a_failing_encode_answers_only_its_own_request(flux, monkeypatch):
    """A black image's encode raises: the batched call fails, each image is encoded alone, and only the black
    image's request gets the error; the other edit and later requests are served, nothing is left in flight."""
    folder, pipe, (a, _), _, _ = flux
    vae = pipe.model.vae
    encode = vae.encode

    def picky(x, *args, **kw):
        if (x.flatten(1) == -1).all(1).any():
            raise RuntimeError("this VAE refuses black images")
        return encode(x, *args, **kw)

    monkeypatch.setattr(vae, "encode", picky)
    black = png_bytes(Image.new("RGB", (32, 32)))
    sched = StepScheduler(pipe)
    sched._loop.edit_starter.batch_images = 8
    sched._loop.edit_starter.gather_s = TIMEOUT_S

    async def main():
        tasks = await _together(sched, [_validated(pipe, black, seed=31), _validated(pipe, a, seed=32)])
        out = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), TIMEOUT_S)
        return out, await asyncio.wait_for(sched.submit(_validated(pipe, a, seed=33)), TIMEOUT_S)

    try:
        (bad, good), later = asyncio.run(main())
        stats = sched.stats()
    finally:
        sched.close()
    assert isinstance(bad, RuntimeError) and "refuses black images" in str(bad)
    assert good.image_bytes and later.image_bytes
    assert sum(s["failed"] for s in stats["shapes"].values()) == 1
    assert stats["rows_in_flight"] == 0 and stats["bytes_in_flight"] == 0
    assert stats["encoding"] == stats["encoded"] == 0 and stats["edit_start"]["rounds"] == 2


def test_close_answers_an_edit_being_encoded_and_one_waiting(flux, monkeypatch):
    folder, pipe, (a, b), _, _ = flux
    entered, release, _ = _hold_encode(monkeypatch, pipe.model.vae)
    sched = StepScheduler(pipe, max_rows=1)  # the second edit waits for the first one's row

    async def main():
        tasks = [asyncio.ensure_future(sched.submit(_validated(pipe, im, seed=40 + i))) for i, im in enumerate((a, b))]
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, TIMEOUT_S)
        queued = sched.stats()["waiting"], sched.stats()["encoding"]
        await asyncio.to_thread(sched.close, 0.5)
        return queued, await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), TIMEOUT_S)

    try:
        queued, answers = asyncio.run(main())
    finally:
        release.set()
    assert queued == (1, 1)
    assert all(isinstance(e, RequestCancelled) for e in answers), answers
    assert sched.stats()["rows_in_flight"] == 0 and sched.stats()["bytes_in_flight"] == 0


def test_the_edit_start_stage_keeps_the_state_equal_to_a_start_on_the_calling_thread(flux):
    """A round of one edit returns the state :meth:`DiTPipeline.start` returns on the calling thread, bit for bit
    (a VAE call of one image is the VAE's own call)."""
    from bcg_core.scheduler.edit_start import EditStarter

    folder, pipe, (a, _), mask, _ = flux
    validated = _validated(pipe, a, mask=mask, seed=50, n=2)
    got = []
    starter = EditStarter(pipe, 4, 4, lambda item, state, error: got.append((state, error)), lambda: False)
    starter.start()

    class Item:  # what the stage reads of an InFlight
        def __init__(self):
            self.validated, self.cancel, self.lease, self.edit_encode_s = validated, threading.Event(), None, None

    try:
        starter.put_many([Item()])
        for _ in range(int(TIMEOUT_S * 10)):
            if got:
                break
            threading.Event().wait(0.1)
    finally:
        starter.close(5.0)
    (state, error), = got
    assert error is None
    ref = pipe.start(validated)
    assert torch.equal(state.latents, ref.latents) and torch.equal(state.timesteps, ref.timesteps)
    for x, y in zip(state.extras["inpaint"], ref.extras["inpaint"], strict=True):
        assert torch.equal(x, y)
