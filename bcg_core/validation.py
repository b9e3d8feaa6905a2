"""The one validation path: a :class:`~bcg_core.request.GenerationRequest` in, a validated request out.

:meth:`RequestValidator.validate` checks every field against the limits and the model (prompt tokens as the family
encodes them, the family's rules, resolution bins, the bucket table) and fills in the defaults; every limit message
comes from here, in the wording of :mod:`bcg_core.field_phrases`. The ingress validates each request once (tokenizer
only, no weights), and everything below it (replica, step scheduler, pipeline) accepts only the
:class:`~bcg_core.request.ValidatedRequest` and trusts it. docs/DESIGN.md section 2 says how a shape rounds up to its
bucket.

The validator is one class in four modules: this one holds :meth:`RequestValidator.validate`, the defaults and the
checks of the plain request fields (prompt, n, size, steps, guidance, seed, output, LoRA, cache); its base classes
hold the size and bucket lookup (:mod:`bcg_core.validation_buckets`: the prompt's token limit, a request's forward
shape, the error of a miss) and the edit and video fields (:mod:`bcg_core.validation_edits`: an edit's image, size
and strength, ``num_frames``, ``guidance_scale_2``) and one family's guidance options (:mod:`bcg_core.validation_cfg`:
Z-Image's ``cfg_normalization`` and ``cfg_truncation``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import replace

from bcg_core.cache_field import check_cache, default_cache
from bcg_core.config import EngineConfig, LimitsConfig, MissPolicy
from bcg_core.errors import RequestError
from bcg_core.families.spec import ModelSpec
from bcg_core.field_phrases import engine_field_phrase, invalid
from bcg_core.request import (
    MAX_PARTIAL_IMAGES,
    QUALITIES,
    QUALITY_ALIASES,
    SEED_MAX,
    GenerationRequest,
    ValidatedRequest,
)
from bcg_core.table import BucketTable, ShapeRules, fit_size
from bcg_core.validation_buckets import BucketShapes
from bcg_core.validation_cfg import CfgOptionFields
from bcg_core.validation_edits import EditFields, is_int

__all__ = ["RequestValidator", "engine_field_phrase", "invalid"]

log = logging.getLogger(__name__)


class RequestValidator(BucketShapes, EditFields, CfgOptionFields):
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
        self._check_bins(config, spec)
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
        Qwen-Image's pipeline), for families with true CFG, ``true_cfg_scale``, and Z-Image's ``cfg_normalization`` and
        ``cfg_truncation`` (``GET /v1/models`` shows them)."""
        d: dict[str, float | int | None] = {"num_inference_steps": self.default_steps,
                                            "guidance_scale": self.default_guidance_scale}
        if self.spec.default_true_cfg_scale is not None:
            d["true_cfg_scale"] = self.spec.default_true_cfg_scale
        return {**d, **self.cfg_option_defaults}

    @classmethod
    def from_config(cls, config: EngineConfig) -> RequestValidator:
        """A validator that loads only the model's tokenizer and JSON configs (cheap; for the ingress)."""
        from bcg_core.models import describe_model, load_tokenizer_counter

        return cls(config, describe_model(config.model), load_tokenizer_counter(config.model))

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
        if not is_int(r.n) or not 1 <= r.n <= lim.max_images:
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
            if not is_int(v) or not lim.min_side_px <= v <= lim.max_side_px:
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
        if not is_int(steps) or not 1 <= steps <= lim.max_steps:
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
        cfg_norm, cfg_trunc = self._cfg_options(r, g)
        neg = r.negative_prompt
        if neg is not None and (not isinstance(neg, str) or len(neg) > lim.max_prompt_chars):
            raise bad("negative_prompt", f"{len(neg)} characters" if isinstance(neg, str) else neg, "too long"
                      if isinstance(neg, str) else "not a string")
        seed = r.seed if r.seed is not None else random.randint(0, 2**31 - 1)
        if not is_int(seed) or not 0 <= seed <= SEED_MAX - lim.max_images:
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
                         cfg_normalization=cfg_norm, cfg_truncation=cfg_trunc,
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

    def _bad(self, name: str, got: object, reason: str) -> RequestError:
        """The error of a refused field, in the one wording of limit messages (:func:`invalid`,
        :func:`engine_field_phrase`)."""
        multiple = None if self.spec.size_bins else self.spec.size_step
        return RequestError(name, invalid(name, got, reason, engine_field_phrase(
            name, self.limits, multiple, tuple(self.config.buckets.resolutions), self.config.lora,
            self.spec.cache_methods, self.spec.guidance_role(), self.rules.frame_stride)))

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
        if c is not None and (not is_int(c) or not 0 <= c <= 100):
            raise self._bad("output_compression", c, "out of range")
        if r.output_format == "png" and c is not None and c != 100:
            raise self._bad("output_compression", c, "it applies to jpeg and webp only (png is lossless)")
        if not is_int(r.partial_images) or not 0 <= r.partial_images <= MAX_PARTIAL_IMAGES:
            raise self._bad("partial_images", r.partial_images, "out of range")

