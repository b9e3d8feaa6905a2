"""FLUX.1 edits: image-to-image (``FluxImg2ImgPipeline``) and inpainting (``FluxInpaintPipeline``) at the step level.

An edit differs from text to image only at its start and, for inpainting, after each step: its latents start
from the VAE encoding of its image, noised to the first of the last ``int(steps * strength)`` timesteps (the
pipelines' ``get_timesteps`` and ``prepare_latents``), and an inpainting request puts its known region back after
every scheduler step, noised to the next timestep (``(1 - mask) * scale_noise(image_latents, t_next, noise) +
mask * latents``, the pipeline's loop). Its forwards are text to image's: its rows share bucket forwards with
any request of the same shape. Every preparation step calls the diffusers pipeline's own method on a view of
the pipeline that holds the request's own scheduler (:class:`~bcg_core.families.edit_view.PipelineView`), in the
pipeline's order, so the generators are drawn as diffusers draws them (the VAE's latent sample first, then the noise,
then the masked image's sample).
"""

from __future__ import annotations

import copy
import threading

import torch

from bcg_core.families.edit_view import PipelineView, edit_pipeline as _edit_pipeline, flow_edit_timesteps
from bcg_core.families.state import RequestState

__all__ = ["edit_pipeline", "start_edit"]


def edit_pipeline(family, inpaint: bool):
    """The family's ``FluxImg2ImgPipeline`` or ``FluxInpaintPipeline`` over its own loaded components (made once,
    no weights copied; text encoders are not needed: the family encodes the text)."""
    from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline

    return _edit_pipeline(family, FluxInpaintPipeline if inpaint else FluxImg2ImgPipeline,
                          scheduler=family.scheduler, vae=family.vae, text_encoder=None, tokenizer=None,
                          text_encoder_2=None, tokenizer_2=None, transformer=family.adapter.model)


@torch.inference_mode()
def start_edit(family, validated, cancel: threading.Event | None = None) -> RequestState:
    """An edit request at its first step (module docstring): text rows, latents from its image, its scheduler with
    the strength's timesteps; an inpainting request keeps ``extras["inpaint"]`` = ``(mask, image_latents,
    noise)``, packed (n, tokens, 64) each."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    from bcg_core.edits import read_image, read_mask

    req = validated.request
    inpaint = req.mask is not None
    pipe = edit_pipeline(family, inpaint)
    cls = type(pipe)
    cond = family.encode(req.prompt)
    uncond = family.encode(req.negative_prompt or "") if family.spec.uses_cfg(req) else None
    image = read_image(req.image, 1 << 62)
    height, width, device = req.height, req.width, family.device
    init_image = pipe.image_processor.preprocess(image, height=height, width=width).to(dtype=torch.float32)
    sched = copy.deepcopy(family.scheduler)
    view = PipelineView(pipe, sched)
    timesteps, runs = flow_edit_timesteps(cls, view, req, device, calculate_shift, retrieve_timesteps)
    latent_timestep = timesteps[:1].repeat(req.n)
    channels = family.adapter.in_channels // 4
    gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
    dtype = cond.text.dtype
    extras = {}
    if inpaint:
        latents, noise, image_latents, _ = cls.prepare_latents(view, init_image, latent_timestep, req.n, channels,
                                                               height, width, dtype, device, gens)
        mask_image = read_mask(req.mask, image.size, 1 << 62)
        mask_condition = pipe.mask_processor.preprocess(mask_image, height=height, width=width)
        masked_image = init_image * (mask_condition < 0.5)
        mask, _ = cls.prepare_mask_latents(view, mask_condition, masked_image, 1, channels, req.n, height, width,
                                           dtype, device, gens)
        extras["inpaint"] = (mask, image_latents, noise)
    else:
        latents, _ = cls.prepare_latents(view, init_image, latent_timestep, req.n, channels, height, width, dtype,
                                         device, gens)
    if family.guidance_embeds:
        extras["guidance"] = torch.full([1], float(req.guidance_scale), device=device, dtype=torch.float32)
    h, w = family.rules.grid(width, height)
    return RequestState(validated, cond, uncond, latents, sched, timesteps, (h, w), extras=extras, cancel=cancel)
