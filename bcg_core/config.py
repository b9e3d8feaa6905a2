"""Typed configuration of the engine: model, bucket table, request limits, runner, quality steps, traffic.

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

__all__ = [
    "BucketConfig", "EngineConfig", "LimitsConfig", "LoRAConfig", "MissPolicy", "ModelConfig", "PlannedTraffic", "QualityConfig",
    "RunnerConfig", "TrafficConfig", "parse_size",
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
    cost_lines: dict[str, float] = Field(default_factory=dict, description="That model's lines (graph_launch_ms, "
        "eager_launch_ms, ms_per_token, eager_ms_per_token, "
        "bytes_per_token): the drift check scores recorded traffic with the same costs.")
    work: dict[str, float] = Field(default_factory=dict, description="Per bucket shape (and 'miss'), its share of the computed tokens: the ownership prior.")

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
    default_steps: int | None = Field(
        default=None, ge=1,
        description="num_inference_steps when a request omits it (and quality). None: the family's, its diffusers "
        "pipeline's __call__ default (FLUX.1 and SD3 28, PixArt-Sigma and SANA 20, Qwen-Image 50; the tiny default "
        "4), clipped to max_steps; GET /v1/models shows it.")
    default_guidance_scale: float | None = Field(
        default=None, ge=0.0,
        description="guidance_scale when a request omits it. None: the family's, its diffusers pipeline's __call__ "
        "default (FLUX.1 3.5, SD3 7.0, PixArt-Sigma and SANA 4.5, Qwen-Image none: it has no guidance input; the "
        "tiny default 3.5), clipped to max_guidance_scale; GET /v1/models shows it.")
    max_guidance_scale: float = Field(default=30.0, gt=0.0, description="Largest guidance_scale.")
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
        "steps, 2097), so that one request cannot hold a replica for minutes. None: no limit.",
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
    kernels: Literal["auto", "eager", "compiled", "fp8"] = Field(
        default="auto",
        description="The kernels of every bucket's padded forward (bcg_core/runners/kernels.py): 'eager' is "
        "PyTorch's eager kernels (diffusers' exact bits); 'compiled' compiles the transformer's repeated blocks "
        "with torch.compile (inductor, static shapes, one compile per bucket shape) and captures those kernels in "
        "the bucket's graph; 'fp8' is 'compiled' with the repeated blocks' linear layers in float8 through torchao "
        "(per-row scales; modulation, embedders and the final projection stay bf16; needs a GPU of compute "
        "capability 8.9 or newer, refused at start elsewhere). 'auto': 'compiled' on CUDA, 'eager' on a CPU. "
        "Every compiled bucket's forward is checked against its eager forward (runner.compile_rtol); a bucket "
        "whose compile fails, passes runner.compile_timeout_s or fails that check keeps eager kernels (noted and "
        "counted in /v1/buckets). Misses (unpadded forwards) always run eager kernels.",
    )
    ready_after_s: float | None = Field(
        default=20.0, ge=0.0, le=86400.0,
        description="A replica reports ready once this many seconds of capture have passed and at least one of its "
        "shapes is captured (largest first); the rest are captured in the background, their requests served by "
        "unpadded eager forwards meanwhile (deployments/dit.py). None: capture every shape before ready.",
    )
    compile_in_background: bool = Field(
        default=True,
        description="With compiled kernels, a replica whose compile cache lacks a bucket's blocks serves that bucket "
        "with eager kernels at once and compiles, checks and swaps it in between steps in a background thread "
        "(bcg_core/runners/background.py; /v1/buckets kernels.pending). False: compile before ready.",
    )
    compile_timeout_s: float | None = Field(
        default=300.0, gt=0, le=86400,
        description="With compiled kernels: seconds one bucket's compile (its warm-up forwards and the check) may "
        "take; a bucket past it keeps eager kernels. None: no bound.",
    )
    compile_rtol: float | None = Field(
        default=None, gt=0, le=1,
        description="With compiled kernels: the largest deviation of a bucket's compiled forward from its eager "
        "forward, relative to the eager forward's largest value, checked when the bucket is prepared. None: "
        "derived at start (bcg_core/verify.py kernel_tolerance): for 'compiled' max(the dtype's padding tolerance, "
        "min(2 x the eager forward's own rounding error against float32, measured on the smallest bucket, 0.1)); "
        "for 'fp8' "
        "the stated bound 0.25 (bcg_core/runners/kernels.py FP8_RTOL).",
    )
    compile_cache_dir: str | None = Field(
        default=None,
        description="With kernels 'compiled' or 'fp8': the folder of torch.compile's on-disk caches (inductor's FX "
        "graph cache and Triton's kernels; bcg_core/runners/kernels.py use_cache_dir). Inductor keys every entry by "
        "graph, torch version, device and options, so a restart with the same model and table reads its kernels "
        "back instead of compiling them. None: inductor's default folder (/tmp/torchinductor_<user>).",
    )
    attention: Literal["auto", "default", "cudnn", "flash", "efficient", "math"] = Field(
        default="auto",
        description="With compiled kernels: the SDPA backend each bucket's compiled forward runs "
        "(bcg_core/runners/attention.py). 'auto': measured per bucket when it is prepared, the fastest of cuDNN, "
        "flash and memory-efficient on a GPU (flash and math on a CPU) on the bucket's own attention calls, and "
        "kept beside the compile cache so a restart reuses it; 'default': PyTorch's own priority; a name: that "
        "backend first. Shown per bucket as 'attention' in /v1/buckets. Buckets on eager kernels always keep "
        "PyTorch's own choice (diffusers' bits).",
    )
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = Field(
        default="default",
        description="With kernels 'compiled': inductor's mode. 'max-autotune-no-cudagraphs' searches matmul "
        "configurations (much longer compiles: 7-16 s per matmul shape on an H200, and at FLUX.1's widths cuBLAS "
        "won every shape of 2,048 rows or more, docs/BENCHMARKS.md 2026-12-04). Modes that capture inductor's own "
        "CUDA graphs are not offered: bcg-serve owns the graphs.",
    )
    compile_decode: bool = Field(
        default=False,
        description="With kernels 'compiled' or 'fp8': compile the VAE decode per latent shape in a background "
        "thread, the first decode of each shape running eager, and keep it for the shapes where it passes the check "
        "against eager and measures faster (bcg_core/runners/decode.py; /v1/buckets kernels.decode). Off by "
        "default until measured in the server on a GPU.",
    )
    warmup_iters: int = Field(default=2, ge=1, le=10, description="Warm-up forwards before capture (with compiled "
                              "kernels and their check, one fewer: the check runs the compiled forward too).")
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
    decode_batch_images: int = Field(default=8, ge=1, le=256, description="Step scheduler: most images one VAE "
        "decode call takes; finished requests of one image size are decoded together, in a decode thread, overlapped "
        "with the next denoising steps.")
    encode_threads: int = Field(default=4, ge=1, le=64, description="Step scheduler: threads that encode decoded "
        "images to PNG (off the event loop and off the denoising and decode threads).")
    fair_wait_s: float = Field(default=2.0, ge=0.0, le=600.0, description="Step scheduler: a request that has waited "
        "this long for admission holds back every later request until it fits, so no request (a large one, a rare "
        "shape) waits without bound.")
    max_queue_wait_s: float | None = Field(default=300.0, gt=0.0, description="Step scheduler: a request that has "
        "waited this many seconds in the replica's queue without being admitted is answered 503 with Retry-After "
        "instead of waiting on (counted as expired). None: no deadline.")
    trim_idle_s: float | None = Field(default=1.0, ge=0.0, le=600.0, description="Step scheduler: once no request "
        "has been in flight for this many seconds, hand the C heap's free memory back to the OS (glibc malloc_trim; "
        "bcg_core/scheduler/memtrim.py says why: without it a CPU replica's memory at rest follows the largest "
        "requests served together). None: never.")
    mmap_threshold_bytes: int | None = Field(
        default=262144, ge=0, le=33554432,
        description="Replica and ingress processes: C heap allocations of at least this many bytes get their own "
        "mmap, given back to the OS when freed (glibc mallopt M_MMAP_THRESHOLD; bcg_core/scheduler/memtrim.py "
        "set_mmap_threshold says why and what it measured: without it glibc raises the threshold up to 32 MiB, and "
        "the memory of a mixed load at rest and under load kept growing). None: glibc's dynamic threshold.",
    )
    measure_costs: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Step scheduler: 'always' times, at prepare, each bucket's forward (a replay on CUDA) and the "
        "unpadded eager forward of each shape against row count, for the cost model; 'never' uses the token-count "
        "model (ms proportional to the tokens computed plus a launch cost per forward); 'auto' measures where "
        "graphs are captured (CUDA), elsewhere uses the token-count model (on a CPU padding never pays).",
    )
    fused_step: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Capture each image's classifier-free guidance combination and its flow-match Euler update in "
        "the bucket graph after the transformer: one replay is one denoising step (bcg_core/runners/fused.py; FLUX.1 "
        "and SD3 with FlowMatchEulerDiscreteScheduler). 'auto': where graphs are captured; 'always': also on the "
        "eager runner (CPU); 'never': guidance and scheduler step on the host. At start one step is run both ways "
        "and compared bit for bit; on any difference it stays off (/v1/buckets fused_step).",
    )


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
    """What the engine reads: model, bucket table, request limits, runner, quality steps, traffic recording.

    The serving layer's :class:`deployments.settings.ServeConfig` adds routing, autoscaling and API keys; the
    engine takes either (it reads only these sections).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    buckets: BucketConfig = Field(default_factory=BucketConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    traffic: TrafficConfig = Field(
        default_factory=TrafficConfig,
        description="Request shapes each replica records for bcg plan (traffic in /v1/buckets).",
    )
    quality: QualityConfig = Field(default_factory=QualityConfig, description="Steps of OpenAI's quality values.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters per request (off by default).")

    @model_validator(mode="after")
    def _reachable_buckets(self) -> EngineConfig:
        """Every bucket must be reachable by some valid request (else it only costs memory and start-up).

        Raises:
            ValueError: every resolution outside the limits, and batch sizes above the most rows, in one message.
        """
        lim = self.limits
        sides = dict(zip(self.buckets.resolutions, self.buckets.resolution_pairs()))
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
