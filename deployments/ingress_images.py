"""The ingress's image routes: ``POST /v1/images/generations``, ``POST /v1/images/edits`` (both answered as JSON or,
with ``stream: true``, Server-Sent Events), the Python handle's ``images`` and ``POST /v1/images/variations``'s 404
(:class:`ImageEndpoints`).

A request is read within its bound (:mod:`deployments.uploads`), checked against its schema
(:mod:`deployments.schemas`), validated once on the validation thread, checked against ``lora.dir`` and sent to a
DiT replica through the shape-aware router (:mod:`deployments.routing`: resent when its replica dies); every refusal
is answered in OpenAI's error shape (:mod:`deployments.http_errors`), the answer's ``usage``, ``bcg`` and event stream
built by :mod:`deployments.answers`.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures (``request: Request``)
# of the class-based view that ``serve.ingress`` builds, and postponed annotations hide them from it.

import dataclasses
import logging
import time
from base64 import b64encode

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from bcg_core.errors import BucketMissError, RequestError, ServiceUnavailable
from bcg_core.request import GenerationRequest, GenerationResult

from .answers import bcg_info, image_events, ingress_timings, usage_of
from .http_errors import (
    error_response,
    find_request_error,
    unavailable_response,
    unsupported_response,
    validation_error_response,
)
from .ingress_app import ERROR_RESPONSES, IMAGES_200, app, too_large, unsupported_route
from .ingress_base import IngressBase
from .request_args import as_generation_request
from .responses import ImageData, ImageGenerationResponse
from .routing import ACCEPTED, call_dit, stream_dit
from .schemas import ImageEditRequest, ImageGenerationRequest
from .uploads import BodyTooLarge, FormError, edit_fields, json_body_refusal, read_body, read_form, upload_limit

__all__ = ["ImageEndpoints"]

logger = logging.getLogger("ray.serve")


class ImageEndpoints(IngressBase):
    """Generations, edits and the Python handle's ``images`` of :class:`~deployments.ingress.Ingress` (each HTTP
    route is registered on :data:`deployments.ingress_app.app`)."""

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
              responses={**ERROR_RESPONSES, 200: IMAGES_200},
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
            return too_large(exc, limits.limits.max_body_bytes, "limits.max_body_bytes")
        if (refused := json_body_refusal(request, body)) is not None:  # a form body, a key sent twice
            return error_response(refused[0], refused[1], param=refused[2])
        try:
            req = ImageGenerationRequest.model_validate_json(body, context={"limits": limits})
        except ValidationError as exc:
            return validation_error_response(exc, limits)
        return await self._serve(req, req.engine_request())

    @app.post("/v1/images/edits", response_model=ImageGenerationResponse,
              responses={**ERROR_RESPONSES, 200: IMAGES_200},
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
            return too_large(exc, bound, "POST /v1/images/edits: the image, mask and fields together")
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

    @app.post("/v1/images/variations", **unsupported_route({
        "image": {"type": "string", "format": "binary"}}))
    async def variations(self, request: Request):
        """OpenAI ``images.create_variation`` (retired by OpenAI): not served; a 404 saying to use
        ``/v1/images/edits``."""
        return self._refused(request) or unsupported_response("/v1/images/variations")
