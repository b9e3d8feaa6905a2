"""A video job's generation: its request rebuilt from the store, validated on the ingress and sent to a DiT replica as
a streamed generation with step progress (:func:`deployments.routing.stream_dit`: the shape-aware router's key, the
replica's admission, cancellation when the job is dropped), its frames returned to the
:class:`~deployments.videos.worker.VideoWorker`.

A job keeps what its create request resolved (frames, seed, steps, guidance, the low-noise expert's guidance of a Wan
2.2 checkpoint, negative prompt: ``params``), so a job that runs again, after its replica died, makes the same video.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from bcg_core.config import parse_size
from bcg_core.errors import RequestError, ServiceUnavailable
from bcg_core.preview import StepProgress
from bcg_core.request import GenerationRequest, GenerationResult, ValidatedRequest

from ..http_errors import find_request_error
from ..routing import stream_dit
from .jobs import VideoJob
from .options import VideoShape
from .worker import JobFailed, Progress

__all__ = ["DiTVideos", "job_params", "job_request"]

logger = logging.getLogger("ray.serve")


def job_params(validated: ValidatedRequest, shape: VideoShape) -> dict[str, Any]:
    """The ``params`` a job keeps of its validated request: what its generation needs beyond prompt and size."""
    r = validated.request
    return {"num_frames": r.num_frames, "fps": shape.fps, "seed": r.seed, "num_inference_steps": r.num_inference_steps,
            "guidance_scale": r.guidance_scale, "negative_prompt": r.negative_prompt,
            "guidance_scale_2": r.guidance_scale_2}


def job_request(job: VideoJob) -> GenerationRequest:
    """The engine's request of ``job`` (one video of its size, frames and kept parameters).

    Raises:
        KeyError: ``params`` lacks ``num_frames`` (a job not created by ``POST /v1/videos``).
    """
    width, height = parse_size(job.size)
    p = job.params
    return GenerationRequest(prompt=job.prompt or "", n=1, width=width, height=height, num_frames=p["num_frames"],
                             seed=p.get("seed"), num_inference_steps=p.get("num_inference_steps"),
                             guidance_scale=p.get("guidance_scale"), negative_prompt=p.get("negative_prompt"),
                             guidance_scale_2=p.get("guidance_scale_2"))


class DiTVideos:
    """The worker's ``generate``: a job's frames from the DiT deployment.

    Args:
        dit: the DiT deployment's handle.
        validate: ``await validate(request)`` -> its :class:`ValidatedRequest` (the ingress's validation thread).
        retry_after_s: ``routing.retry_after_s``; max_retries: ``routing.max_retries``: a generation answered
            :class:`ServiceUnavailable` (every replica busy, the replica died or ran out of memory) is sent again
            this many times, each after the answer's ``Retry-After``.
    """

    def __init__(self, dit, validate: Callable[[GenerationRequest], Awaitable[ValidatedRequest]],
                 retry_after_s: float = 2.0, max_retries: int = 2):
        self._dit, self._validate = dit, validate
        self.retry_after_s, self.max_retries = retry_after_s, max_retries

    async def generate(self, job: VideoJob, on_progress: Progress) -> np.ndarray:
        """The job's (frames, height, width, 3) uint8 RGB frames, reporting each step to ``on_progress``.

        Raises:
            JobFailed: ``invalid_request`` (the request no longer validates: the config changed since it was
                created, or the replica refused it), ``server_unavailable`` (still unavailable after the retries).
            LeaseLost: from ``on_progress`` (the job was dropped): the generation is cancelled.
        """
        try:
            validated = await self._validate(job_request(job))
        except RequestError as exc:
            raise JobFailed("invalid_request", exc.message) from None
        attempt = 0
        while True:
            try:
                return await self._once(validated, on_progress)
            except Exception as exc:
                found = find_request_error(exc)
                if found is None:
                    raise
                if not isinstance(found, ServiceUnavailable):
                    raise JobFailed("invalid_request", found.message) from None
                attempt += 1
                if attempt > self.max_retries:
                    raise JobFailed("server_unavailable", f"{found.message} ({attempt} attempts)") from None
                logger.warning("video %s: %s; sending it again in %g s", job.id, found.message, found.retry_after_s)
                await asyncio.sleep(found.retry_after_s)

    async def _once(self, validated: ValidatedRequest, on_progress: Progress) -> np.ndarray:
        result = None
        events = stream_dit(self._dit, validated, self.retry_after_s, progress=True)
        try:
            async for event in events:
                if isinstance(event, StepProgress):
                    await on_progress(event.step, event.steps)
                elif isinstance(event, GenerationResult):
                    result = event
        finally:
            await events.aclose()  # a dropped job: the stream's call is cancelled, and the request at the replica
        if result is None or not result.videos:
            raise RuntimeError("the DiT replica's stream ended without a video")
        return result.videos[0]
