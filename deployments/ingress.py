"""HTTP ingress: OpenAI Images API on FastAPI, validated and planned before any GPU work.

Routes (relative to the application's route prefix):

- ``POST /v1/images/generations``: body :class:`~deployments.schemas.ImageGenerationRequest`, answer
  :class:`~deployments.schemas.ImageGenerationResponse`; with ``stream: true`` Server-Sent Events instead
  (``image_generation.partial_image`` per preview and image, then ``image_generation.completed`` per image, the
  shapes the ``openai`` client parses; the DiT replica streams them through ``DiTReplica.generate_stream``).
- ``GET /v1/buckets``: one DiT replica's ``DiTReplica.stats()`` (its per-bucket counters, routing view,
  micro-batching totals) and, with shape-aware routing, ``ownership``: the coordinator's assignment and
  every replica's last heartbeat (owned and ready shapes, queue, owner hits), at most
  ``routing.stats_period_s`` old; ``traffic``: the request shapes accepted (with shape-aware routing, every
  replica's histogram merged: the answering replica's current one and the others' from their last heartbeat).
- ``GET /v1/models`` (and ``GET /v1/models/{id}``): the served model in OpenAI's list format, with the bucket
  table, the limits and the step count of each ``quality`` under ``bcg``.
- ``GET /healthz``: ``{"status": "ok"}``; never asks for a key.

API keys: with ``auth.api_keys`` or ``auth.api_key_file`` set, every ``/v1/`` route asks for
``Authorization: Bearer <key>`` (:mod:`deployments.auth`: digests only, compared in constant time); a missing or
unknown key is answered 401 in OpenAI's error shape, naming neither the key nor its digest.

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

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from base64 import b64encode
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from bcg_core.config import MissPolicy, ServeConfig
from bcg_core.errors import BucketMissError, RequestError, ServiceUnavailable
from bcg_core.images import IMAGE_FORMATS
from bcg_core.pipeline import GenerationResult
from bcg_core.planner import GenerationRequest, Plan, Planner
from bcg_core.preview import PartialImage
from bcg_core.traffic import TrafficHistogram

from .auth import ApiKeys
from .routing import ACCEPTED, call_dit, stream_dit
from .schemas import (
    BcgInfo,
    ErrorBody,
    ErrorDetail,
    ImageData,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ModelCard,
    ModelList,
    RequestLimits,
    Usage,
    allowed_values,
)

__all__ = ["Ingress", "error_response", "find_request_error", "merged_traffic", "unauthorized_response",
           "unavailable_response", "validation_error_response"]

logger = logging.getLogger("ray.serve")

app = FastAPI(
    title="bcg-serve",
    description="Diffusion Transformer image generation with Bucketed CUDA Graphs (BCG) on Ray Serve; "
    "OpenAI Images API compatible.",
)

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 413, 422, 500, 503)
}


def error_response(status: int, message: str, param: str | None = None, type_: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error answer.

    Args:
        status: HTTP status code.
        message: human message naming the field and the values it accepts.
        param: the request field at fault, or None.
        type_: OpenAI error type; default ``"invalid_request_error"`` below 500, ``"server_error"`` above.
        code: OpenAI's machine-readable code (``"invalid_api_key"``), or None.
    """
    kind = type_ or ("server_error" if status >= 500 else "invalid_request_error")
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump())


COORDINATOR_TIMEOUT_S = 2.0
"""Seconds ``/v1/buckets`` waits for the ownership coordinator's snapshot; past it ``ownership`` is an error note
(the coordinator is being restarted) and the rest of the stats are answered."""

_AUTH_MESSAGES = {
    "missing": ("You didn't provide an API key. Send it in an Authorization header: 'Authorization: Bearer "
                "<key>' (the openai client: OpenAI(api_key=...)).", None),
    "invalid": ("Incorrect API key provided. Use a key this server was configured with (auth.api_keys or "
                "auth.api_key_file).", "invalid_api_key"),
}


def unauthorized_response(reason: str) -> JSONResponse:
    """A 401 in OpenAI's error shape for a ``"missing"`` or ``"invalid"`` key (:meth:`ApiKeys.check`), with
    ``WWW-Authenticate: Bearer``; it never repeats the key."""
    message, code = _AUTH_MESSAGES[reason]
    answer = error_response(401, message, code=code)
    answer.headers["WWW-Authenticate"] = "Bearer"
    return answer


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


def sse_event(event: str, data: dict) -> bytes:
    """One Server-Sent Event: ``event: <type>``, one ``data:`` line of compact JSON, a blank line (the framing
    ``openai``'s ``SSEDecoder`` parses; JSON escapes every newline, so one data line always suffices)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def usage_of(plan) -> Usage:
    """OpenAI's ``usage`` of a planned request (:class:`~deployments.schemas.Usage`): its prompt tokens in, its
    images' transformer image tokens out."""
    return Usage.of(plan.prompt_tokens, plan.request.n, plan.lookup.query.image_tokens)


def ingress_timings(result: GenerationResult, sent: float) -> dict[str, float]:
    """The replica's ``timings_ms`` plus the ingress's: ``ingress`` (``sent``, a ``time.perf_counter()``, to
    now) and ``route`` (``ingress`` less the replica's ``total``: Ray Serve's queues and the transfers)."""
    timings = dict(result.timings_ms)
    ingress_ms = round((time.perf_counter() - sent) * 1e3, 2)
    timings["ingress"] = ingress_ms
    timings["route"] = round(max(0.0, ingress_ms - timings.get("total", 0.0)), 2)
    return timings


def bcg_info(result: GenerationResult, timings: dict[str, float], retries: int) -> BcgInfo:
    """The ``bcg`` extension of an answer."""
    return BcgInfo(bucket=result.bucket, hit=result.hit, missed=list(result.missed), seed=result.seed,
                   steps=result.steps, timings_ms=timings, replica=result.replica, owner=result.owner, batch_size=result.batch_size,
                   retries=retries)


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
        pydantic.ValidationError: on a bad config (at replica start); ValueError: ``auth.api_key_file`` cannot be
            read or holds no key.
    """

    def __init__(self, dit_handle, config: dict, coordinator=None):
        self._config = ServeConfig.model_validate(config)
        self._keys = ApiKeys.from_config(self._config.auth)
        self._started = int(time.time())
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

    def _refused(self, request: Request) -> JSONResponse | None:
        """The 401 answer for a request without a known API key, or None (accepted, or no keys configured)."""
        reason = self._keys.check(request.headers.get("authorization"))
        return None if reason is None else unauthorized_response(reason)

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        """Liveness: ``{"status": "ok"}`` (no key asked for)."""
        return {"status": "ok"}

    def _model_card(self) -> ModelCard:
        spec, table, lim = self._planner.spec, self._planner.table, self._config.limits
        quality = {q: spec.steps_for_quality(q, self._config.quality, lim.default_steps, lim.max_steps)
                   for q in ("low", "medium", "high", "auto")}
        return ModelCard(id=self._model_name, created=self._started, bcg={
            "family": spec.family, "pipeline_class": spec.pipeline_class,
            "buckets": {**table.describe_limits(), "count": len(table)},
            "limits": {"max_images": lim.max_images, "min_side_px": lim.min_side_px, "max_side_px": lim.max_side_px,
                       "size_multiple": table.rules.pixels_per_token, "max_steps": lim.max_steps,
                       "default_steps": lim.default_steps},
            "quality_steps": quality,
            "output_formats": list(IMAGE_FORMATS),
        })

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorBody}})
    async def models(self, request: Request):
        """The served model in OpenAI's list format (``openai`` ``client.models.list()``), its bucket table
        summarised under ``bcg``."""
        refused = self._refused(request)
        if refused is not None:
            return refused
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
        return self._model_card()

    @app.get("/v1/buckets", responses={401: {"model": ErrorBody}, 500: {"model": ErrorBody},
                                       503: {"model": ErrorBody}})
    async def buckets(self, request: Request):
        """Per-bucket counters of the DiT replica (``DiTPipeline.stats()``), plus the misses this ingress
        rejected under the reject policy (``misses.rejected``, ``misses.rejected_by_dim``) and, with a
        coordinator, ``ownership`` and every replica's ``traffic`` merged (:func:`merged_traffic`). When every
        DiT slot and queue place is taken the call is answered 503 with ``Retry-After`` in OpenAI's error shape,
        like a generation request."""
        refused = self._refused(request)
        if refused is not None:
            return refused
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
            try:
                stats["ownership"] = await asyncio.wait_for(self._coord.snapshot.remote(), COORDINATOR_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a coordinator being restarted must not fail the stats
                stats["ownership"] = {"error": f"the ownership coordinator did not answer within "
                                               f"{COORDINATOR_TIMEOUT_S:g} s ({type(exc).__name__}); it is "
                                               f"restarted by Serve and rebuilds ownership from the replicas' "
                                               f"heartbeats"}
            stats["traffic"] = merged_traffic(stats, stats["ownership"])
        return stats

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

    async def _events(self, plan: Plan, req: ImageGenerationRequest, events, t0: float):
        """The Server-Sent Events of a streamed request: ``image_generation.partial_image`` per preview and image,
        then ``image_generation.completed`` per image, in the shapes of the ``openai`` client's
        ``ImageGenPartialImageEvent`` and ``ImageGenCompletedEvent`` (plus ``image_index`` and, on completed
        events, ``bcg``); a failure after the stream began is one ``error`` event in OpenAI's error shape.
        The client going away closes this generator, which cancels the request on the replica.

        Args:
            plan, req: the request, planned and as sent.
            events: :func:`~deployments.routing.stream_dit` of it, past :data:`~deployments.routing.ACCEPTED`.
            t0: ``time.perf_counter()`` when the plan was sent.
        """
        r = plan.request
        common = {"background": "opaque", "output_format": r.output_format, "quality": req.quality or "auto",
                  "size": f"{r.width}x{r.height}"}
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, PartialImage):
                        yield sse_event("image_generation.partial_image", {
                            "type": "image_generation.partial_image", "b64_json": b64encode(event.data).decode("ascii"),
                            "created_at": int(time.time()), "partial_image_index": event.index, **common,
                            "image_index": event.image_index, "step": event.step})
                        continue
                    usage = usage_of(plan).model_dump()
                    bcg = bcg_info(event, ingress_timings(event, t0), 0).model_dump()
                    for i, data in enumerate(event.images_png):
                        yield sse_event("image_generation.completed", {
                            "type": "image_generation.completed", "b64_json": b64encode(data).decode("ascii"),
                            "created_at": int(time.time()), **common, "usage": usage, "image_index": i, "bcg": bcg})
        except Exception as exc:  # noqa: BLE001 - answered as an error event; the server keeps serving
            found = find_request_error(exc)
            if found is None:
                logger.exception("streamed generation failed")
                detail = ErrorDetail(message=f"generation failed: {type(exc).__name__}", type="server_error")
            else:
                detail = ErrorDetail(message=found.message, param=found.field,
                                     type="server_error" if found.status >= 500 else "invalid_request_error")
            yield sse_event("error", {"type": "error", "error": detail.model_dump()})

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
        responses={**_ERROR_RESPONSES, 200: {
            "description": "The images as JSON; with `stream: true` Server-Sent Events instead "
                           "(`image_generation.partial_image`, then `image_generation.completed` per image).",
            "content": {"text/event-stream": {"schema": {"type": "string"}}}}},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ImageGenerationRequest.model_json_schema()}},
            }
        },
    )
    async def generate(self, request: Request):
        """Generate ``n`` images for a prompt (OpenAI ``images.generate``); with ``stream: true`` as Server-Sent
        Events (:mod:`deployments.streaming`)."""
        refused = self._refused(request)
        if refused is not None:
            return refused
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
                    quality=req.quality,
                    output_format=req.image_format(),
                    output_compression=req.output_compression,
                    partial_images=(req.partial_images or 0) if req.stream else 0,
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
        t0 = time.perf_counter()
        if req.stream:
            events = stream_dit(self._dit, plan, self._config.routing.retry_after_s)
            try:  # answer 200 only once a replica took the request: a refusal stays a plain 4xx or 503
                first = await anext(events)
                if first != ACCEPTED:
                    raise RuntimeError(f"the DiT replica's stream began with {type(first).__name__}, not its "
                                       f"acceptance")
            except Exception as exc:  # noqa: BLE001 - every failure is answered, the server keeps serving
                await events.aclose()
                return self._failure(exc)
            return StreamingResponse(self._events(plan, req, events, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            routed = await call_dit(self._dit, plan, self._config.routing.max_retries,
                                retry_after_s=self._config.routing.retry_after_s)
            result = routed.result
        except Exception as exc:  # noqa: BLE001 - every failure is answered, the server keeps serving
            return self._failure(exc)
        timings = ingress_timings(result, t0)
        return ImageGenerationResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=b64encode(png).decode("ascii")) for png in result.images_png],
            output_format=result.image_format,
            quality=req.quality if req.quality != "auto" else None,
            size=f"{width}x{height}",
            usage=usage_of(plan),
            bcg=bcg_info(result, timings, routed.retries),
        )

