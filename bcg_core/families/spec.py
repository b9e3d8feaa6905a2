"""A model's spec: what the ingress needs to know about a model without loading its weights, and the family's
request rules that follow from it (:class:`ModelSpec`); the steps of OpenAI's ``quality`` per family
(:data:`QUALITY_STEPS`).

Each family's :meth:`~bcg_core.families.base.Family.describe` builds the spec from the checkpoint's JSON configs; the
validator (:mod:`bcg_core.validation`) applies its rules alike at the ingress and on the replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from bcg_core.families.references import ReferenceImages
from bcg_core.table import ShapeRules

__all__ = ["QUALITY_STEPS", "ModelSpec"]


QUALITY_STEPS: dict[str, tuple[int, int, int]] = {
    "bcg-tiny": (2, 4, 8),
    "flux-dev": (14, 28, 50),
    "flux-schnell": (1, 2, 4),
    "sd3": (14, 28, 40),
    "pixart": (10, 20, 40),
    "sana": (10, 20, 40),
    "qwenimage": (20, 30, 50),
    "flux2": (20, 30, 50),
    "flux2-distilled": (2, 4, 8),
    "zimage": (20, 30, 50),
    "qwenimage21": (20, 30, 40),
    "wan": (20, 30, 50),
}
"""Steps of ``quality`` low / medium / high per family. ``medium``: the diffusers pipeline's default
``num_inference_steps`` (FluxPipeline and StableDiffusion3Pipeline 28, PixArtSigmaPipeline and SanaPipeline 20);
FLUX.1-schnell is distilled for 1-4 steps; QwenImagePipeline's, both FLUX.2 pipelines', ZImagePipeline's and
WanPipeline's default, 50, is their ``high``, and QwenImage21Pipeline's 40 its; distilled FLUX.2 [klein] checkpoints
are published for 4 steps; the tiny default (random weights) takes few steps so a CPU serves it quickly. docs/API.md's
quality table repeats them (``tests/unit/test_api_tables.py`` checks it)."""


@dataclass(frozen=True)
class ModelSpec:
    """What the ingress needs to know about a model without loading its weights, and the family's request
    rules that follow from it (pure functions of the request: the ingress and the replica validate alike).

    Attributes:
        name: served model name (the checkpoint folder's name, or ``bcg-tiny-flux``).
        family: the family's :attr:`~bcg_core.families.base.Family.name` (``"flux"``, ``"sd3"``, ``"pixart"``,
            ``"sana"``, ``"qwenimage"``).
        pipeline_class: ``_class_name`` of the checkpoint's ``model_index.json``.
        rules: the family's shape rules (token size, grid keying, native text length).
        guidance_embeds: ``guidance_scale`` is a transformer input (FLUX.1-dev), never uncond rows.
        cfg_rule: when classifier-free guidance adds uncond rows: ``"guidance_scale"`` when
            ``guidance_scale > 1`` (SD3, PixArt, SANA, the tiny default: ``do_classifier_free_guidance`` of
            their pipelines), ``"true_cfg"`` when ``true_cfg_scale > 1`` and a negative prompt is given
            (``FluxPipeline``, ``QwenImagePipeline``), ``"none"``: never (FLUX.2 [dev]'s ``Flux2Pipeline`` and
            distilled [klein] checkpoints: no uncond forward; a ``negative_prompt`` is refused, not ignored),
            ``"guidance_positive"`` when ``guidance_scale > 0`` (``ZImagePipeline``'s ``do_classifier_free_guidance``).
        default_true_cfg_scale: ``true_cfg_scale`` when a request omits it (the pipeline's default, read as
            ``default_steps``: 1.0 for FLUX, 4.0 for Qwen-Image); None where the family has no such option (a
            request that sets it is refused).
        size_bins: aspect-ratio bins (``{"ratio": [height, width]}``) of pipelines with resolution binning
            (PixArt-Sigma, SANA), else None.
        max_prompt_tokens: most prompt tokens the text encoder reads, where it is below the key's text length
            (SD3: T5 reads 256 of its 77 + 256 native tokens); a longer prompt is refused, not truncated.
        max_grid_side: largest token-grid side the transformer's position table holds (SD3's
            ``pos_embed_max_size``), else None.
        max_text_tokens: most text tokens the pipeline ever feeds a masked-text family (PixArt-Sigma and SANA
            300, Qwen-Image 512): a larger text bucket could never fill and is a start-up error.
        quality_steps: denoising steps of OpenAI's ``quality`` ``low``, ``medium`` and ``high`` for this family
            (``medium`` is its diffusers pipeline's default step count where that is below ``high``; see
            :data:`QUALITY_STEPS`); the config's ``quality`` section overrides them.
        default_steps: ``num_inference_steps`` of a request that sets neither it nor ``quality``, unless
            ``limits.default_steps`` is set: the pipeline's ``__call__`` default
            (:func:`~bcg_core.families.defaults.pipeline_defaults`; the tiny default's 4, few so that a CPU serves
            it quickly).
        default_size: ``(width, height)`` in pixels of a request without a size (or OpenAI's ``size: "auto"``):
            what the family's diffusers pipeline generates when called without ``height``/``width`` (FLUX.1 and
            Qwen-Image: their ``default_sample_size`` 128 x the VAE factor 8; SD3 and PixArt-Sigma: the
            transformer's ``sample_size`` x the VAE factor; SANA: its ``__call__`` default), 512x512 for the tiny
            default.
        default_guidance_scale: ``guidance_scale`` of a request that omits it, unless
            ``limits.default_guidance_scale`` is set: the pipeline's default (as ``default_steps``; the tiny
            default's 3.5, FluxPipeline's); None where the pipeline's is None (Qwen-Image: no guidance input, the
            request's guidance_scale stays unset).
        default_strength: set where the spec carries edit defaults of its own (the tiny default: its steps and
            guidance, this strength); None: an edit takes its edit pipeline's defaults.
        edit_pipelines: the diffusers pipelines whose results this model's edits equal, ``(image-to-image,
            inpainting)`` class names (``FluxImg2ImgPipeline``, ``FluxInpaintPipeline``), or None where bcg-serve
            serves no image-to-image or inpainting edits of this family (a request with an image is refused, naming
            the families that edit, unless it takes :attr:`references`).
        references: where the family's pipeline takes ``image`` as reference images (FLUX.2: appended to the image
            stream, conditioning every step, the target denoised from pure noise; no ``strength``, no mask), their
            rules (:class:`~bcg_core.families.references.ReferenceImages`): an edit of this model is a reference edit.
            None: the family has no reference edits.
        size_multiple: pixels each side must be a multiple of where the pipeline needs more than the token size
            (Qwen-Image 2.1: 32, two 16-pixel tokens per encoder image slot; its pipeline rounds other sizes down),
            else None. A request of another size is refused (:meth:`check`), and so is a bucket resolution of one
            (:meth:`check_table`).
        output_alpha: the family's decode gives (height, width, 4) RGBA images, as its diffusers pipeline's PIL
            images are (Qwen-Image 2.1's VAE decodes four channels), served as they are; JPEG, which holds no alpha,
            is then refused (:meth:`check`). False: (height, width, 3) RGB.
        cache_methods: the step-cache methods its transformer takes (:data:`bcg_core.step_cache.METHODS`, e.g.
            ``("first_block",)``), where the family is a :class:`~bcg_core.capabilities.StepCache`; empty: a request
            with a ``cache`` is refused.
        default_frames: a video family's ``num_frames`` of a request that omits it (the pipeline's ``__call__``
            default: 81 for ``WanPipeline``); None for an image family (``rules.frame_stride`` None).
        default_buckets: the ``buckets`` section a config that sets none gets for this model (a video family's: one
            exact tier at its default size and frames, since the image defaults would capture graphs of videos at
            five image sizes), as :class:`~bcg_core.config.BucketConfig` fields; None: the config's own defaults
            (:func:`~bcg_core.families.defaults.family_buckets`).
        boundary_ratio: a checkpoint of two experts (Wan 2.2: ``transformer_2`` below ``boundary_ratio x 1000``,
            :mod:`bcg_core.experts`), whose requests take ``guidance_scale_2``; None: one transformer.
        default_cfg_normalization, default_cfg_truncation: ``cfg_normalization`` / ``cfg_truncation`` of a request
            that omits them, where the family's pipeline takes them (Z-Image: the checkpoint's
            ``bcg_cfg_normalization`` / ``bcg_cfg_truncation``, else ``ZImagePipeline.__call__``'s False and 1.0);
            None: not an option of the family (a request that sets them is refused).
    """

    name: str
    family: str
    pipeline_class: str
    rules: ShapeRules
    guidance_embeds: bool = False
    cfg_rule: str = "guidance_scale"
    default_true_cfg_scale: float | None = None
    size_bins: dict[str, list[float]] | None = None
    max_prompt_tokens: int | None = None
    max_grid_side: int | None = None
    max_text_tokens: int | None = None
    quality_steps: tuple[int, int, int] = (2, 4, 8)
    default_steps: int = 4
    default_guidance_scale: float | None = 3.5
    default_size: tuple[int, int] = (512, 512)
    default_strength: float | None = None
    edit_pipelines: tuple[str, str] | None = None
    references: ReferenceImages | None = None
    cache_methods: tuple[str, ...] = ()
    size_multiple: int | None = None
    output_alpha: bool = False
    default_frames: int | None = None
    default_buckets: dict | None = None
    boundary_ratio: float | None = None
    default_cfg_normalization: bool | float | None = None
    default_cfg_truncation: float | None = None

    @property
    def video(self) -> bool:
        """True for a video family: its requests carry ``num_frames`` and its results videos
        (:attr:`~bcg_core.request.GenerationResult.videos`), never image files."""
        return self.rules.video

    def check_output(self, video: bool) -> None:
        """Refuse a request for the other kind of output: ``video`` True (a caller asking for videos, e.g. the videos
        API) on an image model, or False (the images API) on a video model.

        Raises:
            RequestError: field ``model``, naming what the model generates and where to ask for it.
        """
        from bcg_core.errors import RequestError

        if video and not self.video:
            raise RequestError("model", f"model {self.name!r} ({self.pipeline_class}) generates images, not videos; "
                                        f"ask for images (POST /v1/images/generations), or serve a video model "
                                        f"(WanPipeline) for videos")
        if not video and self.video:
            raise RequestError("model", f"model {self.name!r} ({self.pipeline_class}) generates videos, not images; "
                                        f"ask for videos (POST /v1/videos)")

    @property
    def size_step(self) -> int:
        """Pixels each side of a request must be a multiple of: :attr:`size_multiple` where set, else the token
        size (``rules.pixels_per_token``)."""
        return self.size_multiple or self.rules.pixels_per_token

    def steps_for_quality(self, quality: str, config, default_steps: int, max_steps: int) -> int:
        """Denoising steps of OpenAI's ``quality`` for this model.

        Args:
            quality: ``"low"``, ``"medium"``, ``"high"`` or ``"auto"``.
            config: the :class:`~bcg_core.config.QualityConfig` (its set values win over :attr:`quality_steps`).
            default_steps: ``limits.default_steps``: ``auto`` when the config leaves it unset.
            max_steps: ``limits.max_steps``: every count is clipped to it.

        Raises:
            ValueError: another ``quality``.
        """
        family = dict(zip(("low", "medium", "high"), self.quality_steps, strict=True), auto=default_steps)
        if quality not in family:
            raise ValueError(f"quality {quality!r}; allowed: low, medium, high, auto")
        set_ = getattr(config, quality, None) if config is not None else None
        return max(1, min(max_steps, set_ if set_ is not None else family[quality]))

    def true_cfg_scale(self, request) -> float:
        """The request's ``true_cfg_scale``, or this family's default."""
        v = getattr(request, "true_cfg_scale", None)
        return float(v if v is not None else (self.default_true_cfg_scale or 1.0))

    def uses_cfg(self, request) -> bool:
        """True when ``request`` runs classifier-free guidance with uncond rows (see :attr:`cfg_rule`)."""
        if self.cfg_rule == "true_cfg":
            return self.true_cfg_scale(request) > 1.0 and request.negative_prompt is not None
        if self.cfg_rule == "none":
            return False
        if self.cfg_rule == "guidance_positive":
            return request.guidance_scale is not None and request.guidance_scale > 0.0
        return not self.guidance_embeds and request.guidance_scale is not None and request.guidance_scale > 1.0

    def guidance_role(self) -> str:
        """What ``guidance_scale`` does for this model, for messages (the ``guidance_scale`` phrase of limit errors,
        the ``true_cfg_scale`` refusal): a guidance embedding (FLUX.1-dev, FLUX.2 [dev]), classifier-free guidance
        above 1 (:attr:`cfg_rule` ``"guidance_scale"``) or above 0 (``"guidance_positive"``: Z-Image), or nothing
        (true CFG families: FLUX.1-schnell, Qwen-Image, Qwen-Image 2.1; ``"none"``: distilled FLUX.2 [klein])."""
        if self.guidance_embeds:
            return "it feeds this model's guidance embedding; no classifier-free guidance"
        if self.cfg_rule == "guidance_positive":
            return "above 0 enables classifier-free guidance"
        if self.cfg_rule == "true_cfg":
            return ("this model ignores it: its classifier-free guidance is true_cfg_scale above 1 with a "
                    "negative_prompt")
        if self.cfg_rule == "none":
            return "this model ignores it: it runs no classifier-free guidance"
        return "above 1 enables classifier-free guidance"

    def cfg_scale(self, request) -> float:
        """The scale of the CFG combination ``uncond + s * (cond - uncond)``."""
        return self.true_cfg_scale(request) if self.cfg_rule == "true_cfg" else float(request.guidance_scale)

    def cfg_fields(self, cfg: bool, guidance: float = 4.5) -> dict:
        """Request fields that make a request of this model run with classifier-free guidance (``cfg``) or without,
        by :attr:`cfg_rule`: true CFG takes ``true_cfg_scale`` 4.0 and a negative prompt, else nothing; the
        ``guidance_scale`` rules take ``guidance`` (above 1) or, without CFG, 1.0 (``"guidance_scale"``) or 0.0
        (``"guidance_positive"``: Z-Image runs CFG at any scale above 0); ``"none"`` sets nothing.

        Used where a tool makes requests of a given shape (the planner's histogram traffic, the fused step's
        check), so that each family's rows are counted as its pipeline runs them.

        Raises:
            ValueError: ``cfg`` for a family that never runs classifier-free guidance (``cfg_rule`` ``"none"``).
        """
        if self.cfg_rule == "none":
            if cfg:
                raise ValueError(f"{self.pipeline_class} runs no classifier-free guidance")
            return {}
        if self.cfg_rule == "true_cfg":
            return {"true_cfg_scale": 4.0, "negative_prompt": " "} if cfg else {}
        if cfg:
            return {"guidance_scale": guidance}
        return {"guidance_scale": 0.0 if self.cfg_rule == "guidance_positive" else 1.0}

    def check_table(self, config) -> None:
        """Refuse a bucket table this model cannot serve, before anything loads (the replica would fail at
        capture otherwise).

        Args:
            config: the :class:`~bcg_core.config.BucketConfig`.

        Raises:
            ValueError: a text bucket above :attr:`max_text_tokens`, a resolution whose token grid exceeds
                :attr:`max_grid_side`, or one whose sides are not multiples of :attr:`size_multiple` (no request
                could reach it); the message names the values allowed.
        """
        if self.max_text_tokens is not None and config.all_text_lengths()[-1] > self.max_text_tokens:
            raise ValueError(f"buckets.text_lengths: {config.all_text_lengths()}: {self.pipeline_class} feeds at most "
                             f"{self.max_text_tokens} text tokens, so a larger bucket never fills; use text_lengths "
                             f"up to {self.max_text_tokens}")
        m = self.size_multiple
        if m is not None:
            off = [n for n, (w, h) in zip(config.resolutions, config.resolution_pairs(), strict=True) if w % m or h % m]
            if off:
                raise ValueError(f"buckets.resolutions: {off}: {self.pipeline_class} generates sides that are "
                                 f"multiples of {m} pixels, so no request reaches them; use multiples of {m}")
        if self.max_grid_side is not None:
            px = self.max_grid_side * self.rules.pixels_per_token
            for name, (w, h) in zip(config.resolutions, config.resolution_pairs(), strict=True):
                gh, gw = self.rules.grid(*self.generation_size(w, h))
                if max(gh, gw) > self.max_grid_side:
                    raise ValueError(f"buckets.resolutions: {name} exceeds this model's position table "
                                     f"({self.max_grid_side} tokens a side): sides up to {px} pixels")

    def check(self, request) -> None:
        """Refuse request fields this family's pipeline has no counterpart for.

        Raises:
            RequestError: ``true_cfg_scale`` set on a family without true CFG (field ``true_cfg_scale``); a
                ``negative_prompt`` where ``cfg_rule`` is ``"none"`` (field ``negative_prompt``); a size
                whose token grid exceeds :attr:`max_grid_side` (field ``size``; diffusers raises there too) or whose
                sides are not multiples of :attr:`size_multiple` (field ``size``; diffusers would round them down);
                ``output_format`` ``"jpeg"`` where :attr:`output_alpha` (JPEG holds no alpha).
        """
        from bcg_core.errors import RequestError

        if self.default_true_cfg_scale is None and getattr(request, "true_cfg_scale", None) is not None:
            raise RequestError(
                "true_cfg_scale", f"true_cfg_scale is not an option of {self.pipeline_class} (family {self.family}); "
                f"leave it unset (guidance_scale: {self.guidance_role()})")
        if self.cfg_rule == "none" and getattr(request, "negative_prompt", None) is not None:
            raise RequestError(
                "negative_prompt", f"negative_prompt is not an option of this {self.pipeline_class} checkpoint "
                f"(family {self.family}): it runs no classifier-free guidance; leave it unset")
        if self.size_multiple is not None:
            try:
                self.rules.check_size(request.width, request.height, multiple=self.size_multiple)
            except ValueError as e:
                raise RequestError("size", f"{e} ({self.pipeline_class} generates sides that are multiples of "
                                           f"{self.size_multiple} pixels)") from None
        if self.output_alpha and getattr(request, "output_format", None) == "jpeg":
            raise RequestError("output_format", f"output_format 'jpeg': {self.pipeline_class} generates RGBA images "
                                                f"(its VAE decodes an alpha channel) and JPEG holds no alpha; use "
                                                f"'png' or 'webp'")
        if self.max_grid_side is not None:
            h, w = self.rules.grid(*self.generation_size(request.width, request.height))
            if max(h, w) > self.max_grid_side:
                px = self.max_grid_side * self.rules.pixels_per_token
                raise RequestError("size", f"size {request.width}x{request.height} exceeds this model's position "
                                           f"table ({self.max_grid_side} tokens a side): width and height at most "
                                           f"{px} pixels")

    def generation_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` the latents are generated at: the nearest aspect-ratio bin with resolution
        binning (``PixArtImageProcessor.classify_height_width_bin``, as the pipelines' ``__call__``), else
        the size itself."""
        if not self.size_bins:
            return width, height
        from diffusers.image_processor import PixArtImageProcessor

        h, w = PixArtImageProcessor.classify_height_width_bin(height, width, ratios=self.size_bins)
        return int(w), int(h)
