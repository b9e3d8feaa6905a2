"""What the families' edit paths share: a diffusers pipeline seen with a request's own scheduler, and the edit
pipelines built once per family over its loaded components.

Each family's edit start (:mod:`bcg_core.families.flux_edit`, ...) calls its diffusers edit pipeline's own methods
(``get_timesteps``, ``prepare_latents``, ``prepare_mask_latents``) unbound on a :class:`PipelineView`, so every
generator is drawn as diffusers draws it while the family's shared scheduler is never touched.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["PipelineView", "edit_pipeline"]


class PipelineView:
    """A diffusers pipeline seen with another scheduler: ``scheduler`` is the request's own, every other attribute
    the pipeline's (its methods are called unbound on this view: ``cls.prepare_latents(view, ...)``)."""

    def __init__(self, pipe, scheduler):
        self.__dict__.update(_pipe=pipe, scheduler=scheduler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


def edit_pipeline(family, cls, **components):
    """The family's edit pipeline of class ``cls`` (a diffusers ``...Img2ImgPipeline`` or ``...InpaintPipeline``),
    made once from ``components`` (the family's own loaded modules: no weights are copied) and cached on the family.
    Text encoders may be None: the family encodes the text itself."""
    cache = family.__dict__.setdefault("_edit_pipes", {})
    with family.__dict__.setdefault("_edit_lock", threading.Lock()):
        if cls not in cache:
            cache[cls] = cls(**components)
        return cache[cls]
