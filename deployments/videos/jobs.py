"""A video job as the store keeps it and as OpenAI's Videos API shows it, the list page, and the store's errors.

The API's shapes are the OpenAI Python client's (``openai/types/video.py`` ``Video``; ``openai/pagination.py``
``SyncConversationCursorPage``: ``data``, ``first_id``, ``last_id``, ``has_more``). OpenAI's ``status`` has no
cancelled state: a cancelled job is ``failed`` with error code ``cancelled`` (:data:`CANCELLED`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CANCELLED", "JOB_ID", "VARIANTS", "WORKER_LOST", "JobError", "JobNotFound", "JobStateError", "JobStatus",
    "LeaseLost", "UnknownCursor", "VideoJob", "VideoPage", "VideoStoreError", "check_job_id",
]

JOB_ID = re.compile(r"^video_[0-9a-f]{32}$")
"""A job id: ``video_`` and 32 lowercase hex digits (a random UUID's)."""

VARIANTS = ("video", "thumbnail", "spritesheet")
"""The downloadable files of a completed job (OpenAI's ``variant``); ``video`` is required."""

CANCELLED = "cancelled"
"""Error code of a job cancelled by a request."""

WORKER_LOST = "worker_lost"
"""Error code of a job whose lease ran out ``max_attempts`` times (each replica that ran it died or hung)."""


class JobStatus(str, enum.Enum):
    """A job's lifecycle state (OpenAI's ``status`` values)."""

    QUEUED = "queued"
    """Accepted, waiting for a worker (also after its worker's lease ran out)."""
    IN_PROGRESS = "in_progress"
    """Claimed by a worker, which holds a lease on it."""
    COMPLETED = "completed"
    """Its files are written; it can be downloaded."""
    FAILED = "failed"
    """It failed, or was cancelled (``error.code`` says which)."""

    @property
    def finished(self) -> bool:
        """True for ``completed`` and ``failed``: no worker will touch it again."""
        return self in (JobStatus.COMPLETED, JobStatus.FAILED)


class VideoStoreError(Exception):
    """Base of the store's errors other than bad arguments (those are ``ValueError``)."""


class JobNotFound(VideoStoreError, LookupError):
    """No job has this id (never created, deleted, or expired and purged). The route answers 404."""


class JobStateError(VideoStoreError):
    """The operation does not apply to the job's status (cancel a finished job, download an unfinished one). The
    route answers 409 (or 404 for a download of an unfinished job, as OpenAI does)."""


class LeaseLost(VideoStoreError):
    """The worker no longer holds the job: it was cancelled, deleted, or its lease ran out and it went back to the
    queue (possibly claimed by another worker). The worker must stop working on it and drop what it made."""


class UnknownCursor(VideoStoreError, ValueError):
    """A list's ``after`` names no job (deleted since the previous page). The route answers 400."""


def check_job_id(job_id: object) -> str:
    """``job_id`` if it is of the form :data:`JOB_ID`.

    Raises:
        JobNotFound: anything else (no job can have such an id), naming the form.
    """
    if not isinstance(job_id, str) or not JOB_ID.match(job_id):
        raise JobNotFound(f"no video {str(job_id)[:80]!r}: an id is 'video_' and 32 hex digits")
    return job_id


@dataclass(frozen=True)
class JobError:
    """Why a job failed: OpenAI's ``error`` object (``code``, ``message``)."""

    code: str
    message: str


@dataclass(frozen=True)
class VideoJob:
    """One video job, as read from the store (a snapshot: read it again for news).

    Attributes:
        id: ``video_<32 hex>``.
        status: its :class:`JobStatus`.
        progress: percent done, 0..100 (the worker's denoising steps).
        model: the model it was asked of.
        prompt: the prompt (None for a job without one, e.g. a remix that kept its source's).
        seconds: duration asked for, in seconds, as OpenAI's client sends it (a decimal string, e.g. ``"4"``).
        size: ``"WxH"`` in pixels.
        created_at: Unix time in seconds when it was accepted.
        completed_at: Unix seconds when it finished (completed or failed); None before.
        expires_at: Unix seconds when it and its files are deleted (``videos.retention_s`` after it finished); None
            while running or when kept until deleted.
        error: why it failed; None unless failed.
        remixed_from_video_id: the job it remixes, if any.
        params: the request's other parameters, as the route stored them (JSON values: steps, seed, fps, the input
            reference's file name ...).
        files: ``{variant: file name}`` of its files in its folder, once completed (:data:`VARIANTS`).
        owner: the worker holding it while ``in_progress``; None otherwise.
        lease_expires_at: Unix seconds (float) when the owner's lease runs out; None unless ``in_progress``.
        attempts: times it was claimed by a worker.
    """

    id: str
    status: JobStatus
    progress: int
    model: str
    prompt: str | None
    seconds: str
    size: str
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    error: JobError | None = None
    remixed_from_video_id: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    owner: str | None = None
    lease_expires_at: float | None = None
    attempts: int = 0

    def to_api(self) -> dict[str, Any]:
        """The job as OpenAI's ``Video`` object (what ``GET /v1/videos/{id}`` answers; the client's
        ``openai.types.Video`` parses it)."""
        return {
            "id": self.id,
            "object": "video",
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "status": self.status.value,
            "progress": self.progress,
            "model": self.model,
            "prompt": self.prompt,
            "seconds": self.seconds,
            "size": self.size,
            "error": None if self.error is None else {"code": self.error.code, "message": self.error.message},
            "remixed_from_video_id": self.remixed_from_video_id,
        }


@dataclass(frozen=True)
class VideoPage:
    """One page of ``GET /v1/videos``.

    Attributes:
        data: the jobs, in the order asked for.
        has_more: whether a page follows (ask again with ``after=last_id``).
    """

    data: list[VideoJob]
    has_more: bool

    @property
    def first_id(self) -> str | None:
        """The first job's id; None on an empty page."""
        return self.data[0].id if self.data else None

    @property
    def last_id(self) -> str | None:
        """The last job's id (the next page's ``after``); None on an empty page."""
        return self.data[-1].id if self.data else None

    def to_api(self) -> dict[str, Any]:
        """The page as OpenAI's list object (``object``, ``data``, ``first_id``, ``last_id``, ``has_more``)."""
        return {"object": "list", "data": [job.to_api() for job in self.data], "first_id": self.first_id,
                "last_id": self.last_id, "has_more": self.has_more}
