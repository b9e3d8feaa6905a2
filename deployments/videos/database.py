"""The video job store's database: its one table (SQLAlchemy Core), the engine set up for several processes, and
the two kinds of transaction (:mod:`deployments.videos.store` uses them; docs/DESIGN.md section 13).

SQLite (the default, a file in the store's folder) runs in WAL mode, so readers never wait for the writer, with
``synchronous=FULL``, so a commit is on disk when it returns; pysqlite's own transaction handling is off and every
write transaction starts with ``BEGIN IMMEDIATE``, which takes the write lock at once (a deferred transaction that
reads and then writes can fail at once with "database is locked" when another process wrote in between; an
immediate one waits for the lock, up to 30 s). Any other SQLAlchemy URL (PostgreSQL is tested) is used as it comes,
at its default isolation level: the store's writes are compare-and-set updates that are correct at any level.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .config import database_url_text
from .jobs import JobError, JobStatus, VideoJob, VideoStoreError

__all__ = ["VIDEOS", "create_schema", "open_engine", "reading", "row_job", "writing"]

_WRITE = "bcg_write"  # execution option: this connection's transaction writes (SQLite: BEGIN IMMEDIATE)

METADATA = sa.MetaData()
VIDEOS = sa.Table(
    "bcg_videos", METADATA,
    sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(40), nullable=False, unique=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("progress", sa.Integer, nullable=False),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("prompt", sa.Text),
    sa.Column("seconds", sa.String(16), nullable=False),
    sa.Column("size", sa.String(32), nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("completed_at", sa.BigInteger),
    sa.Column("expires_at", sa.BigInteger),
    sa.Column("error_code", sa.String(64)),
    sa.Column("error_message", sa.Text),
    sa.Column("remixed_from_video_id", sa.String(40)),
    sa.Column("params", sa.Text, nullable=False),  # JSON object
    sa.Column("files", sa.Text, nullable=False),  # JSON {variant: file name}
    sa.Column("owner", sa.String(200)),
    sa.Column("lease_expires_at", sa.Float),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Index("ix_bcg_videos_status_seq", "status", "seq"),
    sqlite_autoincrement=True,  # a deleted last job's seq is never given again: list order stays creation order
)
"""The job table: one row a job; ``seq`` orders jobs by creation (the list's cursor), ``id`` is the API's."""
_c = VIDEOS.c


def row_job(row: Mapping[str, Any]) -> VideoJob:
    """The :class:`VideoJob` of a row of :data:`VIDEOS` (a ``.mappings()`` row)."""
    error = JobError(row["error_code"], row["error_message"] or "") if row["error_code"] else None
    return VideoJob(
        id=row["id"], status=JobStatus(row["status"]), progress=row["progress"], model=row["model"],
        prompt=row["prompt"], seconds=row["seconds"], size=row["size"], created_at=row["created_at"],
        completed_at=row["completed_at"], expires_at=row["expires_at"], error=error,
        remixed_from_video_id=row["remixed_from_video_id"], params=json.loads(row["params"]),
        files=json.loads(row["files"]), owner=row["owner"], lease_expires_at=row["lease_expires_at"],
        attempts=row["attempts"])


@contextmanager
def writing(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A write transaction on ``engine`` (SQLite: ``BEGIN IMMEDIATE``), committed at the end of the block."""
    with engine.connect() as conn, conn.execution_options(**{_WRITE: True}).begin():
        yield conn


@contextmanager
def reading(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection for reads (SQLite: a deferred transaction, which WAL serves without waiting for writers)."""
    with engine.connect() as conn:
        yield conn


def create_schema(engine: sa.Engine, database: str) -> None:
    """Create the job table in ``engine``'s database if absent (several replicas may race here: a loser finds it
    made); ``database`` names it in errors.

    Raises:
        VideoStoreError: a job table of another layout is there.
    """
    try:
        with writing(engine) as conn:
            METADATA.create_all(conn)
    except sa.exc.DBAPIError:
        if not sa.inspect(engine).has_table(VIDEOS.name):
            raise
    columns = {c["name"] for c in sa.inspect(engine).get_columns(VIDEOS.name)}
    missing = sorted(set(_c.keys()) - columns)
    if missing:
        raise VideoStoreError(f"the job table {VIDEOS.name!r} in {database} lacks columns {missing}: it was made by "
                              f"another version of bcg-serve; give videos.database_url or videos.folder a new database")


def open_engine(url: str) -> sa.Engine:
    """An engine for ``url``; SQLite set up for several processes (module docstring).

    Raises:
        ValueError: the URL's driver is not installed; VideoStoreError: the database cannot be opened, or SQLite
            cannot use WAL mode there.
    """
    parsed = sa.engine.make_url(url)
    sqlite = parsed.get_backend_name() == "sqlite"
    try:
        if sqlite:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            engine = sa.create_engine(parsed, connect_args={"timeout": 30.0, "check_same_thread": False})
        else:
            engine = sa.create_engine(parsed, pool_pre_ping=True)
    except ModuleNotFoundError as e:
        raise ValueError(f"videos.database_url {database_url_text(url)}: its driver {e.name!r} is not installed; for "
                         f"PostgreSQL use 'postgresql+psycopg://...' with pip install 'bcg-serve[postgres]'") from None
    if sqlite:
        @sa.event.listens_for(engine, "connect")
        def _connect(dbapi_conn, _record) -> None:
            dbapi_conn.isolation_level = None  # SQLAlchemy's begin event below issues BEGIN, not pysqlite
            cursor = dbapi_conn.cursor()
            mode = cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise VideoStoreError(f"SQLite cannot use WAL mode for {parsed.database!r} (it stays in {mode!r}): "
                                      f"put videos.folder on a local filesystem, or give videos.database_url")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.close()

        @sa.event.listens_for(engine, "begin")
        def _begin(conn) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")

    try:
        with engine.connect():
            pass
    except sa.exc.DBAPIError as e:
        raise VideoStoreError(f"cannot open the video job database {database_url_text(url)}: {e.orig}") from None
    return engine
