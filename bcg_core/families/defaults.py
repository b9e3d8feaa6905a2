"""The request defaults of a family: what its diffusers pipeline does for a call that omits them.

A request without ``num_inference_steps`` or ``guidance_scale`` gets what the family's diffusers pipeline gives a
call without them, read from the signature of the installed pipeline's ``__call__`` when the model is described
(no table of ours to go stale), unless the config's ``limits`` set them (:meth:`bcg_core.validation.RequestValidator`).
"""

from __future__ import annotations

import functools

__all__ = ["FRAME_RATES", "checkpoint_cfg_options", "edit_defaults", "family_buckets", "frame_rate",
           "pipeline_defaults", "text_tokens"]


FRAME_RATES: dict[str, float] = {"WanPipeline": 16.0}
"""Frames per second of the videos a video pipeline's checkpoints are published at, which neither the checkpoint nor
the pipeline's signature holds: Wan 2.1's 16 (its model card, and diffusers' ``WanPipeline`` example:
``export_to_video(output, "output.mp4", fps=16)``; its default 81 frames are 5 seconds after the first frame)."""


def frame_rate(pipeline_class: str) -> float | None:
    """Frames per second of ``pipeline_class``'s videos (:data:`FRAME_RATES`); None for a pipeline not listed (an
    image pipeline)."""
    return FRAME_RATES.get(pipeline_class)


@functools.cache
def pipeline_defaults(pipeline_class: str) -> dict[str, float | int | None]:
    """What the diffusers pipeline ``pipeline_class`` does for a call that omits the request's options: the
    defaults of ``num_inference_steps``, ``guidance_scale`` and ``true_cfg_scale`` in the signature of its
    ``__call__``, read from the installed diffusers (no table of ours to go stale), as :class:`ModelSpec` fields.

    Args:
        pipeline_class: a diffusers pipeline class name, e.g. ``"StableDiffusion3Pipeline"``.

    Returns:
        ``{"default_steps": ..., "default_guidance_scale": ..., "default_true_cfg_scale": ...}``;
        ``default_true_cfg_scale`` is None for a pipeline without ``true_cfg_scale``, ``default_guidance_scale``
        None where the pipeline's default is None (``QwenImagePipeline``: no guidance input). With diffusers
        0.42.1: FluxPipeline 28 steps, guidance 3.5, true CFG 1.0; StableDiffusion3Pipeline 28, 7.0;
        PixArtSigmaPipeline and SanaPipeline 20, 4.5; QwenImagePipeline 50, None, true CFG 4.0. Also
        ``"default_size": (width, height)`` where the signature gives both as integers (SanaPipeline: 1024x1024;
        the other pipelines compute theirs from the checkpoint, see :attr:`ModelSpec.default_size`), and
        ``"default_strength"`` where it has a ``strength`` (the edit pipelines: 0.6), and ``"default_frames"`` where
        it has an integer ``num_frames`` (video pipelines: ``WanPipeline`` 81; with ``default_size`` 832x480), and
        ``"default_cfg_normalization"`` / ``"default_cfg_truncation"`` where it has both (``ZImagePipeline``: False,
        1.0).

    Raises:
        ValueError: diffusers has no such pipeline, or its ``__call__`` has no ``num_inference_steps`` default.
    """
    import inspect

    import diffusers

    cls = getattr(diffusers, pipeline_class, None)
    if cls is None:
        raise ValueError(f"diffusers {diffusers.__version__} has no pipeline {pipeline_class!r}")
    params = inspect.signature(cls.__call__).parameters

    def default(name: str):
        p = params.get(name)
        return None if p is None or p.default is inspect.Parameter.empty else p.default

    steps = default("num_inference_steps")
    if not isinstance(steps, int):
        raise ValueError(f"{pipeline_class}.__call__ has no integer num_inference_steps default ({steps!r})")
    guidance, true_cfg = default("guidance_scale"), default("true_cfg_scale")
    out = {"default_steps": steps,
           "default_guidance_scale": None if guidance is None else float(guidance),
           "default_true_cfg_scale": None if true_cfg is None else float(true_cfg)}
    strength = default("strength")
    if strength is not None:  # edit pipelines (FluxImg2ImgPipeline ...): 0.6
        out["default_strength"] = float(strength)
    width, height = default("width"), default("height")
    if isinstance(width, int) and isinstance(height, int):  # SanaPipeline: 1024x1024; the others compute theirs
        out["default_size"] = (width, height)
    frames = default("num_frames")
    if isinstance(frames, int):  # video pipelines (WanPipeline: 81)
        out["default_frames"] = frames
    if "cfg_normalization" in params and "cfg_truncation" in params:  # ZImagePipeline: False, 1.0
        out["default_cfg_normalization"] = default("cfg_normalization")
        trunc = default("cfg_truncation")
        out["default_cfg_truncation"] = 1.0 if trunc is None else float(trunc)
    return out


def checkpoint_cfg_options(index: dict, name: str = "checkpoint") -> dict[str, bool | float]:
    """The checkpoint's own defaults of ``cfg_normalization`` / ``cfg_truncation`` (Z-Image), as :class:`ModelSpec`
    fields: ``bcg_cfg_normalization`` / ``bcg_cfg_truncation`` of ``model_index.json``, each only where set (the
    pipeline's defaults, :func:`pipeline_defaults`, stand otherwise). A ``bcg_cfg_truncation`` of null, which the
    pipeline reads as "never truncated", is 1.0 (every ``(1000 - t) / 1000`` is below 1).

    Raises:
        ValueError: a ``bcg_cfg_normalization`` that is neither a boolean nor a finite number at least 0, or a
            ``bcg_cfg_truncation`` that is not a finite number at least 0 (the request fields' ranges).
    """
    import math

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    out: dict[str, bool | float] = {}
    if "bcg_cfg_normalization" in index:
        norm = index["bcg_cfg_normalization"]
        if not isinstance(norm, bool) and not number(norm):
            raise ValueError(f"{name}: model_index.json bcg_cfg_normalization {norm!r}: a boolean or a number of at "
                             f"least 0 (the pipeline's cfg_normalization)")
        out["default_cfg_normalization"] = norm if isinstance(norm, bool) else float(norm)
    if "bcg_cfg_truncation" in index:
        trunc = 1.0 if index["bcg_cfg_truncation"] is None else index["bcg_cfg_truncation"]
        if not number(trunc):
            raise ValueError(f"{name}: model_index.json bcg_cfg_truncation {trunc!r}: a number of at least 0 (the "
                             f"pipeline's cfg_truncation)")
        out["default_cfg_truncation"] = float(trunc)
    return out


def edit_defaults(spec, limits, inpaint: bool) -> dict[str, float | int | None]:
    """The defaults of an edit of the model ``spec`` under the config's ``limits``: ``steps``, ``guidance`` and
    ``strength`` of its image-to-image (``inpaint`` False) or inpainting edit pipeline (``spec.edit_pipelines``),
    read by :func:`pipeline_defaults`; a spec with edit defaults of its own (``spec.default_strength`` set: the
    tiny default) gives its own. ``limits.default_steps`` / ``default_guidance_scale`` win where set, and steps
    are capped at ``limits.max_steps`` (SD3's and Qwen-Image's edit pipelines default to 50). The validator
    (:meth:`bcg_core.validation.RequestValidator.validate`) and ``GET /v1/models`` (``deployments/uploads.py``) both
    read this.

    Raises:
        ValueError: ``spec`` serves no edits (``edit_pipelines`` None).
    """
    if spec.edit_pipelines is None:
        raise ValueError(f"{spec.pipeline_class} serves no edits")
    if spec.default_strength is not None:
        d = {"default_steps": spec.default_steps, "default_guidance_scale": spec.default_guidance_scale,
             "default_strength": spec.default_strength}
    else:
        d = pipeline_defaults(spec.edit_pipelines[1 if inpaint else 0])
    steps = limits.default_steps if limits.default_steps is not None else min(d["default_steps"], limits.max_steps)
    guidance = limits.default_guidance_scale if limits.default_guidance_scale is not None \
        else d["default_guidance_scale"]
    return {"steps": steps, "guidance": guidance, "strength": d.get("default_strength", 0.6)}


def family_buckets(config, spec):
    """``config`` (an :class:`~bcg_core.config.EngineConfig`, or a serving config that extends it) with the family's
    default table (:attr:`~bcg_core.families.ModelSpec.default_buckets`) where the config sets no ``buckets`` section
    and the family has one (a video family: Wan's 832x480 at 81 frames); else ``config`` itself. The validator and
    the pipeline both build their table from what this returns, so the ingress and the replica agree.

    Raises:
        pydantic.ValidationError: the family's default table does not fit the config (e.g. its size outside
            ``limits``), naming the field.
    """
    if spec.default_buckets is None or "buckets" in config.model_fields_set:
        return config
    from bcg_core.config import BucketConfig

    return config.model_copy(update={"buckets": BucketConfig(**spec.default_buckets)})


def text_tokens(pipeline_cls, index: dict) -> int:
    """The ``max_sequence_length`` a checkpoint is served with: ``bcg_text_tokens`` of its ``model_index.json``
    (``index``), else the default of ``pipeline_cls.__call__``'s ``max_sequence_length`` (e.g. 512 for
    ``ZImagePipeline``, ``WanPipeline`` and the FLUX.2 pipelines)."""
    import inspect

    default = inspect.signature(pipeline_cls.__call__).parameters["max_sequence_length"].default
    return int(index.get("bcg_text_tokens", default))
