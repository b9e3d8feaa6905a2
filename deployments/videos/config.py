"""``videos``: where video jobs and their files are kept (:class:`~deployments.videos.store.VideoStore`,
docs/OPERATIONS.md "Video jobs", docs/DESIGN.md section 13)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["DEFAULT_FOLDER", "VideosConfig", "database_url_text"]

DEFAULT_FOLDER = "~/.local/share/bcg-serve/videos"
"""The store's folder unless configured: a per-user data folder (XDG's ``~/.local/share``), not ``/tmp``, which a
reboot may empty."""


def database_url_text(url: str) -> str:
    """``url`` with its password hidden (``postgresql+psycopg://user:***@host/db``), for errors and logs; a text
    SQLAlchemy cannot parse is shown as ``<unparsable URL>``."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparsable URL>"


class VideosConfig(BaseModel):
    """Video jobs (``/v1/videos``): the job store and the result files, read by every ingress replica.

    By default the jobs live in an SQLite database, ``jobs.sqlite3``, in ``folder``, with each job's files in
    ``folder/<job id>/``. Several ingress replicas on one host share it safely (SQLite's WAL mode and file locks).
    Replicas on several hosts need either a shared ``folder`` on a filesystem whose locks and shared memory work
    (SQLite's WAL mode needs both; most network filesystems have neither) or a ``database_url`` of a database server,
    with ``folder`` on storage every replica mounts (the result files are read from there).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)  # a URL may hold a password

    folder: str = Field(
        default=DEFAULT_FOLDER,
        description="Folder of the job store: each job's files in <folder>/<job id>/ (its input reference, "
        "video.mp4, thumbnail.webp, spritesheet.jpg) and, without database_url, the SQLite database jobs.sqlite3. "
        "'~' is the ingress user's home; created at start if absent. On several hosts it must be storage every "
        "ingress replica mounts.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL of the job database; None: SQLite in folder/jobs.sqlite3. For ingress replicas "
        "on several hosts: a database server, e.g. 'postgresql+psycopg://user:password@host/bcg' (pip install "
        "'bcg-serve[postgres]'). An SQLite URL must name an absolute file path; an in-memory database is refused.",
    )
    lease_s: float = Field(
        default=60.0, ge=1.0, le=3600.0,
        description="Seconds a worker holds a running job without renewing it (each progress update renews it). A "
        "job whose lease ran out (its replica died) goes back to the queue and runs again elsewhere.",
    )
    max_attempts: int = Field(
        default=3, ge=1, le=100,
        description="Times a job may start: one whose lease ran out this many times fails with code 'worker_lost' "
        "instead of going back to the queue (a job that kills every replica that runs it).",
    )
    retention_s: float | None = Field(
        default=7 * 86400.0, gt=0.0, le=10 * 365 * 86400.0,
        description="Seconds a finished job (completed or failed) and its files are kept after it finished: its "
        "expires_at; the store deletes it after that. None: kept until deleted (expires_at null).",
    )

    max_running: int = Field(
        default=2, ge=1, le=64,
        description="Jobs each ingress replica runs at once (its worker claims no more until one finishes); the "
        "rest wait queued, for this replica or another. Each running job is one request at a DiT replica, so keep "
        "it at or below the video buckets' largest batch size (the default table's: 2).",
    )
    poll_s: float = Field(
        default=1.0, gt=0.0, le=60.0,
        description="Seconds between an idle worker's looks for queued jobs (jobs created through this replica are "
        "claimed at once; those of other replicas, and jobs whose lease ran out, within this).",
    )
    fps: float | None = Field(
        default=None, gt=0.0, le=240.0,
        description="Frames per second of the videos: a request's seconds s asks for 1 + s x fps frames, and the MP4 "
        "plays at fps. None: the model's published rate (Wan 2.1: 16).",
    )
    poll_after_ms: int = Field(
        default=1000, ge=100, le=60000,
        description="openai-poll-after-ms of GET /v1/videos/{id} while a job is queued or in progress: how long the "
        "openai client's poll() waits before asking again.",
    )

    @field_validator("folder")
    @classmethod
    def _folder(cls, folder: str) -> str:
        if not folder.strip() or "\0" in folder:
            raise ValueError("must be a folder path, e.g. '/var/lib/bcg-serve/videos'")
        return folder

    @field_validator("database_url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            parsed = make_url(url)
        except ArgumentError:
            raise ValueError("not an SQLAlchemy URL; e.g. 'sqlite:////var/lib/bcg/jobs.sqlite3'"
                             " or 'postgresql+psycopg://user:password@host/bcg'") from None
        if parsed.get_backend_name() == "sqlite":
            db = parsed.database or ""
            if db in ("", ":memory:") or db.startswith("file::memory:") or "mode=memory" in db:
                raise ValueError(f"{database_url_text(url)} is an in-memory database: its jobs "
                                 f"would be lost at restart and unseen by other replicas; name a file, e.g. "
                                 f"'sqlite:////var/lib/bcg/jobs.sqlite3', or leave it out for folder/jobs.sqlite3")
            if not db.startswith("/"):
                raise ValueError(f"{database_url_text(url)} names a relative file, which each "
                                 f"replica would resolve against its own working folder; give an absolute path: "
                                 f"'sqlite:////abs/path/jobs.sqlite3' (four slashes)")
        return url
