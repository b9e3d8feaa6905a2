"""Prometheus export of the per-bucket counters: a small exporter each DiT replica runs every second.

The engine counts (:class:`bcg_core.metrics.BucketMetrics`, no Ray); this module pushes those counts into Ray's
metrics (``ray.serve.metrics``: ``ray.util.metrics`` with the Serve tags ``deployment``, ``replica`` and
``application`` added inside a replica), which Ray's per-node metrics agent serves to Prometheus. Every push reads
:meth:`bcg_core.pipeline.DiTPipeline.stats` (the very dict ``GET /v1/buckets`` answers, so both show the same
numbers), the step latencies recorded since the last push, and the step scheduler's queue lengths, then:

- counters are increased by the difference to what was pushed last (never decreased: a counter that went down,
  which cannot happen within one replica, only resets the baseline);
- gauges are set to the current value (every push, so Ray's agent never ages them out);
- the step-latency histogram observes every step latency recorded since the last push (exact counts per
  bucket; Ray 2.60's agent approximates the exported ``_sum`` from bucket midpoints, so the exact total is
  also exported as the counter ``bcg_step_time_ms``).

Tags: ``bucket`` is the bucket key (``b2_i1024_t256``) and ``shape`` the key without its batch dimension
(``i1024_t256``); requests no bucket held (run unpadded under the eager miss policy) are tagged
``bucket="miss", shape="miss"``. The traffic counters (``bcg_traffic_*``, from the replica's
:class:`~bcg_core.planning.traffic.TrafficHistogram`) are tagged by the requested shape instead: ``size`` (``"WxH"``),
``n``, ``steps`` and ``text`` (the text bucket holding the prompt's tokens, or ``over``); their label sets
are bounded by ``traffic.max_shapes``. The LoRA counters (``bcg_lora_*``, from the ``lora`` section of the stats,
:meth:`bcg_core.lora.slots.AdapterSlots.describe`) are tagged ``adapter``, the adapter's name, and exported only for
adapters that exist in ``lora.dir`` (loaded at least once, or found there by path): a name a caller made up never
becomes a series. Ray adds ``deployment``, ``replica``, ``application`` (Serve) and its own node tags.
:data:`~deployments.metric_specs.METRICS` (deployments/metric_specs.py) lists every metric; ``docs/OPERATIONS.md``
("Metrics (Prometheus)") gives the exported names (``ray_`` prefixed).

An exception while pushing is logged (the first few, then one in 60) and the next push retries: the exporter
never stops the replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from bcg_core.keys import BucketKey
from bcg_core.metrics import FORWARD_MODES, STEP_MS_BOUNDS, BucketMetrics
from bcg_core.planning.traffic import text_bucket

from .metric_specs import LORA_COUNTERS, METRICS

__all__ = ["EXPORT_PERIOD_S", "MAX_ADAPTER_CHECKS", "MISS", "BucketExporter", "MetricsBackend", "RayMetricsBackend",
           "metrics_url"]

logger = logging.getLogger("ray.serve")

EXPORT_PERIOD_S = 1.0
"""Seconds between two pushes of a replica's counters into Ray's metrics."""

MISS = "miss"
"""``bucket`` and ``shape`` tag of requests no bucket held (run unpadded and eager)."""

MAX_ADAPTER_CHECKS = 4096
"""Most never-loaded adapter names looked up in ``lora.dir`` (once each); later ones are exported once loaded."""


class MetricsBackend(Protocol):
    """Makes metric objects: ``counter(...).inc(value, tags)``, ``gauge(...).set(value, tags)``,
    ``histogram(...).observe(value, tags)`` (the ``ray.util.metrics`` interface)."""

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        """A counter."""
        ...

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        """A gauge."""
        ...

    def histogram(self, name: str, description: str, boundaries: list[float], tag_keys: tuple[str, ...]) -> Any:
        """A histogram with bucket upper bounds ``boundaries``."""
        ...


class RayMetricsBackend:
    """``ray.serve.metrics``: ``ray.util.metrics`` that add ``deployment``, ``replica`` and ``application`` tags when
    made inside a Serve replica (outside one they are plain ``ray.util.metrics``)."""

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        """A ``ray.serve.metrics.Counter``."""
        from ray.serve import metrics

        return metrics.Counter(name, description=description, tag_keys=tag_keys)

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        """A ``ray.serve.metrics.Gauge``."""
        from ray.serve import metrics

        return metrics.Gauge(name, description=description, tag_keys=tag_keys)

    def histogram(self, name: str, description: str, boundaries: list[float], tag_keys: tuple[str, ...]) -> Any:
        """A ``ray.serve.metrics.Histogram``."""
        from ray.serve import metrics

        return metrics.Histogram(name, description=description, boundaries=boundaries, tag_keys=tag_keys)


def _shape_of(key: str) -> str:
    return MISS if key == MISS else BucketKey.parse(key).shape


class BucketExporter:
    """Pushes one replica's bucket counters into Ray's metrics (see the module docstring).

    Args:
        stats: returns :meth:`DiTPipeline.stats`-shaped dicts: ``buckets`` (entries with ``key`` and the counter
            fields of :data:`~deployments.metric_specs.METRICS`, ``forwards_by_mode``, ``pool_bytes``,
            ``padded_token_ratio``) and ``misses`` (``requests``, ``by_dim``, ``forwards_by_mode``, ``real_tokens``,
            ``padded_tokens``).
        metrics: the counters whose step latencies (:meth:`BucketMetrics.step_samples`) feed the histogram.
        queue_lengths: returns requests waiting or running per bucket shape.
        shapes: every bucket shape of the table (a queue gauge is set for each, 0 when empty).
        backend: makes the metric objects; default :class:`RayMetricsBackend`.
        scheduler_stats: returns :meth:`bcg_core.scheduler.step_scheduler.StepScheduler.stats` (the ``bcg_sched_*``
            metrics), or None (no ``bcg_sched_*`` metrics).
        traffic: returns a :meth:`bcg_core.planning.traffic.TrafficHistogram.snapshot` (the ``bcg_traffic_*`` metrics),
            or None (or returns None) when the replica does not record traffic.
        text_lengths: the table's text buckets (``buckets.text_lengths``), for the ``text`` tag.
        drift: returns the replica's last :func:`bcg_core.planning.drift.drift_report` (the ``bcg_plan_*`` gauges),
            or None before its first drift check.
        adapter_exists: ``name -> bool``, whether adapter ``name`` has a file in ``lora.dir`` (a never-loaded
            adapter's ``bcg_lora_*`` series are exported only then); None: only adapters that loaded are exported.
    """

    def __init__(self, stats: Callable[[], dict], metrics: BucketMetrics,
                 queue_lengths: Callable[[], dict[str, int]] = dict, shapes: Iterable[str] = (),
                 backend: MetricsBackend | None = None, scheduler_stats: Callable[[], dict] | None = None,
                 traffic: Callable[[], dict | None] | None = None, text_lengths: Iterable[int] = (),
                 drift: Callable[[], dict | None] | None = None,
                 adapter_exists: Callable[[str], bool] | None = None):
        self._stats = stats
        self._adapter_exists = adapter_exists
        self._adapters: dict[str, bool] = {}  # adapter name -> exported (checked once; loaded ones always)
        self._drift = drift
        self._scheduler_stats = scheduler_stats
        self._traffic = traffic
        self._text_lengths = tuple(sorted(text_lengths))
        self._metrics = metrics
        self._queue_lengths = queue_lengths
        self._shapes = sorted(set(shapes))
        backend = backend or RayMetricsBackend()
        self._m: dict[str, Any] = {}
        for spec in METRICS:
            if spec.kind == "counter":
                self._m[spec.name] = backend.counter(spec.name, spec.description, spec.tag_keys)
            elif spec.kind == "gauge":
                self._m[spec.name] = backend.gauge(spec.name, spec.description, spec.tag_keys)
            else:
                self._m[spec.name] = backend.histogram(spec.name, spec.description, list(STEP_MS_BOUNDS),
                                                       spec.tag_keys)
        self._pushed: dict[tuple, float] = {}  # (metric, tags) -> cumulative value pushed so far
        self._cursor = 0  # last step sample observed
        self.period_s = EXPORT_PERIOD_S
        self.pushes = 0
        self.errors = 0
        self.lost_samples = 0
        self.last_error: str | None = None

    @classmethod
    def for_replica(cls, pipeline, scheduler, backend: MetricsBackend | None = None,
                    traffic=None, drift: Callable[[], dict | None] | None = None) -> BucketExporter:
        """The exporter of a DiT replica: ``pipeline.stats``, ``pipeline.metrics``, the step scheduler's
        ``queue_lengths`` and ``stats``, ``traffic.snapshot`` of the replica's
        :class:`~bcg_core.planning.traffic.TrafficHistogram` (None: no ``bcg_traffic_*`` increments), and with
        ``lora.dir`` the adapter folder's lookup by name (:meth:`bcg_core.lora.files.AdapterFiles.path`)."""
        shapes = {k.shape for k in pipeline.table.keys}
        slots = getattr(pipeline, "lora", None)
        exists = _adapter_lookup(slots.files) if slots is not None else None
        return cls(pipeline.stats, pipeline.metrics, scheduler.queue_lengths, shapes, backend, scheduler.stats,
                   traffic.snapshot if traffic is not None else None, pipeline.table.text_lengths, drift, exists)

    # -- one push ---------------------------------------------------------------------------------------

    def _inc(self, name: str, tags: dict[str, str], total: float) -> None:
        """Raise counter ``name`` at ``tags`` to the cumulative ``total`` (by the difference; never down)."""
        key = (name, tuple(sorted(tags.items())))
        before = self._pushed.get(key, 0)
        delta = total - before
        if delta > 1e-9:
            self._m[name].inc(delta, tags=tags)
            self._pushed[key] = total
        elif delta < -1e-9:  # a counter went down: only a new baseline, never a negative increment
            logger.warning("metric %s%s went down from %s to %s; not exported", name, tags, before, total)
            self._pushed[key] = total

    def push(self) -> None:
        """Push everything once (counters by difference, gauges set, new step latencies observed).

        Raises:
            Exception: whatever reading the stats or recording a metric raised (:meth:`run` logs it).
        """
        stats = self._stats()
        misses = stats.get("misses", {})
        rows = list(stats.get("buckets", []))
        rows.append({"key": MISS, "requests": misses.get("requests", 0), "hits": 0,
                     "forwards_by_mode": misses.get("forwards_by_mode", {}),
                     "real_tokens": misses.get("real_tokens", 0), "padded_tokens": misses.get("padded_tokens", 0),
                     "step_latency_ms": misses.get("step_latency_ms", {}),
                     "cache_reused_rows": misses.get("cache_reused_rows", 0),
                     "cache_computed_rows": misses.get("cache_computed_rows", 0)})
        for row in rows:
            tags = {"bucket": row["key"], "shape": _shape_of(row["key"])}
            for spec in METRICS:
                if spec.kind == "counter" and spec.field is not None and spec.field in row:
                    self._inc(spec.name, tags, row[spec.field] or 0)
            for mode in FORWARD_MODES:
                self._inc("bcg_forwards", {**tags, "mode": mode}, row.get("forwards_by_mode", {}).get(mode, 0))
            self._inc("bcg_step_time_ms", tags, (row.get("step_latency_ms") or {}).get("sum", 0.0))
            if row["key"] != MISS:
                self._m["bcg_graph_pool_bytes"].set(int(row.get("pool_bytes") or 0), tags=tags)
            if row.get("padded_token_ratio") is not None:
                self._m["bcg_padded_token_ratio"].set(float(row["padded_token_ratio"]), tags=tags)
        for dim, n in sorted(misses.get("by_dim", {}).items()):
            self._inc("bcg_misses", {"dim": dim}, n)
        queue = self._queue_lengths()
        for shape in sorted(set(self._shapes) | set(queue)):
            self._m["bcg_queue_length"].set(int(queue.get(shape, 0)), tags={"shape": shape})
        if self._scheduler_stats is not None:
            self._push_scheduler(self._scheduler_stats())
        traffic = self._traffic() if self._traffic is not None else None
        if traffic is not None:
            self._push_traffic(traffic)
        if stats.get("lora") is not None:
            self._push_lora(stats["lora"])
        drift = self._drift() if self._drift is not None else None
        if drift is not None and drift.get("recorded_waste") is not None:
            self._m["bcg_plan_recorded_waste"].set(float(drift["recorded_waste"]), tags={})
            self._m["bcg_plan_drift_gain"].set(float(drift.get("gain") or 0.0), tags={})
        last, samples, lost = self._metrics.step_samples(self._cursor)
        self._cursor = last  # at most once: a failing observe below never observes a step twice
        if lost:
            self.lost_samples += lost
            logger.warning("%d step latencies were dropped before export (more than %d per push)", lost,
                           len(samples))
        histogram = self._m["bcg_step_latency_ms"]
        for key, ms in samples:
            k = MISS if key is None else str(key)
            histogram.observe(float(ms), tags={"bucket": k, "shape": _shape_of(k)})
        self.pushes += 1

    def _push_scheduler(self, sched: dict) -> None:
        """The ``bcg_sched_*`` metrics from one :meth:`StepScheduler.stats` snapshot (every table shape gets
        its gauges, 0 when idle)."""
        shapes = sched.get("shapes", {})
        for shape in sorted(set(self._shapes) | set(shapes)):
            row = shapes.get(shape, {})
            tags = {"shape": shape}
            self._m["bcg_sched_rows_in_flight"].set(int(row.get("rows_in_flight", 0)), tags=tags)
            self._m["bcg_sched_waiting"].set(int(row.get("waiting", 0)), tags=tags)
            for kind, n in row.get("forwards", {}).items():
                self._inc("bcg_sched_forwards", {**tags, "kind": kind}, n)
            for decision, n in row.get("decisions", {}).items():
                self._inc("bcg_sched_decisions", {**tags, "decision": decision}, n)
            if row.get("fill") is not None:
                self._m["bcg_sched_fill"].set(float(row["fill"]), tags=tags)
            self._m["bcg_sched_padded_token_waste"].set(float(row.get("padded_token_waste", 0.0)), tags=tags)
            wait = row.get("queue_wait_ms", {})
            admitted = int(row.get("admitted", 0))
            self._inc("bcg_sched_admitted", tags, admitted)
            for outcome in ("completed", "cancelled", "cancelled_waiting", "failed"):
                self._inc("bcg_sched_requests", {**tags, "outcome": outcome}, int(row.get(outcome, 0)))
            self._inc("bcg_sched_queue_wait_ms", tags, float(wait.get("sum", 0.0)))
            if wait.get("p99") is not None:
                self._m["bcg_sched_queue_wait_p99_ms"].set(float(wait["p99"]), tags=tags)
        compiles = sched.get("background_compiles") or {}
        self._inc("bcg_compile_swaps", {}, int(compiles.get("swapped", 0)))
        self._m["bcg_compiles_pending"].set(int(compiles.get("pending", 0)), tags={})

    def _push_traffic(self, snap: dict) -> None:
        """``bcg_traffic_requests`` and ``bcg_traffic_dropped`` from one traffic snapshot: the shapes' counts
        summed per tag set (keys differing only in prompt tokens within one text bucket share a series)."""
        totals: dict[tuple[str, str, str, str], int] = {}
        for s in snap.get("shapes", ()):
            tags = (f"{s['width']}x{s['height']}", str(s["n"]), str(s["steps"]),
                    text_bucket(s["text_tokens"], self._text_lengths))
            totals[tags] = totals.get(tags, 0) + int(s["count"])
        for (size, n, steps, text), count in sorted(totals.items()):
            self._inc("bcg_traffic_requests", {"size": size, "n": n, "steps": steps, "text": text}, count)
        self._inc("bcg_traffic_dropped", {}, int(snap.get("dropped", 0)))

    def _exported_adapter(self, name: str, counts: dict) -> bool:
        """Whether adapter ``name``'s series are exported: it loaded at least once (so its file existed), or
        ``adapter_exists`` finds its file (asked once per name, for at most :data:`MAX_ADAPTER_CHECKS` names)."""
        known = self._adapters.get(name)
        if known:
            return True
        if counts.get("loads"):
            self._adapters[name] = True
            return True
        if known is not None or self._adapter_exists is None or len(self._adapters) >= MAX_ADAPTER_CHECKS:
            return False
        try:
            found = bool(self._adapter_exists(name))
        except Exception:  # noqa: BLE001 - a failing lookup exports nothing for the name
            found = False
        self._adapters[name] = found
        return found

    def _push_lora(self, lora: dict) -> None:
        """The ``bcg_lora_*`` metrics from the ``lora`` section of the stats
        (:meth:`bcg_core.lora.slots.AdapterSlots.describe`)."""
        for name, counts in sorted((lora.get("adapters") or {}).items()):
            if not self._exported_adapter(name, counts):
                continue
            tags = {"adapter": name}
            for metric, key in LORA_COUNTERS.items():
                self._inc(metric, tags, float(counts.get(key) or 0))
        self._m["bcg_lora_slots_resident"].set(len(lora.get("resident") or {}), tags={})
        self._m["bcg_lora_slots_pinned"].set(len(lora.get("pinned") or {}), tags={})

    # -- the background task ----------------------------------------------------------------------------

    async def run(self, period_s: float = EXPORT_PERIOD_S) -> None:
        """Push every ``period_s`` seconds until cancelled; an exception is logged and the next push retries."""
        self.period_s = period_s
        while True:
            await asyncio.sleep(period_s)
            self.push_logged()

    def push_logged(self) -> bool:
        """:meth:`push`, logging an exception instead of raising it (the first 3, then one in 60).

        Returns:
            True when the push succeeded.
        """
        try:
            self.push()
            return True
        except Exception as e:  # noqa: BLE001 - exporting must never stop the replica
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"[:300]
            if self.errors <= 3 or self.errors % 60 == 0:
                logger.exception("metrics export failed (%d failures so far); retrying", self.errors)
            return False

    def status(self) -> dict:
        """``pushes``, ``errors``, ``last_error``, ``lost_samples`` (step latencies dropped before export) and
        ``period_s`` (seconds between pushes)."""
        return {"pushes": self.pushes, "errors": self.errors, "last_error": self.last_error,
                "lost_samples": self.lost_samples, "period_s": self.period_s}


def _adapter_lookup(files) -> Callable[[str], bool]:
    """``name -> bool``: whether ``files`` (:class:`~bcg_core.lora.files.AdapterFiles`) holds adapter ``name``."""
    from bcg_core.lora.files import AdapterError

    def exists(name: str) -> bool:
        try:
            files.path(name)
        except AdapterError:
            return False
        return True

    return exists


def metrics_url(node_id: str | None = None) -> str | None:
    """``http://ADDRESS:PORT/metrics`` of a Ray node's Prometheus exporter, or None when it does not run
    (``MetricsExportPort`` of ``ray.nodes()`` unset or -1) or the node is not known.

    Args:
        node_id: the node (hex id, as ``ray.get_runtime_context().get_node_id()``); None: the first alive node,
            which is the only one of a server started by :func:`deployments.cli.local.start_local`.

    The address is the node IP: 127.0.0.1 on a loopback node; with ``metrics.host: 0.0.0.0`` the machine's
    address (the exporter then listens on every interface).
    """
    import ray

    node = next((n for n in ray.nodes() if n.get("Alive") and node_id in (None, n.get("NodeID"))), None)
    port = (node or {}).get("MetricsExportPort")
    if not port or port < 0:
        return None
    return f"http://{node['NodeManagerAddress']}:{port}/metrics"
