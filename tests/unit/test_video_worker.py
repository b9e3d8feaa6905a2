"""The video worker (:class:`deployments.videos.worker.VideoWorker`) on a real job store in a temporary folder, with
scripted generations instead of a DiT: at most ``max_running`` jobs at once, a failure recorded with its code, a job
whose lease is lost (deleted through another replica) dropped without a file, a graceful stop that gives the running
job back to the queue for another worker, and a restart that re-runs the job of a worker that died once its lease ran
out."""

from __future__ import annotations

import asyncio

import numpy as np

from deployments.videos import worker as worker_module
from deployments.videos.jobs import JobStatus, LeaseLost
from deployments.videos.store import VideoStore
from deployments.videos.worker import JobFailed, VideoWorker

FRAMES = np.zeros((5, 32, 48, 3), np.uint8)


def _store(folder, clock=None) -> VideoStore:
    return VideoStore(folder, lease_s=1.0, **({"clock": clock} if clock else {}))


def _job(store: VideoStore, prompt: str = "a clip"):
    return store.create(prompt=prompt, model="m", seconds="1", size="48x32", params={"fps": 4.0})


async def _until(check, tries: int = 300, wait_s: float = 0.01):
    """Wait until ``check()`` is true, at most ``tries`` x ``wait_s`` seconds; returns its last value."""
    for _ in range(tries):
        if (got := check()):
            return got
        await asyncio.sleep(wait_s)
    return check()


def test_at_most_max_running_jobs_run_at_once_and_every_job_completes(tmp_path):
    store = _store(tmp_path)
    jobs = [_job(store, f"clip {i}") for i in range(3)]
    gate = asyncio.Event()
    most = {"now": 0, "peak": 0}

    async def generate(job, on_progress):
        most["now"] += 1
        most["peak"] = max(most["peak"], most["now"])
        await on_progress(1, 2)
        await gate.wait()
        most["now"] -= 1
        return FRAMES

    async def run():
        worker = VideoWorker(store, "w1", ["m"], generate, max_running=2, poll_s=0.01)
        worker.start()
        await _until(lambda: len(worker.running) == 2)
        await asyncio.sleep(0.05)  # a third would have been claimed by now
        waiting = store.counts()
        gate.set()
        await _until(lambda: worker.completed == 3)
        await worker.stop()
        return worker, waiting

    worker, waiting = asyncio.run(run())
    assert most["peak"] == 2 and waiting["queued"] == 1 and waiting["in_progress"] == 2
    assert [store.get(j.id).status for j in jobs] == [JobStatus.COMPLETED] * 3
    assert set(store.get(jobs[0].id).files) == {"video", "thumbnail", "spritesheet"}


def test_a_failure_is_recorded_with_its_code_and_the_worker_goes_on(tmp_path):
    store = _store(tmp_path)
    bad, broken, good = _job(store, "bad"), _job(store, "broken"), _job(store, "good")

    async def generate(job, on_progress):
        if job.prompt == "bad":
            raise JobFailed("invalid_request", "invalid 'size': no longer served")
        if job.prompt == "broken":
            raise RuntimeError("the VAE broke")
        return FRAMES

    async def run():
        worker = VideoWorker(store, "w1", ["m"], generate, max_running=1, poll_s=0.01)
        worker.start()
        await _until(lambda: worker.completed + worker.failed == 3)
        await worker.stop()
        return worker

    worker = asyncio.run(run())
    assert (worker.failed, worker.completed) == (2, 1)
    assert store.get(bad.id).error.code == "invalid_request" and "no longer served" in store.get(bad.id).error.message
    assert store.get(broken.id).error.code == "generation_failed"
    assert "RuntimeError: the VAE broke" in store.get(broken.id).error.message
    assert store.get(good.id).status is JobStatus.COMPLETED


def test_a_job_deleted_elsewhere_is_dropped_at_its_next_progress_without_files(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_module, "PROGRESS_EVERY_S", 0.0)
    store = VideoStore(tmp_path, lease_s=60.0)  # no renewal comes first
    job = _job(store)
    seen = []

    async def generate(job, on_progress):
        await on_progress(1, 4)
        store.delete(job.id)  # another replica deletes it mid-run
        try:
            await on_progress(2, 4)
        except LeaseLost as exc:
            seen.append(exc)
            raise
        return FRAMES

    async def run():
        worker = VideoWorker(store, "w1", ["m"], generate, poll_s=0.01)
        worker.start()
        await _until(lambda: worker.dropped == 1)
        await worker.stop()
        return worker

    worker = asyncio.run(run())
    assert worker.dropped == 1 and worker.completed == worker.failed == 0 and "was deleted" in str(seen[0])
    assert not store.files.folder(job.id).exists()


def test_a_job_cancelled_elsewhere_between_steps_is_dropped_at_its_next_lease_renewal(tmp_path):
    store = _store(tmp_path)  # lease_s 1: the keeper renews every third of a second
    job = _job(store)
    stopped = []

    async def generate(job, on_progress):
        store.cancel(job.id)  # another replica cancels it while no step reports (a VAE decode, a queue)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            stopped.append(job.id)
            raise
        return FRAMES

    async def run():
        worker = VideoWorker(store, "w1", ["m"], generate, poll_s=0.01)
        worker.start()
        await _until(lambda: worker.dropped == 1, tries=200)
        await worker.stop()
        return worker

    worker = asyncio.run(run())
    assert stopped == [job.id] and worker.dropped == 1 and store.get(job.id).error.code == "cancelled"


def test_a_graceful_stop_gives_the_running_job_back_and_another_worker_completes_it(tmp_path):
    """``stop_now`` (the ingress's ``__del__``): the job goes back to the queue at once, its generation is cancelled."""
    store = _store(tmp_path)
    job = _job(store)
    started = asyncio.Event()
    calls = []

    async def stuck(job, on_progress):
        calls.append("stuck")
        started.set()
        await asyncio.Event().wait()  # never done: it is cancelled by the stop

    async def quick(job, on_progress):
        calls.append("quick")
        return FRAMES

    async def run():
        first = VideoWorker(store, "w1", ["m"], stuck, poll_s=0.01)
        first.start()
        await asyncio.wait_for(started.wait(), 5)
        released = first.stop_now()  # as the ingress's __del__ calls it when Serve stops the replica
        back = store.get(job.id)
        await _until(lambda: not first.running)  # its generation's task was cancelled
        second = VideoWorker(store, "w2", ["m"], quick, poll_s=0.01)
        second.start()
        await _until(lambda: second.completed == 1)
        await second.stop()
        return released, back

    released, back = asyncio.run(run())
    assert released == 1 and back.status is JobStatus.QUEUED and back.attempts == 0  # a stop is no attempt
    assert calls == ["stuck", "quick"] and store.get(job.id).status is JobStatus.COMPLETED


def test_after_a_restart_the_job_of_a_dead_worker_runs_again_once_its_lease_ran_out(tmp_path):
    now = [1_000_000.0]
    store = _store(tmp_path, clock=lambda: now[0])
    job = _job(store)
    assert store.claim("dead-replica", ["m"]).id == job.id  # claimed, then its replica died

    async def generate(job, on_progress):
        return FRAMES

    async def run():
        worker = VideoWorker(store, "w2", ["m"], generate, poll_s=0.01)
        worker.start()
        await asyncio.sleep(0.05)
        held = store.get(job.id).owner  # its lease has not run out: nobody takes it
        now[0] += 5.0  # past lease_s
        await _until(lambda: worker.completed == 1)
        await worker.stop()
        return held

    held = asyncio.run(run())
    done = store.get(job.id)
    assert held == "dead-replica" and done.status is JobStatus.COMPLETED and done.attempts == 2
