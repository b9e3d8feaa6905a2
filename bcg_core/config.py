"""Typed configuration of the engine: model, bucket table, request limits, runner, scheduler, quality steps, traffic,
LoRA adapters and the step cache.

Every field is documented; every check raises a ``ValueError`` (surfaced by pydantic as a ``ValidationError``)
whose message names the bad value and the fix. :class:`EngineConfig` is what the engine reads; the serving layer's
settings (routing, autoscaling, API keys) and the whole ``ServeConfig`` live in ``deployments/settings.py``.
"""

from __future__ import annotations

import enum
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bcg_core.lora.config import LoRAConfig
from bcg_core.runtime_config import RunnerConfig, SchedulerConfig
from bcg_core.step_cache.spec import StepCacheConfig

__all__ = [
    "BucketConfig", "EngineConfig", "LimitsConfig", "LoRAConfig", "MissPolicy", "ModelConfig", "PlannedTraffic",
    "QualityConfig", "RunnerConfig", "SchedulerConfig", "StepCacheConfig", "TrafficConfig", "parse_size",
]

_SIZE_RE = re.compile(r"^([1-9][0-9]{0,5})x([1-9][0-9]{0,5})$")  # ASCII digits, no sign, space or leading 0


def parse_size(size: str) -> tuple[int, int]:
    """Parse an OpenAI-style ``"WxH"`` size string.

    Args:
        size: e.g. ``"512x768"`` (width 512 pixels, height 768 pixels).

    Returns:
        ``(width, height)`` in pixels.

    Raises:
        ValueError: if the string is not two positive integers (ASCII digits, no leading zero, at most six
            digits) joined by a lowercase ``x`` without spaces.
    """
    m = _SIZE_RE.match(size) if isinstance(size, str) else None
    if m is None:
        raise ValueError(f"size {str(size)[:40]!r} is not of the form 'WxH' with positive integer pixels "
                         f"(for example '512x512')")
    w, h = int(m.group(1)), int(m.group(2))
    if w <= 0 or h <= 0:
        raise ValueError(f"size {size!r} must have positive width and height")
    return w, h


class MissPolicy(str, enum.Enum):
    """What a replica does with a request that no bucket can hold."""

    EAGER = "eager"
    """Run the request unpadded and eagerly (counted as a miss)."""
    REJECT = "reject"
    """Answer HTTP 422 naming the dimension that missed and the largest bucket."""


def _check_ascending(name: str, values: list[int]) -> list[int]:
    if not values:
        raise ValueError(f"{name} must list at least one value")
    for v in values:
        if v <= 0:
            raise ValueError(f"{name} value {v} must be positive")
    if sorted(set(values)) != list(values):
        raise ValueError(f"{name} {values} must be strictly ascending without repeats; use {sorted(set(values))}")
    return values


class PlannedTraffic(BaseModel):
    """What ``bcg plan`` expected of the table it wrote (``buckets.plan``): the replicas' ownership prior and
    the reference their drift check compares recorded traffic with (``bcg_core/planning/drift.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="The traffic sample the table was planned on (krea, gentd26, histogram ...).")
    requests: float = Field(ge=0, description="Requests in that sample.")
    waste: float = Field(ge=0, le=1, description="Expected padded-token waste on it, 0..1.")
    ms_per_image: float = Field(ge=0, description="Expected GPU milliseconds per image on it.")
    miss_share: float = Field(default=0.0, ge=0, le=1,
                              description="Expected share of its requests that no bucket holds (run eager).")
    costs: str = Field(description="The cost model the plan used (token-count, profile ...).")
    cost_lines: dict[str, float] = Field(default_factory=dict, description="That model's lines (graph_launch_ms, "
        "eager_launch_ms, ms_per_token, eager_ms_per_token, "
        "bytes_per_token): the drift check scores recorded traffic with the same costs.")
    work: dict[str, float] = Field(default_factory=dict, description="Per bucket shape (and 'miss'), its share of the "
                                   "computed tokens: the ownership prior.")

    @model_validator(mode="after")
    def _lines_and_work(self) -> PlannedTraffic:
        from bcg_core.keys import BucketShape

        known = ("graph_launch_ms", "eager_launch_ms", "ms_per_token", "eager_ms_per_token", "bytes_per_token")
        for name, x in self.cost_lines.items():
            if name not in known or not 0 <= x < float("inf"):
                raise ValueError(f"cost_lines.{name} is {x}: " + (f"not a cost line; they are {', '.join(known)}"
                                 if name not in known else "a cost is a finite number, 0 or more"))
        for shape, x in self.work.items():
            if not 0 <= x <= 1:
                raise ValueError(f"work[{shape!r}] is {x}: a share of the computed tokens, 0 to 1")
            if shape != "miss":
                BucketShape.parse(shape)  # ValueError naming the format
        return self


class BucketConfig(BaseModel):
    """The bucket table: every combination of the three lists below is one bucket.

    Defaults come from the real request mix in ``bcg_core/data/krea_open_prompts_1k_flat.csv``: 512x512
    is ~49% of images, portrait/landscape 512x768 and 768x512 the next most common sizes, and the
    Discord bot's default of 9 images per request (18 transformer rows with classifier-free guidance),
    and 20 rows for the largest request the default limits allow (n=10 with guidance).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_sizes: list[int] = Field(
        default=[1, 2, 4, 8, 16, 18, 20],
        description="Transformer batch rows per bucket, ascending: images x 2 when classifier-free "
        "guidance is on (cond + uncond rows in one forward), images x 1 otherwise.",
    )
    resolutions: list[str] = Field(
        default=["256x256", "512x512", "512x768", "768x768", "1024x1024"],
        description="Resolution tiers as 'WxH' pixels. For models whose forward depends only on the "
        "number of image tokens (FLUX) a tier holds any size with at most as many tokens; for models "
        "keyed on the latent grid (SD3) it holds exactly that grid.",
    )
    text_lengths: list[int] = Field(
        default=[256],
        description="Text-token buckets, ascending. Models trained on unmasked fixed-length text "
        "(FLUX, SD3) accept only their native length here.",
    )
    text_lengths_by_resolution: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Per-tier text buckets, ascending, for models trained with a text mask: a tier listed here "
        "(its 'WxH' exactly as in resolutions) has these text buckets instead of text_lengths, so a common tier "
        "can have fine text buckets while rare tiers keep one (`bcg plan` writes it). Tiers not listed use "
        "text_lengths.",
    )
    image_padding: Literal["masked", "exact"] = Field(
        default="masked",
        description="For models keyed on the image-token count (FLUX): 'masked' serves a size between "
        "tiers from the next tier up with a key-padding mask (a second graph per tier; exact fits keep the "
        "unmasked graph, whose attention kernels are faster); 'exact' serves only exact tier sizes.",
    )
    frames: list[int] = Field(
        default_factory=list,
        description="Video models only (Wan): the frame counts (a request's num_frames, 1 plus a multiple of the "
        "VAE's temporal factor, 4 for Wan: e.g. [81]) of the video tiers; every resolution is a tier at each of "
        "them, keyed on its exact latent frames x grid. Empty for image models (a start-up error otherwise); a "
        "video model's config without buckets gets its family's default table (frames [81] at 832x480 for Wan).",
    )
    miss_policy: MissPolicy = Field(default=MissPolicy.EAGER, description="What to do on a bucket miss.")
    plan: PlannedTraffic | None = Field(
        default=None,
        description="Written by `bcg plan --write`: what the plan expected of this table (ownership uses its "
        "work shares instead of the krea prior; replicas warn when recorded traffic drifts from it).",
    )

    @field_validator("batch_sizes", "text_lengths")
    @classmethod
    def _ascending(cls, v: list[int], info) -> list[int]:
        return _check_ascending(info.field_name, v)

    @field_validator("frames")
    @classmethod
    def _frames(cls, v: list[int]) -> list[int]:
        return _check_ascending("frames", v) if v else v

    @field_validator("resolutions")
    @classmethod
    def _sizes(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("resolutions must list at least one 'WxH' tier")
        seen = set()
        for s in v:
            wh = parse_size(s)
            if wh in seen:
                raise ValueError(f"resolution {s!r} is listed twice")
            seen.add(wh)
        return v

    @field_validator("text_lengths_by_resolution")
    @classmethod
    def _tier_texts(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        for size, texts in v.items():
            parse_size(size)
            _check_ascending(f"text_lengths_by_resolution[{size!r}]", texts)
        return v

    @model_validator(mode="after")
    def _tier_texts_known(self) -> BucketConfig:
        unknown = [s for s in self.text_lengths_by_resolution if s not in self.resolutions]
        if unknown:
            raise ValueError(f"text_lengths_by_resolution names {unknown}, which are not in resolutions "
                             f"{self.resolutions}; use a tier of resolutions, written the same way")
        return self

    def texts_of(self, size: str) -> list[int]:
        """Text buckets of the tier ``size`` (a ``resolutions`` entry): its own list, else ``text_lengths``."""
        return self.text_lengths_by_resolution.get(size, self.text_lengths)

    def all_text_lengths(self) -> list[int]:
        """Every text bucket of any tier, ascending (the largest is the table's text limit)."""
        return sorted({t for s in self.resolutions for t in self.texts_of(s)})

    def resolution_pairs(self) -> list[tuple[int, int]]:
        """The tiers as ``(width, height)`` pixel pairs, in config order."""
        return [parse_size(s) for s in self.resolutions]


class ModelConfig(BaseModel):
    """Which DiT to load and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        default=None,
        description="Local diffusers checkpoint directory (model_index.json, transformer/, vae/, "
        "scheduler/, text encoder folders). None loads the tiny embedded default: seeded random "
        "weights of the real architectures, untrained, so its images are noise.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="Weights dtype.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="'auto' picks CUDA when available, else CPU."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the tiny default's random weights.")


class LimitsConfig(BaseModel):
    """Request limits enforced by the ingress and the replica (HTTP 422 above them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_images: int = Field(default=10, ge=1, le=64, description="Largest n per request (OpenAI allows 1-10).")
    min_side_px: int = Field(default=256, ge=16, description="Smallest width or height in pixels.")
    max_side_px: int = Field(default=2048, ge=16, description="Largest width or height in pixels.")
    max_steps: int = Field(default=50, ge=1, le=1000, description="Largest num_inference_steps.")
    default_steps: int | None = Field(
        default=None, ge=1,
        description="num_inference_steps when a request omits it (and quality). None: the family's, its diffusers "
        "pipeline's __call__ default (FLUX.1 and SD3 28, PixArt-Sigma and SANA 20, Qwen-Image, FLUX.2 and Z-Image 50, "
        "Qwen-Image 2.1 40; the tiny default 4), clipped to max_steps; GET /v1/models shows it.")
    default_guidance_scale: float | None = Field(
        default=None, ge=0.0,
        description="guidance_scale when a request omits it. None: the family's, its diffusers pipeline's __call__ "
        "default (FLUX.1 3.5, SD3 7.0, PixArt-Sigma and SANA 4.5, FLUX.2 4.0, Z-Image 5.0, Qwen-Image and Qwen-Image "
        "2.1 none: no guidance input; the tiny default 3.5), clipped to max_guidance_scale; GET /v1/models shows it.")
    max_guidance_scale: float = Field(default=30.0, gt=0.0, description="Largest guidance_scale.")
    max_frames: int = Field(default=129, ge=1, le=100000,
                            description="Video models only: the largest num_frames of a request (Wan 2.1 and 2.2 "
                            "generate 81 by default).")
    max_prompt_chars: int = Field(default=4000, ge=1, description="Longest prompt in characters.")
    max_body_bytes: int = Field(default=65536, ge=1024, description="Largest HTTP request body in bytes.")
    max_input_pixels: int = Field(default=4096 * 4096, ge=1, description="Most pixels of an edit's input image or "
                                  "mask, checked from the file's header before it is decoded.")
    max_upload_bytes: int = Field(default=64 * 1024 * 1024, ge=1024,
                                  description="Largest multipart body of POST /v1/images/edits in bytes (image, mask "
                                  "and fields).")
    max_megapixel_steps: float | None = Field(
        default=1000.0, gt=0.0,
        description="Most work one request may ask for: width x height x n x num_inference_steps, in millions of "
        "pixel-steps (the default admits 10 images at 1024x1024 and 50 steps, 524; refuses 10 at 2048x2048 and 50 "
        "steps, 2097), so that one request cannot hold a replica for minutes; a video counts each of its latent "
        "frames as an image (Wan's default 832x480, 81 frames = 21 latent frames, 50 steps: 419). None: no limit.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LimitsConfig:
        if self.min_side_px > self.max_side_px:
            raise ValueError(f"min_side_px {self.min_side_px} exceeds max_side_px {self.max_side_px}")
        if self.default_steps is not None and self.default_steps > self.max_steps:
            raise ValueError(f"default_steps {self.default_steps} exceeds max_steps {self.max_steps}")
        if self.default_guidance_scale is not None and self.default_guidance_scale > self.max_guidance_scale:
            raise ValueError(f"default_guidance_scale {self.default_guidance_scale} exceeds max_guidance_scale "
                             f"{self.max_guidance_scale}")
        return self


class TrafficConfig(BaseModel):
    """The request shapes each DiT replica records (``bcg_core/planning/traffic.py``: the ``traffic`` section of
    ``GET /v1/buckets`` and ``ray_bcg_traffic_requests_total``), an input of ``bcg plan``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    record: bool = Field(
        default=True,
        description="Count every accepted request by (width, height, n, prompt tokens, steps) in a bounded "
        "histogram; False: no histogram (traffic is null in /v1/buckets).",
    )
    max_shapes: int = Field(
        default=512, ge=1, le=100000,
        description="Most distinct request shapes one replica keeps (and Prometheus label sets it exports); "
        "requests of further shapes are counted as dropped.",
    )
    drift_check_s: float = Field(
        default=60.0, ge=1.0, le=86400.0,
        description="Seconds between a replica's drift checks: with buckets.plan set, the recorded traffic is "
        "scored on the table; over 1.5x the planned padded-token waste (and 1 point above it) logs a warning and "
        "raises ray_bcg_plan_drift_gain with what a new plan would save. Advice only: the table never changes.",
    )
    drift_min_requests: int = Field(
        default=50, ge=1, le=10**9,
        description="Recorded requests needed before the first drift check.",
    )


# -- The OpenAI Images API options: quality step counts and API keys (issue 13) ------------------------------


class QualityConfig(BaseModel):
    """Denoising steps of OpenAI's ``quality`` values. An unset value takes the family's own
    (:data:`bcg_core.families.base.QUALITY_STEPS`; ``auto``: the default steps, ``limits.default_steps`` or the
    family's); every count is clipped
    to ``limits.max_steps``. A request's ``num_inference_steps`` wins over its ``quality``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    low: int | None = Field(default=None, ge=1, le=1000, description="Steps of quality 'low'; None: the family's.")
    medium: int | None = Field(default=None, ge=1, le=1000, description="Steps of 'medium'; None: the family's.")
    high: int | None = Field(default=None, ge=1, le=1000, description="Steps of 'high'; None: the family's.")
    auto: int | None = Field(default=None, ge=1, le=1000,
                             description="Steps of 'auto'; None: the default steps (limits.default_steps, else the "
                             "family's).")


class EngineConfig(BaseModel):
    """What the engine reads: model, bucket table, request limits, runner, step scheduler, quality steps, traffic
    recording, LoRA adapters and the step cache (the runner and scheduler sections are defined in
    :mod:`bcg_core.runtime_config`, the cache section in :mod:`bcg_core.step_cache.spec`).

    The serving layer's :class:`deployments.settings.ServeConfig` adds routing, autoscaling and API keys; the
    engine takes either (it reads only these sections).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    buckets: BucketConfig = Field(default_factory=BucketConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig,
                                       description="The step scheduler's settings (bcg_core/runtime_config.py).")
    traffic: TrafficConfig = Field(
        default_factory=TrafficConfig,
        description="Request shapes each replica records for bcg plan (traffic in /v1/buckets).",
    )
    quality: QualityConfig = Field(default_factory=QualityConfig, description="Steps of OpenAI's quality values.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters per request (off by default).")
    cache: StepCacheConfig = Field(
        default_factory=StepCacheConfig,
        description="The step cache (diffusers' First Block Cache) of a request that omits 'cache' (off by default); "
        "a request's own cache wins, and a model whose transformer takes no cache (SD3, PixArt-Sigma, SANA) ignores "
        "it (docs/API.md: Step cache).",
    )

    @model_validator(mode="after")
    def _reachable_buckets(self) -> EngineConfig:
        """Every bucket must be reachable by some valid request (else it only costs memory and start-up).

        Raises:
            ValueError: every resolution outside the limits, and batch sizes above the most rows, in one message.
        """
        lim = self.limits
        sides = dict(zip(self.buckets.resolutions, self.buckets.resolution_pairs(), strict=True))
        inside = [r for r, (w, h) in sides.items() if lim.min_side_px <= min(w, h) and max(w, h) <= lim.max_side_px]
        outside = [s for s in sides if s not in inside]
        problems = []
        if outside:
            one = len(outside) == 1
            problems.append(f"buckets.resolutions: {', '.join(outside)} {'is' if one else 'are'} outside the request "
                            f"limits: sides must be from {lim.min_side_px} to {lim.max_side_px} pixels "
                            "(limits.min_side_px/max_side_px); "
                            + (f"drop {'it' if one else 'them'} (use {inside}) or widen the limits"
                               if inside else "widen the limits")
                            + " (with resolution binning, PixArt-Sigma and SANA, larger requests reach a smaller "
                            f"bin: set limits.min_side_px at or below {'its' if one else 'their'} smaller side to "
                            f"keep {'it' if one else 'them'})")
        most_rows = 2 * lim.max_images
        if self.buckets.batch_sizes[-1] > most_rows:
            fit = [b for b in self.buckets.batch_sizes if b <= most_rows]
            problems.append(f"buckets.batch_sizes: {self.buckets.batch_sizes[-1]} exceeds the most transformer rows "
                            f"a request can need, {most_rows} (2 x limits.max_images with guidance); use {fit} or "
                            f"raise limits.max_images")
        if problems:
            raise ValueError("; ".join(problems))
        return self
