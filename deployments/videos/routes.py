"""The ``/v1/videos`` routes of a video model's ingress (OpenAI's Videos API; docs/API.md "Videos"), and the worker
that runs their jobs. :class:`~deployments.ingress.Ingress` registers the routes and checks the API key; these build
the answers.

- ``POST /v1/videos``: JSON or ``multipart/form-data`` (:mod:`deployments.videos.create`); ``size`` and ``seconds``
  mapped onto the video tiers (:class:`~deployments.videos.options.VideoOptions`), the engine's request validated here,
  at once, like an image generation's; then the job is committed to the store and answered ``queued``.
- ``GET /v1/videos/{id}``: the job (with ``openai-poll-after-ms`` while it is queued or in progress, which the
  ``openai`` client's ``poll`` waits).
- ``GET /v1/videos``: a cursor page (``after``, ``limit`` 1..100, ``order`` ``asc`` or ``desc``).
- ``DELETE /v1/videos/{id}``: the job and its files, in any status (one running stops).
- ``POST /v1/videos/{id}/cancel``: a queued or running job becomes ``failed`` with error code ``cancelled``.
- ``GET /v1/videos/{id}/content?variant=video|thumbnail|spritesheet``: the MP4 (``video/mp4``), its WebP thumbnail
  (``image/webp``) or its JPEG spritesheet (``image/jpeg``) of a completed job.

Errors, in OpenAI's shape: 404 for an unknown job (code ``video_not_found``) and for the content of a job not completed
(as OpenAI answers it), 409 for cancelling a finished job, 400 for a bad ``after``, ``limit`` or ``order``, 422 for a
field of the create body (the message lists the values allowed), 413 and 415 as the image routes, 500 when the store
fails. On an image model every video route answers 404 (code ``unsupported_endpoint``) naming what the model makes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.requests import Request

from bcg_core.errors import RequestError
from bcg_core.field_phrases import invalid
from bcg_core.request import GenerationRequest, ValidatedRequest

from ..http_errors import UNSUPPORTED_STATUS, error_response
from ..uploads import BodyTooLarge, FormError, upload_limit
from .create import read_create, refuse_reference
from .generation import DiTVideos, job_params
from .jobs import VARIANTS, JobNotFound, JobStateError, UnknownCursor
from .options import VideoOptions
from .store import MAX_LIST_LIMIT, VideoStore
from .worker import VideoWorker

__all__ = ["POLL_AFTER_HEADER", "VideoRoutes", "owner_id", "videos_unsupported"]

logger = logging.getLogger("ray.serve")

POLL_AFTER_HEADER = "openai-poll-after-ms"
"""The header the ``openai`` client's ``videos.poll`` reads for its wait before the next ``retrieve``."""


def owner_id() -> str:
    """This ingress replica's id (its video worker's owner id in the job store); a random one outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (tests constructing the ingress directly)
        return f"ingress-{uuid.uuid4().hex[:12]}"


def videos_unsupported(spec, route: str) -> JSONResponse:
    """The answer of a video route on an image model: 404 (code ``unsupported_endpoint``) naming what the model
    generates and where to ask for it (:meth:`~bcg_core.families.ModelSpec.check_output`)."""
    try:
        spec.check_output(video=True)
        why = f"model {spec.name!r} serves no videos"
    except RequestError as exc:
        why = exc.message
    return error_response(UNSUPPORTED_STATUS, f"{route}: {why}", param="model", code="unsupported_endpoint")


class VideoRoutes:
    """The video routes' answers and the replica's :class:`~deployments.videos.worker.VideoWorker`.

    Args:
        config: the served ``ServeConfig``.
        validator: the ingress's :class:`~bcg_core.validation.RequestValidator` (a video model's).
        validate: ``await validate(request)``: the ingress's validation on its validation thread.
        dit: the DiT deployment's handle.
        owner: the ingress replica's id (the worker's owner id in the store).
        store: the job store; None: :meth:`VideoStore.from_config` of ``config.videos`` (opened here).

    Raises:
        ValueError: the model is no video model, a bad ``videos`` section or a store folder that cannot be written.
        VideoStoreError: the store's database cannot be opened.
    """

    def __init__(self, config, validator, validate: Callable[[GenerationRequest], Awaitable[ValidatedRequest]], dit,
                 owner: str, store: VideoStore | None = None):
        self.options = VideoOptions.for_model(validator, config.videos)
        self.store = store if store is not None else VideoStore.from_config(config.videos)
        self._validator, self._validate = validator, validate
        self._upload_bytes = upload_limit(config.limits)
        self._poll_after_ms = config.videos.poll_after_ms
        generation = DiTVideos(dit, validate, config.routing.retry_after_s, config.routing.max_retries)
        self.worker = VideoWorker(self.store, owner, [self.options.model], generation.generate,
                                  max_running=config.videos.max_running, poll_s=config.videos.poll_s)

    async def _store(self, method, *args, **kwargs):
        """``store.method(*args, **kwargs)`` in a thread."""
        return await asyncio.to_thread(getattr(self.store, method), *args, **kwargs)

    @staticmethod
    def _store_error(exc: Exception, content: bool = False) -> JSONResponse:
        """The answer to a store error: 404 unknown job, 409 a job in the wrong status (404 for a download of a job
        not completed, as OpenAI answers it), 400 an unknown cursor, else 500 (logged)."""
        if isinstance(exc, JobNotFound):
            return error_response(404, str(exc), param="video_id", code="video_not_found")
        if isinstance(exc, JobStateError):
            return error_response(404 if content else 409, str(exc), param="video_id")
        if isinstance(exc, UnknownCursor):
            return error_response(400, str(exc), param="after")
        logger.error("the video job store failed", exc_info=exc)
        return error_response(500, f"the video job store failed: {type(exc).__name__}")

    async def create(self, request: Request) -> Response:
        """``POST /v1/videos``: the job, ``queued`` (OpenAI's ``Video``), once committed to the store."""
        model = self.options.model
        try:
            req = await read_create(request, self.options, self._validator, self._upload_bytes)
            if req.model is not None and req.model != model:
                raise RequestError("model", invalid("model", req.model, "not served here", f"{model!r} (or omit it)"))
            refuse_reference(req, self._validator.spec)
            shape = self.options.shape(req.seconds, req.size)
            validated = await self._validate(req.engine_request(shape))
        except BodyTooLarge as exc:
            return error_response(413, f"request body of {'at least ' if exc.read else ''}{exc.size} bytes is over "
                                       f"the limit (limits.max_body_bytes for JSON, limits.max_upload_bytes for a "
                                       f"form)")
        except (FormError, RequestError) as exc:
            return error_response(exc.status, exc.message, param=exc.field)
        try:
            job = await self._store("create", prompt=req.prompt, model=model, seconds=shape.seconds, size=shape.size,
                                    params=job_params(validated, shape))
        except Exception as exc:  # noqa: BLE001 - answered 500, the server keeps serving
            return self._store_error(exc)
        self.worker.wake()
        return JSONResponse(job.to_api())

    async def retrieve(self, video_id: str) -> Response:
        """``GET /v1/videos/{id}``: the job; ``openai-poll-after-ms`` while it is not finished."""
        try:
            job = await self._store("get", video_id)
        except Exception as exc:  # noqa: BLE001
            return self._store_error(exc)
        answer = JSONResponse(job.to_api())
        if not job.status.finished:
            answer.headers[POLL_AFTER_HEADER] = str(self._poll_after_ms)
        return answer

    async def list(self, request: Request) -> Response:
        """``GET /v1/videos``: one page of jobs (``after``, ``limit``, ``order`` from the query)."""
        q = request.query_params
        limit_text, order = q.get("limit", "20"), q.get("order", "desc")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST_LIMIT:
            return error_response(400, invalid("limit", limit_text, "out of range",
                                               f"an integer from 1 to {MAX_LIST_LIMIT} (omitted: 20)"), param="limit")
        if order not in ("asc", "desc"):
            return error_response(400, invalid("order", order, "not an order", "'asc', 'desc' (omitted: 'desc')"),
                                  param="order")
        try:
            page = await self._store("list", after=q.get("after") or None, limit=int(limit_text), order=order)
        except Exception as exc:  # noqa: BLE001
            return self._store_error(exc)
        return JSONResponse(page.to_api())

    async def delete(self, video_id: str) -> Response:
        """``DELETE /v1/videos/{id}``: the job and its files are gone (a job running here stops at once; elsewhere
        at its next progress update)."""
        try:
            await self._store("delete", video_id)
        except Exception as exc:  # noqa: BLE001
            return self._store_error(exc)
        self.worker.drop(video_id)
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})

    async def cancel(self, video_id: str) -> Response:
        """``POST /v1/videos/{id}/cancel``: the job, ``failed`` with error code ``cancelled``."""
        try:
            job = await self._store("cancel", video_id)
        except Exception as exc:  # noqa: BLE001
            return self._store_error(exc)
        self.worker.drop(video_id)
        return JSONResponse(job.to_api())

    async def content(self, video_id: str, request: Request) -> Response:
        """``GET /v1/videos/{id}/content``: the file of ``variant`` (``video`` unless given) of a completed job."""
        variant = request.query_params.get("variant", "video")
        if variant not in VARIANTS:
            return error_response(400, invalid("variant", variant, "not a variant",
                                               ", ".join(repr(v) for v in VARIANTS) + " (omitted: 'video')"),
                                  param="variant")
        try:
            found = await self._store("result", video_id, variant)
        except Exception as exc:  # noqa: BLE001
            return self._store_error(exc, content=True)
        return FileResponse(found.path, media_type=found.media_type,
                            filename=f"{video_id}{found.path.suffix}", content_disposition_type="inline")

