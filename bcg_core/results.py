"""The one place a request's result is built: the step scheduler's requests (:mod:`bcg_core.scheduler.finish`) and the
synchronous :meth:`~bcg_core.pipeline.DiTPipeline.generate` both end in :func:`build_result`, so a result means the
same on either path: the bucket of its first step, its share of that step's computed tokens, the request's own
real tokens and, from its finished state, what its step cache did."""

from __future__ import annotations

from bcg_core.families.state import RequestState
from bcg_core.keys import BucketKey, Dim
from bcg_core.metrics import BucketMetrics
from bcg_core.request import GenerationResult, ValidatedRequest
from bcg_core.step_cache.step import request_cache
from bcg_core.table import BucketLookup

__all__ = ["build_result"]


def build_result(validated: ValidatedRequest, files: list[bytes], key: BucketKey | None, padded_tokens: int,
                 company: int, metrics: BucketMetrics, timings_ms: dict[str, float],
                 state: RequestState | None = None, videos: list | None = None) -> GenerationResult:
    """The result of a finished request, recorded in ``metrics`` (:meth:`BucketMetrics.record_request`).

    Args:
        validated: the validated request.
        files: its image files, in order (image ``i`` from seed ``seed + i``).
        key: the bucket its first step was counted under (:attr:`~bcg_core.costs.StepForwards.counted_key`); None
            for a miss.
        padded_tokens: its share, by rows, of the tokens its first step computed.
        company: most requests that shared one step with it.
        metrics: the pipeline's per-bucket counters.
        timings_ms: milliseconds by phase; ``total`` is recorded as the request's latency.
        state: its finished state, whose step cache (:func:`~bcg_core.step_cache.request_cache`) the result reports
            as ``cache``; None: reported as none.
        videos: a video model's videos (``files`` then empty), each a (num_frames, height, width, 3) uint8 array;
            None for images.

    A request whose rows were split across its shape's buckets (a miss in the batch dimension only) is a hit of
    the bucket it was counted under; a miss in another dimension reports only those dimensions.
    """
    missed = () if key is not None else tuple(d for d in validated.lookup.missed if d is not Dim.BATCH)
    metrics.record_request(BucketLookup(validated.lookup.query, key, missed), timings_ms["total"],
                           padded_tokens=padded_tokens)
    r = validated.request
    cache = None if state is None else request_cache(state)
    return GenerationResult(
        image_bytes=files, seed=r.seed, bucket=key, hit=key is not None, missed=[d.value for d in missed],
        real_tokens=validated.lookup.query.tokens, padded_tokens=padded_tokens, steps=validated.steps_run,
        timings_ms=timings_ms, batch_size=company, image_format=r.output_format,
        cache=None if cache is None else cache.describe(), videos=videos,
    )
