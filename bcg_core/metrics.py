"""Per-bucket counters that know nothing of Ray (deployments export them through ``ray.util.metrics``).

Counted per request: requests, hits, real vs padded tokens (padding waste), latency. Counted per
forward: forwards by how they ran (:data:`FORWARD_MODES`: ``graph`` replays, ``static_eager``, unpadded
``eager``). Counted per denoising step: its latency in milliseconds, in a histogram with the bucket
boundaries :data:`STEP_MS_BOUNDS`. Counted per CUDA graph capture: captures and capture seconds. Misses
are counted by the key dimension that missed.

The step scheduler runs rows of several requests of one bucket shape in one forward per step. Each request
counts its own real tokens and a share of its first step's padded tokens proportional to its rows
(:func:`token_shares`).
"""

from __future__ import annotations

import bisect
import enum
import threading
from collections import Counter, deque
from dataclasses import dataclass, field, replace

from bcg_core.keys import BucketKey, Dim
from bcg_core.table import BucketLookup

__all__ = ["BucketCounters", "BucketMetrics", "FORWARD_MODES", "ForwardMode", "STEP_MS_BOUNDS", "STEP_SAMPLE_LIMIT",
           "histogram_quantile", "token_shares"]

class ForwardMode(str, enum.Enum):
    """How a transformer forward ran (a ``str``: its value is the ``forwards_by_mode`` key and the Prometheus tag)."""

    GRAPH = "graph"
    """Replayed the bucket's CUDA graph."""
    STATIC_EAGER = "static_eager"
    """Ran eagerly on the bucket's static padded buffers (every bucket on a CPU, a bucket whose capture failed or
    was over budget)."""
    EAGER = "eager"
    """Ran unpadded (a miss, a bucket dropped after an out-of-memory capture, an unprepared bucket, or the cost
    model's choice)."""

    @property
    def padded(self) -> bool:
        """True when the forward ran on a bucket's padded buffers."""
        return self is not ForwardMode.EAGER


FORWARD_MODES = tuple(m.value for m in ForwardMode)
""":class:`ForwardMode` values, in order."""

STEP_MS_BOUNDS: tuple[float, ...] = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750,
                                     1000, 2000, 5000, 10000)
"""Upper bounds (milliseconds, inclusive, as Prometheus ``le``) of the step-latency histogram bins; one more bin,
``+Inf``, holds slower steps."""

STEP_SAMPLE_LIMIT = 65536
"""Most step latencies kept for :meth:`BucketMetrics.step_samples` (older ones are dropped first)."""


@dataclass
class BucketCounters:
    """Counters of one bucket (or of the miss path when ``key`` is None).

    ``real_tokens`` and ``padded_tokens`` are per transformer forward, summed over requests:
    ``rows * (image_tokens + text_tokens)`` of the request and of its bucket (for a request that shared
    its forward with others, its share of the bucket's tokens, see :func:`token_shares`).
    ``forwards`` counts every transformer forward; ``replays`` those that replayed a CUDA graph and
    ``unpadded_forwards`` those that ran unpadded and eager (the rest ran eagerly on static buffers).
    ``captures`` counts CUDA graph captures and ``capture_s`` their seconds. ``faults`` counts runtime errors
    of the bucket's padded forward after which it runs unpadded and eager (:func:`bcg_core.runners.base.demote`).
    ``steps``, ``step_ms_sum`` (milliseconds) and ``step_ms_bins`` (non-cumulative counts per bin of
    :data:`STEP_MS_BOUNDS`, then ``+Inf``) describe the latency of the denoising steps run on the bucket.
    ``cache_reused_rows`` and ``cache_computed_rows`` count the rows of requests with a step cache in the bucket's
    steps (:mod:`bcg_core.step_cache`), by whether they reused (First Block Cache: the remaining blocks' residual;
    TaylorSeer: the predicted output) or computed; a row of an unpadded chunk counts under its shape's bucket.
    """

    requests: int = 0
    hits: int = 0
    forwards: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    latency_ms_sum: float = 0.0
    replays: int = 0
    unpadded_forwards: int = 0
    captures: int = 0
    capture_s: float = 0.0
    faults: int = 0
    steps: int = 0
    step_ms_sum: float = 0.0
    step_ms_bins: list[int] = field(default_factory=lambda: [0] * (len(STEP_MS_BOUNDS) + 1))
    cache_reused_rows: int = 0
    cache_computed_rows: int = 0

    @property
    def padding_waste_pct(self) -> float:
        """Share of computed tokens that were padding: ``100 * (1 - real / padded)``; 0 with no traffic."""
        return 100.0 * (1.0 - self.real_tokens / self.padded_tokens) if self.padded_tokens else 0.0

    @property
    def mean_latency_ms(self) -> float:
        """Mean end-to-end latency of this bucket's requests in milliseconds; 0 with no traffic."""
        return self.latency_ms_sum / self.requests if self.requests else 0.0

    @property
    def padded_token_ratio(self) -> float | None:
        """Computed tokens per real token, ``padded_tokens / real_tokens`` (1.0: no padding; 1.25: a quarter
        more tokens computed than requested); None with no traffic."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else None

    @property
    def forwards_by_mode(self) -> dict[str, int]:
        """Forwards by :data:`FORWARD_MODES`: ``graph`` (replays), ``static_eager``, ``eager`` (unpadded)."""
        return {ForwardMode.GRAPH.value: self.replays,
                ForwardMode.STATIC_EAGER.value: self.forwards - self.replays - self.unpadded_forwards,
                ForwardMode.EAGER.value: self.unpadded_forwards}

    def step_latency(self) -> dict:
        """JSON-ready step latency: ``count``, ``sum`` and ``mean`` (milliseconds), ``p50`` and ``p95``
        (milliseconds, interpolated within the histogram bins as Prometheus' ``histogram_quantile`` does; None
        with no steps) and ``buckets``: cumulative counts by upper bound (``"0.5"``, ``"1.0"`` ... ``"10000.0"``,
        ``"+Inf"``), the ``le`` labels and values of the exported histogram."""
        cumulative, n = {}, 0
        for bound, c in zip([*STEP_MS_BOUNDS, float("inf")], self.step_ms_bins, strict=True):
            n += c
            cumulative["+Inf" if bound == float("inf") else str(float(bound))] = n
        return {
            "count": self.steps, "sum": round(self.step_ms_sum, 3),
            "mean": round(self.step_ms_sum / self.steps, 3) if self.steps else 0.0,
            "p50": _round(histogram_quantile(0.5, self.step_ms_bins)),
            "p95": _round(histogram_quantile(0.95, self.step_ms_bins)), "buckets": cumulative,
        }


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def histogram_quantile(q: float, bins: list[int], bounds: tuple[float, ...] = STEP_MS_BOUNDS) -> float | None:
    """The ``q`` quantile (0..1) of a histogram, interpolated linearly within its bin (Prometheus'
    ``histogram_quantile``; the first bin starts at 0 and a quantile in ``+Inf`` is the last finite bound).

    Args:
        q: the quantile, 0..1.
        bins: non-cumulative counts per bin of ``bounds``, then ``+Inf`` (``len(bounds) + 1`` counts).
        bounds: bin upper bounds, ascending.

    Returns:
        The quantile in the unit of ``bounds``; None for an empty histogram.
    """
    total = sum(bins)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, c in enumerate(bins):
        if c and seen + c >= rank:
            if i == len(bounds):
                return float(bounds[-1])
            lo = 0.0 if i == 0 else float(bounds[i - 1])
            return lo + (float(bounds[i]) - lo) * max(0.0, rank - seen) / c
        seen += c
    return float(bounds[-1])


def token_shares(total: int, rows: list[int]) -> list[int]:
    """Split ``total`` tokens among requests in proportion to their ``rows``, summing exactly to ``total``.

    Shares are floored and the remainder goes one token at a time to the largest fractional parts (ties:
    earlier requests first), so a request alone gets ``total`` and equal rows get shares within one token.

    Raises:
        ValueError: no rows, or a row count below 1.
    """
    if not rows or min(rows) < 1:
        raise ValueError(f"rows must be a non-empty list of positive counts, got {rows}")
    whole = sum(rows)
    shares = [total * r // whole for r in rows]
    order = sorted(range(len(rows)), key=lambda i: (-(total * rows[i] % whole), i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares


class BucketMetrics:
    """Thread-safe per-bucket counters for one replica.

    Args:
        keys: every bucket of the table (listed in :meth:`snapshot` even with no traffic).
    """

    def __init__(self, keys: list[BucketKey]):
        self._lock = threading.Lock()
        self._buckets: dict[BucketKey, BucketCounters] = {k: BucketCounters() for k in keys}
        self._miss = BucketCounters()
        self._miss_by_dim: Counter[str] = Counter({d.value: 0 for d in Dim})
        self._samples: deque[tuple[int, BucketKey | None, float]] = deque(maxlen=STEP_SAMPLE_LIMIT)
        self._sample_seq = 0

    def _of(self, key: BucketKey | None) -> BucketCounters:
        """The counters of ``key`` (None: the miss path); call with the lock held."""
        return self._buckets.setdefault(key, BucketCounters()) if key is not None else self._miss

    def record_request(self, lookup: BucketLookup, latency_ms: float, padded_tokens: int | None = None) -> None:
        """Count one served request that went through ``lookup``.

        Args:
            lookup: the request's own query and the bucket its first step was counted under.
            latency_ms: end-to-end latency of the request.
            padded_tokens: the request's share of the forward's padded tokens (:func:`token_shares`);
                None: the whole forward's (``lookup.padded_tokens``), for a request that ran alone.
        """
        with self._lock:
            c = self._buckets.setdefault(lookup.key, BucketCounters()) if lookup.hit else self._miss
            c.requests += 1
            c.hits += int(lookup.hit)
            c.real_tokens += lookup.query.tokens
            c.padded_tokens += lookup.padded_tokens if padded_tokens is None else padded_tokens
            c.latency_ms_sum += latency_ms
            for d in lookup.missed:
                self._miss_by_dim[d.value] += 1

    def record_forward(self, key: BucketKey | None, mode: ForwardMode | str | None = None) -> None:
        """Count one transformer forward on bucket ``key`` (None: an eager miss forward).

        Args:
            key: the bucket, or None for a miss.
            mode: how it ran, one of :data:`FORWARD_MODES`; None: ``eager`` for a miss, else ``static_eager``.

        Raises:
            ValueError: an unknown ``mode``.
        """
        mode = mode or (ForwardMode.EAGER if key is None else ForwardMode.STATIC_EAGER)
        if mode not in FORWARD_MODES:
            raise ValueError(f"forward mode must be one of {FORWARD_MODES}, got {mode!r}")
        mode = ForwardMode(mode)
        with self._lock:
            c = self._of(key)
            c.forwards += 1
            c.replays += int(mode is ForwardMode.GRAPH)
            c.unpadded_forwards += int(not mode.padded)

    def record_cache(self, key: BucketKey | None, reused: int, computed: int) -> None:
        """Count the rows of cached requests of one step on bucket ``key`` (None: a miss): ``reused`` reused
        (the remaining blocks' residual, or TaylorSeer's prediction), ``computed`` computed
        (:mod:`bcg_core.step_cache`)."""
        with self._lock:
            c = self._of(key)
            c.cache_reused_rows += reused
            c.cache_computed_rows += computed

    def record_capture(self, key: BucketKey, seconds: float) -> None:
        """Count one CUDA graph capture of bucket ``key`` that took ``seconds`` (warm-up included)."""
        with self._lock:
            c = self._of(key)
            c.captures += 1
            c.capture_s += seconds

    def record_fault(self, key: BucketKey) -> None:
        """Count one runtime error of bucket ``key``'s padded forward (:func:`bcg_core.runners.base.demote`)."""
        with self._lock:
            self._of(key).faults += 1

    def record_steps(self, key: BucketKey | None, step_ms: list[float]) -> None:
        """Count denoising steps run on bucket ``key`` (None: a miss), each taking ``step_ms[i]`` milliseconds."""
        if not step_ms:
            return
        with self._lock:
            c = self._of(key)
            for ms in step_ms:
                c.steps += 1
                c.step_ms_sum += ms
                c.step_ms_bins[bisect.bisect_left(STEP_MS_BOUNDS, ms)] += 1
                self._sample_seq += 1
                self._samples.append((self._sample_seq, key, ms))

    def step_samples(self, after: int = 0) -> tuple[int, list[tuple[BucketKey | None, float]], int]:
        """Step latencies recorded after sequence number ``after``, oldest first (for an exporter that observes
        each one into a histogram; the last :data:`STEP_SAMPLE_LIMIT` are kept).

        Returns:
            ``(last, samples, lost)``: the sequence number to pass next time, ``(key, milliseconds)`` pairs, and
            how many samples after ``after`` were already dropped (0 unless the caller fell behind).
        """
        with self._lock:
            last = self._sample_seq
            if after >= last:
                return last, [], 0
            first = self._samples[0][0] if self._samples else last + 1
            lost = max(0, first - after - 1)
            start = max(0, after + 1 - first)
            samples = [(k, ms) for _, k, ms in list(self._samples)[start:]]
        return last, samples, lost

    def faults(self) -> dict[str, int]:
        """``{bucket key: runtime errors}`` of the buckets that had any (what a replica's heartbeat reports)."""
        with self._lock:
            return {str(k): c.faults for k, c in self._buckets.items() if c.faults}

    def counters(self, key: BucketKey | None) -> BucketCounters:
        """A copy of the counters of ``key`` (None: the miss path)."""
        with self._lock:
            c = self._buckets.get(key, BucketCounters()) if key is not None else self._miss
            return replace(c, step_ms_bins=list(c.step_ms_bins))

    def snapshot(self) -> dict:
        """JSON-ready view: ``{"buckets": [...], "misses": {...}, "totals": {...}}``.

        Per bucket: its key and dimensions, ``shape`` (the key without its batch dimension), ``requests``,
        ``hits``, ``forwards``, ``replays`` (forwards that replayed a CUDA graph), ``forwards_by_mode``
        (:data:`FORWARD_MODES`), ``captures``, ``faults`` (runtime errors after which the bucket runs eager),
        ``real_tokens``, ``padded_tokens``, ``padding_waste_pct`` (percent), ``padded_token_ratio`` (padded / real
        tokens, None with no traffic), ``mean_latency_ms`` (per request) and ``step_latency_ms`` (per denoising step,
        :meth:`BucketCounters.step_latency`), ``cache_reused_rows`` and ``cache_computed_rows`` (rows of requests with a
        step cache whose first block ran on it, by whether they reused or computed the remaining blocks). ``misses``
        holds the same request, token, forward and step counters for
        requests no bucket held (run unpadded), plus ``by_dim``.
        """
        with self._lock:
            buckets = [
                {
                    "key": str(k), "batch": k.batch, "image_tokens": k.image_tokens, "text_tokens": k.text_tokens,
                    "latent_hw": list(k.latent_hw) if k.latent_hw else None, "frames": k.frames, "shape": k.shape,
                    "requests": c.requests, "hits": c.hits, "forwards": c.forwards,
                    "replays": c.replays, "forwards_by_mode": c.forwards_by_mode, "captures": c.captures,
                    "faults": c.faults,
                    "real_tokens": c.real_tokens, "padded_tokens": c.padded_tokens,
                    "padding_waste_pct": round(c.padding_waste_pct, 2),
                    "padded_token_ratio": _round(c.padded_token_ratio, 4),
                    "mean_latency_ms": round(c.mean_latency_ms, 2),
                    "step_latency_ms": c.step_latency(),
                    "cache_reused_rows": c.cache_reused_rows, "cache_computed_rows": c.cache_computed_rows,
                }
                for k, c in sorted(self._buckets.items())
            ]
            hits = sum(c.hits for c in self._buckets.values())
            m = self._miss
            misses = {
                "requests": m.requests, "forwards": m.forwards,
                "by_dim": dict(self._miss_by_dim), "mean_latency_ms": round(m.mean_latency_ms, 2),
                "real_tokens": m.real_tokens, "padded_tokens": m.padded_tokens, "forwards_by_mode": m.forwards_by_mode,
                "step_latency_ms": m.step_latency(),
                "cache_reused_rows": m.cache_reused_rows, "cache_computed_rows": m.cache_computed_rows,
            }
            totals = {"requests": hits + self._miss.requests, "hits": hits, "misses": self._miss.requests}
        return {"buckets": buckets, "misses": misses, "totals": totals}
