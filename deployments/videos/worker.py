"""The video worker of one ingress replica: it claims queued jobs from the store and runs them (docs/OPERATIONS.md
"Video jobs: the worker", docs/DESIGN.md section 13).

One :class:`VideoWorker` per ingress replica, on its event loop, under the replica's id as the jobs' owner. At start
it calls :meth:`~deployments.videos.store.VideoStore.recover` (jobs whose lease ran out go back to the queue, so a
restart resumes queued and running jobs once their leases lapse), then loops: while fewer than ``max_running`` of its
jobs run, it claims the oldest queued job of the served model; then it waits for a job of its own to finish, for
:meth:`VideoWorker.wake` (a job created through this replica) or ``poll_s`` seconds (jobs created elsewhere).

A job runs as one asyncio task: ``generate(job, on_progress)`` (the ingress's: the job's request validated and sent to
a DiT replica through the shape-aware router, as a streamed image generation, :mod:`deployments.videos.generation`)
gives its frames, each :class:`~bcg_core.preview.StepProgress` setting the job's ``progress`` (0-99 while denoising,
at most one write per :data:`PROGRESS_EVERY_S`; each write renews the lease); the frames are encoded
(:func:`~deployments.videos.encode.encode_video`) in a thread, off the event loop, its three files written and the job
completed. Beside it a keeper renews the lease every ``lease_s / 3`` seconds (decode and encode take no steps).

Stopping work on a job: a store write that raises :class:`~deployments.videos.jobs.LeaseLost` (the job was cancelled
or deleted, possibly through another replica, or its lease ran out and it went back to the queue) drops it, and so does
:meth:`VideoWorker.drop` (a cancel or delete through this replica: at once); either way the generation's task is
cancelled, which cancels the request at the DiT replica at its next step, and nothing more is written. A failure fails
the job with a code (:class:`JobFailed`'s, else ``generation_failed``) and message. :meth:`VideoWorker.stop` (the
replica stops gracefully) cancels its jobs and gives them back to the queue (:meth:`~deployments.videos.store.
VideoStore.release`), where another replica, or this one after a restart, claims them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection

import numpy as np

from .jobs import LeaseLost, VideoJob

__all__ = ["PROGRESS_EVERY_S", "PURGE_EVERY_S", "JobFailed", "VideoWorker"]

logger = logging.getLogger("ray.serve")

PROGRESS_EVERY_S = 0.5
"""Least seconds between two progress writes of one job (a tiny model's steps take milliseconds; Wan 2.1's a
second or more: one write per step)."""

PURGE_EVERY_S = 600.0
"""Seconds between the worker's deletions of expired jobs (:meth:`~deployments.videos.store.VideoStore.
purge_expired`)."""

Progress = Callable[[int, int], Awaitable[None]]
"""``on_progress(step, steps)``: the job's denoising progress, awaited by ``generate`` after each step."""


class JobFailed(Exception):
    """A job that cannot be made: it fails with ``code`` (``invalid_request``, ``server_unavailable`` ...) and
    ``message``, the job's ``error``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class VideoWorker:
    """Runs an ingress replica's share of the video jobs (see the module docstring).

    Args:
        store: the :class:`~deployments.videos.store.VideoStore`.
        owner: this worker's id in the store (the ingress replica's id).
        models: the model ids whose jobs it claims (the served model's).
        generate: ``await generate(job, on_progress)`` -> the job's (frames, height, width, 3) uint8 RGB frames;
            raises :class:`JobFailed` for a job that cannot be made (anything else fails it ``generation_failed``).
        max_running: most jobs it runs at once (``videos.max_running``).
        poll_s: seconds between looks for queued jobs while idle (``videos.poll_s``).
        encode: ``encode(frames, fps)`` -> an :class:`~deployments.videos.encode.EncodedVideo` (blocking; run in a
            thread); default :func:`~deployments.videos.encode.encode_video`.

    Raises:
        ValueError: ``max_running`` below 1 or ``poll_s`` not above 0.
    """

    def __init__(self, store, owner: str, models: Collection[str], generate: Callable[[VideoJob, Progress],
                 Awaitable[np.ndarray]], *, max_running: int = 2, poll_s: float = 1.0, encode=None):
        if max_running < 1 or not poll_s > 0:
            raise ValueError(f"max_running must be at least 1 and poll_s above 0, got {max_running} and {poll_s}")
        if encode is None:
            from .encode import encode_video as encode
        self.store, self.owner, self.models = store, owner, list(models)
        self.max_running, self.poll_s = max_running, poll_s
        self._generate, self._encode = generate, encode
        self._running: dict[str, asyncio.Task] = {}
        self._dropped: set[str] = set()
        self._wake = asyncio.Event()
        self._main: asyncio.Task | None = None
        self.completed = self.failed = self.dropped = 0

    # -- lifecycle --------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker's loop on the running event loop (once)."""
        if self._main is None:
            self._main = asyncio.get_running_loop().create_task(self._serve(), name=f"video-worker-{self.owner}")

    def wake(self) -> None:
        """Look for queued jobs now (a job was just created)."""
        self._wake.set()

    @property
    def running(self) -> list[str]:
        """The ids of the jobs running here."""
        return list(self._running)

    def drop(self, job_id: str) -> bool:
        """Stop running ``job_id`` at once, writing nothing more of it (it was cancelled or deleted); False when it
        does not run here."""
        task = self._running.get(job_id)
        if task is None:
            return False
        self._dropped.add(job_id)
        task.cancel()
        return True

    def _cancel_all(self) -> list[asyncio.Task]:
        tasks = [t for t in (self._main, *self._running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        return tasks

    async def stop(self) -> int:
        """Stop: cancel the loop and every job running here, wait for them, and give this worker's jobs back to the
        queue; returns how many went back."""
        tasks = self._cancel_all()
        await asyncio.gather(*tasks, return_exceptions=True)
        return await asyncio.to_thread(self.store.release, self.owner)

    def stop_now(self) -> int:
        """:meth:`stop` from synchronous code (a replica's ``__del__``): the tasks are cancelled (they stop at their
        next await and write nothing more) and the jobs given back at once; returns how many went back."""
        self._cancel_all()
        return self.store.release(self.owner)

    # -- the loop ---------------------------------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            found = await asyncio.to_thread(self.store.recover)
            logger.info("video worker %s: %s", self.owner, found)
        except Exception:  # noqa: BLE001 - the loop below retries the store
            logger.exception("video worker %s: recovering the job store failed", self.owner)
        purge_at = time.monotonic() + PURGE_EVERY_S
        while True:
            self._wake.clear()
            try:
                await self._fill()
                if time.monotonic() >= purge_at:
                    purge_at = time.monotonic() + PURGE_EVERY_S
                    await asyncio.to_thread(self.store.purge_expired)
            except Exception:  # noqa: BLE001 - a store that fails now may answer at the next look
                logger.exception("video worker %s: the job store failed; looking again in %g s", self.owner,
                                 self.poll_s)
            await self._wait()

    async def _wait(self) -> None:
        """Until :meth:`wake` or ``poll_s`` seconds. Not ``wait_for``: on Python 3.11 a cancel that meets its timeout
        can come out as the ``TimeoutError``, and the stop would be lost."""
        waiter = asyncio.get_running_loop().create_task(self._wake.wait())
        try:
            await asyncio.wait({waiter}, timeout=self.poll_s)
        finally:
            waiter.cancel()

    async def _fill(self) -> None:
        """Claim jobs while fewer than ``max_running`` run here."""
        while len(self._running) < self.max_running:
            job = await asyncio.to_thread(self.store.claim, self.owner, self.models)
            if job is None:
                return
            logger.info("video worker %s: claimed %s (attempt %d)", self.owner, job.id, job.attempts)
            self._running[job.id] = asyncio.get_running_loop().create_task(self._run(job), name=f"video-{job.id}")

    # -- one job ----------------------------------------------------------------------------------------------------

    async def _run(self, job: VideoJob) -> None:
        keeper = asyncio.get_running_loop().create_task(self._keep(job))
        try:
            files = await self._produce(job)
            await asyncio.to_thread(self.store.complete, job.id, self.owner, files)
            self.completed += 1
            logger.info("video worker %s: completed %s", self.owner, job.id)
        except asyncio.CancelledError:
            if job.id not in self._dropped:
                raise  # stopping: stop() gives the job back
            asyncio.current_task().uncancel()
            self.dropped += 1
            logger.info("video worker %s: dropped %s (cancelled, deleted or its lease lost)", self.owner, job.id)
        except LeaseLost as exc:
            self.dropped += 1
            logger.info("video worker %s: dropped %s: %s", self.owner, job.id, exc)
        except Exception as exc:  # noqa: BLE001 - the job fails; the worker goes on
            await self._fail(job, exc)
        finally:
            keeper.cancel()
            self._running.pop(job.id, None)
            self._dropped.discard(job.id)
            self._wake.set()  # a place is free

    async def _produce(self, job: VideoJob) -> dict[str, str]:
        """Generate, encode and write the job's files; returns ``{variant: file name}``."""
        written = {"progress": 0, "at": 0.0}

        async def on_progress(step: int, steps: int) -> None:
            pct = min(99, 100 * step // max(1, steps))
            now = time.monotonic()
            if pct > written["progress"] and now - written["at"] >= PROGRESS_EVERY_S:
                written.update(progress=pct, at=now)
                await asyncio.to_thread(self.store.progress, job.id, self.owner, pct)

        frames = await self._generate(job, on_progress)
        encoded = await asyncio.to_thread(self._encode, frames, float(job.params["fps"]))
        files = {}
        for variant, (name, data) in encoded.files().items():
            await asyncio.to_thread(self.store.write_file, job.id, name, data)
            files[variant] = name
        return files

    async def _keep(self, job: VideoJob) -> None:
        """Renew the job's lease every ``lease_s / 3`` seconds; drop the job when it is lost."""
        while True:
            await asyncio.sleep(self.store.lease_s / 3)
            try:
                await asyncio.to_thread(self.store.renew, job.id, self.owner)
            except LeaseLost:
                self.drop(job.id)
                return
            except Exception:  # noqa: BLE001 - a store hiccup; the lease lasts three periods
                logger.warning("video worker %s: renewing the lease of %s failed", self.owner, job.id, exc_info=True)

    async def _fail(self, job: VideoJob, exc: Exception) -> None:
        if isinstance(exc, JobFailed):
            code, message = exc.code, exc.message
        else:
            logger.error("video worker %s: %s failed", self.owner, job.id, exc_info=exc)
            code, message = "generation_failed", f"generation failed: {type(exc).__name__}: {exc}"[:1000]
        try:
            await asyncio.to_thread(self.store.fail, job.id, self.owner, code, message)
            self.failed += 1
        except LeaseLost:
            self.dropped += 1
        except Exception:  # noqa: BLE001 - the lease runs out and the job runs again
            logger.exception("video worker %s: recording the failure of %s failed", self.owner, job.id)
