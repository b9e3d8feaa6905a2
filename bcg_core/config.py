"""Typed configuration for a bcg-serve replica: model, bucket table and request limits.

Every field is documented; every check raises a ``ValueError`` (surfaced by pydantic as a
``ValidationError``) whose message names the bad value and the fix. Configuration is read from a
YAML/JSON mapping or built in code; environment variables are read only in :mod:`bcg_core.settings`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "API_KEY_DIGEST",
    "AuthConfig",
    "AutoscalingSettings",
    "BackpressureLimits",
    "BucketConfig",
    "PlannedTraffic",
    "LimitsConfig",
    "QualityConfig",
    "MissPolicy",
    "ModelConfig",
    "RoutingConfig",
    "RunnerConfig",
    "ServeConfig",
    "TrafficConfig",
    "api_key_digest",
    "backpressure_limits",
    "load_config",
    "parse_size",
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
        raise ValueError(f"size {str(size)[:40]!r} is not of the form 'WxH' with positive integer pixels (for example '512x512')")
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
    cost_lines: dict[str, float] = Field(
        default_factory=dict,
        description="That model's lines (graph_launch_ms, eager_launch_ms, ms_per_token, eager_ms_per_token, "
        "bytes_per_token): the drift check scores recorded traffic with the same costs.")
    work: dict[str, float] = Field(
        default_factory=dict,
        description="Per bucket shape (and 'miss'), its share of the computed tokens: the ownership prior.")


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
    def _tier_texts_known(self) -> "BucketConfig":
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
    default_steps: int = Field(default=4, ge=1, description="num_inference_steps when a request omits it.")
    default_guidance_scale: float = Field(default=3.5, ge=0.0, description="CFG scale when omitted.")
    max_guidance_scale: float = Field(default=30.0, gt=0.0, description="Largest guidance_scale.")
    max_prompt_chars: int = Field(default=4000, ge=1, description="Longest prompt in characters.")
    max_body_bytes: int = Field(default=65536, ge=1024, description="Largest HTTP request body in bytes.")
    max_megapixel_steps: float | None = Field(
        default=1000.0, gt=0.0,
        description="Most work one request may ask for: width x height x n x num_inference_steps, in millions of "
        "pixel-steps (the default admits 10 images at 1024x1024 and 50 steps, 524; refuses 10 at 2048x2048 and 50 "
        "steps, 2097), so that one request cannot hold a replica for minutes. None: no limit.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LimitsConfig:
        if self.min_side_px > self.max_side_px:
            raise ValueError(f"min_side_px {self.min_side_px} exceeds max_side_px {self.max_side_px}")
        if self.default_steps > self.max_steps:
            raise ValueError(f"default_steps {self.default_steps} exceeds max_steps {self.max_steps}")
        if self.default_guidance_scale > self.max_guidance_scale:
            raise ValueError(f"default_guidance_scale {self.default_guidance_scale} exceeds max_guidance_scale "
                             f"{self.max_guidance_scale}")
        return self


class RunnerConfig(BaseModel):
    """How bucket forwards execute: eager on static buffers, or CUDA graph capture and replay."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["auto", "eager", "graph"] = Field(
        default="auto",
        description="'graph' captures one CUDA graph per bucket at start (needs CUDA); 'eager' runs every "
        "bucket eagerly on its static padded buffers; 'auto' is 'graph' on CUDA and 'eager' on CPU.",
    )
    graph_memory_budget_mib: float | None = Field(
        default=None, gt=0,
        description="Most MiB the shared graph memory pool may hold. Buckets whose capture would exceed "
        "it are not captured (reported 'over_budget', served eagerly). None: 90% of the GPU memory free "
        "after the weights are loaded.",
    )
    lazy_capture: bool = Field(
        default=False,
        description="Capture a bucket on its first request instead of at start (each lazy capture is "
        "counted and logged). Off by default: serving never captures.",
    )
    warmup_iters: int = Field(default=2, ge=1, le=10, description="Warm-up forwards on a side stream before capture.")
    max_rows_in_flight: int = Field(
        default=64, ge=1, le=4096,
        description="Step scheduler: most transformer rows (images, x2 with classifier-free guidance) in flight "
        "per replica; a request that does not fit waits for admission (FIFO per shape). On CUDA admission "
        "is further bounded by measured memory. A single request larger than this runs alone.",
    )
    max_requests: int | None = Field(
        default=None, ge=1, le=100000,
        description="Step scheduler: requests a replica accepts (in flight plus waiting for admission; Ray "
        "Serve's max_ongoing_requests of the DiT deployment unless routing.max_ongoing_requests is set). "
        "None: 2 x max_rows_in_flight / rows of a default request (one set in flight, one waiting).",
    )
    decode_batch_images: int = Field(
        default=8, ge=1, le=256,
        description="Step scheduler: most images one VAE decode call takes; finished requests of the same "
        "image size are decoded together, in a decode thread, overlapped with the next denoising steps.",
    )
    encode_threads: int = Field(
        default=4, ge=1, le=64,
        description="Step scheduler: threads that encode decoded images to PNG (off the event loop and off "
        "the denoising and decode threads).",
    )
    fair_wait_s: float = Field(
        default=2.0, ge=0.0, le=600.0,
        description="Step scheduler: a request that has waited this long for admission holds back every later "
        "request until it fits, so no request (a large one, a rare shape) waits without bound.",
    )
    max_queue_wait_s: float | None = Field(
        default=300.0, gt=0.0,
        description="Step scheduler: a request that has waited this many seconds in the replica's queue without "
        "being admitted is answered 503 with Retry-After instead of waiting on (counted as expired). None: no "
        "deadline.",
    )
    trim_idle_s: float | None = Field(
        default=1.0, ge=0.0, le=600.0,
        description="Step scheduler: once no request has been in flight for this many seconds, hand the C heap's "
        "free memory back to the OS (glibc malloc_trim; bcg_core/scheduler/memtrim.py says why: without it a CPU replica's "
        "memory at rest follows the largest requests served together). None: never.",
    )
    measure_costs: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Step scheduler: 'always' times, at prepare, each bucket's forward (a replay on CUDA) and "
        "the unpadded eager forward of each shape against row count, and the cost model chooses forwards from "
        "these times; 'never' uses the token-count model (milliseconds proportional to the tokens computed "
        "plus a launch cost per forward); 'auto' measures where graphs are captured (CUDA) and uses the "
        "token-count model elsewhere (on a CPU a padded row is pure extra work, so padding never pays).",
    )
    fused_step: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Capture each image's classifier-free guidance combination and its flow-match Euler update "
        "in the bucket graph after the transformer, so one replay is one whole denoising step (bcg_core/runners/fused.py; "
        "FLUX.1 and SD3 with FlowMatchEulerDiscreteScheduler). 'auto': where graphs are captured; 'always': also "
        "on the eager runner (CPU), computed on the static buffers; 'never': the transformer alone in the graph, "
        "guidance and scheduler step on the host. At start one step is run both ways and compared bit for bit; "
        "on any difference the fused step stays off (reported in /v1/buckets under fused_step).",
    )


class RoutingConfig(BaseModel):
    """Bucket ownership and shape-aware routing across DiT replicas (``router/``, docs/DESIGN.md section 5)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape_aware: bool = Field(
        default=True,
        description="Replicas own bucket shapes (assigned by the ownership coordinator) and capture only "
        "those; ShapeAwareRouter sends each request to an owner. False: Ray's default router, every "
        "replica captures every bucket.",
    )
    fallback_wait_s: float = Field(
        default=2.0, ge=0.0, le=600.0,
        description="Seconds a request waits for an owner of its shape before any replica may take it "
        "(eagerly, or by lazy capture there; counted).",
    )
    stats_period_s: float = Field(
        default=1.0, gt=0.0, le=60.0,
        description="Period of each replica's routing stats and ownership heartbeat in seconds.",
    )
    lease_s: float = Field(
        default=5.0, gt=0.0, le=600.0,
        description="A replica silent this long has left: its shapes move to the survivors.",
    )
    capture_stall_s: float | None = Field(
        default=600.0, gt=0.0, le=86400.0,
        description="A replica whose one capture has run this many seconds is stalled: the coordinator takes it "
        "out of the ownership assignment (its shapes move to the others, which capture them) until it reports "
        "the capture ended. None: never. Captures take seconds (docs/BENCHMARKS.md); the default leaves room "
        "for a slow first model load on a busy GPU.",
    )
    join_window_s: float = Field(
        default=60.0, ge=0.0, le=3600.0,
        description="At start, the first assignment waits up to this long for all expected replicas to join, "
        "so each captures only its own shapes.",
    )
    hot_share: float = Field(
        default=0.10, gt=0.0, le=1.0,
        description="A shape with at least this fraction of the expected requests (krea mix) gets >= 2 owners "
        "when >= 2 replicas exist; 1.0 gives every shape one owner (disjoint sets).",
    )
    max_retries: int = Field(
        default=2, ge=0, le=10,
        description="Times the ingress resends a request whose replica died before answering.",
    )
    max_ongoing_requests: int | None = Field(
        default=None, ge=1, le=1024,
        description="Requests one DiT replica accepts at once (waiting in its scheduler or running). None: "
        "derived from the scheduler's capacity (bcg_core.config.backpressure_limits): runner.max_requests, else "
        "2 x (runner.max_rows_in_flight // rows of a default request) for the step scheduler; 2 x (largest "
        "batch bucket // rows) for request-level micro-batching.",
    )
    max_queued_requests: int | None = Field(
        default=None, ge=1, le=100000,
        description="Requests each caller of the DiT deployment (each ingress replica) may hold waiting for a "
        "replica slot; beyond it a request is answered 503 with Retry-After at once (backpressure). None: "
        "max_ongoing_requests x the most DiT replicas (autoscaling.max_replicas, or the fixed replica count).",
    )
    retry_after_s: float = Field(
        default=2.0, gt=0.0, le=3600.0,
        description="Seconds sent in the Retry-After header of a 503 answered under overload.",
    )


class AutoscalingSettings(BaseModel):
    """Autoscaling of the DiT replicas by bucket load (``router/autoscaling.py``, docs/DESIGN.md section 5).

    Off by default: the replica count is then fixed (``dit_replicas``). On, :func:`deployments.build_app`
    gives the DiT deployment a Ray Serve ``autoscaling_config`` whose policy is
    :class:`router.autoscaling.BucketLoadPolicy`; the delays below are applied by that policy (Ray's own
    ``upscale_delay_s`` and ``downscale_delay_s`` are set to 0 so that they do not stack).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=False, description="Scale the DiT replicas by bucket load (else a fixed count).")
    min_replicas: int = Field(default=1, ge=1, le=1024, description="Fewest DiT replicas.")
    max_replicas: int = Field(default=4, ge=1, le=1024, description="Most DiT replicas (one GPU each).")
    initial_replicas: int | None = Field(
        default=None, ge=1, le=1024,
        description="DiT replicas at deploy time (None: min_replicas); the first ownership assignment waits "
        "for this many.",
    )
    target_utilization: float = Field(
        default=0.75, gt=0.0, le=1.0,
        description="Fraction of each ready replica's measured capacity the policy plans to use: replicas = "
        "ceil(bucket load / target_utilization) + replicas still capturing.",
    )
    backlog_drain_s: float = Field(
        default=10.0, gt=0.0, le=3600.0,
        description="Seconds in which the requests in flight (at replicas and queued at the ingress) should be "
        "served: a backlog counts as (its measured work in seconds) / backlog_drain_s replicas.",
    )
    upscale_delay_s: float = Field(
        default=3.0, ge=0.0, le=3600.0,
        description="Seconds the policy must want more replicas without a break before it adds them.",
    )
    downscale_delay_s: float = Field(
        default=30.0, ge=0.0, le=3600.0,
        description="Seconds the policy must want fewer replicas without a break before it removes them (to the "
        "most it wanted during that time).",
    )
    capture_grace_s: float = Field(
        default=30.0, ge=0.0, le=3600.0,
        description="A replica that is capturing graphs (shapes gained when a peer left) or has not reported yet is "
        "not capacity; after this many seconds of warming without a break it is added on top of what the load "
        "needs. Captures normally end sooner, so a downscale (which makes the survivors capture) does not bounce.",
    )
    look_back_period_s: float = Field(
        default=10.0, gt=0.0, le=600.0,
        description="Window in seconds of each replica's arrival rate and measured service time per bucket "
        "shape, and of Ray's metric aggregation.",
    )
    metrics_interval_s: float = Field(
        default=1.0, gt=0.0, le=60.0,
        description="Seconds between a replica's record_autoscaling_stats reports (Ray's metrics_interval_s).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling.min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        if self.look_back_period_s < self.metrics_interval_s:
            raise ValueError(f"autoscaling.look_back_period_s {self.look_back_period_s} is shorter than "
                             f"metrics_interval_s {self.metrics_interval_s}: a rate needs reports within its window")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"autoscaling.initial_replicas {self.initial_replicas} must be from min_replicas "
                             f"{self.min_replicas} to max_replicas {self.max_replicas}")
        return self

    @property
    def start_replicas(self) -> int:
        """Replicas at deploy time: ``initial_replicas``, else ``min_replicas``."""
        return self.initial_replicas if self.initial_replicas is not None else self.min_replicas


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
    (:data:`bcg_core.families.base.QUALITY_STEPS`; ``auto``: ``limits.default_steps``); every count is clipped
    to ``limits.max_steps``. A request's ``num_inference_steps`` wins over its ``quality``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    low: int | None = Field(default=None, ge=1, le=1000, description="Steps of quality 'low'; None: the family's.")
    medium: int | None = Field(default=None, ge=1, le=1000, description="Steps of 'medium'; None: the family's.")
    high: int | None = Field(default=None, ge=1, le=1000, description="Steps of 'high'; None: the family's.")
    auto: int | None = Field(default=None, ge=1, le=1000, description="Steps of 'auto'; None: limits.default_steps.")


API_KEY_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
"""An API key stored as its digest: ``sha256:`` and the lowercase hex SHA-256 of the key's UTF-8 bytes."""


def api_key_digest(key: str) -> str:
    """``sha256:<hex>`` of ``key`` (what :class:`AuthConfig` stores instead of the key)."""
    import hashlib

    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


class _BadKey:
    """Stands in for a bad ``api_keys`` entry during validation; its repr (what pydantic prints) is the reason."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"<{self.reason}>"


class AuthConfig(BaseModel):
    """API keys the ingress asks for (``Authorization: Bearer <key>``); no keys: the API is open.

    Keys are stored as SHA-256 digests from the moment the config is read: a plain key in ``api_keys`` is
    replaced by ``sha256:<hex>`` (a value already of that form is kept as a digest), so the config that travels
    to the deployments, ``bcg config`` and every echo hold digests only. ``api_key_file`` is read by the ingress
    at start (``deployments/auth.py``): one key a line, blank lines and lines starting with ``#`` skipped.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)  # errors never echo a key

    api_keys: list[str] = Field(
        default_factory=list,
        description="API keys, or their digests 'sha256:<64 hex>'; stored as digests only. Empty (and no "
        "api_key_file): every request is served without a key.",
    )
    api_key_file: str | None = Field(
        default=None,
        description="A file of API keys, one a line ('#' comments), read by the ingress at start (on its node).",
    )

    @model_validator(mode="before")
    @classmethod
    def _digests(cls, data: Any) -> Any:
        """Replace every key by its digest before any field check, so that no error message (pydantic echoes a
        bad field's input) ever holds a key: a bad entry becomes a :class:`_BadKey` that says what is wrong."""
        if not isinstance(data, Mapping) or "api_keys" not in data:
            return data
        keys = data["api_keys"]
        if not isinstance(keys, list):
            return {**data, "api_keys": _BadKey("not a list of strings")}
        out: list[Any] = []
        for key in keys:
            if not isinstance(key, str):
                out.append(_BadKey("not a string"))
            elif not key or key != key.strip():
                out.append(_BadKey("empty, or padded with white space"))
            else:
                out.append(key if API_KEY_DIGEST.match(key) else api_key_digest(key))
        return {**data, "api_keys": out}

    def __repr_args__(self):
        yield "api_keys", f"[{len(self.api_keys)} digests]"
        yield "api_key_file", self.api_key_file

    @property
    def enabled(self) -> bool:
        """True when requests need a key."""
        return bool(self.api_keys) or self.api_key_file is not None


class ServeConfig(BaseModel):
    """Everything one replica needs: the embedded default is ``ServeConfig()``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    buckets: BucketConfig = Field(default_factory=BucketConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    traffic: TrafficConfig = Field(
        default_factory=TrafficConfig,
        description="Request shapes each replica records for bcg plan (traffic in /v1/buckets).",
    )
    quality: QualityConfig = Field(default_factory=QualityConfig, description="Steps of OpenAI's quality values.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys (stored as SHA-256 digests).")

    @model_validator(mode="after")
    def _reachable_buckets(self) -> ServeConfig:
        """Every bucket must be reachable by some valid request (else it only costs memory and start-up)."""
        lim = self.limits
        for s, (w, h) in zip(self.buckets.resolutions, self.buckets.resolution_pairs()):
            if not (lim.min_side_px <= w <= lim.max_side_px and lim.min_side_px <= h <= lim.max_side_px):
                raise ValueError(f"bucket resolution {s} is outside the request limits: sides must be from "
                                 f"{lim.min_side_px} to {lim.max_side_px} pixels (limits.min_side_px/max_side_px)")
        most_rows = 2 * lim.max_images
        if self.buckets.batch_sizes[-1] > most_rows:
            raise ValueError(f"batch size {self.buckets.batch_sizes[-1]} exceeds the most transformer rows a "
                             f"request can need, {most_rows} (2 x limits.max_images with guidance)")
        return self


def load_config(config: Mapping[str, Any] | None = None, config_path: str | Path | None = None) -> ServeConfig:
    """Build a ``ServeConfig`` from a mapping or a YAML/JSON file (what ``bcg config`` prints).

    Raises:
        ValueError: both given, or a file that does not hold a mapping; pydantic.ValidationError (a
            ValueError) for a bad value, naming the field.
        FileNotFoundError: ``config_path`` does not exist.
    """
    import yaml

    if config is not None and config_path is not None:
        raise ValueError("give either config or config_path, not both")
    if config_path is not None:
        path = Path(config_path)
        if path.is_dir():
            raise ValueError(f"config file {str(path)!r} is a directory; give a YAML or JSON file (see `bcg config`)")
        try:
            data = yaml.safe_load(path.read_text())  # YAML is a superset of JSON
        except yaml.YAMLError as e:
            raise ValueError(f"config file {str(path)!r} is not valid YAML/JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config_path {str(config_path)!r} must hold a mapping with model/buckets/limits")
        config = data
    return ServeConfig.model_validate(dict(config or {}))


@dataclass(frozen=True)
class BackpressureLimits:
    """Request limits of the deployments (:func:`backpressure_limits`).

    Attributes:
        batch_capacity: requests of the default shape (n=1, default guidance) a replica runs at once.
        dit_max_ongoing: ``max_ongoing_requests`` of each DiT replica.
        dit_max_queued: ``max_queued_requests`` of the DiT deployment, per caller (ingress replica).
        ingress_max_ongoing: ``max_ongoing_requests`` of each ingress replica: enough to hold every DiT slot
            and the DiT queue, plus 8 for ``/v1/buckets`` and ``/healthz``, so the DiT deployment's queue,
            not the ingress, is what answers 503 under overload.
    """

    batch_capacity: int
    dit_max_ongoing: int
    dit_max_queued: int
    ingress_max_ongoing: int


def backpressure_limits(config: ServeConfig, dit_replicas: int = 1) -> BackpressureLimits:
    """The backpressure limits of an application, from the scheduler's capacity unless the config sets them.

    ``rows`` of a default request: 2 with classifier-free guidance (``limits.default_guidance_scale > 1``),
    else 1. ``batch_capacity`` (the requests a replica runs at once) is ``runner.max_rows_in_flight // rows``:
    the step scheduler splits forwards across buckets (or runs them eager), so the largest batch bucket does
    not bound it.

    ``max_ongoing_requests``: ``runner.max_requests`` when set, else ``2 x batch_capacity`` (one set running, one
    waiting for admission).
    ``max_queued_requests = max_ongoing_requests x most replicas`` (``autoscaling.max_replicas`` when
    autoscaling is on, else ``dit_replicas``): each ingress replica may hold one full deployment's worth of
    requests waiting, enough for a burst to wait while replicas are added. Explicit
    ``routing.max_ongoing_requests`` / ``max_queued_requests`` win.

    Args:
        config: the application's config.
        dit_replicas: the fixed DiT replica count (ignored when autoscaling is on).

    Returns:
        The limits. Default config (step scheduler, 64 rows, guidance 3.5): batch capacity 32, 64 ongoing
        per replica, 256 queued with 4 replicas at most.
    """
    rows = 2 if config.limits.default_guidance_scale > 1 else 1
    runner = config.runner
    capacity = max(1, runner.max_rows_in_flight // rows)
    default_ongoing = runner.max_requests or 2 * capacity
    most = config.autoscaling.max_replicas if config.autoscaling.enabled else max(1, int(dit_replicas))
    ongoing = config.routing.max_ongoing_requests or default_ongoing
    queued = config.routing.max_queued_requests or ongoing * most
    return BackpressureLimits(capacity, ongoing, queued, ongoing * most + queued + 8)
