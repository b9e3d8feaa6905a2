"""The ingress's FastAPI application: the one ``app`` whose routes :class:`~deployments.ingress.Ingress` and its
route groups (:mod:`deployments.ingress_info`, :mod:`deployments.ingress_images`, :mod:`deployments.ingress_videos`)
register, its middleware and exception handlers, and the route options they share (OpenAPI answers).

Every error it answers itself is in OpenAI's shape (:func:`~deployments.http_errors.error_response`): FastAPI's own
validation error as 422 naming the field, and Starlette's HTTP errors (an unknown path: 404) with the method and path.

Middleware (outermost first): :class:`~deployments.drain.DrainMiddleware` (once the server stops, a new request is
answered 503 with ``Retry-After`` while those in flight finish), then :class:`~deployments.memory.IdleTrimMiddleware`
(the heap trimmed once no request is in flight).
"""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .drain import DrainMiddleware
from .http_errors import UNSUPPORTED_STATUS, error_response
from .memory import IdleTrimMiddleware
from .schemas import ErrorBody
from .uploads import BodyTooLarge

__all__ = ["ERROR_RESPONSES", "IMAGES_200", "VIDEO_ERRORS", "app", "too_large", "unsupported_route"]

app = FastAPI(
    title="bcg-serve",
    description="Diffusion Transformer image generation with Bucketed CUDA Graphs (BCG) on Ray Serve; "
    "OpenAI Images API compatible.",
)
app.add_middleware(IdleTrimMiddleware)  # trims this process's heap once no request is in flight (deployments.memory)
app.add_middleware(DrainMiddleware)  # added last, so outermost: a request refused while draining reaches nothing else

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {c: {"model": ErrorBody} for c in (400, 401, 413, 415, 422, 500,
                                                                                     503)}
"""The error answers an image route documents (OpenAPI), each in OpenAI's error shape."""

VIDEO_ERRORS = {**ERROR_RESPONSES, 404: {"model": ErrorBody}, 409: {"model": ErrorBody}}
"""The error answers a ``/v1/videos`` route documents."""

IMAGES_200 = {"description": "The images as JSON; with `stream: true` Server-Sent Events instead "
                             "(`<kind>.partial_image`, then `<kind>.completed` per image; kind `image_generation`, "
                             "or `image_edit` for an edit).",
              "content": {"text/event-stream": {"schema": {"type": "string"}}}}
"""The 200 answer of a generation or an edit: JSON, or Server-Sent Events with ``stream: true``."""


@app.exception_handler(RequestValidationError)
async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    param = str(errs[0]["loc"][-1]) if errs and errs[0].get("loc") else None
    return error_response(422, f"invalid request: {errs}", param=param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})")


def too_large(exc: BodyTooLarge, limit: int, name: str) -> JSONResponse:
    """The 413 of a body over ``limit`` bytes; ``name`` is the setting (or the parts) that bound it."""
    size = f"of at least {exc.size} bytes (read no further)" if exc.read else f"of {exc.size} bytes"
    return error_response(413, f"request body {size} is over the limit of {limit} bytes ({name})")


def unsupported_route(fields: dict[str, dict]) -> dict[str, Any]:
    """The route options of an OpenAI route not served: its documented answers (404, 401) and OpenAI's multipart
    request body (``required: false``: it is never read)."""
    return dict(
        status_code=UNSUPPORTED_STATUS, response_model=ErrorBody,
        response_description="Always: the route is not served (OpenAI's error shape, code unsupported_endpoint).",
        responses={401: {"model": ErrorBody}},
        openapi_extra={"requestBody": {"required": False, "content": {"multipart/form-data": {
            "schema": {"type": "object", "properties": fields}}}}},
    )
