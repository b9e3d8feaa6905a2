"""What each request field accepts, in one wording: the phrases of limit messages (:func:`engine_field_phrase`) and
the message of a refused field (:func:`invalid`), shared by the validator (:mod:`bcg_core.validation`) and the HTTP
schema's type errors (``deployments/schemas.py``)."""

from __future__ import annotations

from bcg_core.cache_field import cache_phrase
from bcg_core.config import LimitsConfig, LoRAConfig
from bcg_core.errors import shown
from bcg_core.request import MAX_PARTIAL_IMAGES, QUALITIES, QUALITY_ALIASES, SEED_MAX

__all__ = ["engine_field_phrase", "invalid"]


def engine_field_phrase(name: str, limits: LimitsConfig, size_multiple: int | None = 16,
                        resolutions: tuple[str, ...] = (), lora: LoRAConfig | None = None,
                        cache_methods: tuple[str, ...] | None = None, guidance: str | None = None,
                        frame_stride: int | None = None) -> str | None:
    """What request field ``name`` accepts under ``limits``: the one wording of every limit message (the validator's
    errors and the HTTP schema's type errors both use it). None for a field the engine does not validate.

    Args:
        name: a field of :class:`~bcg_core.request.GenerationRequest` (``size`` for width and height).
        limits: the served limits.
        size_multiple: width and height must be multiples of it (the model's pixels per token side); None for
            a family with resolution binning (any size: generated at its aspect-ratio bin, resized back).
        resolutions: the bucket resolution tiers, named in the ``size`` phrase.
        lora: the ``lora`` section, for the ``lora`` phrase.
        cache_methods: the model's step-cache methods, for the ``cache`` phrase (None: every method served).
        guidance: what ``guidance_scale`` does for the model (:meth:`~bcg_core.families.ModelSpec.guidance_role`), for
            the ``guidance_scale`` phrase; None: classifier-free guidance above 1 (a model without other rules).
        frame_stride: a video model's pixel frames per latent frame (:attr:`~bcg_core.table.ShapeRules.frame_stride`),
            for the ``num_frames`` phrase; None: an image model (``num_frames`` is not one of its fields).
    """
    from bcg_core.images import IMAGE_FORMATS

    lim = limits
    if name == "prompt":
        return f"a non-empty string of at most {lim.max_prompt_chars} characters"
    if name == "negative_prompt":
        return f"a string of at most {lim.max_prompt_chars} characters"
    if name == "n":
        return f"an integer from 1 to {lim.max_images}"
    if name == "size":
        each = "" if size_multiple is None else f", each a multiple of {size_multiple}"
        tiers = f"; bucketed sizes: {', '.join(resolutions)}" if resolutions else ""
        return ("'auto' (the model's default size, GET /v1/models: limits.default_size; for an edit the input "
                f"image's) or a string 'WxH' with width and height from {lim.min_side_px} to {lim.max_side_px} "
                f"pixels{each}{tiers}")
    if name == "seed":
        return f"an integer from 0 to {SEED_MAX - lim.max_images}"
    if name == "num_inference_steps":
        return f"an integer from 1 to {lim.max_steps}"
    if name == "guidance_scale":
        role = guidance or "above 1 enables classifier-free guidance"
        return f"a number from 0 to {lim.max_guidance_scale:g} ({role})"
    if name == "guidance_scale_2":
        return (f"a number from 0 to {lim.max_guidance_scale:g} (Wan 2.2 checkpoints of two experts only: the "
                f"low-noise expert's classifier-free guidance, with guidance_scale above 1; omitted: guidance_scale)")
    if name == "true_cfg_scale":
        return (f"a number from 0 to {lim.max_guidance_scale:g} (FLUX.1, Qwen-Image and Qwen-Image 2.1 only: true CFG "
                f"above 1 with a negative_prompt)")
    if name == "cfg_normalization":
        return ("false, true (= 1.0) or a number of at least 0 (Z-Image only, with classifier-free guidance: caps each "
                "image's guided prediction's norm at that multiple of its cond prediction's; false or 0: off; omitted: "
                "the model's default, GET /v1/models bcg.defaults)")
    if name == "cfg_truncation":
        return ("a number of at least 0 (Z-Image only, with classifier-free guidance: steps whose (1000 - t) / 1000 "
                "exceeds it run without guidance; 1 or more: every step guided; omitted: the model's default, GET "
                "/v1/models bcg.defaults)")
    if name == "output_format":
        return ", ".join(repr(f) for f in IMAGE_FORMATS) + " ('gif' and 'svg' are not served)"
    if name == "output_compression":
        return ("an integer from 0 to 100 for output_format 'jpeg' or 'webp' (100 keeps the most detail); omit it "
                "for 'png'")
    if name == "quality":
        aliases = ", ".join(f"{a!r} (= {q!r})" for a, q in QUALITY_ALIASES.items())
        return ", ".join(repr(q) for q in QUALITIES) + f", {aliases} (a step count each; see /v1/models)"
    if name == "partial_images":
        return f"an integer from 0 to {MAX_PARTIAL_IMAGES}, with stream: true"
    if name == "num_frames":
        if frame_stride is None:
            return "nothing: this model generates images (num_frames is for video models)"
        m = frame_stride
        most = (lim.max_frames - 1) // m * m + 1
        return (f"an integer 1 plus a multiple of {m} from 1 to {most} ({', '.join(str(1 + m * k) for k in range(3))}, "
                f"..., {most})")
    if name == "strength":
        return ("a number above 0 and at most 1 (an edit runs about num_inference_steps x strength steps, rounded "
                "up as diffusers' get_timesteps does)")
    if name in ("image", "mask"):
        return (f"one PNG, JPEG or WebP file of at most {limits.max_input_pixels} pixels"
                + (", the image's size, with alpha: fully transparent pixels mark where to edit" if name == "mask"
                   else ""))
    if name == "lora":
        if lora is None or lora.dir is None:
            return "nothing: this deployment serves no LoRA adapters (lora.dir is unset)"
        return (f"a list of at most {lora.max_per_request} {{\"name\": ..., \"scale\": ...}} with distinct names of "
                f"adapters in GET /v1/models and scales from {-lora.max_scale:g} to {lora.max_scale:g}")
    if name == "cache":
        return cache_phrase(cache_methods)
    return None


def invalid(name: str, got: object, reason: str, allowed: str | None) -> str:
    """The message of a refused field: ``invalid 'n' (got 11): out of range; allowed: an integer from 1 to
    10`` (the HTTP schema's type errors read the same)."""
    return f"invalid '{name}' (got {shown(got)}): {reason}" + (f"; allowed: {allowed}" if allowed else "")
