"""The video job store: OpenAI-shaped video jobs in a database (SQLAlchemy 2.x), their files in a folder
(docs/DESIGN.md section 13, docs/OPERATIONS.md "Video jobs").

**Durability.** :meth:`VideoStore.create` returns after the job's row is committed (its input files written before,
atomically), so a job the API acknowledged survives any crash after. SQLite runs in WAL mode with ``synchronous=FULL``
(a commit is on disk before it returns) and every write transaction starts with ``BEGIN IMMEDIATE``, which takes
SQLite's write lock at once: two processes never both read a job as free and then both fail to upgrade, they wait on
the lock (up to 30 s) instead.

**Claims and leases.** A worker claims the oldest queued job with a compare-and-set: ``UPDATE ... WHERE id = ? AND
status = 'queued'``, counted by its row count. Of two workers that pick the same job, on any database and isolation
level, exactly one updates it; the other tries the next job. The claim gives the worker a lease of ``lease_s``
seconds, which :meth:`~VideoStore.progress` and :meth:`~VideoStore.renew` extend. A job whose lease ran out (its
replica died or hung) goes back to ``queued`` at the next claim or :meth:`~VideoStore.recover`, and runs again; after
``max_attempts`` claims it fails with code ``worker_lost`` instead. Every write of a worker names its owner id and
applies only while that owner holds the job, else :class:`~deployments.videos.jobs.LeaseLost`: a worker whose job was
cancelled, deleted or re-queued finds out at its next progress update and stops. Leases compare the replicas' wall
clocks (``time.time``): keep them in sync (NTP) to well within ``lease_s``.

Every method blocks on the database and the disk: call them from a thread (``asyncio.to_thread``), never on an event
loop. One store object per process; it is safe to share between threads.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import sqlalchemy as sa

from .config import VideosConfig, database_url_text
from .database import VIDEOS, create_schema, open_engine, reading, row_job, writing
from .files import JobFiles, media_type
from .jobs import (
    CANCELLED,
    VARIANTS,
    WORKER_LOST,
    JobNotFound,
    JobStateError,
    JobStatus,
    LeaseLost,
    UnknownCursor,
    VideoJob,
    VideoPage,
    VideoStoreError,
    check_job_id,
)

__all__ = ["MAX_LIST_LIMIT", "Recovery", "ResultFile", "VideoStore"]

MAX_LIST_LIMIT = 100
"""Most jobs on one list page (``limit`` 1..100; 20 unless given, as OpenAI's cursor lists)."""

ORPHAN_GRACE_S = 3600.0
"""A job folder without a job row is removed by :meth:`VideoStore.recover` once it is this old (a create writes its
input files just before its row commits; a worker may write files just after its job was deleted)."""

_c = VIDEOS.c
_QUEUED, _RUNNING = JobStatus.QUEUED.value, JobStatus.IN_PROGRESS.value
_FINISHED = (JobStatus.COMPLETED.value, JobStatus.FAILED.value)
_SECONDS = re.compile(r"^[0-9]{1,4}(\.[0-9]{1,3})?$")
_ERROR_CODE = re.compile(r"^[a-z0-9_.-]{1,64}$")


class ResultFile(NamedTuple):
    """A completed job's downloadable file: its path and media type (``video/mp4``, ``image/webp`` ...)."""

    path: Path
    media_type: str


@dataclass(frozen=True)
class Recovery:
    """What :meth:`VideoStore.recover` did: jobs re-queued and failed (leases that ran out), expired jobs deleted,
    and job folders without a job removed."""

    requeued: int
    failed: int
    purged: int
    orphans: int


def _text(name: str, value: object, most: int, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > most:
        raise ValueError(f"{name} must be a non-empty string of at most {most} characters, got {str(value)[:60]!r}")
    return value


def _json(name: str, value: Mapping[str, Any] | None) -> str:
    if value is None:
        return "{}"
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name} must be a mapping with string keys, got {type(value).__name__}")
    try:
        return json.dumps(dict(value), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must hold JSON values only (strings, numbers, booleans, None, lists, mappings): "
                         f"{e}") from None


class VideoStore:
    """Video jobs and their files.

    Args:
        folder: the store's folder (``~`` expanded; created if absent): job files in ``folder/<job id>/`` and, without
            ``database_url``, the SQLite database ``folder/jobs.sqlite3``.
        database_url: an SQLAlchemy URL of the job database (``videos.database_url``), or None.
        lease_s: seconds a claimed job stays with its worker without a renewal.
        max_attempts: claims a job may have before a lease that runs out fails it (``worker_lost``).
        retention_s: seconds a finished job is kept (its ``expires_at``); None: until deleted.
        clock: Unix time in seconds (injected by tests; ``time.time``).

    Raises:
        ValueError: a bad argument, a folder that cannot be written, a URL whose driver is not installed.
        VideoStoreError: the database cannot be opened, or holds a job table of another layout.
    """

    def __init__(self, folder: str | os.PathLike, database_url: str | None = None, *, lease_s: float = 60.0,
                 max_attempts: int = 3, retention_s: float | None = 7 * 86400.0,
                 clock: Callable[[], float] = time.time):
        from pydantic import ValidationError

        from deployments.settings import error_text

        try:  # the config's own checks, its field names in the message
            config = VideosConfig(folder=str(folder), database_url=database_url, lease_s=lease_s,
                                  max_attempts=max_attempts, retention_s=retention_s)
        except ValidationError as e:
            raise ValueError(error_text(e, VideosConfig, what="video store arguments", top="VideoStore")) from None
        self.files = JobFiles(config.folder)
        self.lease_s, self.max_attempts, self.retention_s = config.lease_s, config.max_attempts, config.retention_s
        self._clock = clock
        url = database_url or f"sqlite:///{self.files.root / 'jobs.sqlite3'}"
        self.database = database_url_text(url)
        self._engine = open_engine(url)
        create_schema(self._engine, self.database)

    @classmethod
    def from_config(cls, config: VideosConfig, clock: Callable[[], float] = time.time) -> VideoStore:
        """The store ``config`` (the ``videos`` section of ServeConfig) describes."""
        return cls(config.folder, config.database_url, lease_s=config.lease_s, max_attempts=config.max_attempts,
                   retention_s=config.retention_s, clock=clock)

    def close(self) -> None:
        """Close the database connections (the store is unusable after)."""
        self._engine.dispose()

    def __enter__(self) -> VideoStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- jobs -------------------------------------------------------------------------------------------------------

    def create(self, *, prompt: str | None, model: str, seconds: str, size: str,
               params: Mapping[str, Any] | None = None, inputs: Mapping[str, bytes] | None = None,
               remixed_from_video_id: str | None = None) -> VideoJob:
        """Accept a job: its input files written, then its row committed; it is ``queued`` when this returns.

        Args:
            prompt: the prompt (None for none); model: the model's id; seconds: duration as a decimal string
                (``"4"``, ``"5.06"``); size: ``"WxH"``.
            params: the request's other parameters for the worker, JSON values only.
            inputs: ``{file name: bytes}`` written into the job's folder first (the ``input_reference`` image).
            remixed_from_video_id: the job it remixes.

        Raises:
            ValueError: a bad argument, naming it and what it takes.
        """
        from bcg_core.config import parse_size

        _text("prompt", prompt, 100_000, optional=True)
        _text("model", model, 200)
        if not isinstance(seconds, str) or not _SECONDS.match(seconds) or float(seconds) <= 0:
            raise ValueError(f"seconds {str(seconds)[:20]!r} must be a positive decimal string, e.g. '4'")
        parse_size(size)  # ValueError naming the form
        if remixed_from_video_id is not None:
            check_job_id(remixed_from_video_id)
        params_json = _json("params", params)
        if inputs is not None and not isinstance(inputs, Mapping):
            raise ValueError(f"inputs must map file names to bytes, got {type(inputs).__name__}")
        job_id = "video_" + uuid.uuid4().hex
        row = dict(id=job_id, status=_QUEUED, progress=0, model=model, prompt=prompt, seconds=seconds, size=size,
                   created_at=int(self._clock()), remixed_from_video_id=remixed_from_video_id, params=params_json,
                   files="{}", attempts=0)
        try:
            for name, data in (inputs or {}).items():
                self.files.write(job_id, name, data)
            with writing(self._engine) as conn:
                conn.execute(VIDEOS.insert().values(**row))
        except BaseException:
            self.files.remove(job_id)
            raise
        return self.get(job_id)

    def get(self, job_id: str) -> VideoJob:
        """The job ``job_id``. Raises JobNotFound."""
        check_job_id(job_id)
        with reading(self._engine) as conn:
            row = conn.execute(sa.select(VIDEOS).where(_c.id == job_id)).mappings().first()
        if row is None:
            raise JobNotFound(f"no video {job_id!r}")
        return row_job(row)

    def list(self, after: str | None = None, limit: int = 20, order: Literal["asc", "desc"] = "desc") -> VideoPage:
        """One page of jobs by creation, OpenAI's cursor pagination.

        Args:
            after: the id of the previous page's last job (its ``last_id``); None: from the start.
            limit: jobs on the page, 1..100.
            order: ``desc`` (newest first, OpenAI's default) or ``asc``.

        Raises:
            ValueError: a bad limit or order; UnknownCursor: ``after`` names no job.
        """
        if order not in ("asc", "desc"):
            raise ValueError(f"order {str(order)[:20]!r} is not one of 'asc', 'desc'")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise ValueError(f"limit {limit!r} must be an integer from 1 to {MAX_LIST_LIMIT}")
        query = sa.select(VIDEOS).order_by(_c.seq.asc() if order == "asc" else _c.seq.desc()).limit(limit + 1)
        with reading(self._engine) as conn:
            if after is not None:
                if not isinstance(after, str) or not after:
                    raise ValueError("after must be a video id (a page's last_id)")
                seq = conn.execute(sa.select(_c.seq).where(_c.id == after)).scalar()
                if seq is None:
                    raise UnknownCursor(f"after {after[:80]!r} names no video (deleted since that page?); list again "
                                        f"without after")
                query = query.where(_c.seq > seq if order == "asc" else _c.seq < seq)
            rows = conn.execute(query).mappings().all()
        return VideoPage([row_job(r) for r in rows[:limit]], has_more=len(rows) > limit)

    def counts(self) -> dict[str, int]:
        """``{status: jobs}`` for every :class:`JobStatus` (0 where none): the queue's depth for metrics and
        admission."""
        with reading(self._engine) as conn:
            rows = conn.execute(sa.select(_c.status, sa.func.count()).group_by(_c.status)).all()
        out = {s.value: 0 for s in JobStatus}
        out.update({status: n for status, n in rows})
        return out

    # -- workers ----------------------------------------------------------------------------------------------------

    def claim(self, owner: str, models: Collection[str] | None = None) -> VideoJob | None:
        """Take the oldest queued job (of ``models``, when given) for worker ``owner``: it is ``in_progress`` with a
        lease of ``lease_s`` seconds, its attempts counted. Jobs whose lease ran out are re-queued first.

        Returns:
            The claimed job, or None when no job is queued.

        Raises:
            ValueError: a bad owner, or ``models`` given as one string.
        """
        _text("owner", owner, 200)
        if isinstance(models, str):
            raise ValueError(f"models must be a collection of model ids, e.g. [{models!r}], not a string")
        self._expire_leases(self._clock())
        while True:
            with writing(self._engine) as conn:
                pick = sa.select(_c.id).where(_c.status == _QUEUED).order_by(_c.seq).limit(1)
                if models is not None:
                    pick = pick.where(_c.model.in_(list(models)))
                job_id = conn.execute(pick).scalar()
                if job_id is None:
                    return None
                won = conn.execute(VIDEOS.update().where(_c.id == job_id, _c.status == _QUEUED).values(
                    status=_RUNNING, owner=owner, lease_expires_at=self._clock() + self.lease_s, progress=0,
                    attempts=_c.attempts + 1)).rowcount
                if won == 1:
                    return row_job(conn.execute(sa.select(VIDEOS).where(_c.id == job_id)).mappings().one())
            # another worker took it between our read and our update (PostgreSQL): try the next one

    def progress(self, job_id: str, owner: str, progress: int) -> None:
        """Set the job's ``progress`` (0..100) and renew ``owner``'s lease.

        Raises:
            ValueError: progress out of range; LeaseLost: ``owner`` no longer holds the job (stop working on it).
        """
        if isinstance(progress, bool) or not isinstance(progress, int) or not 0 <= progress <= 100:
            raise ValueError(f"progress {progress!r} must be an integer from 0 to 100")
        self._owned_update(job_id, owner, progress=progress, lease_expires_at=self._clock() + self.lease_s)

    def renew(self, job_id: str, owner: str) -> None:
        """Renew ``owner``'s lease on the job (call it every ``lease_s / 3`` seconds at least while it runs).

        Raises:
            LeaseLost: ``owner`` no longer holds the job.
        """
        self._owned_update(job_id, owner, lease_expires_at=self._clock() + self.lease_s)

    def write_file(self, job_id: str, name: str, data: bytes) -> Path:
        """Write file ``name`` (``video.mp4``, ``thumbnail.webp`` ...) of job ``job_id`` atomically (temporary file,
        then rename); returns its path. :meth:`complete` then names it.

        Raises:
            ValueError: a bad file name or data; JobNotFound: a malformed id.
        """
        return self.files.write(job_id, name, data)

    def complete(self, job_id: str, owner: str, files: Mapping[str, str | os.PathLike]) -> VideoJob:
        """Finish the job: ``completed``, progress 100, its ``files`` downloadable, ``expires_at`` set.

        Args:
            files: ``{variant: file}`` for ``video`` (required), ``thumbnail``, ``spritesheet``; each a file name
                or a path in the job's folder, already written (:meth:`write_file`).

        Raises:
            ValueError: an unknown variant, no ``video``, a file that is missing or outside the job's folder.
            LeaseLost: ``owner`` no longer holds the job (a deleted job's folder is removed here).
        """
        if not isinstance(files, Mapping) or "video" not in files or not set(files) <= set(VARIANTS):
            raise ValueError(f"files must map variants ({', '.join(VARIANTS)}; 'video' required) to files, got "
                             f"{sorted(files) if isinstance(files, Mapping) else type(files).__name__}")
        names = {variant: self.files.name_of(job_id, path) for variant, path in files.items()}
        return self._owned_update(job_id, owner, **self._finished(self._clock(), JobStatus.COMPLETED), progress=100,
                                  files=json.dumps(names))

    def fail(self, job_id: str, owner: str, code: str, message: str) -> VideoJob:
        """Finish the job as ``failed`` with ``error`` {code, message} (e.g. ``code="generation_failed"``).

        Raises:
            ValueError: a code that is not 1..64 of ``a-z 0-9 _ . -``, an empty message; LeaseLost as for
                :meth:`complete`.
        """
        if not isinstance(code, str) or not _ERROR_CODE.match(code):
            raise ValueError(f"error code {str(code)[:80]!r} must be 1 to 64 of a-z, 0-9, '_', '.', '-'")
        _text("error message", message, 1_000_000)
        return self._owned_update(job_id, owner, **self._finished(self._clock(), JobStatus.FAILED), error_code=code,
                                  error_message=message[:4000])

    def release(self, owner: str) -> int:
        """Give every job ``owner`` holds back to the queue (a replica stopping gracefully), not counting the
        attempt; returns how many."""
        _text("owner", owner, 200)
        with writing(self._engine) as conn:
            return conn.execute(VIDEOS.update().where(_c.status == _RUNNING, _c.owner == owner).values(
                status=_QUEUED, owner=None, lease_expires_at=None, progress=0, attempts=_c.attempts - 1)).rowcount

    # -- requests ---------------------------------------------------------------------------------------------------

    def cancel(self, job_id: str) -> VideoJob:
        """Cancel a queued or running job: ``failed`` with error code ``cancelled`` at once (its worker finds out at
        its next progress update: LeaseLost).

        Raises:
            JobNotFound; JobStateError: it already finished (naming its status).
        """
        check_job_id(job_id)
        with writing(self._engine) as conn:
            done = conn.execute(VIDEOS.update().where(_c.id == job_id, _c.status.in_((_QUEUED, _RUNNING))).values(
                **self._finished(self._clock(), JobStatus.FAILED), error_code=CANCELLED,
                error_message="cancelled by request")).rowcount
            row = conn.execute(sa.select(VIDEOS).where(_c.id == job_id)).mappings().first()
        if row is None:
            raise JobNotFound(f"no video {job_id!r}")
        if not done:
            raise JobStateError(f"video {job_id!r} is already {row['status']}; only a queued or in_progress video can "
                                f"be cancelled")
        return row_job(row)

    def delete(self, job_id: str) -> None:
        """Delete the job (in any status) and its folder; a worker still on it gets LeaseLost at its next update.

        Raises:
            JobNotFound.
        """
        check_job_id(job_id)
        with writing(self._engine) as conn:
            gone = conn.execute(VIDEOS.delete().where(_c.id == job_id)).rowcount
        self.files.remove(job_id)  # after the commit: a crash in between leaves an orphan, which recover() removes
        if not gone:
            raise JobNotFound(f"no video {job_id!r}")

    def result(self, job_id: str, variant: str = "video") -> ResultFile:
        """The file of a completed job to download (``variant``: ``video``, ``thumbnail`` or ``spritesheet``).

        Raises:
            ValueError: an unknown variant; JobNotFound; JobStateError: the job is not completed, or has no such
            file; VideoStoreError: its file is gone from the folder.
        """
        if variant not in VARIANTS:
            raise ValueError(f"variant {str(variant)[:40]!r} is not one of {', '.join(VARIANTS)}")
        job = self.get(job_id)
        if job.status is not JobStatus.COMPLETED:
            raise JobStateError(f"video {job_id!r} is {job.status.value}; its content is ready once it is completed")
        if variant not in job.files:
            raise JobStateError(f"video {job_id!r} has no {variant}")
        path = self.files.path(job_id, job.files[variant])
        if not path.is_file():
            raise VideoStoreError(f"the {variant} of video {job_id!r} is missing from {str(path.parent)!r}")
        return ResultFile(path, media_type(path.name))

    # -- upkeep -----------------------------------------------------------------------------------------------------

    def recover(self) -> Recovery:
        """Start-up upkeep (also fine to run periodically): jobs whose lease ran out go back to the queue (or fail,
        after ``max_attempts``), expired jobs are deleted with their files, and job folders older than an hour
        without a job are removed. Jobs of a replica that died keep their lease until it runs out, then re-run."""
        requeued, failed = self._expire_leases(self._clock())
        purged = self.purge_expired()
        with reading(self._engine) as conn:
            known = set(conn.execute(sa.select(_c.id)).scalars())
        cutoff = self._clock() - ORPHAN_GRACE_S
        orphans = [i for i, mtime in self.files.folders().items() if i not in known and mtime < cutoff]
        for job_id in orphans:
            self.files.remove(job_id)
        return Recovery(requeued, failed, purged, len(orphans))

    def purge_expired(self) -> int:
        """Delete finished jobs whose ``expires_at`` has passed, with their folders; returns how many."""
        now = int(self._clock())
        expired = (_c.expires_at <= now) & _c.status.in_(_FINISHED)
        with reading(self._engine) as conn:
            ids = list(conn.execute(sa.select(_c.id).where(expired)).scalars())
        if not ids:
            return 0
        with writing(self._engine) as conn:
            conn.execute(VIDEOS.delete().where(expired, _c.id.in_(ids)))
        for job_id in ids:
            self.files.remove(job_id)
        return len(ids)

    # -- internals --------------------------------------------------------------------------------------------------

    def _finished(self, now: float, status: JobStatus) -> dict[str, Any]:
        """The columns of a job that finished at ``now`` in ``status`` (its lease dropped, ``expires_at`` set)."""
        done = int(now)
        expires = None if self.retention_s is None else done + math.ceil(self.retention_s)
        return dict(status=status.value, completed_at=done, expires_at=expires, owner=None, lease_expires_at=None)

    def _owned_update(self, job_id: str, holder: str, /, **values: Any) -> VideoJob:
        """Apply ``values`` if ``holder`` holds the job and return it as it is then, else LeaseLost saying why."""
        check_job_id(job_id)
        _text("owner", holder, 200)
        with writing(self._engine) as conn:
            done = conn.execute(VIDEOS.update().where(_c.id == job_id, _c.owner == holder, _c.status == _RUNNING)
                                .values(**values)).rowcount
            row = conn.execute(sa.select(VIDEOS).where(_c.id == job_id)).mappings().first() if done else None
        if row is not None:
            return row_job(row)
        try:
            job = self.get(job_id)
        except JobNotFound:
            self.files.remove(job_id)  # deleted while it ran: what the worker wrote goes too
            raise LeaseLost(f"video {job_id!r} was deleted") from None
        why = ("was cancelled" if job.error is not None and job.error.code == CANCELLED else
               f"is {job.status.value}" + (f", held by {job.owner!r}" if job.owner else ""))
        raise LeaseLost(f"video {job_id!r} is no longer held by {holder!r}: it {why}")

    def _expire_leases(self, now: float) -> tuple[int, int]:
        """Jobs whose lease ran out: failed (``worker_lost``) after ``max_attempts`` claims, else re-queued."""
        lapsed = (_c.status == _RUNNING) & (_c.lease_expires_at < now)
        with writing(self._engine) as conn:
            failed = conn.execute(VIDEOS.update().where(lapsed, _c.attempts >= self.max_attempts).values(
                **self._finished(now, JobStatus.FAILED), error_code=WORKER_LOST,
                error_message=f"the worker running it stopped answering {self.max_attempts} times (each lease of "
                              f"{self.lease_s:g} s ran out)")).rowcount
            requeued = conn.execute(VIDEOS.update().where(lapsed).values(
                status=_QUEUED, owner=None, lease_expires_at=None, progress=0)).rowcount
        return requeued, failed
