"""Video jobs for ``/v1/videos`` (OpenAI's Videos API): the job store that keeps them across restarts and replicas
(:mod:`~deployments.videos.store`, SQLAlchemy), the H.264 encoder of their results (:mod:`~deployments.videos.encode`,
PyAV), the ``videos`` config section (:mod:`~deployments.videos.config`), the routes' answers
(:mod:`~deployments.videos.routes`; the body: :mod:`~deployments.videos.create`; sizes and seconds:
:mod:`~deployments.videos.options`) and the worker of each ingress replica that runs the jobs
(:mod:`~deployments.videos.worker`, through :mod:`~deployments.videos.generation`). docs/DESIGN.md section 13.

Names are re-exported lazily: importing this package (the config does) loads neither SQLAlchemy nor PyAV.
"""

from __future__ import annotations

import importlib

__all__ = [
    "CANCELLED", "DEFAULT_FOLDER", "MAX_LIST_LIMIT", "THUMBNAIL_FORMATS", "VARIANTS", "WORKER_LOST", "EncodedVideo",
    "JobError", "JobFailed", "JobNotFound", "JobStateError", "JobStatus", "LeaseLost", "Recovery", "ResultFile",
    "UnknownCursor", "VideoJob", "VideoOptions", "VideoPage", "VideoRoutes", "VideoShape", "VideoStore",
    "VideoStoreError", "VideoWorker", "VideosConfig", "encode_mp4", "encode_video", "float_frames_to_uint8",
    "spritesheet", "thumbnail",
]

_WHERE = {
    "config": ("DEFAULT_FOLDER", "VideosConfig"),
    "jobs": ("CANCELLED", "VARIANTS", "WORKER_LOST", "JobError", "JobNotFound", "JobStateError", "JobStatus",
             "LeaseLost", "UnknownCursor", "VideoJob", "VideoPage", "VideoStoreError"),
    "store": ("MAX_LIST_LIMIT", "Recovery", "ResultFile", "VideoStore"),
    "encode": ("THUMBNAIL_FORMATS", "EncodedVideo", "encode_mp4", "encode_video", "float_frames_to_uint8",
               "spritesheet", "thumbnail"),
    "options": ("VideoOptions", "VideoShape"),
    "routes": ("VideoRoutes",),
    "worker": ("JobFailed", "VideoWorker"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE[name]}", __name__), name)
