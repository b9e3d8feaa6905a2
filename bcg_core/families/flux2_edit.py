"""FLUX.2 reference edits: ``Flux2Pipeline`` / ``Flux2KleinPipeline`` called with ``image`` (one reference image or a
list of them), served step by step.

What diffusers 0.42.1 does with ``image`` (``pipeline_flux2.py``, D; ``pipeline_flux2_klein.py``, K, the same lines
shifted) and what this module reuses:

- Each reference is checked (``image_processor.check_image_input``: sides of at least 64 pixels, aspect ratio at most
  8:1; D:889-890), resized to 1024 x 1024 pixels of area where larger (``_resize_to_target_area``), cut down to
  multiples of ``vae_scale_factor * 2`` and centre-cropped to them (``preprocess(resize_mode="crop")``; D:893-902).
  Without ``height``/``width`` the image takes the first reference's size (D:903-904); the validator mirrors these
  sizes (:class:`~bcg_core.families.references.ReferenceImages`) so a request's bucket is known at the ingress.
- ``prepare_image_latents`` (D:654-687, called here, unbound on a
  :class:`~bcg_core.families.edit_view.PipelineView` so that its ``vae.encode`` joins the edit-start stage's batched
  VAE calls, :mod:`bcg_core.scheduler.edit_start`) encodes each reference alone (``_encode_vae_image``: the latent
  distribution's mode, ``sample_mode="argmax"``, so no generator is drawn; patchified and normalised by the VAE's
  batch-norm statistics), packs and concatenates their tokens, and gives their ids (``_prepare_image_ids``: time index
  ``10 + 10 * i`` for reference ``i``, the target's being 0).
- The noise and schedule are text to image's (the target starts from pure noise; ``mu`` from the target's tokens only,
  D:938-939). Every step feeds ``torch.cat([latents, image_latents], dim=1)`` with ``torch.cat([latent_ids,
  image_latent_ids], dim=1)`` (D:970-972; [klein]'s uncond forward the same, K:866-875) and keeps
  ``noise_pred[:, :latents.size(1)]`` (D:985, K:862, K:876): the references condition every step and are never
  denoised.

Here the reference tokens are kept once per request (``extras["reference_latents"]``, (1, S_r, C)) and appended to
every row (cond and uncond) by :meth:`~bcg_core.families.flux2.Flux2Family.model_rows`; their token grids travel as
``DenoiseInputs.references``, from which :meth:`~bcg_core.families.flux2_adapter.Flux2Adapter.stream_ids` builds the
ids.
"""

from __future__ import annotations

import torch

from bcg_core.families.edit_view import PipelineView

__all__ = ["FLUX2_REFERENCE_AREA", "reference_images", "reference_latents"]

FLUX2_REFERENCE_AREA = 1024 * 1024
"""Pixels above which a reference is resized to this area (D:895-896, K:774-775: a literal in ``__call__``)."""


def reference_images(pipe, files: tuple[bytes, ...]) -> list[torch.Tensor]:
    """The request's reference image files as the pipeline preprocesses ``image`` (D:887-902): each read upright
    (:func:`~bcg_core.edits.read_image`), checked, resized to :data:`FLUX2_REFERENCE_AREA` where larger, cut down to
    multiples of ``vae_scale_factor * 2`` and centre-cropped (``image_processor.preprocess(resize_mode="crop")``).

    Returns:
        One (1, 3, H, W) float32 tensor in [-1, 1] per reference, in order.

    Raises:
        ValueError: an image the pipeline refuses (``check_image_input``; the validator refuses it first).
    """
    from bcg_core.edits import read_image

    images = [read_image(data, 1 << 62) for data in files]  # bounded and checked by the validator
    for img in images:
        pipe.image_processor.check_image_input(img)
    out = []
    multiple = pipe.vae_scale_factor * 2
    for img in images:
        width, height = img.size
        if width * height > FLUX2_REFERENCE_AREA:
            img = pipe.image_processor._resize_to_target_area(img, FLUX2_REFERENCE_AREA)
            width, height = img.size
        width, height = width // multiple * multiple, height // multiple * multiple
        out.append(pipe.image_processor.preprocess(img, height=height, width=width, resize_mode="crop"))
    return out


@torch.inference_mode()
def reference_latents(family, state) -> torch.Tensor:
    """The packed reference tokens of ``state``'s request (module docstring), encoded once for all its images.

    Args:
        family: the :class:`~bcg_core.families.flux2.Flux2Family`.
        state: the request's :class:`~bcg_core.families.RequestState`, text to image's start done (its
            ``validated.references``: the token grids the validator counted).

    Returns:
        (1, S_r, 128) in the latents' dtype on the family's device: every reference's tokens, in order.

    Raises:
        ValueError: the references do not have the token grids the validator counted (the validator's mirror of the
            pipeline's resizing is wrong: :class:`~bcg_core.families.references.ReferenceImages`).
    """
    pipe, validated = family.pipe, state.validated
    images = reference_images(pipe, validated.request.images)
    multiple = pipe.vae_scale_factor * 2
    grids = tuple((im.shape[-2] // multiple, im.shape[-1] // multiple) for im in images)
    if grids != tuple(validated.references):
        raise ValueError(f"the reference images encode to token grids {grids}, the validator counted "
                         f"{validated.references}")
    gens = [torch.Generator("cpu").manual_seed(validated.request.seed + i) for i in range(state.n)]
    view = PipelineView(pipe, state.scheduler)  # its vae.encode goes through the edit-start stage's rounds
    latents, _ = type(pipe).prepare_image_latents(view, images=images, batch_size=1, generator=gens,
                                                  device=family.device, dtype=pipe.vae.dtype)
    return latents.to(state.latents.dtype)
