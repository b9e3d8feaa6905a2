"""What a generation answers with, besides the images: OpenAI's ``usage``, the ``bcg`` extension and timings, and
the Server-Sent Events of ``stream: true``.

:func:`usage_of`, :func:`ingress_timings` and :func:`bcg_info` build the parts every answer carries (the JSON
answer and each ``image_generation.completed`` event alike); :func:`image_events` turns a replica's stream
(:func:`~deployments.routing.stream_dit`) into SSE frames (:func:`sse_event`) in the shapes the ``openai``
client parses, a failure after the stream began being one ``error`` event.
"""

import contextlib
import json
import logging
import time
from base64 import b64encode

from bcg_core.preview import PartialImage
from bcg_core.request import GenerationResult, ValidatedRequest

from .http_errors import find_request_error
from .responses import BcgInfo, Usage
from .schemas import ErrorDetail, ImageGenerationRequest, LoraAdapter

__all__ = ["bcg_info", "image_events", "ingress_timings", "sse_event", "usage_of"]

logger = logging.getLogger("ray.serve")


def sse_event(event: str, data: dict) -> bytes:
    """One Server-Sent Event: ``event: <type>``, one ``data:`` line of compact JSON, a blank line (the framing
    ``openai``'s ``SSEDecoder`` parses; JSON escapes every newline, so one data line always suffices)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def usage_of(validated) -> Usage:
    """OpenAI's ``usage`` of a validated request (:class:`~deployments.responses.Usage`): its prompt tokens (and an
    edit's input image, one image's transformer image tokens; a reference edit's, its references' tokens) in, its
    images' transformer image tokens out."""
    tokens = validated.lookup.query.image_tokens
    refs = sum(h * w for h, w in validated.references)  # a reference edit's stream also holds its references
    edited = (refs or tokens) if validated.request.image is not None else 0
    return Usage.of(validated.prompt_tokens, validated.request.n, tokens - refs, edited)


def ingress_timings(result: GenerationResult, sent: float) -> dict[str, float]:
    """The replica's ``timings_ms`` plus the ingress's: ``ingress`` (``sent``, a ``time.perf_counter()``, to
    now) and ``route`` (``ingress`` less the replica's ``total``: Ray Serve's queues and the transfers)."""
    timings = dict(result.timings_ms)
    ingress_ms = round((time.perf_counter() - sent) * 1e3, 2)
    timings["ingress"] = ingress_ms
    timings["route"] = round(max(0.0, ingress_ms - timings.get("total", 0.0)), 2)
    return timings


def bcg_info(result: GenerationResult, timings: dict[str, float], retries: int, validated: ValidatedRequest) -> BcgInfo:
    """The ``bcg`` extension of the answer to ``validated``: how its replica served it, its adapters (``lora``) and what
    its step cache did (``cache``)."""
    lora = [LoraAdapter(name=name, scale=scale) for name, scale in validated.request.lora] or None
    return BcgInfo(bucket=None if result.bucket is None else str(result.bucket), hit=result.hit,
                   missed=list(result.missed), seed=result.seed, steps=result.steps, timings_ms=timings,
                   replica=result.replica, owner=result.owner, batch_size=result.batch_size, retries=retries, lora=lora,
                   cache=result.cache)


async def image_events(validated: ValidatedRequest, req: ImageGenerationRequest, events, t0: float,
                       kind: str = "image_generation", background: str = "opaque"):
    """The Server-Sent Events of a streamed request: ``image_generation.partial_image`` per preview and image,
    then ``image_generation.completed`` per image, in the shapes of the ``openai`` client's
    ``ImageGenPartialImageEvent`` and ``ImageGenCompletedEvent`` (plus ``image_index`` and, on completed
    events, ``bcg``); a failure after the stream began is one ``error`` event in OpenAI's error shape.
    The client going away closes this generator, which cancels the request on the replica.

    Args:
        validated, req: the request, validated and as sent.
        events: :func:`~deployments.routing.stream_dit` of it, past :data:`~deployments.routing.ACCEPTED`.
        t0: ``time.perf_counter()`` when the validated request was sent.
        kind: the events' prefix: ``image_generation``, or ``image_edit`` for an edit (the client's
            ``ImageEditPartialImageEvent`` and ``ImageEditCompletedEvent``).
        background: what the served model's images are: ``opaque``, or ``transparent`` where they carry alpha.
    """
    r = validated.request
    common = {"background": background, "output_format": r.output_format, "quality": r.quality or "auto",
              "size": f"{r.width}x{r.height}"}
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, PartialImage):
                    yield sse_event(f"{kind}.partial_image", {
                        "type": f"{kind}.partial_image", "b64_json": b64encode(event.data).decode("ascii"),
                        "created_at": int(time.time()), "partial_image_index": event.index, **common,
                        "image_index": event.image_index, "step": event.step})
                    continue
                usage = usage_of(validated).model_dump()
                bcg = bcg_info(event, ingress_timings(event, t0), 0, validated).model_dump()
                for i, data in enumerate(event.image_bytes):
                    yield sse_event(f"{kind}.completed", {
                        "type": f"{kind}.completed", "b64_json": b64encode(data).decode("ascii"),
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
