"""Per-bucket counters that know nothing of Ray (deployments export them through ``ray.util.metrics``).

Counted per request: requests, hits, real vs padded tokens (padding waste), latency. Counted per
forward: forwards (replays on the GPU). Misses are counted by the key dimension that missed.

Micro-batching (:meth:`bcg_core.pipeline.DiTPipeline.generate_batch`) runs several requests of one bucket
shape in one forward per step. Each request then counts its own real tokens and a share of the batch
forward's padded tokens proportional to its rows (:func:`token_shares`), so a bucket's ``real_tokens`` and
``padded_tokens`` still sum to what its forwards computed; ``batches`` counts denoising loops shared by two
or more requests and ``batched_requests`` the requests served by them.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from .buckets import BucketKey, BucketLookup, Dim

__all__ = ["BucketCounters", "BucketMetrics", "token_shares"]


@dataclass
class BucketCounters:
    """Counters of one bucket (or of the miss path when ``key`` is None).

    ``real_tokens`` and ``padded_tokens`` are per transformer forward, summed over requests:
    ``rows * (image_tokens + text_tokens)`` of the request and of its bucket (for a request that shared
    its forward with others, its share of the bucket's tokens, see :func:`token_shares`).
    ``batches`` counts denoising loops shared by two or more requests; ``batched_requests`` counts the
    requests served by such a loop (so ``requests - batched_requests`` ran alone).
    """

    requests: int = 0
    hits: int = 0
    forwards: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    latency_ms_sum: float = 0.0
    batches: int = 0
    batched_requests: int = 0

    @property
    def padding_waste_pct(self) -> float:
        """Share of computed tokens that were padding: ``100 * (1 - real / padded)``; 0 with no traffic."""
        return 100.0 * (1.0 - self.real_tokens / self.padded_tokens) if self.padded_tokens else 0.0

    @property
    def mean_latency_ms(self) -> float:
        """Mean end-to-end latency of this bucket's requests in milliseconds; 0 with no traffic."""
        return self.latency_ms_sum / self.requests if self.requests else 0.0


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

    def record_request(self, lookup: BucketLookup, latency_ms: float, padded_tokens: int | None = None,
                       batch_size: int = 1) -> None:
        """Count one served request that went through ``lookup``.

        Args:
            lookup: the request's own query and the bucket that served it (for a batched request: the
                batch's bucket).
            latency_ms: end-to-end latency of the request.
            padded_tokens: the request's share of the forward's padded tokens (:func:`token_shares`);
                None: the whole forward's (``lookup.padded_tokens``), for a request that ran alone.
            batch_size: requests that shared the forward (above 1 counts a batched request).
        """
        with self._lock:
            c = self._buckets.setdefault(lookup.key, BucketCounters()) if lookup.hit else self._miss
            c.requests += 1
            c.hits += int(lookup.hit)
            c.real_tokens += lookup.query.tokens
            c.padded_tokens += lookup.padded_tokens if padded_tokens is None else padded_tokens
            c.latency_ms_sum += latency_ms
            c.batched_requests += int(batch_size > 1)
            for d in lookup.missed:
                self._miss_by_dim[d.value] += 1

    def record_forward(self, key: BucketKey | None) -> None:
        """Count one transformer forward on bucket ``key`` (None: an eager miss forward)."""
        with self._lock:
            (self._buckets.setdefault(key, BucketCounters()) if key is not None else self._miss).forwards += 1

    def record_batch(self, key: BucketKey | None, requests: int) -> None:
        """Count one denoising loop on bucket ``key`` shared by ``requests`` requests (ignored below 2)."""
        if requests < 2:
            return
        with self._lock:
            (self._buckets.setdefault(key, BucketCounters()) if key is not None else self._miss).batches += 1

    def counters(self, key: BucketKey | None) -> BucketCounters:
        """A copy of the counters of ``key`` (None: the miss path)."""
        with self._lock:
            c = self._buckets.get(key, BucketCounters()) if key is not None else self._miss
            return BucketCounters(**vars(c))

    def snapshot(self) -> dict:
        """JSON-ready view: ``{"buckets": [...], "misses": {...}, "totals": {...}, "batch_totals": {...}}``.

        ``batch_totals`` sums the batch counters (``batches``, ``batched_requests``) over every bucket; it is
        kept apart from ``totals``, whose keys (requests, hits, misses) clients compare whole.
        """
        with self._lock:
            buckets = [
                {
                    "key": str(k), "batch": k.batch, "image_tokens": k.image_tokens, "text_tokens": k.text_tokens,
                    "latent_hw": list(k.latent_hw) if k.latent_hw else None,
                    "requests": c.requests, "hits": c.hits, "forwards": c.forwards,
                    "batches": c.batches, "batched_requests": c.batched_requests,
                    "real_tokens": c.real_tokens, "padded_tokens": c.padded_tokens,
                    "padding_waste_pct": round(c.padding_waste_pct, 2),
                    "mean_latency_ms": round(c.mean_latency_ms, 2),
                }
                for k, c in sorted(self._buckets.items())
            ]
            hits = sum(c.hits for c in self._buckets.values())
            misses = {
                "requests": self._miss.requests, "forwards": self._miss.forwards,
                "by_dim": dict(self._miss_by_dim), "mean_latency_ms": round(self._miss.mean_latency_ms, 2),
            }
            totals = {"requests": hits + self._miss.requests, "hits": hits, "misses": self._miss.requests}
            every = [*self._buckets.values(), self._miss]
            batch_totals = {"batches": sum(c.batches for c in every),
                            "batched_requests": sum(c.batched_requests for c in every)}
        return {"buckets": buckets, "misses": misses, "totals": totals, "batch_totals": batch_totals}
