"""Every metric a DiT replica exports to Prometheus (:data:`METRICS`): its name, kind, tags, unit and description,
and which field of the stats each counter follows.

This is the exported contract: docs/OPERATIONS.md's "Metrics (Prometheus)" table lists every metric here by its
exported name (``ray_`` prefixed, ``_total`` on counters: :attr:`MetricSpec.exported`), which
tests/unit/test_prometheus.py checks. The exporter that pushes the values into Ray's metrics every second reads
this table (:class:`deployments.metrics.BucketExporter`, whose module docstring gives the tags and how counters,
gauges and the histogram are pushed). Apart from metrics.py so that the list reads on its own, apart from the push.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LORA_COUNTERS", "METRICS", "MetricSpec"]

_BUCKET = ("bucket", "shape")
"""Tags of a per-bucket metric: the bucket key (``b2_i1024_t256``) and its shape (``i1024_t256``), or ``miss``."""

LORA_COUNTERS = {"bcg_lora_requests": "requests", "bcg_lora_hits": "hits", "bcg_lora_loads": "loads",
                 "bcg_lora_load_seconds": "load_s", "bcg_lora_evictions": "evictions", "bcg_lora_refused": "refused",
                 "bcg_lora_timeouts": "timeouts", "bcg_lora_cancelled": "cancelled"}
"""The per-adapter counters and the key of ``stats()["lora"]["adapters"][name]`` each follows."""


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric.

    Attributes:
        name: the name given to Ray (Prometheus shows ``ray_`` + name, plus ``_total`` for a counter).
        kind: ``counter``, ``gauge`` or ``histogram``.
        tag_keys: our tags (Ray adds its own, see the module docstring).
        unit: the unit of the value.
        description: what it counts.
        field: for bucket counters, the key of a ``stats()["buckets"]`` entry it follows (None: derived).
    """

    name: str
    kind: str
    tag_keys: tuple[str, ...]
    unit: str
    description: str
    field: str | None = None

    @property
    def exported(self) -> str:
        """The name on Ray's Prometheus endpoint (histograms add ``_bucket``, ``_count`` and ``_sum``)."""
        return f"ray_{self.name}_total" if self.kind == "counter" else f"ray_{self.name}"


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("bcg_requests", "counter", _BUCKET, "requests",
               "Requests served (bucket=miss: requests no bucket held, run unpadded).", "requests"),
    MetricSpec("bcg_hits", "counter", _BUCKET, "requests", "Requests a bucket held (bucket hits).", "hits"),
    MetricSpec("bcg_misses", "counter", ("dim",), "requests",
               "Requests no bucket held, served unpadded, by the key dimension that missed (batch, image_tokens, "
               "text_tokens; a request missing in two dimensions counts in both)."),
    MetricSpec("bcg_forwards", "counter", (*_BUCKET, "mode"), "forwards",
               "Transformer forwards by mode: graph (CUDA graph replays), static_eager (eager on the bucket's "
               "static padded buffers: every bucket on a CPU), eager (unpadded)."),
    MetricSpec("bcg_captures", "counter", _BUCKET, "captures", "CUDA graph captures of the bucket.", "captures"),
    MetricSpec("bcg_bucket_faults", "counter", _BUCKET, "errors",
               "Runtime errors of the bucket's padded forward (e.g. a CUDA error mid-replay); after the first the "
               "bucket runs unpadded and eager.", "faults"),
    MetricSpec("bcg_step_cache_reused_rows", "counter", _BUCKET, "rows",
               "Rows of requests with a step cache in the bucket's steps that reused instead of computing: the "
               "remaining blocks' residual (First Block Cache) or the predicted output (TaylorSeer).",
               "cache_reused_rows"),
    MetricSpec("bcg_step_cache_computed_rows", "counter", _BUCKET, "rows",
               "Rows of requests with a step cache in the bucket's steps that computed (First Block Cache: the "
               "remaining blocks; TaylorSeer: the whole forward).", "cache_computed_rows"),
    MetricSpec("bcg_capture_seconds", "counter", _BUCKET, "seconds",
               "Seconds spent capturing the bucket's CUDA graph (warm-up forwards included).", "capture_s"),
    MetricSpec("bcg_real_tokens", "counter", _BUCKET, "tokens",
               "Real (requested) tokens per forward, summed over requests: rows x (image + text tokens).",
               "real_tokens"),
    MetricSpec("bcg_padded_tokens", "counter", _BUCKET, "tokens",
               "Computed (padded) tokens per forward, summed over requests (a batched request counts its share).",
               "padded_tokens"),
    MetricSpec("bcg_step_time_ms", "counter", _BUCKET, "milliseconds",
               "Total milliseconds of denoising steps (exact; the histogram's _sum is approximated by Ray)."),
    MetricSpec("bcg_step_latency_ms", "histogram", _BUCKET, "milliseconds",
               "Milliseconds per denoising step (transformer forward + guidance + scheduler update)."),
    MetricSpec("bcg_graph_pool_bytes", "gauge", _BUCKET, "bytes",
               "CUDA graph memory pool growth measured when the bucket was captured (0 on a CPU).", "pool_bytes"),
    MetricSpec("bcg_padded_token_ratio", "gauge", _BUCKET, "ratio",
               "padded_tokens / real_tokens since start (1.0: no padding); set once the bucket served a request.",
               "padded_token_ratio"),
    MetricSpec("bcg_queue_length", "gauge", ("shape",), "requests",
               "Requests waiting or running in the replica's scheduler, per bucket shape."),
    MetricSpec("bcg_sched_rows_in_flight", "gauge", ("shape",), "rows",
               "Step scheduler: transformer rows of the requests in flight (shape=miss: misses)."),
    MetricSpec("bcg_sched_waiting", "gauge", ("shape",), "requests",
               "Step scheduler: requests waiting for admission."),
    MetricSpec("bcg_sched_forwards", "counter", ("shape", "kind"), "forwards",
               "Step scheduler: forwards by kind: graph (a step's only forward, on a bucket), split (a bucket "
               "forward of a step split into several), eager (unpadded: a miss, or the cost model's choice)."),
    MetricSpec("bcg_sched_decisions", "counter", ("shape", "decision"), "steps",
               "Step scheduler: steps by the cost model's decision: fill (one full bucket), pad (one bucket with "
               "padded rows), split (several forwards), eager (any unpadded chunk)."),
    MetricSpec("bcg_sched_fill", "gauge", ("shape",), "ratio",
               "Step scheduler: real rows / bucket rows over every bucket forward since start (1.0: no padded rows)."),
    MetricSpec("bcg_sched_padded_token_waste", "gauge", ("shape",), "ratio",
               "Step scheduler: 1 - real / computed tokens over every forward since start (0.0: no padding)."),
    MetricSpec("bcg_sched_queue_wait_ms", "counter", ("shape",), "milliseconds",
               "Step scheduler: total milliseconds admitted requests waited for admission (divide by "
               "bcg_sched_admitted for the mean)."),
    MetricSpec("bcg_sched_admitted", "counter", ("shape",), "requests", "Step scheduler: requests admitted."),
    MetricSpec("bcg_sched_requests", "counter", ("shape", "outcome"), "requests",
               "Step scheduler: requests that ended, by outcome: completed, cancelled (after admission), "
               "cancelled_waiting (before admission), failed."),
    MetricSpec("bcg_sched_queue_wait_p99_ms", "gauge", ("shape",), "milliseconds",
               "Step scheduler: p99 of the last 1024 admission waits."),
    MetricSpec("bcg_traffic_requests", "counter", ("size", "n", "steps", "text"), "requests",
               "Requests accepted, by requested shape: size WxH pixels, n images, steps, and the text bucket "
               "holding the prompt's tokens (over: above every text bucket); at most traffic.max_shapes label sets."),
    MetricSpec("bcg_traffic_dropped", "counter", (), "requests",
               "Requests accepted whose shape was not kept: the traffic histogram already held "
               "traffic.max_shapes shapes."),
    MetricSpec("bcg_plan_recorded_waste", "gauge", (), "fraction",
               "Padded-token waste the table would serve the recorded traffic with (last drift check; needs "
               "buckets.plan, written by bcg plan)."),
    MetricSpec("bcg_plan_drift_gain", "gauge", (), "fraction",
               "Share of the GPU time per image a new plan of the recorded traffic would save, set when that traffic "
               "drifted from the plan (over 1.5x its padded-token waste); 0 otherwise. Advice only."),
    MetricSpec("bcg_compile_swaps", "counter", (), "buckets", "Buckets compiled in the background and swapped in."),
    MetricSpec("bcg_compiles_pending", "gauge", (), "buckets",
               "Buckets serving eager kernels until their background compile swaps compiled ones in."),
    MetricSpec("bcg_lora_requests", "counter", ("adapter",), "requests",
               "LoRA: requests that named the adapter (lora.dir set)."),
    MetricSpec("bcg_lora_hits", "counter", ("adapter",), "requests",
               "LoRA: requests that found the adapter resident in a slot (no load)."),
    MetricSpec("bcg_lora_loads", "counter", ("adapter",), "loads",
               "LoRA: loads of the adapter into a slot (read from lora.dir or the host cache, copied to the device)."),
    MetricSpec("bcg_lora_load_seconds", "counter", ("adapter",), "seconds",
               "LoRA: seconds spent copying the adapter into its slots (divide by bcg_lora_loads for the mean)."),
    MetricSpec("bcg_lora_evictions", "counter", ("adapter",), "evictions",
               "LoRA: times the adapter was evicted from its slot (least recently used, unpinned) for another."),
    MetricSpec("bcg_lora_refused", "counter", ("adapter",), "requests",
               "LoRA: requests refused because the adapter's file cannot be served (HTTP 422)."),
    MetricSpec("bcg_lora_timeouts", "counter", ("adapter",), "requests",
               "LoRA: requests answered 503 because the adapter was not loaded within lora.load_timeout_s (every "
               "slot pinned by requests in flight, or loads queued behind others or slow to read)."),
    MetricSpec("bcg_lora_cancelled", "counter", ("adapter",), "requests",
               "LoRA: requests whose client gave up while waiting for the adapter to load."),
    MetricSpec("bcg_lora_slots_resident", "gauge", (), "adapters",
               "LoRA: adapters resident in the replica's slots (at most lora.slots)."),
    MetricSpec("bcg_lora_slots_pinned", "gauge", (), "slots",
               "LoRA: slots pinned by requests in flight (a pinned slot is never evicted)."),
)
"""Every metric the exporter pushes, in the order of docs/OPERATIONS.md's table."""
