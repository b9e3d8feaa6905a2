"""The one validation path: a :class:`~bcg_core.request.GenerationRequest` in, a validated request out.

:meth:`RequestValidator.validate` checks every field against the limits and the model (prompt tokens as the family
encodes them, the family's rules, resolution bins, the bucket table) and fills in the defaults; every limit message
comes from here, in the wording of :mod:`bcg_core.field_phrases`. The ingress validates each request once (tokenizer
only, no weights), and everything below it (replica, step scheduler, pipeline) accepts only the
:class:`~bcg_core.request.ValidatedRequest` and trusts it. docs/DESIGN.md section 2 says how a shape rounds up to its
bucket.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import replace

from bcg_core.cache_field import check_cache, default_cache
from bcg_core.config import EngineConfig, LimitsConfig, MissPolicy
from bcg_core.errors import BucketMissError, RequestError
from bcg_core.families.base import ModelSpec
from bcg_core.field_phrases import engine_field_phrase, invalid
from bcg_core.keys import Dim, ShapeQuery
from bcg_core.request import (
    MAX_PARTIAL_IMAGES,
    QUALITIES,
    QUALITY_ALIASES,
    SEED_MAX,
    GenerationRequest,
    ValidatedRequest,
    steps_run,
)
from bcg_core.table import BucketLookup, BucketTable, ShapeRules, fit_size

__all__ = ["RequestValidator", "engine_field_phrase", "invalid"]

log = logging.getLogger(__name__)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class RequestValidator:
    """Validates requests and maps them to buckets.

    Args:
        config: the replica's config (limits and bucket table).
        spec: the model's spec (shape and request rules of its family); bare :class:`ShapeRules` stand for a
            family with classifier-free guidance by ``guidance_scale`` and no other rules (tests, tools).
        count_tokens: ``(prompt, negative=False) -> tokens`` of the key's text dimension, counted as the family
            encodes a prompt or a negative prompt (:meth:`~bcg_core.families.Family.count_tokens`).
    """

    def __init__(self, config: EngineConfig, spec: ModelSpec | ShapeRules, count_tokens: Callable[[str], int]):
        if isinstance(spec, ShapeRules):
            spec = ModelSpec("model", "generic", "", spec)
        from bcg_core.families.defaults import family_buckets

        config = family_buckets(config, spec)  # a video family's own table where the config sets none
        self.config = config
        self.spec = spec
        self.limits = config.limits
        rules = self.rules = spec.rules
        spec.check_table(config.buckets)
        if spec.size_bins:
            bins = {(int(w), int(h)) for h, w in spec.size_bins.values()}
            dead = [r for r, wh in zip(config.buckets.resolutions, config.buckets.resolution_pairs(), strict=True)
                    if wh not in bins]
            if dead:
                near = sorted({f"{w}x{h}" for w, h in (spec.generation_size(*wh)
                                                       for wh in config.buckets.resolution_pairs())})
                raise ValueError(f"buckets.resolutions: {dead} are not aspect-ratio bins of this model: resolution "
                                 f"binning generates every image at a bin, so no request would reach them; use bins, "
                                 f"e.g. {', '.join(near)}")
        min_side = -(-config.limits.min_side_px // rules.pixels_per_token)
        self.table = BucketTable(config.buckets, rules, min_image_tokens=min_side * min_side)
        self.count_tokens = count_tokens
        self.default_steps, self.default_guidance_scale = self._defaults(config.limits, spec)
        lim = config.limits  # a request without a size: the model's default, fitted into the side limits
        self.default_size = fit_size(spec.default_size, lim.min_side_px, lim.max_side_px, spec.size_step)
        if self.default_size != tuple(spec.default_size):
            log.warning("limits: the model's default size %dx%d is outside %d-%d px a side; a request without a size "
                        "gets %dx%d", *spec.default_size, lim.min_side_px, lim.max_side_px, *self.default_size)
        self.default_cache = default_cache(config.cache, spec)
        if config.cache.default is not None and config.cache.default != self.default_cache:
            log.warning("cache.default %s is ignored: %s (family %s) takes no such step cache (methods: %s)",
                        config.cache.default.model_dump(), spec.pipeline_class, spec.family, spec.cache_methods)

    @staticmethod
    def _defaults(lim: LimitsConfig, spec: ModelSpec) -> tuple[int, float | None]:
        """``(steps, guidance_scale)`` of a request that omits them: the config's where set, else the family's
        (:attr:`ModelSpec.default_steps`, :attr:`ModelSpec.default_guidance_scale`: its diffusers pipeline's
        ``__call__`` defaults), clipped to ``limits.max_steps`` and ``limits.max_guidance_scale`` (logged: the
        images then differ from diffusers' defaults)."""
        steps, guidance = lim.default_steps, lim.default_guidance_scale
        if steps is None:
            steps = min(spec.default_steps, lim.max_steps)
            if steps < spec.default_steps:
                log.warning("the family's default of %d steps (%s) is above limits.max_steps %d: requests that omit "
                            "num_inference_steps get %d; raise max_steps or set limits.default_steps",
                            spec.default_steps, spec.pipeline_class, lim.max_steps, steps)
        if guidance is None and spec.default_guidance_scale is not None:
            guidance = min(spec.default_guidance_scale, lim.max_guidance_scale)
            if guidance < spec.default_guidance_scale:
                log.warning("the family's default guidance_scale %g (%s) is above limits.max_guidance_scale %g: "
                            "requests that omit it get %g", spec.default_guidance_scale, spec.pipeline_class,
                            lim.max_guidance_scale, guidance)
        return steps, guidance

    @property
    def defaults(self) -> dict[str, float | int | None]:
        """What a request that omits them gets: ``num_inference_steps``, ``guidance_scale`` (None: left unset, as
        Qwen-Image's pipeline) and, for families with true CFG, ``true_cfg_scale`` (``GET /v1/models`` shows them)."""
        d: dict[str, float | int | None] = {"num_inference_steps": self.default_steps,
                                            "guidance_scale": self.default_guidance_scale}
        if self.spec.default_true_cfg_scale is not None:
            d["true_cfg_scale"] = self.spec.default_true_cfg_scale
        return d

    @classmethod
    def from_config(cls, config: EngineConfig) -> RequestValidator:
        """A validator that loads only the model's tokenizer and JSON configs (cheap; for the ingress)."""
        from bcg_core.models import describe_model, load_tokenizer_counter

        return cls(config, describe_model(config.model), load_tokenizer_counter(config.model))

    @property
    def text_limit(self) -> int:
        """Most prompt tokens a request may have: what the text encoder reads (:attr:`ModelSpec.max_prompt_tokens`),
        else the native length; for a masked-text family (PixArt-Sigma, SANA, Qwen-Image) the encoder's cut
        (:attr:`ModelSpec.max_text_tokens`): a prompt longer than the largest text bucket is a text miss, served
        unpadded on eager kernels under ``miss_policy: eager`` and refused as a miss (:class:`BucketMissError`,
        counted by dimension) under ``reject``; else the largest text bucket."""
        if self.spec.max_prompt_tokens is not None:
            return self.spec.max_prompt_tokens
        native = self.rules.native_text_tokens
        if native is not None:
            return native
        cut = self.spec.max_text_tokens
        return max(cut, self.table.text_lengths[-1]) if cut is not None else self.table.text_lengths[-1]

    def validate(self, request: GenerationRequest) -> ValidatedRequest:
        """Validate every field of ``request``, fill defaults (the step cache's: :mod:`bcg_core.cache_field`), and look
        its shape up in the table.

        Raises:
            RequestError: naming the first bad field and its allowed values; also for a miss under the
                reject policy.
        """
        lim = self.limits
        r = request
        bad = self._bad
        if not isinstance(r.prompt, str) or not r.prompt.strip():
            raise bad("prompt", r.prompt, "it is empty" if isinstance(r.prompt, str) else "not a string")
        if not any(ch.isprintable() and not ch.isspace() for ch in r.prompt):
            raise bad("prompt", r.prompt, "it must contain visible text (it holds only control, format or zero-width "
                                          "characters)")
        if len(r.prompt) > lim.max_prompt_chars:
            raise bad("prompt", f"{len(r.prompt)} characters", "too long")
        if not _is_int(r.n) or not 1 <= r.n <= lim.max_images:
            raise bad("n", r.n, "out of range")
        frames = self._frames(r)  # a video's latent frames (the transformer's), 1 for an image
        edit = self._edit_defaults(r)  # the edit pipeline's defaults; None for text to image
        if edit is not None and (r.width is None or r.height is None):  # an edit's size: its image's
            w, h = edit["image_size"]
            r = replace(r, width=w if r.width is None else r.width, height=h if r.height is None else r.height)
        if r.width is None or r.height is None:  # size 'auto' or omitted: the model's (its diffusers pipeline's)
            w, h = self.default_size
            r = replace(r, width=w if r.width is None else r.width, height=h if r.height is None else r.height)
        size = f"{r.width}x{r.height}"
        for name, v in (("width", r.width), ("height", r.height)):
            if not _is_int(v) or not lim.min_side_px <= v <= lim.max_side_px:
                raise bad("size", size, f"{name} {v} is out of range")
        if not self.spec.size_bins:  # with binning any size is served (generated at its bin, resized back)
            try:
                self.rules.check_size(r.width, r.height, multiple=self.spec.size_step)
            except ValueError as e:
                raise bad("size", size, str(e).removeprefix(f"size {size}: ")) from None  # the size: quoted once
        if r.quality is not None and (not isinstance(r.quality, str)
                                      or (r.quality not in QUALITIES and r.quality not in QUALITY_ALIASES)):
            raise bad("quality", r.quality, "not a served quality")
        quality = QUALITY_ALIASES.get(r.quality, r.quality)  # DALL-E 3's 'standard' and 'hd': medium and high
        default_steps = self.default_steps if edit is None else edit["steps"]
        if r.num_inference_steps is not None:
            steps = r.num_inference_steps
        elif quality is not None:
            steps = self.spec.steps_for_quality(quality, self.config.quality, default_steps, lim.max_steps)
        else:
            steps = default_steps
        if not _is_int(steps) or not 1 <= steps <= lim.max_steps:
            raise bad("num_inference_steps", steps, "out of range")
        strength, runs = self._strength(r, edit, steps)
        refs = edit["references"] if edit is not None else ()
        px = self.rules.pixels_per_token
        ref_px = sum(h * w for h, w in refs) * px * px  # a reference edit's images go through every step too
        work = (r.width * r.height + ref_px) * r.n * frames * runs / 1e6
        if lim.max_megapixel_steps is not None and work > lim.max_megapixel_steps:
            field = "n" if r.n > 1 else "num_inference_steps" if steps > 1 else "size"
            ran = f"{runs} steps (its strength's share of {steps})" if runs != steps else f"{steps} steps"
            also = f" (plus its reference images' {ref_px} pixels)" if refs else ""
            also += f" x {frames} latent frames" if self.spec.video else ""
            kind = "videos" if self.spec.video else "images"
            raise RequestError(field, f"the request asks for {r.width}x{r.height}{also} x {r.n} {kind} x {ran} = "
                                      f"{work:.0f} megapixel-steps, above limits.max_megapixel_steps "
                                      f"{lim.max_megapixel_steps:g}; lower n, num_inference_steps or size")
        g = (self.default_guidance_scale if edit is None else edit["guidance"]) if r.guidance_scale is None \
            else r.guidance_scale
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float))
                              or not 0.0 <= g <= lim.max_guidance_scale):
            raise bad("guidance_scale", g, "out of range")
        g2 = self._guidance_2(r, g)
        neg = r.negative_prompt
        if neg is not None and (not isinstance(neg, str) or len(neg) > lim.max_prompt_chars):
            raise bad("negative_prompt", f"{len(neg)} characters" if isinstance(neg, str) else neg, "too long"
                      if isinstance(neg, str) else "not a string")
        seed = r.seed if r.seed is not None else random.randint(0, 2**31 - 1)
        if not _is_int(seed) or not 0 <= seed <= SEED_MAX - lim.max_images:
            raise bad("seed", seed, "out of range (image i uses seed + i)")
        tcfg = r.true_cfg_scale
        if tcfg is not None and (isinstance(tcfg, bool) or not isinstance(tcfg, (int, float))
                                 or not 0.0 <= tcfg <= lim.max_guidance_scale):
            raise bad("true_cfg_scale", tcfg, "out of range")
        self._check_output(r)
        lora = self._check_lora(r.lora)
        cache = self.default_cache if r.cache is None else check_cache(r.cache, self.spec)
        filled = replace(r, lora=lora, cache=cache, strength=strength, num_inference_steps=steps,
                         guidance_scale=None if g is None else float(g), negative_prompt=neg, seed=seed,
                         true_cfg_scale=None if tcfg is None else float(tcfg), quality=quality, guidance_scale_2=g2,
                         num_frames=r.num_frames if r.num_frames is not None or not self.spec.video
                         else self.spec.default_frames)
        self.spec.check(filled)
        if self.spec.size_bins:
            gen_w, gen_h = self.spec.generation_size(r.width, r.height)
            try:
                self.rules.check_size(gen_w, gen_h)
            except ValueError as e:
                raise RequestError("size", f"size {r.width}x{r.height} is generated at its aspect-ratio bin "
                                           f"{gen_w}x{gen_h} (resolution binning): {e}") from None
        limit = self.text_limit
        tokens = self.count_tokens(r.prompt)
        if tokens > limit:
            raise RequestError("prompt", f"prompt is {self._too_long(tokens)}; {self._limit_reason}")
        neg_tokens = self.count_tokens(neg or "", negative=True) if self.spec.uses_cfg(filled) else 0
        if neg_tokens > limit:
            raise RequestError("negative_prompt",
                               f"negative_prompt is {self._too_long(neg_tokens)}; {self._limit_reason}")
        lookup = self.table.lookup(self.query(filled, tokens, neg_tokens, refs))
        home = lookup.key if lookup.hit else self.table.split_home(lookup)
        if home is None and self.table.miss_policy is MissPolicy.REJECT:
            raise self._miss_error(filled, lookup, refs)
        grid = lookup.query.grid or self.rules.grid(*self.spec.generation_size(filled.width, filled.height))
        return ValidatedRequest(filled, lookup, tokens, grid, None if home is None else home.shape, refs)

    def _frames(self, r: GenerationRequest) -> int:
        """A video request's latent frames (its ``num_frames``, or the family's default, through
        :meth:`~bcg_core.table.ShapeRules.latent_frames`); 1 for an image model's request.

        Raises:
            RequestError: ``num_frames`` on an image model, out of 1..``limits.max_frames``, not ``1 + k x
                frame_stride`` or of more latent frames than the model's position table holds; ``partial_images`` on a
                video model (no previews of videos).
        """
        if not self.spec.video:
            if r.num_frames is not None:
                raise RequestError("num_frames", f"invalid 'num_frames' (got {r.num_frames!r}): "
                                                 f"{self.spec.pipeline_class} (family {self.spec.family}) generates "
                                                 f"images, not videos; leave num_frames unset")
            return 1
        if r.partial_images:
            raise self._bad("partial_images", r.partial_images, "previews are not served for videos; send 0")
        nf = self.spec.default_frames if r.num_frames is None else r.num_frames
        if not _is_int(nf) or not 1 <= nf <= self.limits.max_frames:
            raise self._bad("num_frames", nf, "out of range")
        try:
            latent = self.rules.latent_frames(nf)
        except ValueError as e:
            raise self._bad("num_frames", nf, str(e).removeprefix(f"num_frames {nf} ")) from None
        most = self.spec.max_grid_side
        if most is not None and latent > most:  # the frames axis of the model's position table
            raise self._bad("num_frames", nf, f"its {latent} latent frames exceed this model's position table ({most} "
                                              f"a side): at most {(most - 1) * self.rules.frame_stride + 1} frames")
        return latent

    def _guidance_2(self, r: GenerationRequest, g: float | None) -> float | None:
        """``guidance_scale_2`` of a model of two experts (:attr:`ModelSpec.boundary_ratio`): the request's, else
        ``g`` (as ``WanPipeline``); None on one transformer or without CFG. Raises RequestError where set on one
        transformer (diffusers raises too), out of 0 to ``limits.max_guidance_scale``, or beside a ``guidance_scale``
        of at most 1 (no uncond rows run)."""
        g2 = r.guidance_scale_2
        if g2 is None:
            return None if self.spec.boundary_ratio is None or g is None or g <= 1.0 else float(g)
        if self.spec.boundary_ratio is None:
            raise self._bad("guidance_scale_2", g2, f"{self.spec.pipeline_class} checkpoint {self.spec.name!r} has "
                                                    f"one transformer (no boundary_ratio); leave it unset")
        if isinstance(g2, bool) or not isinstance(g2, (int, float)) or not 0.0 <= g2 <= self.limits.max_guidance_scale:
            raise self._bad("guidance_scale_2", g2, "out of range")
        if g is None or g <= 1.0:
            raise self._bad("guidance_scale_2", g2, f"guidance_scale {g} runs no classifier-free guidance, so the "
                                                    f"low-noise expert's scale would be ignored; set guidance_scale "
                                                    f"above 1 or leave guidance_scale_2 unset")
        return float(g2)

    def _bad(self, name: str, got: object, reason: str) -> RequestError:
        """The error of a refused field, in the one wording of limit messages (:func:`invalid`,
        :func:`engine_field_phrase`)."""
        multiple = None if self.spec.size_bins else self.spec.size_step
        return RequestError(name, invalid(name, got, reason, engine_field_phrase(
            name, self.limits, multiple, tuple(self.config.buckets.resolutions), self.config.lora,
            self.spec.cache_methods, self.spec.guidance_role(), self.rules.frame_stride)))

    def _edit_defaults(self, r: GenerationRequest) -> dict | None:
        """For an edit (``image`` set): its image read and checked (:mod:`bcg_core.edits`) and the defaults of the
        family's edit pipeline (image-to-image, or inpainting with a ``mask``): ``steps`` and ``guidance``
        (``limits.default_steps`` / ``default_guidance_scale`` where set), ``strength``, ``image_size``, the
        image's size with each side rounded down to the model's token size (the size of an edit without one), and
        ``references`` ``()``. A reference edit (:attr:`ModelSpec.references`: FLUX.2) has its pipeline's own
        defaults (text to image's: the same ``__call__``), ``strength`` None, ``image_size`` its first image's as the
        pipeline resizes it and ``references`` the images' token grids (:func:`~bcg_core.edits.read_references`).
        None for text to image.

        Raises:
            RequestError: a mask without an image, a family without edits (naming the families that edit), several
                images where the family edits one, or an image or mask that is not served (:mod:`bcg_core.edits`).
        """
        if r.image is None:
            if r.mask is not None:
                raise RequestError("image", "'mask' needs an 'image' to edit; send both (or neither)")
            if r.strength is not None:
                raise RequestError("strength", "'strength' applies to edits (POST /v1/images/edits) only")
            return None
        from bcg_core.edits import read_image, read_mask, read_references
        from bcg_core.families.defaults import edit_defaults

        if not r.images:  # an empty list of files
            raise RequestError("image", "'image' holds no file; send the image to edit as the file part 'image'")
        if self.spec.references is not None:
            refs, size = read_references(r, self.spec.references, self.limits.max_input_pixels)
            return {"steps": self.default_steps, "guidance": self.default_guidance_scale, "strength": None,
                    "image_size": size, "references": refs}
        if self.spec.edit_pipelines is None:
            raise RequestError("image", f"'image': {self.spec.pipeline_class} (family {self.spec.family}) is not "
                                        f"served for edits; edits are served for FLUX.1, SD3/SD3.5 and Qwen-Image "
                                        f"(FluxPipeline, StableDiffusion3Pipeline and QwenImagePipeline "
                                        f"checkpoints) and the tiny default; reference-image edits for FLUX.2 "
                                        f"(Flux2Pipeline and Flux2KleinPipeline checkpoints)")
        if len(r.images) > 1:
            raise RequestError("image", f"'image': {len(r.images)} images were sent; {self.spec.pipeline_class} edits "
                                        f"one image (several reference images are served for FLUX.2 checkpoints)")
        image = read_image(r.images[0], self.limits.max_input_pixels)
        if r.mask is not None:
            read_mask(r.mask, image.size, self.limits.max_input_pixels)
        return {**edit_defaults(self.spec, self.limits, r.mask is not None),
                "image_size": self._edit_size(image.width, image.height), "references": ()}

    def _edit_size(self, width: int, height: int) -> tuple[int, int]:
        """The size of an edit that sends none: its image's, scaled (aspect kept) to fit ``limits.min_side_px`` ..
        ``max_side_px`` where a side falls outside (a 4032x3024 photo at max 2048: 2048x1536), each side then rounded
        down to the model's pixels per token (up where that would fall below ``min_side_px``). The image is resized
        to it, as to a size the request names."""
        lim, px = self.limits, self.rules.pixels_per_token
        scale = min(1.0, lim.max_side_px / max(width, height))
        if min(width, height) * scale < lim.min_side_px:
            scale = min(lim.max_side_px / max(width, height), lim.min_side_px / min(width, height))

        def side(v: float) -> int:
            s = max(px, int(v + 1e-6) // px * px)
            return s if s >= lim.min_side_px else -(-lim.min_side_px // px) * px
        return side(width * scale), side(height * scale)

    def _strength(self, r: GenerationRequest, edit: dict | None, steps: int) -> tuple[float | None, int]:
        """``(strength, steps run)`` (:func:`~bcg_core.request.steps_run`); text to image: ``(None, steps)``."""
        if edit is None or edit["references"]:  # text to image, or a reference edit (its target starts from noise)
            return None, steps
        s = edit["strength"] if r.strength is None else r.strength
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 < s <= 1.0:
            raise self._bad("strength", s, "out of range")
        runs = steps_run(steps, s)
        if runs < 1:  # steps x strength below one ulp of steps: diffusers' get_timesteps leaves no step either
            raise self._bad("strength", s, f"runs no denoising step of {steps}: {steps} x strength is below the "
                                           f"float resolution of {steps} (diffusers' edit pipelines refuse it too)")
        return float(s), runs

    def _check_lora(self, lora) -> tuple[tuple[str, float], ...]:
        """``lora`` as ``((name, float scale), ...)``: at most ``lora.max_per_request`` entries, distinct names that
        pass :data:`~bcg_core.lora.files.NAME_RE`, finite scales within ``lora.max_scale``. Whether each adapter
        exists and fits the model is the replica's check (:class:`~bcg_core.lora.slots.AdapterSlots`)."""
        import math

        from bcg_core.lora.files import NAME_RE

        if not lora:
            return ()
        cfg = self.config.lora
        if cfg.dir is None:
            raise RequestError("lora", "invalid 'lora': this deployment serves no LoRA adapters (lora.dir is unset); "
                                       "send none")
        entries = list(lora) if isinstance(lora, (list, tuple)) else None
        if entries is None or not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in entries):
            raise self._bad("lora", lora, "not a list of (name, scale) entries")
        if len(entries) > cfg.max_per_request:
            raise self._bad("lora", f"{len(entries)} adapters", f"more than {cfg.max_per_request} adapters")
        out = []
        for name, scale in entries:
            if not isinstance(name, str) or not NAME_RE.match(name):
                raise self._bad("lora", name, "not an adapter name (1 to 128 ASCII letters, digits, '_', '.', '-', "
                                              "starting with a letter or digit; no path)")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                    or abs(scale) > cfg.max_scale:
                raise self._bad("lora", scale, f"the scale of {name!r} is out of range")
            out.append((name, float(scale)))
        if len({n for n, _ in out}) < len(out):
            raise self._bad("lora", [n for n, _ in out], "an adapter is named twice")
        return tuple(out)

    def _check_output(self, r: GenerationRequest) -> None:
        """Refuse an unknown ``output_format``, an ``output_compression`` out of 0..100 (or below 100 for png) and
        ``partial_images`` out of 0..:data:`MAX_PARTIAL_IMAGES`."""
        from bcg_core.images import IMAGE_FORMATS

        if r.output_format not in IMAGE_FORMATS:
            raise self._bad("output_format", r.output_format, "not a served format")
        c = r.output_compression
        if c is not None and (not _is_int(c) or not 0 <= c <= 100):
            raise self._bad("output_compression", c, "out of range")
        if r.output_format == "png" and c is not None and c != 100:
            raise self._bad("output_compression", c, "it applies to jpeg and webp only (png is lossless)")
        if not _is_int(r.partial_images) or not 0 <= r.partial_images <= MAX_PARTIAL_IMAGES:
            raise self._bad("partial_images", r.partial_images, "out of range")

    def _too_long(self, tokens: int) -> str:
        """``"N tokens long"``, or ``"at least N tokens long"`` where N is the family's cut (the encoder keeps no
        more: PixArt-Sigma, SANA and Qwen-Image cut as their pipelines do)."""
        cut = self.spec.max_text_tokens
        return f"{'at least ' if cut is not None and tokens >= cut else ''}{tokens} tokens long"

    @property
    def _limit_reason(self) -> str:
        """Why :attr:`text_limit` is the limit, and what to do."""
        limit = self.text_limit
        if self.spec.max_prompt_tokens is not None:
            return f"this model's text encoder reads at most {limit} tokens (more would be cut); shorten it"
        if self.rules.native_text_tokens is not None:
            return f"this model takes at most {limit} tokens; shorten it"
        most = self.spec.max_text_tokens
        if most is not None:  # text_limit is then the encoder's cut
            return f"this model's text encoder keeps at most {most} tokens; shorten it"
        return f"the largest text bucket (buckets.text_lengths) holds {limit} tokens; shorten it"

    def rows(self, request: GenerationRequest) -> int:
        """Transformer rows of ``request``: ``n``, doubled when classifier-free guidance adds uncond rows."""
        return request.n * (2 if self.spec.uses_cfg(request) else 1)

    def query(self, request: GenerationRequest, prompt_tokens: int, negative_tokens: int = 0,
              references: tuple[tuple[int, int], ...] = ()) -> ShapeQuery:
        """The exact forward shape of a validated request (at its generation size: the aspect-ratio bin of
        families with resolution binning); a reference edit's image stream also holds its ``references``' tokens
        (token grids, :attr:`~bcg_core.request.ValidatedRequest.references`)."""
        grid = self.rules.grid(*self.spec.generation_size(request.width, request.height))
        native = self.rules.native_text_tokens
        text = native if native is not None else max(prompt_tokens, negative_tokens)
        frames = self.rules.latent_frames(request.num_frames) if self.spec.video else None
        image = grid[0] * grid[1] * (frames or 1) + sum(h * w for h, w in references)
        return ShapeQuery(self.rows(request), image, text, grid if self.rules.grid_keyed else None, frames)

    def _miss_error(self, request: GenerationRequest, lookup: BucketLookup,
                    references: tuple[tuple[int, int], ...] = ()) -> BucketMissError:
        """One error naming every dimension that missed; ``field`` is the first one's request field. The batch
        dimension never misses: the step scheduler splits rows above the largest batch bucket."""
        t = self.table
        parts: list[tuple[str, str]] = []
        missed = tuple(d for d in lookup.missed if d is not Dim.BATCH)
        for dim in missed:
            if dim is Dim.IMAGE and self.spec.video:
                q = lookup.query
                parts.append(("size", f"size {request.width}x{request.height} at {request.num_frames} frames "
                                      f"({q.frames} latent frames) fits no video bucket; served tiers: "
                                      f"{', '.join(t.config.resolutions)} at num_frames {t.config.frames} (exactly "
                                      f"these sizes and frame counts)"))
            elif dim is Dim.IMAGE:
                if t.pad_images:
                    rule = "any size with at most as many pixels as a tier"
                elif self.rules.grid_keyed:
                    rule = "exactly these sizes"
                else:
                    rule = "sizes with exactly a tier's number of image tokens"
                refs = sum(h * w for h, w in references)
                also = (f" with its reference images' {refs} tokens ({lookup.query.image_tokens} image tokens in "
                        f"all; a tier of 'WxH' holds W x H / {self.rules.pixels_per_token ** 2})") if refs else ""
                parts.append(("size", f"size {request.width}x{request.height}{also} fits no resolution bucket; "
                                      f"served tiers: {', '.join(t.config.resolutions)} ({rule})"))
            else:
                q = lookup.query
                texts = t.texts_for(q.image_tokens, q.latent_hw, q.frames)
                where = "" if texts == t.text_lengths else f" of its resolution tier ({list(texts)})"
                parts.append(("prompt", f"prompt needs {q.text_tokens} text tokens, above the largest "
                                        f"text bucket{where} {texts[-1]} (buckets.miss_policy is reject; under "
                                        f"eager it would run unpadded)"))
        return BucketMissError(parts[0][0], "; and ".join(m for _, m in parts), tuple(d.value for d in missed))
