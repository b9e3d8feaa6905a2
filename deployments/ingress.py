"""HTTP ingress: OpenAI Images API on FastAPI, validated and planned before any GPU work.

Routes (relative to the application's route prefix):

- ``POST /v1/images/generations``: body :class:`~deployments.schemas.ImageGenerationRequest`, answer
  :class:`~deployments.schemas.ImageGenerationResponse`.
- ``GET /v1/buckets``: one DiT replica's ``DiTReplica.stats()`` (its per-bucket counters, routing view,
  micro-batching totals) and, with shape-aware routing, ``ownership``: the coordinator's assignment and
  every replica's last heartbeat (owned and ready shapes, queue, owner hits), at most
  ``routing.stats_period_s`` old; ``traffic``: the request shapes accepted (with shape-aware routing, every
  replica's histogram merged: the answering replica's current one and the others' from their last heartbeat).
- ``GET /healthz``: ``{"status": "ok"}``.

Python handle callers use ``Ingress.images`` (same validation and routing). Each request is planned here
once (:class:`~bcg_core.planner.Planner`: validation, defaults, the seed, the bucket lookup) and its
:class:`~bcg_core.planner.Plan` travels to the DiT deployment, which trusts it, with its bucket shape in the
request metadata (:mod:`deployments.routing`); the same plan (the same seed) is resent when its replica dies
mid-request (answered 503 only if that keeps happening). The served model name (a request's ``model``) comes
from the model's spec (``describe_model``: the checkpoint's JSON configs), known at start.

Every error is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 413 for a
body over ``limits.max_body_bytes``, 400 for a body that is not JSON, 422 for a field that fails
validation or planning (the message names the field and the values it accepts), 503 when no replica could
serve it (under overload at once, with ``Retry-After``: backpressure from ``routing.max_queued_requests``),
500 for a server fault.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures (``request: Request``)
# of the class-based view that ``serve.ingress`` builds, and postponed annotations hide them from it.

import dataclasses
import logging
import time
from base64 import b64encode
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from bcg_core.config import MissPolicy, ServeConfig
from bcg_core.errors import BucketMissError, RequestError, ServiceUnavailable
from bcg_core.pipeline import GenerationResult
from bcg_core.planner import GenerationRequest, Planner
from bcg_core.traffic import TrafficHistogram

from .routing import call_dit
from .schemas import (
    BcgInfo,
    ErrorBody,
    ErrorDetail,
    ImageData,
    ImageGenerationRequest,
    ImageGenerationResponse,
    RequestLimits,
    allowed_values,
)

__all__ = ["Ingress", "error_response", "find_request_error", "merged_traffic", "unavailable_response",
           "validation_error_response"]

logger = logging.getLogger("ray.serve")

app = FastAPI(
    title="bcg-serve",
    description="Diffusion Transformer image generation with Bucketed CUDA Graphs (BCG) on Ray Serve; "
    "OpenAI Images API compatible.",
)

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 413, 422, 500, 503)
}


def error_response(status: int, message: str, param: str | None = None, type_: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error answer.

    Args:
        status: HTTP status code.
        message: human message naming the field and the values it accepts.
        param: the request field at fault, or None.
        type_: OpenAI error type; default ``"invalid_request_error"`` below 500, ``"server_error"`` above.
    """
    kind = type_ or ("server_error" if status >= 500 else "invalid_request_error")
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, param=param))
    return JSONResponse(status_code=status, content=body.model_dump())


def unavailable_response(message: str, retry_after_s: float, param: str | None = None) -> JSONResponse:
    """A 503 answer with ``Retry-After`` in whole seconds (at least 1), for overload and a replica not ready."""
    answer = error_response(503, message, param=param)
    answer.headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return answer


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_error_response(exc: ValidationError, limits: RequestLimits) -> JSONResponse:
    """Turn a pydantic error of :class:`ImageGenerationRequest` into an OpenAI error answer.

    Returns:
        400 when the body is not JSON, else 422; ``param`` is the first field at fault and the message
        lists every fault, each with the values its field accepts.
    """
    fields = ", ".join(ImageGenerationRequest.model_fields)
    messages: list[str] = []
    param: str | None = None
    status = 422
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err.get("loc", ())]
        name = loc[0] if loc else None
        kind = err.get("type", "")
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if kind == "json_invalid":
            status = 400
            messages.append(f"request body is not valid JSON ({err.get('ctx', {}).get('error', msg)}); "
                            f"send a JSON object with the fields {fields}")
            continue
        if name is None:
            messages.append(f"request body must be a JSON object with the fields {fields} ({msg})")
            continue
        param = param or name
        if kind == "extra_forbidden":
            messages.append(f"unknown field '{name}'; allowed fields: {fields}")
        elif kind == "missing":
            messages.append(f"'{name}' is required: {allowed_values(name, limits)}")
        else:
            got = f" (got {_short(err['input'])})" if "input" in err else ""
            messages.append(f"invalid '{name}'{got}: {msg}; allowed: {allowed_values(name, limits)}")
    return error_response(status, "; ".join(messages) or str(exc), param=param)


def find_request_error(exc: BaseException) -> RequestError | None:
    """The :class:`RequestError` inside ``exc``, however Ray wrapped it, or None.

    Ray re-raises a replica's exception as a ``RayTaskError`` that usually also subclasses the original
    class (so ``isinstance`` works) and keeps the original in ``.cause``; both are checked, plus the
    ``__cause__`` chain, a bounded number of levels deep.
    """
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, RequestError):
            cause = getattr(seen, "cause", None)
            return cause if isinstance(cause, RequestError) else seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return None


def merged_traffic(stats: dict, ownership: dict) -> dict | None:
    """Every replica's traffic histogram summed (:meth:`TrafficHistogram.merged`), for ``/v1/buckets``.

    The answering replica's snapshot is ``stats["traffic"]`` (current); the others' come from their last
    heartbeat (``ownership["replicas"][id]["stats"]["traffic"]``), which this removes from ``ownership`` so the
    answer holds each histogram once. A snapshot that fails validation is left out (logged).

    Returns:
        The merged snapshot, or None when no replica records traffic.
    """
    here = stats.get("replica")
    parts = [stats["traffic"]] if stats.get("traffic") is not None else []
    for replica, view in (ownership.get("replicas") or {}).items():
        reported = view.get("stats") or {}
        snap = reported.pop("traffic", None)
        if snap is not None and replica != here:
            parts.append(snap)
    good: list[TrafficHistogram] = []
    for snap in parts:
        try:
            good.append(TrafficHistogram.from_snapshot(snap))
        except ValueError:
            logger.exception("a replica's traffic snapshot is invalid; left out of /v1/buckets traffic")
    return TrafficHistogram.merged(good).snapshot() if good else None


@app.exception_handler(RequestValidationError)
async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    param = str(errs[0]["loc"][-1]) if errs and errs[0].get("loc") else None
    return error_response(422, f"invalid request: {errs}", param=param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})")


class _BodyTooLarge(Exception):
    pass


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """Read the body, stopping as soon as it exceeds ``max_bytes`` (raises :class:`_BodyTooLarge`)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _BodyTooLarge(int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _BodyTooLarge(size)
        chunks.append(chunk)
    return b"".join(chunks)


@serve.deployment
@serve.ingress(app)
class Ingress:
    """FastAPI ingress: validates and plans each request once (bucket lookup, miss policy), forwards its plan.

    Args:
        dit_handle: handle of the :class:`~deployments.dit.DiTReplica` deployment.
        config: a ``ServeConfig`` as a mapping (``ServeConfig.model_dump(mode="json")``).
        coordinator: handle of the :class:`~deployments.coordinator.BucketCoordinator` (shape-aware routing),
            or None.

    Raises:
        pydantic.ValidationError: on a bad config (at replica start).
    """

    def __init__(self, dit_handle, config: dict, coordinator=None):
        self._config = ServeConfig.model_validate(config)
        self._dit = dit_handle
        self._coord = coordinator
        # The planner's spec is describe_model(config.model): the served name comes from the checkpoint's JSON
        # configs, as the replicas' own, so no request waits for (or spends a DiT slot on) a stats call for it.
        self._planner = Planner.from_config(self._config)
        self._model_name = self._planner.spec.name
        self._limits = self._request_limits()
        self._rejected: Counter[str] = Counter()  # misses answered 422 here (reject policy), by dimension
        self._rejected_requests = 0

    def _request_limits(self) -> RequestLimits:
        return RequestLimits(
            limits=self._config.limits,
            size_multiple=self._planner.table.rules.pixels_per_token,
            model_name=self._model_name,
            resolutions=tuple(self._config.buckets.resolutions),
        )

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        """Liveness: ``{"status": "ok"}``."""
        return {"status": "ok"}

    @app.get("/v1/buckets", responses={500: {"model": ErrorBody}, 503: {"model": ErrorBody}})
    async def buckets(self):
        """Per-bucket counters of the DiT replica (``DiTPipeline.stats()``), plus the misses this ingress
        rejected under the reject policy (``misses.rejected``, ``misses.rejected_by_dim``) and, with a
        coordinator, ``ownership`` and every replica's ``traffic`` merged (:func:`merged_traffic`). When every
        DiT slot and queue place is taken the call is answered 503 with ``Retry-After`` in OpenAI's error shape,
        like a generation request."""
        try:
            stats = await self._dit.stats.remote()
        except BackPressureError as exc:
            retry = self._config.routing.retry_after_s
            return unavailable_response(f"the server is at capacity (every DiT replica busy and the queue full: "
                                        f"{exc}); retry after {retry:g} s", retry, param="request")
        misses = stats.setdefault("misses", {})
        misses["rejected"] = self._rejected_requests
        misses["rejected_by_dim"] = {d: self._rejected.get(d, 0) for d in ("batch", "image_tokens", "text_tokens")}
        if self._coord is not None:
            stats["ownership"] = await self._coord.snapshot.remote()
            stats["traffic"] = merged_traffic(stats, stats["ownership"])
        return stats

    async def images(self, request: GenerationRequest | dict) -> GenerationResult:
        """Python handle entry point: ``serve.get_app_handle(name).images.remote({...})``.

        Plans the request (same validation as HTTP) and sends its plan to an owner of its bucket shape, exactly
        as the HTTP route does; the replica trusts the plan and does not plan it again.

        Args:
            request: a :class:`GenerationRequest` or a dict of its fields (``prompt`` required).

        Returns:
            The :class:`GenerationResult` (PNG bytes, bucket, replica, owner, batch size).

        Raises:
            RequestError: a field out of range, or a miss under the reject policy (``field`` names it).
            ReplicaUnavailable: the serving replica died on every attempt.
        """
        from .dit import as_generation_request

        plan = self._planner.plan(as_generation_request(request))
        routed = await call_dit(self._dit, plan, self._config.routing.max_retries,
                                retry_after_s=self._config.routing.retry_after_s)
        return dataclasses.replace(routed.result, retries=routed.retries)

    @app.post(
        "/v1/images/generations",
        response_model=ImageGenerationResponse,
        responses=_ERROR_RESPONSES,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ImageGenerationRequest.model_json_schema()}},
            }
        },
    )
    async def generate(self, request: Request):
        """Generate ``n`` images for a prompt (OpenAI ``images.generate``)."""
        limits = self._limits
        try:
            body = await _read_body(request, limits.limits.max_body_bytes)
        except _BodyTooLarge as exc:
            return error_response(
                413, f"request body of {exc.args[0]} bytes is over the limit of {limits.limits.max_body_bytes} bytes"
            )
        try:
            req = ImageGenerationRequest.model_validate_json(body, context={"limits": limits})
            width, height = req.width_height()
            plan = self._planner.plan(
                GenerationRequest(
                    prompt=req.prompt,
                    n=req.n or 1,
                    width=width,
                    height=height,
                    num_inference_steps=req.num_inference_steps,
                    guidance_scale=req.guidance_scale,
                    negative_prompt=req.negative_prompt,
                    seed=req.seed,
                    true_cfg_scale=req.true_cfg_scale,
                )
            )
        except ValidationError as exc:
            return validation_error_response(exc, limits)
        except RequestError as exc:
            if isinstance(exc, BucketMissError):
                self._rejected_requests += 1
                self._rejected.update(exc.missed)
            return error_response(exc.status, exc.message, param=exc.field)
        if not plan.lookup.hit and plan.home is None and self._planner.table.miss_policy is MissPolicy.REJECT:
            # The planner is expected to reject this itself; kept so a reject policy can never run eager.
            missed = [d.value for d in plan.lookup.missed]
            param = {"image_tokens": "size", "batch": "n", "text_tokens": "prompt"}[missed[0]]
            return error_response(422, f"no bucket holds this request ({', '.join(missed)} missed; table: "
                                  f"{self._planner.table.describe_limits()}) and the miss policy is reject",
                                  param=param)
        try:
            routed = await call_dit(self._dit, plan, self._config.routing.max_retries,
                                retry_after_s=self._config.routing.retry_after_s)
            result = routed.result
        except Exception as exc:  # noqa: BLE001 - every failure is answered, the server keeps serving
            found = find_request_error(exc)
            if found is not None:
                if isinstance(found, ServiceUnavailable):
                    return unavailable_response(found.message, found.retry_after_s, param=found.field)
                return error_response(found.status, found.message, param=found.field)
            logger.exception("generation failed")
            return error_response(500, f"generation failed: {type(exc).__name__}")
        return ImageGenerationResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=b64encode(png).decode("ascii")) for png in result.images_png],
            bcg=BcgInfo(
                bucket=result.bucket,
                hit=result.hit,
                missed=list(result.missed),
                seed=result.seed,
                timings_ms=dict(result.timings_ms),
                replica=result.replica,
                owner=result.owner,
                batch_size=result.batch_size,
                retries=routed.retries,
            ),
        )
