"""Request validation and bucket planning: a request in, its bucket key (or a counted miss) out.

The ingress runs a :class:`Planner` (tokenizer only, no weights) to reject bad input with a 4xx before
it reaches a GPU replica and to compute the bucket key that routing needs. The family's request rules
(which options it refuses, when classifier-free guidance adds uncond rows, PixArt's and SANA's resolution
binning) come from its :class:`~bcg_core.families.ModelSpec`, read from JSON configs: the ingress plans each
request once, and the replica trusts that :class:`Plan` (it plans only raw requests that direct handle
callers send it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable

from .buckets import BucketKey, BucketLookup, BucketTable, Dim, ShapeQuery, ShapeRules
from .config import MissPolicy, ServeConfig
from .errors import BucketMissError, RequestError
from .families.base import ModelSpec

__all__ = ["GenerationRequest", "MAX_PARTIAL_IMAGES", "Plan", "Planner", "QUALITIES", "SEED_MAX"]

SEED_MAX = 2**63 - 1
"""Largest seed (``torch.Generator.manual_seed`` takes 64-bit values; JSON clients handle int64)."""


@dataclass
class GenerationRequest:
    """One text-to-image request.

    Attributes:
        prompt: the text.
        n: images to generate.
        width, height: image size in pixels.
        num_inference_steps: denoising steps (None: ``quality``'s, else the configured default).
        guidance_scale: guidance scale (None: the configured default). For most families it is the
            classifier-free guidance scale, and above 1 adds one uncond row per image (cond and uncond in one
            forward); for guidance-distilled FLUX.1-dev it feeds the guidance embedding (see the family table
            in docs/OPERATIONS.md).
        negative_prompt: text of the uncond rows (None: the family's default, "" for most; FLUX and Qwen-Image
            run true CFG only when one is given, as their diffusers pipelines).
        seed: image ``i`` uses noise seeded with ``seed + i`` (None: a random seed, reported back).
        true_cfg_scale: true classifier-free guidance scale of FLUX and Qwen-Image (``true_cfg_scale`` of
            ``FluxPipeline``/``QwenImagePipeline``; None: the pipeline's default); refused by other families.
        quality: OpenAI's ``quality``, ``"low"``, ``"medium"``, ``"high"`` or ``"auto"``: the step count the config
            and the family set for it (:meth:`~bcg_core.families.ModelSpec.steps_for_quality`), used when
            ``num_inference_steps`` is None. None: ``limits.default_steps``.
        output_format: the image files' format, ``"png"``, ``"jpeg"`` or ``"webp"`` (:mod:`bcg_core.images`).
        output_compression: 0..100 for jpeg and webp (None: 100); None or 100 for png.
        partial_images: previews to stream while denoising, 0..3 (:mod:`bcg_core.preview`); 0 for a request
            that is not streamed.
    """

    prompt: str
    n: int = 1
    width: int = 512
    height: int = 512
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    true_cfg_scale: float | None = None
    quality: str | None = None
    output_format: str = "png"
    output_compression: int | None = None
    partial_images: int = 0


QUALITIES = ("low", "medium", "high", "auto")
"""OpenAI ``quality`` values served (each a step count, :meth:`~bcg_core.families.ModelSpec.steps_for_quality`)."""

MAX_PARTIAL_IMAGES = 3
"""Most previews a streamed request may ask for (OpenAI's ``partial_images`` range, 0 to 3)."""


@dataclass
class Plan:
    """A validated request with defaults filled in, and its bucket lookup."""

    request: GenerationRequest
    lookup: BucketLookup
    prompt_tokens: int
    home: BucketKey | None = None
    """With the step scheduler, for a request with more rows than the largest batch bucket (a miss in the
    batch dimension only): the largest bucket of its shape, across which its rows are split. It routes to the
    shape's owners and is not refused under the reject policy."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Planner:
    """Validates requests and maps them to buckets.

    Args:
        config: the replica's config (limits and bucket table).
        spec: the model's spec (shape and request rules of its family); bare :class:`ShapeRules` stand for a
            family with classifier-free guidance by ``guidance_scale`` and no other rules (tests, tools).
        count_tokens: ``(prompt, negative=False) -> tokens`` of the key's text dimension, counted as the family
            encodes a prompt or a negative prompt (:meth:`~bcg_core.families.Family.count_tokens`).
    """

    def __init__(self, config: ServeConfig, spec: ModelSpec | ShapeRules, count_tokens: Callable[[str], int]):
        if isinstance(spec, ShapeRules):
            spec = ModelSpec("model", "generic", "", spec)
        self.config = config
        self.spec = spec
        self.limits = config.limits
        rules = self.rules = spec.rules
        spec.check_table(config.buckets)
        if spec.size_bins:
            bins = {(int(w), int(h)) for h, w in spec.size_bins.values()}
            dead = [r for r, wh in zip(config.buckets.resolutions, config.buckets.resolution_pairs()) if wh not in bins]
            if dead:
                near = sorted({f"{w}x{h}" for w, h in (spec.generation_size(*wh) for wh in config.buckets.resolution_pairs())})
                raise ValueError(f"bucket resolutions {dead} are not aspect-ratio bins of this model: resolution "
                                 f"binning generates every image at a bin, so no request would reach them; use bins, "
                                 f"e.g. {', '.join(near)}")
        min_side = -(-config.limits.min_side_px // rules.pixels_per_token)
        self.table = BucketTable(config.buckets, rules, min_image_tokens=min_side * min_side)
        self.count_tokens = count_tokens
        self.splits_batches = config.runner.scheduler == "step"
        """Rows above the largest batch bucket are split across buckets (the step scheduler), not missed."""

    @classmethod
    def from_config(cls, config: ServeConfig) -> "Planner":
        """A planner that loads only the model's tokenizer and JSON configs (cheap; for the ingress)."""
        from .models import describe_model, load_tokenizer_counter

        return cls(config, describe_model(config.model), load_tokenizer_counter(config.model))

    @property
    def text_limit(self) -> int:
        """Most prompt tokens a request may have: what the text encoder reads (:attr:`ModelSpec.max_prompt_tokens`),
        else the native length, else the largest text bucket."""
        if self.spec.max_prompt_tokens is not None:
            return self.spec.max_prompt_tokens
        native = self.rules.native_text_tokens
        return native if native is not None else self.table.text_lengths[-1]

    def plan(self, request: GenerationRequest) -> Plan:
        """Validate every field of ``request``, fill defaults, and look its shape up in the table.

        Raises:
            RequestError: naming the first bad field and its allowed values; also for a miss under the
                reject policy.
        """
        lim = self.limits
        r = request
        if not isinstance(r.prompt, str) or not r.prompt.strip():
            raise RequestError("prompt", "prompt must be a non-empty string")
        if not any(ch.isprintable() and not ch.isspace() for ch in r.prompt):
            raise RequestError("prompt", "prompt must contain visible text (it holds only control, format or "
                                         "zero-width characters)")
        if len(r.prompt) > lim.max_prompt_chars:
            raise RequestError("prompt", f"prompt has {len(r.prompt)} characters; at most {lim.max_prompt_chars} allowed")
        if not _is_int(r.n) or not 1 <= r.n <= lim.max_images:
            raise RequestError("n", f"n must be an integer from 1 to {lim.max_images}, got {r.n!r}")
        for name, v in (("width", r.width), ("height", r.height)):
            if not _is_int(v) or not lim.min_side_px <= v <= lim.max_side_px:
                raise RequestError(
                    "size", f"size {r.width}x{r.height}: {name} must be from {lim.min_side_px} to {lim.max_side_px} pixels"
                )
        if not self.spec.size_bins:  # with binning any size is served (generated at its bin, resized back)
            try:
                self.rules.check_size(r.width, r.height)
            except ValueError as e:
                raise RequestError("size", str(e)) from None
        if r.quality is not None and r.quality not in QUALITIES:
            raise RequestError("quality", f"quality must be one of {', '.join(QUALITIES)}, got {r.quality!r}")
        if r.num_inference_steps is not None:
            steps = r.num_inference_steps
        elif r.quality is not None:
            steps = self.spec.steps_for_quality(r.quality, self.config.quality, lim.default_steps, lim.max_steps)
        else:
            steps = lim.default_steps
        if not _is_int(steps) or not 1 <= steps <= lim.max_steps:
            raise RequestError(
                "num_inference_steps", f"num_inference_steps must be an integer from 1 to {lim.max_steps}, got {steps!r}"
            )
        work = r.width * r.height * r.n * steps / 1e6
        if lim.max_megapixel_steps is not None and work > lim.max_megapixel_steps:
            field = "n" if r.n > 1 else "num_inference_steps" if steps > 1 else "size"
            raise RequestError(field, f"the request asks for {r.width}x{r.height} x {r.n} images x {steps} steps = "
                                      f"{work:.0f} megapixel-steps, above limits.max_megapixel_steps "
                                      f"{lim.max_megapixel_steps:g}; lower n, num_inference_steps or size")
        g = lim.default_guidance_scale if r.guidance_scale is None else r.guidance_scale
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 <= g <= lim.max_guidance_scale:
            raise RequestError(
                "guidance_scale", f"guidance_scale must be a number from 0 to {lim.max_guidance_scale}, got {g!r}"
            )
        neg = r.negative_prompt
        if neg is not None and (not isinstance(neg, str) or len(neg) > lim.max_prompt_chars):
            raise RequestError(
                "negative_prompt", f"negative_prompt must be a string of at most {lim.max_prompt_chars} characters"
            )
        seed = r.seed if r.seed is not None else random.randint(0, 2**31 - 1)
        if not _is_int(seed) or not 0 <= seed <= SEED_MAX - lim.max_images:
            raise RequestError("seed", f"seed must be an integer from 0 to {SEED_MAX - lim.max_images}, got {seed!r}")
        tcfg = r.true_cfg_scale
        if tcfg is not None and (isinstance(tcfg, bool) or not isinstance(tcfg, (int, float))
                                 or not 0.0 <= tcfg <= lim.max_guidance_scale):
            raise RequestError(
                "true_cfg_scale", f"true_cfg_scale must be a number from 0 to {lim.max_guidance_scale}, got {tcfg!r}"
            )
        self._check_output(r)
        filled = replace(r, num_inference_steps=steps, guidance_scale=float(g), negative_prompt=neg, seed=seed,
                         true_cfg_scale=None if tcfg is None else float(tcfg))
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
            raise RequestError("negative_prompt", f"negative_prompt is {self._too_long(neg_tokens)}; {self._limit_reason}")
        lookup = self.table.lookup(self.query(filled, tokens, neg_tokens))
        home = self.table.split_home(lookup) if self.splits_batches else None
        if not lookup.hit and home is None and self.table.miss_policy is MissPolicy.REJECT:
            raise self._miss_error(filled, lookup)
        return Plan(filled, lookup, tokens, home)

    @staticmethod
    def _check_output(r: GenerationRequest) -> None:
        """Refuse an unknown ``output_format``, an ``output_compression`` out of 0..100 (or below 100 for png) and
        ``partial_images`` out of 0..:data:`MAX_PARTIAL_IMAGES`."""
        from .images import IMAGE_FORMATS

        if r.output_format not in IMAGE_FORMATS:
            raise RequestError("output_format", f"output_format must be one of {', '.join(IMAGE_FORMATS)}, "
                                                f"got {r.output_format!r}")
        c = r.output_compression
        if c is not None and (not _is_int(c) or not 0 <= c <= 100):
            raise RequestError("output_compression", f"output_compression must be an integer from 0 to 100, got {c!r}")
        if r.output_format == "png" and c is not None and c != 100:
            raise RequestError("output_compression", "output_compression applies to jpeg and webp only; omit it "
                                                     "(or send 100) for png")
        if not _is_int(r.partial_images) or not 0 <= r.partial_images <= MAX_PARTIAL_IMAGES:
            raise RequestError("partial_images", f"partial_images must be an integer from 0 to {MAX_PARTIAL_IMAGES}, "
                                                 f"got {r.partial_images!r}")

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
        more = f", or add a larger text bucket (up to {most})" if most is not None and limit < most else ""
        return (f"the largest text bucket (buckets.text_lengths) holds {limit} tokens; shorten it{more}")

    def rows(self, request: GenerationRequest) -> int:
        """Transformer rows of ``request``: ``n``, doubled when classifier-free guidance adds uncond rows."""
        return request.n * (2 if self.spec.uses_cfg(request) else 1)

    def query(self, request: GenerationRequest, prompt_tokens: int, negative_tokens: int = 0) -> ShapeQuery:
        """The exact forward shape of a validated request (at its generation size: the aspect-ratio bin of
        families with resolution binning)."""
        grid = self.rules.grid(*self.spec.generation_size(request.width, request.height))
        native = self.rules.native_text_tokens
        text = native if native is not None else max(prompt_tokens, negative_tokens)
        return ShapeQuery(self.rows(request), grid[0] * grid[1], text, grid if self.rules.grid_keyed else None)

    def _miss_error(self, request: GenerationRequest, lookup: BucketLookup) -> BucketMissError:
        """One error naming every dimension that missed; ``field`` is the first one's request field. Under the
        step scheduler the batch dimension is left out: rows above the largest bucket are split, not missed."""
        t = self.table
        parts: list[tuple[str, str]] = []
        missed = tuple(d for d in lookup.missed if not (self.splits_batches and d is Dim.BATCH))
        for dim in missed:
            if dim is Dim.BATCH:
                per = 2 if self.spec.uses_cfg(request) else 1
                why = " (cond + uncond rows for guidance_scale > 1)" if per == 2 else ""
                parts.append(("n", f"n={request.n} needs {lookup.query.batch} transformer rows{why}, above the "
                                   f"largest batch bucket {t.batch_sizes[-1]}; use n <= {t.batch_sizes[-1] // per}"))
            elif dim is Dim.IMAGE:
                if t.pad_images:
                    rule = "any size with at most as many pixels as a tier"
                elif self.rules.grid_keyed:
                    rule = "exactly these sizes"
                else:
                    rule = "sizes with exactly a tier's number of image tokens"
                parts.append(("size", f"size {request.width}x{request.height} fits no resolution bucket; served "
                                      f"tiers: {', '.join(t.config.resolutions)} ({rule})"))
            else:
                q = lookup.query
                texts = t.texts_for(q.image_tokens, q.latent_hw)
                where = "" if texts == t.text_lengths else f" of its resolution tier ({list(texts)})"
                parts.append(("prompt", f"prompt needs {q.text_tokens} text tokens, above the largest "
                                        f"text bucket{where} {texts[-1]}"))
        return BucketMissError(parts[0][0], "; and ".join(m for _, m in parts), tuple(d.value for d in missed))
