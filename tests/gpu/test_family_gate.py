"""The reference gate on a GPU: every family served through captured CUDA graphs equals its diffusers pipeline.

The tiny checkpoints of ``tests/tiny/`` (fp32), loaded through ``model.path`` on CUDA, where the runner
captures every bucket as a CUDA graph and replays it; the same request through the family's diffusers
pipeline on CUDA. A request alone at its exact bucket, and a request that joins another one two steps into
its loop (rows of both, at different timesteps, in one padded forward). On CUDA the graph's kernels and
diffusers' need not sum in the same order (fp32 attention and convolutions pick kernels by shape), so the
latents must agree within 1e-4 relative and the images within one level on at most 1% of the pixel values.
TF32 is off in this module (cuDNN turns it on for convolutions by default, and the VAE then amplifies a 1e-7
difference of the latents into one-level flips on ~1.5% of the pixels).

FLUX.2 [dev] and [klein] (CFG against ``""``, the base checkpoint's way) are served at the tiny checkpoints' text
length (``bcg_text_tokens``, diffusers called with the same ``max_sequence_length``); [klein]'s
``output_type="latent"`` answer is unpacked and un-normalised, so bcg-serve's packed final latents are compared in that
layout (:func:`_as_diffusers`). Z-Image with CFG and a negative prompt, grid-keyed buckets, masked captions.
"""

import importlib

import pytest
import torch

from bcg_core import GenerationRequest
from reference_gate import GateRun, assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run
from tiny.flux2 import TEXT_TOKENS as FLUX2_TEXT
from tiny.qwenimage21 import loadable, without_torchvision

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("no_tf32")]

RTOL_CUDA, PIXELS_CUDA = 1e-4, 1e-2

# family: (builder module, build kwargs, diffusers pipeline class, buckets, request fields, diffusers kwargs)
CASES = {
    "flux-dev": ("flux", {"variant": "dev"}, "FluxPipeline",
                 {"batch_sizes": [1, 2, 4], "resolutions": ["32x32", "64x64"], "text_lengths": [32]},
                 {"width": 32, "height": 32, "guidance_scale": 3.5}, {"max_sequence_length": 32}),
    "sd35": ("sd3", {"variant": "sd35"}, "StableDiffusion3Pipeline",
             {"batch_sizes": [1, 2, 4, 8], "resolutions": ["64x64"], "text_lengths": [333]},
             {"width": 64, "height": 64, "guidance_scale": 5.0}, {}),
    "pixart": ("pixart", {}, "PixArtSigmaPipeline",
               {"batch_sizes": [1, 2, 4, 8], "resolutions": ["256x256"], "text_lengths": [16, 32]},
               {"width": 256, "height": 256, "guidance_scale": 4.5}, {}),
    "sana": ("sana", {}, "SanaPipeline",
             {"batch_sizes": [1, 2, 4, 8], "resolutions": ["512x512"], "text_lengths": [16, 32]},
             {"width": 512, "height": 512, "guidance_scale": 4.5}, {}),
    "qwenimage": ("qwenimage", {}, "QwenImagePipeline",
                  {"batch_sizes": [1, 2, 4, 8], "resolutions": ["64x64"], "text_lengths": [16, 32]},
                  {"width": 64, "height": 64, "negative_prompt": "blurry"}, {}),
    "qwenimage21": ("qwenimage21", {}, "QwenImage21Pipeline",
                    {"batch_sizes": [1, 2, 4, 8], "resolutions": ["64x64"], "text_lengths": [16, 32]},
                    {"width": 64, "height": 64, "negative_prompt": "blurry", "true_cfg_scale": 4.0}, {}),
    "flux2-dev": ("flux2", {"variant": "dev"}, "Flux2Pipeline",
                  {"batch_sizes": [1, 2, 4], "resolutions": ["32x32", "64x64"], "text_lengths": [FLUX2_TEXT]},
                  {"width": 32, "height": 32, "guidance_scale": 4.0}, {"max_sequence_length": FLUX2_TEXT}),
    "flux2-klein": ("flux2", {"variant": "klein"}, "Flux2KleinPipeline",
                    {"batch_sizes": [1, 2, 4, 8], "resolutions": ["32x32", "64x64"], "text_lengths": [FLUX2_TEXT]},
                    {"width": 32, "height": 32, "guidance_scale": 4.0}, {"max_sequence_length": FLUX2_TEXT}),
    "zimage": ("zimage", {}, "ZImagePipeline",
               {"batch_sizes": [1, 2, 4, 8], "resolutions": ["32x32", "40x36"], "text_lengths": [32, 64]},
               {"width": 32, "height": 32, "guidance_scale": 4.0, "negative_prompt": "blurry"}, {}),
}
FUSING = ("flux", "sd3", "flux2")
"""Families whose steps run fused once the start-up check passes (flow-match Euler, plain CFG or none)."""



@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory):
    module, kwargs, cls, buckets, fields, ref = CASES[request.param]
    folder = importlib.import_module(f"tiny.{module}").build(tmp_path_factory.mktemp(request.param), **kwargs)
    with loadable():
        pipe = bcg_pipeline(folder, buckets, device="cuda")
    assert {d["mode"] for d in pipe.runner.describe()} == {"graph"}, pipe.runner.describe()
    return folder, pipe, getattr(importlib.import_module("diffusers"), cls), fields, ref


@pytest.fixture(autouse=True)
def _loadable(monkeypatch):
    without_torchvision(monkeypatch)  # Qwen-Image 2.1's processor where torchvision is missing


def _req(fields: dict, **kw) -> GenerationRequest:
    return GenerationRequest(**{"prompt": "a photo of a cat sitting on a red chair", "n": 1, "seed": 3,
                                "num_inference_steps": 4, **fields, **kw})


def _as_diffusers(pipe, ours: GateRun, req: GenerationRequest) -> GateRun:
    """``ours`` in the layout of the diffusers pipeline's ``output_type="latent"`` answer: ``Flux2KleinPipeline``
    returns its final latents unpacked, with the VAE's batch-norm statistics undone
    (:meth:`~bcg_core.families.flux2.Flux2Family.unpacked_latents`, which reproduces it bit for bit,
    tests/families/test_flux2.py); every other pipeline here (``Flux2Pipeline`` included) returns what the step loop
    holds, and ``ours`` is returned as it is."""
    if pipe.model.spec.pipeline_class != "Flux2KleinPipeline":
        return ours
    from diffusers import Flux2Pipeline

    fam = pipe.model
    ids = Flux2Pipeline._prepare_latent_ids(torch.empty(req.n, 0, *fam.rules.grid(req.width, req.height)))
    with torch.inference_mode():
        lat = fam.unpacked_latents(ours.latents.to(fam.device, fam.dtype), ids.to(fam.device))
    return GateRun(lat.float().cpu(), ours.pngs)


def test_alone_at_its_bucket_replayed_as_a_graph_equals_diffusers_on_cuda(family):
    folder, pipe, cls, fields, ref = family
    req = pipe.validator.validate(_req(fields)).request
    key = str(pipe.validator.validate(req).lookup.key)
    before = {b["key"]: b["replays"] for b in pipe.stats()["buckets"]}.get(key, 0)
    ours = bcg_run(pipe, req)
    after = {b["key"]: b["replays"] for b in pipe.stats()["buckets"]}[key]
    assert after - before == req.num_inference_steps  # every step replayed its bucket's graph
    assert_same(_as_diffusers(pipe, ours, req), diffusers_run(cls, folder, req, device="cuda", **ref), rtol=RTOL_CUDA,
                pixel_share=PIXELS_CUDA)


def test_flow_match_euler_families_fuse_their_steps_after_the_bitwise_check_on_cuda(family):
    """FLUX.1, SD3 and FLUX.2 (flow-match Euler, plain CFG or none) run each step as one replay of the fused graph,
    after the start-up check found it bit for bit equal to the host path; the other families keep the host path."""
    folder, pipe, cls, fields, ref = family
    fuses = pipe.model.name in FUSING
    assert pipe.fused.on == fuses, pipe.fused.note
    if fuses:
        req = pipe.validator.validate(_req(fields, seed=11)).request
        before = pipe.fused.steps
        ours = bcg_run(pipe, req)
        assert pipe.fused.steps - before == req.num_inference_steps and not pipe.fused.host_steps
        assert_same(_as_diffusers(pipe, ours, req), diffusers_run(cls, folder, req, device="cuda", **ref),
                    rtol=RTOL_CUDA, pixel_share=PIXELS_CUDA)


def test_joining_a_running_request_in_one_graph_replay_equals_diffusers_on_cuda(family):
    folder, pipe, cls, fields, ref = family
    a = pipe.validator.validate(_req(fields, seed=7)).request
    b = pipe.validator.validate(_req(fields, n=2, seed=40, num_inference_steps=5,
                                     prompt="an astronaut riding a horse")).request
    ours_a, ours_b = bcg_run_joined(pipe, a, b, head_start=2)
    for ours, req in ((ours_a, a), (ours_b, b)):
        assert_same(_as_diffusers(pipe, ours, req), diffusers_run(cls, folder, req, device="cuda", **ref),
                    rtol=RTOL_CUDA, pixel_share=PIXELS_CUDA)


def test_the_step_scheduler_with_measured_costs_equals_diffusers_on_cuda(family):
    """Through the step scheduler on CUDA: costs measured on the captured graphs, a request joining another
    mid-flight, the batched decode on the decode stream and the PNG pool; each image equals diffusers' own."""
    import asyncio

    from bcg_core.scheduler.step_scheduler import StepScheduler
    from reference_gate import pixels

    folder, pipe, cls, fields, ref = family
    costs = pipe.measure_costs(pipe.table.keys, iters=1)
    assert costs.source == "measured" and costs.bucket_ms
    a = pipe.validator.validate(_req(fields, seed=7))
    b = pipe.validator.validate(_req(fields, n=2, seed=40, num_inference_steps=6, prompt="an astronaut riding a horse"))
    sched = StepScheduler(pipe, costs=costs)

    async def main():
        first = asyncio.ensure_future(sched.submit(b))
        while sched.stats()["iterations"] < 2:
            await asyncio.sleep(0.001)
        return await sched.submit(a), await first

    try:
        ra, rb = asyncio.run(asyncio.wait_for(main(), 300))
        stats = sched.stats()
    finally:
        sched.close()
    assert stats["costs"]["source"] == "measured" and sum(stats["forwards"].values()) > 0
    for ours, validated in ((ra, a), (rb, b)):
        theirs = diffusers_run(cls, folder, validated.request, device="cuda", **ref)
        assert len(ours.image_bytes) == len(theirs.pngs)
        for x, y in zip(ours.image_bytes, theirs.pngs, strict=True):
            diff = abs(pixels(x) - pixels(y))
            assert diff.max() <= 1 and float((diff > 0).mean()) <= PIXELS_CUDA
