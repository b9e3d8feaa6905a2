"""deployments/videos/store.py: video jobs that survive restarts and replicas.

SQLite in a temporary folder (the default store) with an injected clock for leases and expiry; claim races between
store objects in threads and between forked processes; and the same store on a real PostgreSQL server started by the
test (``pgserver`` bundles its binaries; skipped, saying why, where it is not installed or cannot start).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")

from deployments.settings import error_text, load_config  # noqa: E402
from deployments.videos import (  # noqa: E402
    JobNotFound,
    JobStateError,
    JobStatus,
    LeaseLost,
    Recovery,
    UnknownCursor,
    VideoStore,
)

LEASE_S = 10.0
RETENTION_S = 100.0
JOB = dict(prompt="a red fox in snow", model="wan2.1-t2v", seconds="4", size="1280x720")


class Clock:
    """A settable Unix clock in seconds."""

    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _store(folder: Path, clock: Clock, url: str | None = None) -> VideoStore:
    return VideoStore(folder, url, lease_s=LEASE_S, max_attempts=2, retention_s=RETENTION_S, clock=clock)


@pytest.fixture
def store(tmp_path, clock):
    with _store(tmp_path / "videos", clock) as s:
        yield s


def _finish(store: VideoStore, owner: str = "w1"):
    """Create, claim and complete a job with all three files; the completed job."""
    store.create(**JOB)
    job = store.claim(owner)
    for name in ("video.mp4", "thumbnail.webp", "spritesheet.jpg"):
        store.write_file(job.id, name, name.encode())
    return store.complete(job.id, owner, {"video": "video.mp4", "thumbnail": "thumbnail.webp",
                                          "spritesheet": store.files.folder(job.id) / "spritesheet.jpg"})


def test_every_accepted_job_is_seen_by_a_new_store_on_the_same_folder(tmp_path, clock):
    from openai.types import Video

    folder = tmp_path / "videos"
    with _store(folder, clock) as first:
        made = [first.create(**JOB, params={"steps": 4, "seed": 7}, inputs={"input_reference.png": b"\x89PNG"}),
                first.create(**{**JOB, "prompt": None, "seconds": "5.06", "size": "832x480"})]
        first.claim("w1")
    with _store(folder, clock) as second:  # a restart, or another replica
        seen = [second.get(job.id) for job in made]
        assert [j.status for j in seen] == [JobStatus.IN_PROGRESS, JobStatus.QUEUED]
        assert seen[0].params == {"steps": 4, "seed": 7} and seen[0].owner == "w1" and seen[0].attempts == 1
        assert (second.files.folder(made[0].id) / "input_reference.png").read_bytes() == b"\x89PNG"
        assert seen[1] == made[1]
        assert [j.id for j in second.list(order="asc").data] == [j.id for j in made]
    api = seen[1].to_api()
    assert api == {"id": made[1].id, "object": "video", "created_at": int(clock.now), "completed_at": None,
                   "expires_at": None, "status": "queued", "progress": 0, "model": "wan2.1-t2v", "prompt": None,
                   "seconds": "5.06", "size": "832x480", "error": None, "remixed_from_video_id": None}
    Video.model_validate(seen[0].to_api())  # the client's own type, strictly (its size is one of OpenAI's)
    assert made[0].id.startswith("video_") and len(made[0].id) == 38


def test_the_list_pages_through_every_job_once_in_both_orders(store):
    ids = [store.create(**JOB).id for _ in range(7)]
    for order, expected in (("asc", ids), ("desc", ids[::-1])):
        seen, after, more = [], None, []
        while True:
            page = store.list(after=after, limit=3, order=order)
            assert page.first_id == page.data[0].id and page.last_id == page.data[-1].id
            seen += [j.id for j in page.data]
            more.append(page.has_more)
            if not page.has_more:
                break
            after = page.last_id
        assert seen == expected and more == [True, True, False], order
    assert [j.id for j in store.list().data] == ids[::-1]  # desc, 20, by default
    body = store.list(limit=7, order="asc").to_api()
    assert (body["object"], body["first_id"], body["last_id"], body["has_more"]) == ("list", ids[0], ids[-1], False)
    assert [d["id"] for d in body["data"]] == ids
    store.delete(ids[3])
    assert [j.id for j in store.list(after=ids[1], limit=2, order="asc").data] == [ids[2], ids[4]]


def test_list_refuses_bad_arguments(store):
    store.create(**JOB)
    for kwargs, needle in (({"limit": 0}, "limit 0 must be an integer from 1 to 100"), ({"limit": 101}, "limit 101"),
                           ({"limit": "5"}, "limit '5'"), ({"order": "up"}, "order 'up' is not one of 'asc', 'desc'")):
        with pytest.raises(ValueError, match=needle):
            store.list(**kwargs)
    with pytest.raises(UnknownCursor, match="names no video"):
        store.list(after="video_" + "0" * 32)


def _claim_all(store: VideoStore, owner: str, out: list) -> None:
    try:
        while (job := store.claim(owner)) is not None:
            out.append(job.id)
    except Exception as e:  # recorded: a thread's exception would not fail the test
        out.append(e)


def _race(stores: list[VideoStore], workers: int = 4) -> list[str]:
    """Every queued job claimed by ``workers`` threads over ``stores``; the ids each claimed, all of them together
    (asserting that no thread failed)."""
    got: list[list] = [[] for _ in range(workers)]
    threads = [threading.Thread(target=_claim_all, args=(stores[i % len(stores)], f"w{i}", got[i]))
               for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claimed = [x for ids in got for x in ids]
    assert not [x for x in claimed if isinstance(x, Exception)]
    return claimed


def test_workers_of_separate_stores_in_threads_never_claim_the_same_job(tmp_path, clock):
    folder = tmp_path / "videos"
    stores = [_store(folder, clock) for _ in range(2)]
    ids = {stores[0].create(**JOB).id for _ in range(24)}
    claimed = _race(stores)
    assert sorted(claimed) == sorted(ids)  # each job once, none lost
    assert {stores[1].get(i).status for i in ids} == {JobStatus.IN_PROGRESS}
    for s in stores:
        s.close()


def _claim_in_child(folder: str, owner: str, queue) -> None:
    with VideoStore(folder, lease_s=LEASE_S) as store:  # a store of the child's own, as a replica's
        out: list = []
        _claim_all(store, owner, out)
        queue.put((owner, out))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork (Linux)")
def test_workers_in_two_processes_never_claim_the_same_job(tmp_path, clock):
    folder = tmp_path / "videos"
    with _store(folder, clock) as store:
        ids = {store.create(**JOB).id for _ in range(30)}
    ctx = multiprocessing.get_context("fork")  # the parent's imports, none of its connections: each opens its own
    queue = ctx.Queue()
    children = [ctx.Process(target=_claim_in_child, args=(str(folder), f"p{i}", queue)) for i in range(2)]
    for p in children:
        p.start()
    results = dict(queue.get(timeout=30) for _ in children)
    for p in children:
        p.join(timeout=60)
    claimed = results["p0"] + results["p1"]
    assert sorted(claimed) == sorted(ids) and all(p.exitcode == 0 for p in children)


def test_a_lapsed_lease_requeues_the_job_and_its_old_worker_loses_it(store, clock):
    job = store.create(**JOB)
    assert store.claim("w1").id == job.id and store.claim("w2") is None
    store.progress(job.id, "w1", 40)
    clock.now += LEASE_S + 1  # w1's replica died
    assert store.get(job.id).status is JobStatus.IN_PROGRESS  # until someone looks
    again = store.claim("w2")
    assert (again.id, again.owner, again.attempts, again.progress) == (job.id, "w2", 2, 0)
    with pytest.raises(LeaseLost, match="held by 'w2'"):
        store.progress(job.id, "w1", 50)
    with pytest.raises(LeaseLost):
        store.complete(job.id, "w1", {"video": store.write_file(job.id, "video.mp4", b"x")})
    store.progress(job.id, "w2", 10)
    clock.now += LEASE_S + 1  # w2 died too: max_attempts (2) claims spent
    assert store.claim("w3") is None
    failed = store.get(job.id)
    assert failed.status is JobStatus.FAILED and failed.error.code == "worker_lost" and failed.owner is None
    assert failed.expires_at == int(clock.now) + RETENTION_S


def test_progress_and_renew_extend_the_lease(store, clock):
    job = store.create(**JOB)
    store.claim("w1")
    for _ in range(3):
        clock.now += LEASE_S * 0.8
        store.renew(job.id, "w1")
    clock.now += LEASE_S * 0.8
    store.progress(job.id, "w1", 60)
    clock.now += LEASE_S * 0.8  # 4 leases since the claim, 0.8 of one since the last update
    assert store.claim("w2") is None
    assert (store.get(job.id).owner, store.get(job.id).progress) == ("w1", 60)


def test_recover_requeues_lapsed_jobs_and_removes_expired_jobs_and_orphan_folders(tmp_path, clock):
    folder = tmp_path / "videos"
    with _store(folder, clock) as store:
        done = _finish(store)
        running = store.create(**JOB)
        store.claim("w1")
        orphan, fresh = store.files.folder("video_" + "a" * 32), store.files.folder("video_" + "b" * 32)
        for f in (orphan, fresh):
            f.mkdir()
        os.utime(orphan, (clock.now - 7200, clock.now - 7200))
        os.utime(fresh, (clock.now - 60, clock.now - 60))
    clock.now += RETENTION_S + 1  # the server was down: the lease ran out, the finished job expired
    with _store(folder, clock) as store:
        assert store.recover() == Recovery(requeued=1, failed=0, purged=1, orphans=1)
        assert store.get(running.id).status is JobStatus.QUEUED
        with pytest.raises(JobNotFound):
            store.get(done.id)
        assert not store.files.folder(done.id).exists() and not orphan.exists() and fresh.exists()
        assert store.recover() == Recovery(0, 0, 0, 0)


def test_a_completed_jobs_files_are_written_atomically_and_served_by_variant(store):
    job = _finish(store)
    assert (job.status, job.progress, job.completed_at, job.owner) == (JobStatus.COMPLETED, 100, job.created_at, None)
    assert job.expires_at == job.completed_at + RETENTION_S
    assert [(store.result(job.id, v).path.name, store.result(job.id, v).media_type)
            for v in ("video", "thumbnail", "spritesheet")] == [
        ("video.mp4", "video/mp4"), ("thumbnail.webp", "image/webp"), ("spritesheet.jpg", "image/jpeg")]
    assert store.result(job.id).path.read_bytes() == b"video.mp4"
    store.write_file(job.id, "video.mp4", b"second")  # replaced whole
    assert store.result(job.id).path.read_bytes() == b"second"
    assert sorted(p.name for p in store.files.folder(job.id).iterdir()) == [
        "spritesheet.jpg", "thumbnail.webp", "video.mp4"]  # no temporary file left
    with pytest.raises(ValueError, match="variant 'poster' is not one of video, thumbnail, spritesheet"):
        store.result(job.id, "poster")
    queued = store.create(**JOB)
    with pytest.raises(JobStateError, match="is queued; its content is ready once it is completed"):
        store.result(queued.id)


def test_complete_refuses_missing_or_foreign_files(store, tmp_path):
    job = store.create(**JOB)
    store.claim("w1")
    store.write_file(job.id, "thumbnail.webp", b"t")
    (tmp_path / "video.mp4").write_bytes(b"v")
    for files, needle in (({"thumbnail": "thumbnail.webp"}, "'video' required"),
                          ({"video": "video.mp4"}, "does not exist; write it first"),
                          ({"video": tmp_path / "video.mp4"}, "is not in the job's folder"),
                          ({"video": "thumbnail.webp", "poster": "thumbnail.webp"}, "poster")):
        with pytest.raises(ValueError, match=needle):
            store.complete(job.id, "w1", files)
    assert store.get(job.id).status is JobStatus.IN_PROGRESS


def test_fail_records_openais_error_object(store, clock):
    job = store.create(**JOB)
    store.claim("w1")
    with pytest.raises(ValueError, match="error code 'Bad Code'"):
        store.fail(job.id, "w1", "Bad Code", "x")
    failed = store.fail(job.id, "w1", "generation_failed", "CUDA out of memory")
    assert failed.to_api()["error"] == {"code": "generation_failed", "message": "CUDA out of memory"}
    assert (failed.status, failed.completed_at) == (JobStatus.FAILED, int(clock.now))
    with pytest.raises(LeaseLost, match="it is failed"):
        store.progress(job.id, "w1", 90)


def test_cancel_fails_queued_and_running_jobs_and_stops_the_worker(store):
    queued, running = store.create(**JOB), store.create(**JOB)
    store.claim("w1")  # takes the oldest: queued
    queued, running = running, queued
    assert store.cancel(queued.id).error.code == "cancelled"
    cancelled = store.cancel(running.id)
    assert (cancelled.status, cancelled.error.code, cancelled.owner) == (JobStatus.FAILED, "cancelled", None)
    with pytest.raises(LeaseLost, match="was cancelled"):
        store.progress(running.id, "w1", 20)
    with pytest.raises(JobStateError, match="already failed"):
        store.cancel(running.id)
    with pytest.raises(JobNotFound):
        store.cancel("video_" + "c" * 32)
    assert store.claim("w2") is None


def test_delete_removes_the_job_and_its_files_even_while_it_runs(store):
    done = _finish(store)
    folder = store.files.folder(done.id)
    assert folder.is_dir()
    store.delete(done.id)
    assert not folder.exists()
    with pytest.raises(JobNotFound):
        store.get(done.id)
    with pytest.raises(JobNotFound):
        store.delete(done.id)
    running = store.create(**JOB)
    store.claim("w1")
    store.delete(running.id)
    store.write_file(running.id, "video.mp4", b"late")  # the worker did not know yet
    with pytest.raises(LeaseLost, match="was deleted"):
        store.complete(running.id, "w1", {"video": "video.mp4"})
    assert not store.files.folder(running.id).exists()
    assert store.counts() == {"queued": 0, "in_progress": 0, "completed": 0, "failed": 0}


def test_a_claim_takes_the_oldest_queued_job_of_the_models_asked(store):
    a = store.create(**JOB)
    b = store.create(**{**JOB, "model": "wan2.1-i2v"})
    c = store.create(**JOB)
    assert store.claim("w1", models=["wan2.1-i2v"]).id == b.id
    assert store.claim("w1", models={"other"}) is None
    assert [store.claim("w2").id, store.claim("w2").id, store.claim("w2")] == [a.id, c.id, None]
    with pytest.raises(ValueError, match=r"models must be a collection of model ids, e.g. \['wan'\]"):
        store.claim("w3", models="wan")


def test_release_gives_a_stopping_workers_jobs_back_without_counting_the_attempt(store):
    a, b = store.create(**JOB), store.create(**JOB)
    store.claim("w1"), store.claim("w1")
    assert store.release("w1") == 2
    assert [(j.status, j.owner, j.attempts) for j in map(store.get, (a.id, b.id))] == [(JobStatus.QUEUED, None, 0)] * 2


@pytest.mark.parametrize("kwargs, needle", [
    ({"size": "1280by720"}, "size '1280by720' is not of the form 'WxH'"),
    ({"seconds": "four"}, "seconds 'four' must be a positive decimal string"),
    ({"seconds": 4}, "seconds '4' must be a positive decimal string"),
    ({"seconds": "0"}, "seconds '0'"),
    ({"model": ""}, "model must be a non-empty string"),
    ({"prompt": 7}, "prompt must be a non-empty string"),
    ({"params": {"seed": object()}}, "params must hold JSON values only"),
    ({"params": {"guidance": float("nan")}}, "params must hold JSON values only"),
    ({"params": ["steps"]}, "params must be a mapping"),
    ({"inputs": {"../x.png": b""}}, "file name '../x.png' is not a plain file name"),
    ({"inputs": {"ref.png": "text"}}, "data must be bytes"),
    ({"remixed_from_video_id": "vid_1"}, "an id is 'video_' and 32 hex digits"),
])
def test_create_refuses_bad_input_naming_the_field_and_leaves_nothing(store, kwargs, needle):
    with pytest.raises((ValueError, JobNotFound)) as e:
        store.create(**{**JOB, **kwargs})
    assert needle in str(e.value)
    assert store.counts()["queued"] == 0 and store.files.folders() == {}


def test_bad_ids_owners_and_progress_are_refused(store):
    with pytest.raises(JobNotFound, match="no video 'video_1'"):
        store.get("video_1")
    job = store.create(**JOB)
    store.claim("w1")
    for value in (101, -1, 5.5, True):
        with pytest.raises(ValueError, match="progress .* must be an integer from 0 to 100"):
            store.progress(job.id, "w1", value)
    with pytest.raises(ValueError, match="owner must be a non-empty string"):
        store.claim("")


def test_store_and_config_refuse_unusable_places(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        VideoStore(tmp_path / "file")
    with pytest.raises(ValueError, match="database_url: sqlite:// is an in-memory database"):
        VideoStore(tmp_path / "v", "sqlite://")
    with pytest.raises(ValueError, match="driver 'pg8000' is not installed") if _missing("pg8000") else _nothing():
        VideoStore(tmp_path / "v", "postgresql+pg8000://u:secret@localhost/db")
    for videos, needle in (
            ({"database_url": "sqlite:///jobs.db"}, "videos.database_url: sqlite:///jobs.db names a relative file"),
            ({"database_url": "postgres ql://"}, "videos.database_url: not an SQLAlchemy URL"),
            ({"lease_s": 0}, "videos.lease_s: Input should be greater than or equal to 1"),
            ({"retention": 5}, "videos.retention: unknown field (did you mean 'retention_s'?)"),
            ({"database_url": "postgresql+psycopg://u:secret@h/db", "folder": ""}, "videos.folder: must be a folder")):
        with pytest.raises(ValueError) as e:
            load_config({"videos": videos})
        assert needle in error_text(e.value) and "secret" not in error_text(e.value)
    assert load_config({}).videos.database_url is None


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- PostgreSQL: a real server, started here -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server of ``pgserver`` (bundled binaries) in a temporary folder; its SQLAlchemy URL factory.

    The folder is not pytest's ``tmp_path``: pytest removes old ``pytest-<n>`` folders when a run starts, and another
    run starting on the same machine could remove the server's data folder under it."""
    import tempfile

    pgserver = pytest.importorskip("pgserver", reason="pgserver (test extra) not installed")
    pytest.importorskip("psycopg", reason="psycopg (test extra) not installed")
    with tempfile.TemporaryDirectory(prefix="bcg-pg-") as folder:
        try:
            server = pgserver.get_server(folder, cleanup_mode="stop")
        except Exception as e:  # no binaries for this platform, no shared memory ...: say so and skip
            pytest.skip(f"pgserver could not start PostgreSQL here: {type(e).__name__}: {e}")

        def database(name: str) -> str:
            server.psql(f"CREATE DATABASE {name};")
            return server.get_uri(name).replace("postgresql://", "postgresql+psycopg://", 1)

        try:
            yield database
        finally:
            server.cleanup()


def test_a_postgresql_server_keeps_jobs_for_replicas_that_race_for_them(postgres, tmp_path, clock):
    url = postgres("videos_race")
    folder = tmp_path / "shared"
    stores = [_store(folder, clock, url) for _ in range(2)]  # two ingress replicas, one database
    ids = [stores[0].create(**JOB).id for _ in range(16)]
    assert sorted(_race(stores)) == sorted(ids)
    job = stores[1].get(ids[0])
    stores[1].write_file(job.id, "video.mp4", b"v")
    assert stores[0].complete(job.id, job.owner, {"video": "video.mp4"}).status is JobStatus.COMPLETED
    clock.now += LEASE_S + 1
    assert stores[1].recover().requeued == 15
    pages = [stores[0].list(limit=10, order="asc")]
    pages.append(stores[1].list(after=pages[0].last_id, limit=10, order="asc"))
    assert [j.id for p in pages for j in p.data] == ids and [p.has_more for p in pages] == [True, False]
    for s in stores:
        s.close()
    with _store(folder, clock, url) as restarted:
        assert restarted.counts() == {"queued": 15, "in_progress": 0, "completed": 1, "failed": 0}
