"""What the families' edit paths share: a diffusers pipeline seen with a request's own scheduler, the edit
pipelines built once per family over its loaded components, the flow-matching edit schedule of FLUX.1 and
Qwen-Image, and inpainting's per-step blend of the known region (the same in all three families' pipelines).

Each family's edit start (:mod:`bcg_core.families.flux_edit`, ...) calls its diffusers edit pipeline's own methods
(``get_timesteps``, ``prepare_latents``, ``prepare_mask_latents``) unbound on a :class:`PipelineView`, so every
generator is drawn as diffusers draws it while the family's shared scheduler is never touched. The view's methods
are the pipeline's, bound to the view, so a method they call (``_encode_vae_image``) sees the view's attributes too.

Inside :func:`vae_encodes` on the calling thread, a view's ``vae.encode(x)`` goes to the given function instead
(the step scheduler's edit-start stage, :mod:`bcg_core.scheduler.edit_start`, encodes the images of several edits in one
VAE call that way); everything else of the VAE, and diffusers' sampling of the returned latent distribution with
the request's own generators, stays as it is.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["PipelineView", "blend_known_region", "edit_pipeline", "flow_edit_timesteps", "vae_encodes"]

_local = threading.local()


@contextlib.contextmanager
def vae_encodes(encode: Callable[[Any, Any], Any]) -> Iterator[None]:
    """While in this block, on this thread only, a :class:`PipelineView`'s ``vae.encode(x)`` (with no other
    argument) returns ``encode(vae, x)``: ``vae`` the pipeline's own VAE, ``x`` the image batch diffusers passes
    ((b, 3, H, W), or (b, 3, 1, H, W) for a video VAE, in the VAE's dtype and device); ``encode`` must return what
    ``vae.encode(x)`` returns (an ``AutoencoderKLOutput`` whose ``latent_dist`` diffusers samples). Nests: the
    previous function is restored on exit."""
    prev = getattr(_local, "encode", None)
    _local.encode = encode
    try:
        yield
    finally:
        _local.encode = prev


class _RoutedVAE:
    """The pipeline's VAE whose ``encode(x)`` goes to the :func:`vae_encodes` function of the thread."""

    def __init__(self, vae, encode):
        self.__dict__.update(_vae=vae, _encode=encode)

    def encode(self, x, *args, **kwargs):
        if args or kwargs:  # a call diffusers' edit pipelines never make: the VAE's own
            return self._vae.encode(x, *args, **kwargs)
        return self._encode(self._vae, x)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vae, name)


class PipelineView:
    """A diffusers pipeline seen with another scheduler: ``scheduler`` is the request's own, every other attribute
    the pipeline's, its methods bound to the view (its methods are called unbound on this view:
    ``cls.prepare_latents(view, ...)``; a method they call is the view's too). ``vae`` is routed inside
    :func:`vae_encodes` (module docstring)."""

    def __init__(self, pipe, scheduler):
        self.__dict__.update(_pipe=pipe, scheduler=scheduler)

    def __getattr__(self, name: str) -> Any:
        pipe = self._pipe
        if name == "vae":
            encode = getattr(_local, "encode", None)
            return pipe.vae if encode is None else _RoutedVAE(pipe.vae, encode)
        if name not in vars(pipe) and isinstance(inspect.getattr_static(type(pipe), name, None), types.FunctionType):
            return types.MethodType(getattr(type(pipe), name), self)  # a plain method (not static, not a class one)
        return getattr(pipe, name)


def edit_pipeline(family, cls, **components):
    """The family's edit pipeline of class ``cls`` (a diffusers ``...Img2ImgPipeline`` or ``...InpaintPipeline``),
    made once from ``components`` (the family's own loaded modules: no weights are copied) and cached on the family.
    Text encoders may be None: the family encodes the text itself."""
    cache = family.__dict__.setdefault("_edit_pipes", {})
    with family.__dict__.setdefault("_edit_lock", threading.Lock()):
        if cls not in cache:
            cache[cls] = cls(**components)
        return cache[cls]


def flow_edit_timesteps(cls, view: PipelineView, request, device, calculate_shift, retrieve_timesteps):
    """The timesteps an edit runs, and their count, as ``FluxImg2ImgPipeline`` / ``QwenImageImg2ImgPipeline``
    (and their inpainting twins) compute them: sigmas ``linspace(1, 1/N, N)`` shifted by ``mu = calculate_shift(
    (H / vae_scale_factor / 2) * (W / vae_scale_factor / 2), ...)`` from the scheduler's config, through
    ``retrieve_timesteps`` on the view's (the request's own) scheduler, then the pipeline's ``get_timesteps(N,
    strength)``: the last ``int(N * strength)`` of them. ``calculate_shift`` and ``retrieve_timesteps`` are the
    pipeline module's own functions.

    Returns:
        ``(timesteps (runs,) float32 on device, runs)``.
    """
    import numpy as np

    sched, steps = view.scheduler, request.num_inference_steps
    c = sched.config
    seq = (int(request.height) // view.vae_scale_factor // 2) * (int(request.width) // view.vae_scale_factor // 2)
    mu = calculate_shift(seq, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    _, runs = retrieve_timesteps(sched, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return cls.get_timesteps(view, runs, request.strength, device)


def blend_known_region(state, dtype=None) -> None:
    """After the scheduler step of step ``state.step_index`` of an inpainting request (before the index moves on):
    its known region put back from its image latents, noised to the next timestep (not after the last step), as
    the inpainting pipelines' loops do (``FluxInpaintPipeline``, ``StableDiffusion3InpaintPipeline``,
    ``QwenImageInpaintPipeline``): ``latents = (1 - mask) * scale_noise(image_latents, t_next, noise) + mask *
    latents``. ``state.extras["inpaint"]`` holds ``(mask, image_latents, noise)`` in the family's latent layout
    (the mask broadcasting over channels where it has one); the request's own scheduler gives ``scale_noise`` the
    sigma at its step index, which its step has just advanced. With ``dtype`` (FLUX.1's loop), the latents are cast
    back to it when the blend changed their dtype."""
    import torch

    mask, image_latents, noise = state.extras["inpaint"]
    i = state.step_index
    known = image_latents
    if i < len(state.timesteps) - 1:
        known = state.scheduler.scale_noise(image_latents, torch.tensor([state.timesteps[i + 1]]), noise)
    latents = (1 - mask) * known + mask * state.latents
    state.latents = latents.to(dtype) if dtype is not None and latents.dtype != dtype else latents
