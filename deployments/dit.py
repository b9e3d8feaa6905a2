"""DiT replica deployment: one :class:`~bcg_core.pipeline.DiTPipeline` per replica (one GPU each).

The pipeline is built (and, on CUDA, its bucket graphs captured) in the constructor, so the replica
reports ready only when it can serve. Generation is blocking torch work: it runs in a worker thread so
the replica's event loop keeps answering ``stats`` and health checks; a cancelled call (its client went
away) stops that thread at the next denoising step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from ray import serve

from bcg_core.config import ServeConfig
from bcg_core.errors import RequestError
from bcg_core.pipeline import DiTPipeline, GenerationResult
from bcg_core.planner import GenerationRequest

__all__ = ["DiTReplica", "as_generation_request"]

_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest))


def as_generation_request(request: GenerationRequest | dict) -> GenerationRequest:
    """Accept a :class:`GenerationRequest` or a mapping of its fields.

    Raises:
        RequestError: a mapping with an unknown field or without ``prompt`` (field ``"request"``).
    """
    if isinstance(request, GenerationRequest):
        return request
    if not isinstance(request, dict):
        raise RequestError("request", f"request must be a GenerationRequest or a dict with the fields "
                           f"{', '.join(_REQUEST_FIELDS)}; got {type(request).__name__}")
    unknown = sorted(set(request) - set(_REQUEST_FIELDS))
    if unknown:
        raise RequestError("request", f"unknown request field(s) {unknown}; allowed: {', '.join(_REQUEST_FIELDS)}")
    if "prompt" not in request:
        raise RequestError("prompt", "prompt is required: a non-empty string")
    return GenerationRequest(**request)


@serve.deployment(name="DiTReplica")
class DiTReplica:
    """Ray Serve deployment owning one DiT pipeline.

    Args:
        config: a ``ServeConfig`` as a mapping (``ServeConfig.model_dump(mode="json")``).

    Raises:
        pydantic.ValidationError: on a bad config; ``ValueError`` on a bad bucket table (at start).
    """

    def __init__(self, config: dict):
        self._pipeline = DiTPipeline.from_config(ServeConfig.model_validate(config))

    async def generate(self, request: GenerationRequest | dict) -> GenerationResult:
        """Generate images for one request.

        Args:
            request: a :class:`GenerationRequest`, or a dict of its fields.

        Returns:
            The :class:`GenerationResult` (PNG bytes, seed, bucket, timings).

        Raises:
            RequestError: a field out of range, or a bucket miss under the reject policy.
        """
        req = as_generation_request(request)
        cancel = threading.Event()
        try:
            return await asyncio.to_thread(self._pipeline.generate, req, cancel)
        except asyncio.CancelledError:
            # The caller went away (an HTTP client disconnected, a handle call was cancelled): stop the
            # worker thread at its next denoising step instead of finishing an image nobody will read.
            cancel.set()
            raise

    def stats(self) -> dict:
        """Per-bucket counters: :meth:`DiTPipeline.stats`."""
        return self._pipeline.stats()
