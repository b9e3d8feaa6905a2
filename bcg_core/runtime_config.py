"""The ``runner:`` and ``scheduler:`` sections of the engine config: how a replica runs its bucket forwards
(capture, kernel tiers, compiles) and how its step scheduler admits, batches and finishes requests.

Split from :mod:`bcg_core.config` (which re-exports both) so that each section has room to grow. A key that moved
from ``runner:`` to ``scheduler:`` is refused under its old place with a message naming the new one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SCHEDULER_KEYS", "RunnerConfig", "SchedulerConfig"]

SCHEDULER_KEYS = ("max_rows_in_flight", "max_requests", "decode_batch_images", "encode_threads", "fair_wait_s",
                  "max_queue_wait_s", "trim_idle_s", "measure_costs")
"""Keys of :class:`SchedulerConfig` that were ``runner:`` keys before it had a section of its own."""


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
        "with torch.compile (inductor; one compile per token shape and batch class, runner.compile_batch_dynamic) "
        "and captures those kernels in the bucket's graph; 'fp8' is 'compiled' with the repeated blocks' linear "
        "layers in float8 through torchao (per-row scales; modulation, embedders and the final projection stay "
        "bf16; needs a GPU of compute capability 8.9 or newer, refused at start elsewhere). 'auto': 'compiled' on "
        "CUDA, 'eager' on a CPU. Every compiled bucket's forward is checked against its eager forward "
        "(runner.compile_rtol); a bucket whose compile fails, passes runner.compile_timeout_s or fails that check "
        "keeps eager kernels (noted and counted in /v1/buckets). Misses (unpadded forwards) always run eager "
        "kernels.",
    )
    ready_after_s: float | None = Field(
        default=20.0, ge=0.0, le=86400.0,
        description="A replica reports ready once this many seconds of capture have passed and at least one of its "
        "shapes is captured (largest first); the rest are captured in the background, their requests served by "
        "unpadded eager forwards meanwhile (deployments/dit.py); the cost model's timing of the shapes captured before "
        "ready runs after it too (the token-count stand-in prices them meanwhile). None: capture and time every shape "
        "before ready.",
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
        "the stated bound 0.25 (bcg_core/runners/fp8.py FP8_RTOL).",
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
    compile_batch_dynamic: bool = Field(
        default=False,
        description="With compiled kernels: the buckets of one token shape and more than one row share one compile, "
        "their batch dimension left dynamic (bcg_core/runners/kernels.py shared_batch); one row, and inputs too "
        "large for 32-bit indexing at any batch, compile per shape. Off by default: inside the server's CUDA graph "
        "capture on an H100 it failed (tests/gpu/test_kernels_gpu.py, docs/BENCHMARKS.md 2026-12-07 second entry); "
        "both causes are fixed and tested on the CPU (replays looked the shared compile up without the bucket's "
        "SDPA backend; the masked tier's mask kept a static batch) and tests/gpu/test_kernels_gpu.py now passes with "
        "it on an H100; it stays off until a server's cold start with it is measured. Alone it compiled 12 graphs in "
        "42.8 s instead of 24 in 65.9 s. False: one static compile per bucket shape.",
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
    mmap_threshold_bytes: int | None = Field(
        default=262144, ge=0, le=33554432,
        description="Replica and ingress processes: C heap allocations of at least this many bytes get their own "
        "mmap, given back to the OS when freed (glibc mallopt M_MMAP_THRESHOLD; bcg_core/scheduler/memtrim.py "
        "set_mmap_threshold says why and what it measured: without it glibc raises the threshold up to 32 MiB, and "
        "the memory of a mixed load at rest and under load kept growing). None: glibc's dynamic threshold.",
    )
    fused_step: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Capture each image's classifier-free guidance combination and its flow-match Euler update in "
        "the bucket graph after the transformer: one replay is one denoising step (bcg_core/runners/fused.py; FLUX.1 "
        "and SD3 with FlowMatchEulerDiscreteScheduler). 'auto': where graphs are captured; 'always': also on the "
        "eager runner (CPU); 'never': guidance and scheduler step on the host. At start one step is run both ways "
        "and compared bit for bit; on any difference it stays off (/v1/buckets fused_step).",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_to_scheduler(cls, data):
        """Refuse a step-scheduler key under ``runner:``, naming its new place (``scheduler:``).

        Raises:
            ValueError: ``runner.<key>`` for a key of :data:`SCHEDULER_KEYS`.
        """
        if isinstance(data, dict):
            moved = sorted(set(data) & set(SCHEDULER_KEYS))
            if moved:
                raise ValueError("; ".join(f"runner.{k} moved to scheduler.{k}" for k in moved)
                                 + ": the step scheduler's settings have a section of their own (scheduler:)")
        return data


class SchedulerConfig(BaseModel):
    """The step scheduler's settings (``bcg_core/scheduler/``): what is admitted, decoded and encoded together, how
    long a request may wait, when idle memory is trimmed, and whether forward costs are measured. Read by
    :meth:`~bcg_core.scheduler.step_scheduler.StepScheduler.from_pipeline` and the replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rows_in_flight: int = Field(
        default=64, ge=1, le=4096,
        description="Most transformer rows (images, x2 with classifier-free guidance) in flight "
        "per replica; a request that does not fit waits for admission (FIFO per shape). On CUDA admission "
        "is further bounded by measured memory. A single request larger than this runs alone.",
    )
    max_requests: int | None = Field(
        default=None, ge=1, le=100000,
        description="Requests a replica accepts (in flight plus waiting for admission; Ray "
        "Serve's max_ongoing_requests of the DiT deployment unless routing.max_ongoing_requests is set). "
        "None: 2 x max_rows_in_flight / rows of a default request (one set in flight, one waiting).",
    )
    decode_batch_images: int = Field(default=8, ge=1, le=256, description="Most images one VAE "
        "decode call takes; finished requests of one image size are decoded together, in a decode thread, overlapped "
        "with the next denoising steps. A video counts each of its frames (so videos are decoded one request at a "
        "time).")
    encode_threads: int = Field(default=4, ge=1, le=64, description="Threads that encode decoded "
        "images to PNG (off the event loop and off the denoising and decode threads).")
    fair_wait_s: float = Field(default=2.0, ge=0.0, le=600.0, description="A request that has waited "
        "this long for admission holds back every later request until it fits, so no request (a large one, a rare "
        "shape) waits without bound.")
    max_queue_wait_s: float | None = Field(default=300.0, gt=0.0, description="A request that has "
        "waited this many seconds in the replica's queue without being admitted is answered 503 with Retry-After "
        "instead of waiting on (counted as expired). None: no deadline.")
    trim_idle_s: float | None = Field(default=1.0, ge=0.0, le=600.0, description="Once no request "
        "has been in flight for this many seconds, hand the C heap's free memory back to the OS (glibc malloc_trim; "
        "bcg_core/scheduler/memtrim.py says why: without it a CPU replica's memory at rest follows the largest "
        "requests served together). None: never.")
    measure_costs: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="'always' times, at prepare, each bucket's forward (a replay on CUDA) and the "
        "unpadded eager forward of each shape against row count, for the cost model; 'never' uses the token-count "
        "model (ms proportional to the tokens computed plus a launch cost per forward); 'auto' measures where "
        "graphs are captured (CUDA), elsewhere uses the token-count model (on a CPU padding never pays).",
    )
