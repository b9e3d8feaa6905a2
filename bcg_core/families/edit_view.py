"""What the families' edit paths share: a diffusers pipeline seen with a request's own scheduler, and the edit
pipelines built once per family over its loaded components.

Each family's edit start (:mod:`bcg_core.families.flux_edit`, ...) calls its diffusers edit pipeline's own methods
(``get_timesteps``, ``prepare_latents``, ``prepare_mask_latents``) unbound on a :class:`PipelineView`, so every
generator is drawn as diffusers draws it while the family's shared scheduler is never touched. The view's methods
are the pipeline's, bound to the view, so a method they call (``_encode_vae_image``) sees the view's attributes too.

Inside :func:`vae_encodes` on the calling thread, a view's ``vae.encode(x)`` goes to the given function instead
(the step scheduler's prepare stage, :mod:`bcg_core.scheduler.prepare`, encodes the images of several edits in one
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

__all__ = ["PipelineView", "edit_pipeline", "vae_encodes"]

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
