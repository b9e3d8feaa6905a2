"""Qwen-Image edits: image-to-image (``QwenImageImg2ImgPipeline``) and inpainting (``QwenImageInpaintPipeline``) at
the step level, as :mod:`bcg_core.families.flux_edit` does FLUX.1's.

What diffusers 0.42.1 does (``pipelines/qwenimage/pipeline_qwenimage_img2img.py`` and
``pipeline_qwenimage_inpaint.py``, ``__call__`` steps 2-6), and what this module does the same way:

- Text: ``encode_prompt`` is a copy of ``QwenImagePipeline``'s (``max_sequence_length`` 512), and true CFG runs as
  there (a negative prompt and ``true_cfg_scale > 1``, default 4.0; combined prediction norm-rescaled to the cond
  one): the family's own encode and :meth:`~bcg_core.families.qwenimage.QwenImageFamily.advance`.
- Image: ``image_processor.preprocess(image, height, width)`` to (1, 3, H, W) in [-1, 1], float32.
- Schedule: the text-to-image schedule (sigmas ``linspace(1, 1/N, N)``, ``mu = calculate_shift(h * w, ...)`` from
  the scheduler config, ``retrieve_timesteps``), then ``get_timesteps(N, strength)``: the last
  ``N - int(N - N * strength)`` timesteps, with the scheduler's begin index set to the first of them.
- Latents: ``prepare_latents`` adds the frame dim (the VAE is a video VAE), encodes the image with
  ``_encode_vae_image`` (a sample of the latent distribution drawn from ``generator[0]``: one image for all
  ``n``), normalises it per channel (``(z - latents_mean) / latents_std``), repeats it ``n`` times, draws
  ``(n, 1, 16, 2h, 2w)`` noise from the request's generators, noises the image latents to the first timestep
  (``scheduler.scale_noise``) and packs 2x2 patches into tokens: (n, h * w, 64). The inpainting pipeline also
  returns the packed noise and image latents.
- Inpainting mask: ``mask_processor.preprocess`` (grayscale, binarised, [0, 1]) and ``prepare_mask_latents``
  (nearest-resized to the latent grid, repeated over the 16 channels, packed): (n, h * w, 64), 1 where to
  repaint. After every scheduler step the known region is put back noised to the next timestep:
  ``(1 - mask) * scale_noise(image_latents, t_next, noise) + mask * latents`` (the image latents themselves after
  the last step), with no cast of the result (the pipeline casts only on Apple MPS).

Every preparation step calls the diffusers pipeline's own method unbound on a view of the pipeline that holds the
request's own scheduler (:class:`~bcg_core.families.edit_view.PipelineView`), in the pipeline's order, so the
generators are drawn as diffusers draws them: the image's latent sample (``generator[0]``), then the noise (one
generator per image). One step is left out: ``prepare_mask_latents`` also VAE-encodes the masked image (a second
``generator[0]`` draw), and ``QwenImageInpaintPipeline``'s loop never reads the result (it is for 64-channel
inpainting transformers) and draws nothing after it; here that method gets a latent-shaped placeholder in its
place, which it takes as latents as they are (its ``masked_image.shape[1] == latent_channels`` branch), so no VAE
encode runs for nothing. The forwards are text to image's: an edit's rows share bucket forwards with any request
of the same grid.
"""

from __future__ import annotations

import copy
import threading

import torch

from bcg_core.families.edit_view import PipelineView, edit_pipeline as _edit_pipeline, flow_edit_timesteps
from bcg_core.families.state import RequestState

__all__ = ["edit_pipeline", "start_edit"]


def edit_pipeline(family, inpaint: bool):
    """The family's ``QwenImageInpaintPipeline`` (``inpaint``) or ``QwenImageImg2ImgPipeline``, over its own loaded
    scheduler, VAE and transformer (made once and cached on the family, no weights copied; no text encoder or
    tokenizer: the family encodes the text with ``QwenImagePipeline.encode_prompt``, of which the edit pipelines'
    ``encode_prompt`` is a copy)."""
    from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline

    p = family.pipe
    return _edit_pipeline(family, QwenImageInpaintPipeline if inpaint else QwenImageImg2ImgPipeline,
                          scheduler=p.scheduler, vae=p.vae, text_encoder=None, tokenizer=None,
                          transformer=p.transformer)


@torch.inference_mode()
def start_edit(family, validated, cancel: threading.Event | None = None) -> RequestState:
    """An edit request of the Qwen-Image ``family`` at its first step (module docstring).

    Args:
        family: the :class:`~bcg_core.families.qwenimage.QwenImageFamily`.
        validated: the validated request; ``request.image`` set (``request.mask`` too for inpainting), its size,
            steps and strength filled by the validator (the image and mask already read and checked there).
        cancel: the request's cancel event.

    Returns:
        The state: ``latents`` (n, h * w, 64) packed, the image noised to the first of the strength's timesteps, in
        the text embeddings' dtype; ``timesteps`` the last ``steps_run`` of the schedule (its own scheduler's begin
        index at the first); an inpainting request keeps ``extras["inpaint"] = (mask, image_latents, noise)``,
        each (n, h * w, 64) packed (mask 1 where to repaint).

    Raises:
        RequestError: the image or mask does not decode (:mod:`bcg_core.edits`; the validator has read them already).
        ValueError: the strength leaves no step (diffusers raises the same; the validator refuses a strength of 0).
    """
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import calculate_shift, retrieve_timesteps

    from bcg_core.edits import read_image, read_mask

    req = validated.request
    inpaint = req.mask is not None
    pipe = edit_pipeline(family, inpaint)
    cls = type(pipe)
    cond = family.encode(req.prompt)
    uncond = family.encode(req.negative_prompt) if family.spec.uses_cfg(req) else None
    image = read_image(req.image, 1 << 62)
    height, width, device = req.height, req.width, family.device
    init_image = pipe.image_processor.preprocess(image, height=height, width=width).to(dtype=torch.float32)
    sched = copy.deepcopy(family.pipe.scheduler)
    view = PipelineView(pipe, sched)
    timesteps, runs = flow_edit_timesteps(cls, view, req, device, calculate_shift, retrieve_timesteps)
    if runs < 1:
        raise ValueError(f"strength {req.strength} of {req.num_inference_steps} steps leaves {runs} steps to run "
                         f"(diffusers raises too)")
    latent_timestep = timesteps[:1].repeat(req.n)
    channels = family.adapter.in_channels // 4
    gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
    dtype = cond.text.dtype
    extras = {}
    if inpaint:
        latents, noise, image_latents = cls.prepare_latents(view, init_image, latent_timestep, req.n, channels,
                                                            height, width, dtype, device, gens)
        mask_image = read_mask(req.mask, image.size, 1 << 62)
        mask_condition = pipe.mask_processor.preprocess(mask_image, height=height, width=width)
        # The masked image's latents are unused by the pipeline's loop: a placeholder in latent channels, which
        # prepare_mask_latents takes as latents, skips their VAE encode (module docstring).
        unused = torch.zeros(1, pipe.latent_channels, 1, 2 * (int(height) // (pipe.vae_scale_factor * 2)),
                             2 * (int(width) // (pipe.vae_scale_factor * 2)), dtype=dtype, device=device)
        mask, _ = cls.prepare_mask_latents(view, mask_condition, unused, 1, channels, req.n, height, width, dtype,
                                           device, gens)
        extras["inpaint"] = (mask, image_latents, noise)
    else:
        latents = cls.prepare_latents(view, init_image, latent_timestep, req.n, channels, height, width, dtype,
                                      device, gens)
    grid = family.rules.grid(width, height)
    return RequestState(validated, cond, uncond, latents, sched, timesteps, grid, extras=extras, cancel=cancel)
