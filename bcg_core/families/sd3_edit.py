"""SD3 / SD3.5 edits: image to image (``StableDiffusion3Img2ImgPipeline``) and inpainting
(``StableDiffusion3InpaintPipeline``) at the step level.

What diffusers 0.42.1 does (``pipelines/stable_diffusion_3/pipeline_stable_diffusion_3_img2img.py`` and
``..._inpaint.py``, their ``__call__``), and what this module does the same way by calling those pipelines' own
methods unbound on a :class:`~bcg_core.families.edit_view.PipelineView` that holds the request's own scheduler, in
the pipelines' order, so every generator is drawn as diffusers draws it:

- Schedule: the text-to-image timesteps (``retrieve_timesteps``, ``mu`` from the latent size under
  ``use_dynamic_shifting``: :meth:`~bcg_core.families.sd3.SD3Family.set_timesteps`), then ``get_timesteps``: the
  last ``steps - int(steps - steps * strength)`` of them, and ``set_begin_index`` on the scheduler.
- Image to image (``prepare_latents``): the image, preprocessed (``image_processor.preprocess``) and cast to the
  text dtype, is VAE-encoded and *sampled* (``retrieve_latents``), ``(z - shift_factor) * scaling_factor``, then
  noised to the first timestep: ``scale_noise(z, t_0, noise)`` with noise drawn after the sample.
- Inpainting (``prepare_latents`` with ``return_noise`` and ``return_image_latents``, then ``prepare_mask_latents``):
  the image latents are sampled from the first generator (``_encode_vae_image`` encodes the one image), the noise
  is drawn from every generator, the start is that noise at ``strength == 1`` (``is_strength_max``) and the noised
  image latents otherwise; the mask is resized to the latent grid (nearest); the masked image's VAE sample is
  drawn last. After every scheduler step the known region is put back, noised to the next timestep (none after the
  last): ``(1 - mask) * scale_noise(image_latents, t_next, noise) + mask * latents``. Under classifier-free
  guidance diffusers doubles the mask and takes its first half for the blend: the same values as the undoubled
  mask used here.

Deviations from diffusers 0.42.1, each deliberate:

- Image to image with ``n > 1``: ``StableDiffusion3Img2ImgPipeline.prepare_latents`` encodes ``image[i : i + 1]``
  for each of the ``n`` generators of a list, so one image with ``num_images_per_prompt > 1`` and a generator per
  image fails in diffusers (it encodes an empty batch). bcg-serve's ``n`` images equal that pipeline called with
  the image repeated ``n`` times (``image=[image] * n``), which encodes every copy with its own generator: image
  ``i`` is the ``n = 1`` edit of seed ``seed + i``.
- Inpainting decode: ``StableDiffusion3InpaintPipeline`` decodes ``vae.decode(z / scaling_factor)``, without the
  ``+ shift_factor`` of its own encode and of every other SD3 pipeline (diffusers issue #13611, item 1). bcg-serve
  decodes every SD3 request as ``StableDiffusion3Pipeline`` does (``z / scaling_factor + shift_factor``): the final
  latents equal diffusers' inpainting latents, the images are those latents decoded correctly.

Not served: a transformer with ``in_channels`` 33 (latents, mask and masked-image latents concatenated: an
inpainting-only model, which only the inpainting pipeline runs); :meth:`~bcg_core.families.sd3.SD3Family.describe`
refuses it.
"""

from __future__ import annotations

import copy
import threading

import torch

from bcg_core.families.edit_view import PipelineView, edit_pipeline as _edit_pipeline
from bcg_core.families.state import RequestState

__all__ = ["edit_pipeline", "start_edit"]


def edit_pipeline(family, inpaint: bool):
    """The family's ``StableDiffusion3InpaintPipeline`` (``inpaint``) or ``StableDiffusion3Img2ImgPipeline`` over its
    own loaded transformer, VAE and scheduler (made once per family, no weights copied). Its text encoders are None:
    the family encodes the text with its own ``encode_prompt`` (the edit pipelines' copies are the same code)."""
    from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline

    p = family.pipe
    return _edit_pipeline(family, StableDiffusion3InpaintPipeline if inpaint else StableDiffusion3Img2ImgPipeline,
                          transformer=p.transformer, scheduler=p.scheduler, vae=p.vae, text_encoder=None,
                          tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                          tokenizer_3=None)


@torch.inference_mode()
def start_edit(family, validated, cancel: threading.Event | None = None) -> RequestState:
    """An SD3 edit request at its first step (module docstring): its text rows, its scheduler at the strength's
    timesteps and its latents from its image.

    Args:
        family: the :class:`~bcg_core.families.sd3.SD3Family`.
        validated: a validated request with ``image`` set (and ``mask`` for inpainting), its size (a multiple of the
            token size, the validator's), ``strength`` and ``seed`` filled in.

    Returns:
        A state at step 0 whose ``timesteps`` are the last ``steps_run`` of the schedule; ``latents``
        (n, 16, H/8, W/8) in the text-embedding dtype. Inpainting keeps ``extras["inpaint"] = (mask, image_latents,
        noise)``: mask (n, 1, H/8, W/8), 1 where to repaint; image latents and noise (n, 16, H/8, W/8).

    Raises:
        RequestError: an image or mask that does not decode (fields ``image``, ``mask``; the validator checked them).
    """
    from bcg_core.edits import read_image, read_mask

    req = validated.request
    inpaint = req.mask is not None
    pipe = edit_pipeline(family, inpaint)
    cls = type(pipe)
    cond, uncond = family.encode_text(req)
    dtype, device = cond.text.dtype, family.device
    height, width = req.height, req.width
    image = read_image(req.image, 1 << 62)
    sched = copy.deepcopy(family.pipe.scheduler)
    view = PipelineView(pipe, sched)
    family.set_timesteps(sched, req.num_inference_steps, height, width)
    timesteps, _ = cls.get_timesteps(view, req.num_inference_steps, req.strength, device)
    latent_timestep = timesteps[:1].repeat(req.n)
    gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
    extras = {}
    if inpaint:
        init_image = pipe.image_processor.preprocess(image, height=height, width=width).to(dtype=torch.float32)
        latents, noise, image_latents = cls.prepare_latents(
            view, req.n, pipe.vae.config.latent_channels, height, width, dtype, device, gens, None, image=init_image,
            timestep=latent_timestep, is_strength_max=req.strength == 1.0, return_noise=True,
            return_image_latents=True)
        mask_condition = pipe.mask_processor.preprocess(read_mask(req.mask, image.size, 1 << 62), height=height,
                                                        width=width)
        masked_image = init_image * (mask_condition < 0.5)
        mask, _ = cls.prepare_mask_latents(view, mask_condition, masked_image, 1, req.n, height, width, dtype,
                                           device, gens, False)
        extras["inpaint"] = (mask, image_latents, noise)
    else:  # one copy of the image per generator (module docstring: diffusers fails on one image for n > 1),
        # preprocessed as the list ``[image] * n`` (its strides, not a contiguous repeat: CPU convolutions round by
        # memory layout)
        init_image = pipe.image_processor.preprocess([image] * req.n, height=height, width=width)
        latents = cls.prepare_latents(view, init_image, latent_timestep, 1, req.n, dtype, device, gens)
    return RequestState(validated=validated, cond=cond, uncond=uncond, latents=latents, scheduler=sched,
                        timesteps=timesteps, grid=family.rules.grid(width, height), extras=extras, cancel=cancel)
