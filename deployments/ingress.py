"""HTTP ingress: OpenAI Images API on FastAPI, validated before any GPU work.

Routes (relative to the application's route prefix):

- ``POST /v1/images/generations``: body :class:`~deployments.schemas.ImageGenerationRequest`, answer
  :class:`~deployments.responses.ImageGenerationResponse`; with ``stream: true`` Server-Sent Events instead
  (``image_generation.partial_image`` per preview and image, then ``image_generation.completed`` per image, the
  shapes the ``openai`` client parses; the DiT replica streams them through ``DiTReplica.generate_stream``).
- ``GET /v1/buckets``: one DiT replica's ``DiTReplica.stats()`` (its per-bucket counters, routing view,
  step scheduler counters) and, with shape-aware routing, ``ownership``: the coordinator's assignment and
  every replica's last heartbeat (owned and ready shapes, queue, owner hits), at most
  ``routing.stats_period_s`` old; ``traffic``: the request shapes accepted (with shape-aware routing, every
  replica's histogram merged: the answering replica's current one and the others' from their last heartbeat).
- ``POST /v1/images/edits``: a ``multipart/form-data`` body (the ``openai`` client's ``images.edit``) read within
  its bound (:mod:`deployments.uploads`) and mapped onto :class:`~deployments.schemas.ImageEditRequest`, then
  validated, routed and answered as a generation (``image_edit.*`` events when streamed); the validator reads and
  bounds the image and mask (:mod:`bcg_core.edits`).
- ``GET /v1/models`` (and ``GET /v1/models/{id}``): the served model in OpenAI's list format, with the bucket
  table, the limits, the step count of each ``quality``, the LoRA adapters in ``lora.dir`` (``lora``, null
  without it), the edits it serves (``edits``, null for a family without) and its step cache (``cache_methods``,
  ``cache_default``) under ``bcg``.
- ``GET /healthz``: ``{"status": "ok"}``; never asks for a key.
- ``/v1/videos`` (a video model's: create, list, retrieve, delete, ``cancel``, ``content``; OpenAI's Videos API):
  :mod:`deployments.videos.routes` answers them, and its worker, started here, runs the jobs on this replica's event
  loop; an image model answers them 404, and a video model its image routes 422 (field ``model``).
- ``POST /v1/images/variations``: not served; answered 404 in OpenAI's error shape (code ``unsupported_endpoint``)
  saying to use ``/v1/images/edits``, without reading the body, after the API key check
  (:func:`~deployments.http_errors.unsupported_response`).

API keys: with ``auth.api_keys`` or ``auth.api_key_file`` set, every ``/v1/`` route asks for
``Authorization: Bearer <key>`` (:mod:`deployments.auth`: digests only, compared in constant time); a missing or
unknown key is answered 401 in OpenAI's error shape, naming neither the key nor its digest.

LoRA adapters (a request's ``lora``): the schema bounds the entries, the validator checks names and scales, and the
ingress refuses a name with no file in ``lora.dir`` with a 422 listing the adapters
(:class:`~deployments.adapters.AdapterCatalog`: no GPU, no replica); the replica that serves the request reads the
file and stays the authority (422 for a file it cannot serve, 503 with ``Retry-After`` when no adapter slot freed
within ``lora.load_timeout_s``; neither is resent to another replica).

Python handle callers use ``Ingress.images`` (same validation and routing). Each request is validated here
once, on the ingress's one validation thread, so the event loop stays free while an edit's image is decoded
(:class:`~bcg_core.validation.RequestValidator`: validation, defaults, the seed, the bucket lookup), and its
:class:`~bcg_core.request.ValidatedRequest` travels to the DiT deployment, which trusts it, with its bucket shape in the
request metadata (:mod:`deployments.routing`); the same validated request (the same seed) is resent when its replica
dies mid-request (answered 503 only if that keeps happening). The served model name (a request's ``model``) comes
from the model's spec (``describe_model``: the checkpoint's JSON configs), known at start.

Every error is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 413 for a
body over ``limits.max_body_bytes`` (an edit's: :func:`~deployments.uploads.upload_limit`), 400 for a body that is
not JSON (or not readable multipart), 415 for an edit not sent as ``multipart/form-data`` or a generation sent as a
form, 422 for a field that fails validation (the message names the field and the values it accepts), 503
when no replica could serve it (under overload at once, with ``Retry-After``: backpressure from
``routing.max_queued_requests``), 500 for a server fault (the answers: :mod:`deployments.http_errors`; usage,
``bcg`` and the event stream: :mod:`deployments.answers`; the model card, ``/v1/buckets``'s additions and
``/metrics``'s pointer: :mod:`deployments.introspection`).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures (``request: Request``)
# of the class-based view that ``serve.ingress`` builds, and postponed annotations hide them from it.

import asyncio
import contextlib
import dataclasses
import logging
import time
from base64 import b64encode
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from bcg_core.errors import BucketMissError, RequestError, ServiceUnavailable
from bcg_core.pipeline import GenerationResult
from bcg_core.request import GenerationRequest, ValidatedRequest
from bcg_core.validation import RequestValidator

from .adapters import AdapterCatalog
from .answers import bcg_info, image_events, ingress_timings, usage_of
from .auth import ApiKeys
from .http_errors import (
    UNSUPPORTED_STATUS,
    error_response,
    find_request_error,
    unauthorized_response,
    unavailable_response,
    unsupported_response,
    validation_error_response,
)
from .introspection import ingress_view, metrics_pointer, model_card
from .memory import IdleTrimMiddleware, configure_ingress
from .request_args import as_generation_request
from .responses import ImageData, ImageGenerationResponse, ModelCard, ModelList
from .routing import ACCEPTED, call_dit, overloaded, stream_dit
from .schemas import ErrorBody, ImageEditRequest, ImageGenerationRequest, RequestLimits
from .settings import ServeConfig
from .uploads import (
    BodyTooLarge,
    FormError,
    edit_fields,
    edits_card,
    json_body_refusal,
    read_body,
    read_form,
    upload_limit,
)
from .videos.create import VIDEO_BODY, VIDEO_CONTENT

__all__ = ["Ingress"]

logger = logging.getLogger("ray.serve")

app = FastAPI(
    title="bcg-serve",
    description="Diffusion Transformer image generation with Bucketed CUDA Graphs (BCG) on Ray Serve; "
    "OpenAI Images API compatible.",
)
app.add_middleware(IdleTrimMiddleware)  # trims this process's heap once no request is in flight (deployments.memory)

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {c: {"model": ErrorBody} for c in (400, 401, 413, 415, 422, 500,
                                                                                      503)}
_VIDEO_ERRORS = {**_ERROR_RESPONSES, 404: {"model": ErrorBody}, 409: {"model": ErrorBody}}
_IMAGES_200 = {"description": "The images as JSON; with `stream: true` Server-Sent Events instead "
                              "(`<kind>.partial_image`, then `<kind>.completed` per image; kind `image_generation`, "
                              "or `image_edit` for an edit).",
               "content": {"text/event-stream": {"schema": {"type": "string"}}}}

@app.exception_handler(RequestValidationError)
async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    param = str(errs[0]["loc"][-1]) if errs and errs[0].get("loc") else None
    return error_response(422, f"invalid request: {errs}", param=param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})")


def _too_large(exc: BodyTooLarge, limit: int, name: str) -> JSONResponse:
    size = f"of at least {exc.size} bytes (read no further)" if exc.read else f"of {exc.size} bytes"
    return error_response(413, f"request body {size} is over the limit of {limit} bytes ({name})")


def _unsupported_route(fields: dict[str, dict]) -> dict[str, Any]:
    """The route options of an OpenAI route not served: its documented answers (404, 401) and OpenAI's multipart
    request body (``required: false``: it is never read)."""
    return dict(
        status_code=UNSUPPORTED_STATUS, response_model=ErrorBody,
        response_description="Always: the route is not served (OpenAI's error shape, code unsupported_endpoint).",
        responses={401: {"model": ErrorBody}},
        openapi_extra={"requestBody": {"required": False, "content": {"multipart/form-data": {
            "schema": {"type": "object", "properties": fields}}}}},
    )


@serve.deployment
@serve.ingress(app)
class Ingress:
    """FastAPI ingress: validates each request once (bucket lookup, miss policy), forwards the validated request.

    Args:
        dit_handle: handle of the :class:`~deployments.dit.DiTReplica` deployment.
        config: a ``ServeConfig`` as a mapping (``ServeConfig.model_dump(mode="json")``).
        coordinator: handle of the :class:`~deployments.coordinator.BucketCoordinator` (shape-aware routing),
            or None.

    Raises:
        pydantic.ValidationError: on a bad config (at replica start); ValueError: ``auth.api_key_file`` cannot be
            read or holds no key.
    """

    def __init__(self, dit_handle, config: dict, coordinator=None):
        self._config = ServeConfig.model_validate(config)
        self._keys = ApiKeys.from_config(self._config.auth)
        self._started = int(time.time())
        self._dit = dit_handle
        self._coord = coordinator
        # The validator's spec is describe_model(config.model): the served name comes from the checkpoint's JSON
        # configs, as the replicas' own, so no request waits for (or spends a DiT slot on) a stats call for it.
        self._validator = RequestValidator.from_config(self._config)
        self._model_name = self._validator.spec.name
        self._limits = self._request_limits()
        self._adapters = AdapterCatalog.for_config(self._config)  # None without lora.dir
        self._rejected: Counter[str] = Counter()  # misses answered 422 here (reject policy), by dimension
        self._rejected_requests = 0
        # one thread validates every request: the tokenizers are not shared across threads, and an edit's image is
        # decoded off the event loop
        self._validating = ThreadPoolExecutor(1, thread_name_prefix="bcg-validate")
        self._edits = edits_card(self._validator.spec, self._config.limits)
        self._background = "transparent" if self._validator.spec.output_alpha else "opaque"  # what the images are
        configure_ingress(self._config)  # large buffers mmapped; the heap trimmed once idle
        self._videos = None  # a video model's /v1/videos routes and the worker running their jobs
        if self._validator.spec.video:
            from .videos.routes import VideoRoutes, owner_id

            self._videos = VideoRoutes(self._config, self._validator, self._validate, dit_handle, owner_id())
            with contextlib.suppress(RuntimeError):  # outside Serve no loop runs here: the caller starts it
                self._videos.worker.start()

    def __del__(self):
        """Graceful stop: the video worker's running jobs go back to the queue (for another replica, or this one
        restarted; should this fail, their leases run out and they re-queue then)."""
        if getattr(self, "_videos", None) is not None:
            self._videos.worker.stop_now()

    def _request_limits(self) -> RequestLimits:
        return RequestLimits(
            limits=self._config.limits,
            size_multiple=None if self._validator.spec.size_bins else self._validator.spec.size_step,
            model_name=self._model_name,
            resolutions=tuple(self._config.buckets.resolutions),
            lora=self._config.lora,
            cache_methods=self._validator.spec.cache_methods,
            output_alpha=self._validator.spec.output_alpha,
            guidance=self._validator.spec.guidance_role(),
        )

    def _refused(self, request: Request) -> JSONResponse | None:
        """The 401 answer for a request without a known API key, or None (accepted, or no keys configured)."""
        reason = self._keys.check(request.headers.get("authorization"))
        return None if reason is None else unauthorized_response(reason)

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        """Liveness: ``{"status": "ok"}`` (no key asked for)."""
        return {"status": "ok"}

    def _model_card(self) -> ModelCard:
        card = model_card(self._validator, self._config, self._model_name, self._started, self._adapters, self._edits)
        card.bcg["videos"] = self._videos.options.card() if self._videos is not None else None
        return card

    async def _validate(self, request: GenerationRequest) -> ValidatedRequest:
        """``self._validator.validate(request)`` on the validation thread (raises its :class:`RequestError`)."""
        return await asyncio.get_running_loop().run_in_executor(self._validating, self._validator.validate, request)

    async def _check_adapters(self, validated) -> None:
        """A validated request naming an adapter with no file in ``lora.dir`` raises RequestError (HTTP 422 listing
        the adapters; :meth:`~deployments.adapters.AdapterCatalog.check`); the replica decides the rest."""
        if self._adapters is not None:
            await self._adapters.check(validated.request.lora)

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorBody}})
    async def models(self, request: Request):
        """The served model in OpenAI's list format (``openai`` ``client.models.list()``), its bucket table
        summarised under ``bcg``."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        await AdapterCatalog.fresh(self._adapters)
        return ModelList(data=[self._model_card()])

    @app.get("/v1/models/{model_id}", response_model=ModelCard, responses={401: {"model": ErrorBody},
                                                                          404: {"model": ErrorBody}})
    async def model(self, model_id: str, request: Request):
        """One model (``client.models.retrieve(id)``): the served one, else 404 naming it."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if model_id != self._model_name:
            return error_response(404, f"model {model_id!r} is not served here; served: {self._model_name!r}",
                                  param="model", code="model_not_found")
        await AdapterCatalog.fresh(self._adapters)
        return self._model_card()

    @app.get("/v1/buckets", responses={401: {"model": ErrorBody}, 500: {"model": ErrorBody},
                                       503: {"model": ErrorBody}})
    async def buckets(self, request: Request):
        """Per-bucket counters of the DiT replica (``DiTPipeline.stats()``), plus the misses this ingress
        rejected under the reject policy (``misses.rejected``, ``misses.rejected_by_dim``) and, with a
        coordinator, ``ownership`` and every replica's ``traffic`` merged
        (:func:`~deployments.introspection.ingress_view`). When every DiT slot and queue place is taken the call is
        answered 503 with ``Retry-After`` in OpenAI's error shape, like a generation request."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        try:
            stats = await self._dit.stats.remote()
        except BackPressureError as exc:
            full = overloaded(exc, self._config.routing.retry_after_s)
            return unavailable_response(full.message, full.retry_after_s, param="request")
        return await ingress_view(stats, self._rejected_requests, self._rejected, self._coord)

    @staticmethod
    def _failure(exc: BaseException) -> JSONResponse:
        """The answer to a request the DiT deployment failed: its :class:`RequestError` (503 with Retry-After for
        :class:`ServiceUnavailable`), else 500 (logged)."""
        found = find_request_error(exc)
        if found is not None:
            if isinstance(found, ServiceUnavailable):
                return unavailable_response(found.message, found.retry_after_s, param=found.field)
            return error_response(found.status, found.message, param=found.field)
        logger.exception("generation failed")
        return error_response(500, f"generation failed: {type(exc).__name__}")

    _events = staticmethod(image_events)  # the SSE frames of a streamed request (deployments.answers)

    async def images(self, request: GenerationRequest | dict) -> GenerationResult:
        """Python handle entry point: ``serve.get_app_handle(name).images.remote({...})``.

        Validates the request (as HTTP does) and sends it to an owner of its bucket shape, exactly as the HTTP
        route does; the replica trusts it and does not validate it again.

        Args:
            request: a :class:`GenerationRequest` or a dict of its fields (``prompt`` required).

        Returns:
            The :class:`GenerationResult` (PNG bytes, bucket, replica, owner, batch size).

        Raises:
            RequestError: a field out of range, a miss under the reject policy (``field`` names it), or an adapter
                of ``lora`` refused (no file in ``lora.dir``; on the replica: a file it cannot serve).
            ServiceUnavailable: the replica's adapter slots stayed full for ``lora.load_timeout_s``.
            ReplicaUnavailable: the serving replica died on every attempt.
        """
        validated = await self._validate(as_generation_request(request))
        await self._check_adapters(validated)
        routed = await call_dit(self._dit, validated, self._config.routing.max_retries,
                                retry_after_s=self._config.routing.retry_after_s)
        return dataclasses.replace(routed.result, retries=routed.retries)

    @app.post("/v1/images/generations", response_model=ImageGenerationResponse,
              responses={**_ERROR_RESPONSES, 200: _IMAGES_200},
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": ImageGenerationRequest.body_schema()}}}})
    async def generate(self, request: Request):
        """Generate ``n`` images for a prompt (OpenAI ``images.generate``); with ``stream: true`` as Server-Sent
        Events (:func:`deployments.answers.image_events`)."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        limits = self._limits
        try:
            body = await read_body(request, limits.limits.max_body_bytes)
        except BodyTooLarge as exc:
            return _too_large(exc, limits.limits.max_body_bytes, "limits.max_body_bytes")
        if (refused := json_body_refusal(request, body)) is not None:  # a form body, a key sent twice
            return error_response(refused[0], refused[1], param=refused[2])
        try:
            req = ImageGenerationRequest.model_validate_json(body, context={"limits": limits})
        except ValidationError as exc:
            return validation_error_response(exc, limits)
        return await self._serve(req, req.engine_request())

    @app.post("/v1/images/edits", response_model=ImageGenerationResponse,
              responses={**_ERROR_RESPONSES, 200: _IMAGES_200},
              openapi_extra={"requestBody": {"required": True, "content": {
                  "multipart/form-data": {"schema": ImageEditRequest.form_schema()}}}})
    async def edits(self, request: Request):
        """Edit an image (OpenAI ``images.edit``): image-to-image, or inpainting with a ``mask``; answered as a
        generation, with ``stream: true`` as ``image_edit.*`` Server-Sent Events."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        limits, bound = self._limits, upload_limit(self._config.limits)
        try:
            fields = await edit_fields(await read_form(request, bound))
            req = ImageEditRequest.model_validate(fields, context={"limits": limits})
        except BodyTooLarge as exc:
            return _too_large(exc, bound, "POST /v1/images/edits: the image, mask and fields together")
        except FormError as exc:
            return error_response(exc.status, exc.message, param=exc.field)
        except ValidationError as exc:
            return validation_error_response(exc, limits, ImageEditRequest)
        image = tuple(req.image) if isinstance(req.image, list) else req.image  # several: reference images
        return await self._serve(req, req.engine_request(image=image, mask=req.mask, strength=req.strength),
                                 kind="image_edit")

    async def _serve(self, req: ImageGenerationRequest, request: GenerationRequest, kind: str = "image_generation"):
        """Validate ``request`` (``req``: its validated HTTP body), send it to a DiT replica and answer: JSON, or with
        ``stream: true`` Server-Sent Events of ``kind``; every refusal in OpenAI's error shape. The one path of
        generations and edits."""
        try:
            self._validator.spec.check_output(video=False)  # a video model's videos: POST /v1/videos
            validated = await self._validate(request)
            await self._check_adapters(validated)
        except RequestError as exc:
            if isinstance(exc, BucketMissError):
                self._rejected_requests += 1
                self._rejected.update(exc.missed)
            message = exc.message
            if exc.field == "size" and req.size == "auto":
                px = self._validator.rules.pixels_per_token
                refs = self._validator.spec.references
                if request.image is not None and refs is not None:
                    message += (f" (for a reference edit, size 'auto', or omitted, is its first image's size as "
                                f"{refs.pipeline} resizes it; send a size)")
                else:
                    message += (" (for an edit, size 'auto', or omitted, is its image's size scaled into the side "
                                f"limits, each side a multiple of {px})" if request.image is not None else
                                " (size 'auto', or omitted, is the model's default size {}x{})".format(
                                    *self._validator.default_size))
            return error_response(exc.status, message, param=exc.field)
        except Exception as exc:  # noqa: BLE001 - an input file Pillow fails on in a way bcg_core.edits misses
            if request.image is None:
                raise
            logger.exception("validating an edit failed on its input files")
            return error_response(422, f"invalid 'image' or 'mask': the file does not decode ({type(exc).__name__}: "
                                       f"{str(exc)[:80]}); allowed: one PNG, JPEG or WebP file each", param="image")
        t0 = time.perf_counter()
        if req.stream:
            events = stream_dit(self._dit, validated, self._config.routing.retry_after_s)
            try:  # answer 200 only once a replica took the request: a refusal stays a plain 4xx or 503
                first = await anext(events)
                if first != ACCEPTED:
                    raise RuntimeError(f"the DiT replica's stream began with {type(first).__name__}, not its "
                                       f"acceptance")
            except Exception as exc:  # noqa: BLE001 - every failure is answered, the server keeps serving
                await events.aclose()
                return self._failure(exc)
            return StreamingResponse(self._events(validated, req, events, t0, kind, self._background),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            routed = await call_dit(self._dit, validated, self._config.routing.max_retries,
                                    retry_after_s=self._config.routing.retry_after_s)
            result = routed.result
        except Exception as exc:  # noqa: BLE001 - every failure is answered, the server keeps serving
            return self._failure(exc)
        timings = ingress_timings(result, t0)
        return ImageGenerationResponse(
            created=int(time.time()),
            background=self._background,
            data=[ImageData(b64_json=b64encode(data).decode("ascii")) for data in result.image_bytes],
            output_format=result.image_format,
            quality=validated.request.quality if validated.request.quality != "auto" else None,  # standard, hd: mapped
            size=f"{validated.request.width}x{validated.request.height}",
            usage=usage_of(validated),
            bcg=bcg_info(result, timings, routed.retries, validated),
        )

    @app.get("/metrics", include_in_schema=False)
    async def metrics_elsewhere(self) -> JSONResponse:
        """Not on the API port: a 404 in OpenAI's error shape naming the URL of Ray's Prometheus exporter on this
        replica's node (the one metrics source, docs/OPERATIONS.md "Metrics"). No key asked for: it reveals
        only the address (:func:`~deployments.introspection.metrics_pointer`)."""
        return await metrics_pointer()

    @app.post("/v1/images/variations", **_unsupported_route({
        "image": {"type": "string", "format": "binary"}}))
    async def variations(self, request: Request):
        """OpenAI ``images.create_variation`` (retired by OpenAI): not served; a 404 saying to use
        ``/v1/images/edits``."""
        return self._refused(request) or unsupported_response("/v1/images/variations")

    def _video_refusal(self, request: Request, route: str) -> JSONResponse | None:
        """The 401 of a request without a known key, the 404 of a video route on an image model, or None."""
        refused = self._refused(request)
        if refused is None and self._videos is None:
            from .videos.routes import videos_unsupported

            return videos_unsupported(self._validator.spec, route)
        return refused

    @app.post("/v1/videos", responses=_VIDEO_ERRORS, openapi_extra=VIDEO_BODY)
    async def create_video(self, request: Request):
        """Create a video job (OpenAI ``videos.create``): JSON or a form; answered ``queued`` at once."""
        return self._video_refusal(request, "POST /v1/videos") or await self._videos.create(request)

    @app.get("/v1/videos", responses=_VIDEO_ERRORS)
    async def list_videos(self, request: Request):
        """A page of video jobs (``videos.list``: ``after``, ``limit``, ``order``)."""
        return self._video_refusal(request, "GET /v1/videos") or await self._videos.list(request)

    @app.get("/v1/videos/{video_id}", responses=_VIDEO_ERRORS)
    async def retrieve_video(self, video_id: str, request: Request):
        """One video job (``videos.retrieve``)."""
        return self._video_refusal(request, "GET /v1/videos/{id}") or await self._videos.retrieve(video_id)

    @app.delete("/v1/videos/{video_id}", responses=_VIDEO_ERRORS)
    async def delete_video(self, video_id: str, request: Request):
        """Delete a video job and its files (``videos.delete``)."""
        return self._video_refusal(request, "DELETE /v1/videos/{id}") or await self._videos.delete(video_id)

    @app.post("/v1/videos/{video_id}/cancel", responses=_VIDEO_ERRORS)
    async def cancel_video(self, video_id: str, request: Request):
        """Cancel a queued or running video job: ``failed`` with error code ``cancelled``."""
        return self._video_refusal(request, "POST /v1/videos/{id}/cancel") or await self._videos.cancel(video_id)

    @app.get("/v1/videos/{video_id}/content", responses={**_VIDEO_ERRORS, 200: VIDEO_CONTENT})
    async def video_content(self, video_id: str, request: Request):
        """A completed job's file (``videos.download_content``: ``variant`` video, thumbnail or spritesheet)."""
        return (self._video_refusal(request, "GET /v1/videos/{id}/content")
                or await self._videos.content(video_id, request))
