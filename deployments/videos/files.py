"""The files of video jobs: ``<root>/<job id>/<name>``, each written atomically (a temporary file in the same folder,
flushed to disk, then renamed over the name), so a reader never sees half a file and a crash leaves either the old
file or the new one (plus, at worst, a hidden ``.<name>.<random>.tmp`` that the job's removal takes with it)."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from .jobs import JOB_ID, check_job_id

__all__ = ["FILE_NAME", "MEDIA_TYPES", "JobFiles", "media_type"]

FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}(\.[A-Za-z0-9]{1,8})?$")
"""A job's file name: letters, digits, ``_`` and ``-`` (not first), and one extension; no folder, no dot first."""

MEDIA_TYPES = {"mp4": "video/mp4", "webp": "image/webp", "jpg": "image/jpeg", "jpeg": "image/jpeg",
               "png": "image/png"}
"""Media type of a file by its extension (what a download answers as ``Content-Type``)."""


def media_type(name: str) -> str:
    """The media type of file ``name`` by its extension; ``application/octet-stream`` for any other."""
    return MEDIA_TYPES.get(name.rsplit(".", 1)[-1].lower() if "." in name else "", "application/octet-stream")


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JobFiles:
    """The job folders under ``root``.

    Args:
        root: the store's folder (created, with parents, if absent).

    Raises:
        ValueError: ``root`` exists and is not a folder, or cannot be written (naming it).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"videos.folder {str(self.root)!r} is a file, not a folder")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"videos.folder {str(self.root)!r} cannot be created: {e.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"videos.folder {str(self.root)!r} is not writable by this process (user id "
                             f"{os.getuid()})")

    def folder(self, job_id: str) -> Path:
        """``root/<job_id>`` (not created). Raises JobNotFound for a malformed id."""
        return self.root / check_job_id(job_id)

    def path(self, job_id: str, name: str) -> Path:
        """The path of file ``name`` of job ``job_id``.

        Raises:
            ValueError: ``name`` is not a plain file name (:data:`FILE_NAME`).
        """
        if not isinstance(name, str) or not FILE_NAME.match(name):
            raise ValueError(f"file name {str(name)[:80]!r} is not a plain file name (letters, digits, '_', '-' and "
                             f"one extension, e.g. 'video.mp4')")
        return self.folder(job_id) / name

    def write(self, job_id: str, name: str, data: bytes) -> Path:
        """Write ``data`` as file ``name`` of job ``job_id``, atomically (module docstring); returns its path.

        Raises:
            ValueError: a bad name, or ``data`` not bytes.
            OSError: the disk refused it (the temporary file is removed).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"file {name!r}: data must be bytes, got {type(data).__name__}")
        target = self.path(job_id, name)
        target.parent.mkdir(exist_ok=True)
        tmp = target.parent / f".{name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_folder(target.parent)
        return target

    def name_of(self, job_id: str, path: str | os.PathLike) -> str:
        """The file name of ``path``, a file of job ``job_id`` given by name or by a path inside its folder.

        Raises:
            ValueError: the path lies outside the job's folder, is not a plain file name, or no such file exists.
        """
        p = Path(path)
        folder = self.folder(job_id)
        if p.is_absolute() or len(p.parts) > 1:
            if p.resolve().parent != folder.resolve():
                raise ValueError(f"result file {str(path)!r} is not in the job's folder {str(folder)!r}")
        target = self.path(job_id, p.name)
        if not target.is_file():
            raise ValueError(f"result file {str(target)!r} does not exist; write it first (VideoStore.write_file)")
        return p.name

    def remove(self, job_id: str) -> bool:
        """Delete job ``job_id``'s folder and everything in it; False if it had none."""
        folder = self.folder(job_id)
        if not folder.exists():
            return False
        shutil.rmtree(folder, ignore_errors=True)
        return True

    def folders(self) -> dict[str, float]:
        """``{job id: modification time (Unix seconds)}`` of every job folder under ``root``."""
        out = {}
        for entry in os.scandir(self.root):
            if entry.is_dir(follow_symlinks=False) and JOB_ID.match(entry.name):
                try:
                    out[entry.name] = entry.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:  # removed meanwhile
                    continue
        return out
