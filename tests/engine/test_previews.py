"""Streamed previews without Ray: which steps, the linear latent-to-RGB fit, every family's ``preview`` hook,
the step scheduler's preview thread, and the bound on what previews cost the requests that share a step.

The bound (docs/API.md, "Streaming"): the denoising thread's whole share of a preview is one latent copy and a
queue put, measured per preview (``previews.handoff_ms_*``); it must stay under :data:`HANDOFF_BOUND_MS` per
preview, and a request's result does not wait for another request's previews (a preview that sleeps 0.4 s
delays only its own request). The latency bound of a request sharing steps with one that streams previews
(1.25x) is held on a GPU by tests/gpu/test_preview_bound.py and measured by benchmarks/bench_previews.py: on a
2-core CPU the preview thread's drawing competes with the denoising thread for the cores, and the ratio read
0.96-1.59 between runs, a measurement, not a test.
"""

from __future__ import annotations

import asyncio
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bcg_core.config import EngineConfig
from bcg_core.pipeline import DiTPipeline
from bcg_core.preview import LinearPreview, PartialImage, StepProgress, preview_steps
from bcg_core.request import GenerationRequest
from bcg_core.scheduler.step_scheduler import StepScheduler
from scheduling import ValidatingScheduler

sys.path.insert(0, str(Path(__file__).parents[1]))

HANDOFF_BOUND_MS = 2.0
"""Most milliseconds of the denoising thread one preview may take (measured: about 0.05 ms at 256x256 and
0.1 ms at 512x512 on a 2-core CPU; the bound leaves room for a loaded machine)."""

@pytest.mark.parametrize("steps,k,expect", [(20, 3, (5, 10, 15)), (4, 3, (1, 2, 3)), (2, 3, (1,)), (1, 3, ()),
                                            (10, 0, ()), (8, 1, (4,)), (50, 2, (17, 33))])
def test_preview_steps_are_evenly_spaced_and_never_the_last(steps, k, expect):
    assert preview_steps(steps, k) == expect
    assert all(1 <= s < steps for s in preview_steps(steps, k))


def test_preview_steps_refuses_bad_counts():
    with pytest.raises(ValueError):
        preview_steps(0, 1)
    with pytest.raises(ValueError):
        preview_steps(4, -1)


def test_the_linear_fit_recovers_a_linear_encoder():
    # an encoder that is linear per latent pixel (mean colour of 8x8 pixels, mixed into 4 channels): the fit
    # must invert it, so a preview of its latents is the picture's mean colours
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(4, 3, generator=g)
    shift = torch.randn(4, generator=g)

    def encode(x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nchw,kc->nkhw", torch.nn.functional.avg_pool2d(x, 8), mix) + shift[None, :, None, None]

    fit = LinearPreview.fit(encode, factor=8)
    x = torch.rand(2, 3, 64, 96, generator=g) * 2 - 1
    got = np.stack(fit(encode(x))).astype(int)
    want = ((torch.nn.functional.avg_pool2d(x, 8).clamp(-1, 1) + 1) * 127.5).round().permute(0, 2, 3, 1).numpy()
    assert got.shape == (2, 8, 12, 3) and np.abs(got - want).max() <= 1


def test_the_fit_refuses_an_encoder_of_another_factor():
    with pytest.raises(ValueError, match="pixels per latent pixel"):
        LinearPreview.fit(lambda x: torch.nn.functional.avg_pool2d(x, 4), factor=8)


# -- every family's hook, on its tiny checkpoint --------------------------------------------------------------

FAMILIES = {  # family -> (builder kwargs, bucket table, request size)
    "flux": ({"variant": "dev"}, {"batch_sizes": [2], "resolutions": ["32x32"], "text_lengths": [32]}, 32),
    "sd3": ({"variant": "sd35"}, {"batch_sizes": [2], "resolutions": ["64x64"], "text_lengths": [333]}, 64),
    "pixart": ({}, {"batch_sizes": [2], "resolutions": ["256x256"], "text_lengths": [32]}, 256),
    "sana": ({}, {"batch_sizes": [2], "resolutions": ["512x512"], "text_lengths": [32]}, 512),
    "qwenimage": ({}, {"batch_sizes": [2], "resolutions": ["64x64"], "text_lengths": [32]}, 64),
    "flux2": ({"variant": "dev"}, {"batch_sizes": [2], "resolutions": ["32x32"], "text_lengths": [96]}, 32),
    "zimage": ({}, {"batch_sizes": [2], "resolutions": ["32x32"], "text_lengths": [32]}, 32),
    "qwenimage21": ({}, {"batch_sizes": [2], "resolutions": ["64x64"], "text_lengths": [32]}, 64),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_previews_mid_denoise_latents(family, tmp_path):
    import importlib

    from reference_gate import bcg_pipeline

    kwargs, buckets, size = FAMILIES[family]
    folder = importlib.import_module(f"tiny.{family}").build(tmp_path / family, **kwargs)
    pipe = bcg_pipeline(folder, buckets)
    validated = pipe.validator.validate(GenerationRequest("a red cube", n=2, width=size, height=size,
                                                          num_inference_steps=3, guidance_scale=1.0, seed=0))
    state = pipe.start(validated)
    pipe.step([state], pipe.decider.for_states([state]))
    assert pipe.capabilities.previews  # the step scheduler takes previews of it (without, partial_images gets none)
    images = pipe.model.preview(state, state.latents.clone())
    gen_w, gen_h = pipe.model.spec.generation_size(size, size)
    model = pipe.model  # pixels per latent pixel of the tiny VAE (fewer blocks than the real ones)
    factor = model.vae_scale_factor if hasattr(model, "vae_scale_factor") else model.pipe.vae_scale_factor
    assert len(images) == 2
    for im in images:
        assert im.dtype == np.uint8 and im.shape == (gen_h // factor, gen_w // factor, 3)
    assert not np.array_equal(images[0], images[1])  # two seeds, two previews


def test_a_streamed_qwenimage21_request_gets_its_previews_before_its_rgba_images(tmp_path):
    """The families added last (FLUX.2, Z-Image, Qwen-Image 2.1) answered ``partial_images`` with the completed event
    alone; here the RGBA one: RGB previews at the requested size, then the RGBA images."""
    from reference_gate import bcg_pipeline
    from tiny.qwenimage21 import build

    pipe = bcg_pipeline(build(tmp_path / "qwen21"), FAMILIES["qwenimage21"][1])
    sched = ValidatingScheduler(pipe)
    try:
        events = asyncio.run(_collect(sched, GenerationRequest("a red cube", n=2, width=64, height=64,
                                                               num_inference_steps=4, partial_images=3, seed=1)))
    finally:
        sched.close()
    previews, result = events[:-1], events[-1]
    assert sorted((p.image_index, p.step) for p in previews) == [(i, s) for i in (0, 1) for s in (1, 2, 3)]
    for p in previews:
        with Image.open(io.BytesIO(p.data)) as img:
            assert img.size == (64, 64) and img.mode == "RGB"
    with Image.open(io.BytesIO(result.image_bytes[0])) as img:
        assert img.mode == "RGBA"


# -- the scheduler: previews streamed, their size and format, and their cost ----------------------------------

@pytest.fixture(scope="module")
def pipe() -> DiTPipeline:
    cfg = EngineConfig.model_validate({"buckets": {"batch_sizes": [1, 2, 4], "resolutions": ["256x256", "512x512"],
                                                  "text_lengths": [256]}})
    return DiTPipeline.from_config(cfg)


def _request(**kw) -> GenerationRequest:
    fields = dict(prompt="a lighthouse at dusk", n=1, width=256, height=256, num_inference_steps=6,
                  guidance_scale=0.0, seed=3)
    fields.update(kw)
    return GenerationRequest(**fields)


async def _collect(sched: StepScheduler, request: GenerationRequest) -> list:
    return [event async for event in sched.submit_stream(request)]


def test_scheduler_streams_each_preview_of_each_image_then_the_result(pipe):
    sched = ValidatingScheduler(pipe)
    try:
        events = asyncio.run(_collect(sched, _request(n=2, width=512, height=256, partial_images=3,
                                                      output_format="webp")))
        previews, result = events[:-1], events[-1]
        assert all(isinstance(p, PartialImage) for p in previews) and result.image_format == "webp"
        assert [(p.index, p.step) for p in previews if p.image_index == 0] == [(0, 2), (1, 3), (2, 4)]
        assert sorted(p.image_index for p in previews) == [0, 0, 0, 1, 1, 1]
        for p in previews:
            with Image.open(io.BytesIO(p.data)) as img:
                img.load()
                assert img.format == "WEBP" and img.size == (512, 256) and img.mode == "RGB"
        stats = sched.stats()["previews"]
        assert stats["taken"] == stats["sent"] == 3 and stats["dropped"] == stats["failed"] == 0
        assert stats["handoff_ms_max"] < HANDOFF_BOUND_MS, stats
        # a request that is not streamed takes no preview
        plain = asyncio.run(sched.submit(_request(partial_images=3)))
        assert len(plain.image_bytes) == 1 and sched.stats()["previews"]["taken"] == 3
    finally:
        sched.close()


def test_a_stream_with_progress_reports_each_step_in_order_before_the_result(pipe):
    """``submit_stream(progress=True)`` (a video job's progress): a StepProgress after every step, then the result;
    without it, none."""
    sched = ValidatingScheduler(pipe)

    async def run(progress: bool):
        return [e async for e in sched.submit_stream(_request(num_inference_steps=3, partial_images=1),
                                                     progress=progress)]

    try:
        with_steps, without = asyncio.run(run(True)), asyncio.run(run(False))
    finally:
        sched.close()
    steps = [e for e in with_steps if isinstance(e, StepProgress)]
    assert steps == [StepProgress(1, 3), StepProgress(2, 3), StepProgress(3, 3)]
    assert [type(e).__name__ for e in with_steps if not isinstance(e, StepProgress)] == ["PartialImage",
                                                                                       "GenerationResult"]
    assert with_steps[-1].steps == 3 and not any(isinstance(e, StepProgress) for e in without)


def test_a_slow_preview_holds_only_its_own_result_and_all_previews_come_first(pipe, monkeypatch):
    import time

    real = pipe.model.preview

    def slow(state, latents):
        time.sleep(0.4)
        return real(state, latents)

    monkeypatch.setattr(pipe.model, "preview", slow)
    sched = ValidatingScheduler(pipe)

    async def run():
        a = asyncio.ensure_future(_collect(sched, _request(num_inference_steps=3, partial_images=2)))
        b = asyncio.ensure_future(sched.submit(_request(num_inference_steps=3, seed=9)))
        rb = await b
        tb = time.perf_counter()
        events = await a
        return events, rb, time.perf_counter() - tb

    try:
        events, rb, gap = asyncio.run(run())
    finally:
        sched.close()
    assert [type(e).__name__ for e in events] == ["PartialImage", "PartialImage", "GenerationResult"]
    assert [e.step for e in events[:2]] == [1, 2]
    assert len(rb.image_bytes) == 1 and gap > 0.3  # B was answered at once; A's result waited for its previews
