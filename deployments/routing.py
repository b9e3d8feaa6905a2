"""Sending a validated request (its :class:`~bcg_core.request.ValidatedRequest`) to the DiT deployment, with its bucket
shape in the request metadata.

On the HTTP path the router sees a request's arguments only as opaque bytes, so the bucket shape travels in
``RequestMetadata.multiplexed_model_id`` (``handle.options(multiplexed_model_id=str(key))``, ``key`` the request's
:class:`~router.routing_key.RoutingKey`), where :class:`router.shape_router.ShapeAwareRouter` reads it. The ingress uses
:func:`call_dit` for HTTP requests and for its Python handle method ``Ingress.images``; code holding a DiT handle
directly can use it too.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from bcg_core.errors import ServiceUnavailable
from bcg_core.request import GenerationResult, ValidatedRequest
from router.routing_key import RoutingKey

__all__ = ["ACCEPTED", "Overloaded", "ReplicaUnavailable", "Routed", "bucket_shape", "call_dit", "overloaded",
           "routing_key", "stream_dit"]

ACCEPTED = "bcg:accepted"
"""The first item of every ``DiTReplica.generate_stream``: the replica took the request. The ingress waits for it
before it answers 200, so a refusal (a bad field, a full queue, a dead replica) is still a plain 4xx or 503."""

logger = logging.getLogger("ray.serve")


class Overloaded(ServiceUnavailable):
    """Every DiT replica is busy and the caller's queue is full (HTTP 503 with ``Retry-After``)."""


class ReplicaUnavailable(ServiceUnavailable):
    """Every attempt hit a replica that died before answering (HTTP 503 with ``Retry-After``: the client may
    retry once a replacement is up)."""


def routing_key(validated: ValidatedRequest) -> RoutingKey:
    """The routing key of a validated request: its bucket shape (:attr:`ValidatedRequest.shape`, e.g. ``"i1024_t256"``),
    or ``""`` for a miss (no owner: any replica, eagerly), and its LoRA adapters' names (replicas holding them are
    preferred)."""
    shape = str(validated.shape) if validated.shape is not None else ""
    return RoutingKey.of(shape, (n for n, _ in validated.request.lora))


def bucket_shape(validated: ValidatedRequest) -> str:
    """:func:`routing_key` in its wire form, the ``multiplexed_model_id`` a call carries (``"i1024_t256|lora=ink"``)."""
    return str(routing_key(validated))


@dataclass
class Routed:
    """A result and how many times its request was resent."""

    result: GenerationResult
    retries: int


async def call_dit(handle, validated: ValidatedRequest, max_retries: int = 2, retry_wait_s: float = 0.5,
                   retry_after_s: float = 2.0) -> Routed:
    """Send ``validated`` to the DiT deployment, keyed by its bucket shape; resend when the replica dies.

    The replica trusts the validated request (seed filled in, bucket looked up) and does not validate it again. A
    replica that dies mid-request (``RayActorError``: killed, node lost, out of memory) fails its in-flight
    calls; generation is deterministic per seed and has no side effects, so the same validated request (the same
    seed) is resent (the router skips the dead replica) up to ``max_retries`` times, ``retry_wait_s`` apart.

    Raises:
        RequestError: the replica refused the request (bad field, miss under the reject policy).
        Overloaded: the deployment's queue for this caller is full (``max_queued_requests``); raised at
            once, with ``retry_after_s`` for the client.
        ReplicaUnavailable: every attempt met a dead replica (with ``retry_after_s`` for the client).
    """
    shape = bucket_shape(validated)
    routed = handle.options(multiplexed_model_id=shape)
    last: BaseException | None = None
    for attempt in range(max_retries + 1):
        try:
            result = await routed.generate.remote(validated)
            return Routed(result, attempt)
        except BackPressureError as exc:
            raise overloaded(exc, retry_after_s) from None
        except RayActorError as exc:
            last = exc
            logger.warning("DiT replica died serving a request of shape %r (attempt %d of %d): %s",
                           shape, attempt + 1, max_retries + 1, type(exc).__name__)
            await asyncio.sleep(retry_wait_s)
    raise ReplicaUnavailable(
        "request", f"the DiT replica serving this request died {max_retries + 1} times in a row "
        f"({type(last).__name__}); retry after {retry_after_s:g} s", retry_after_s=retry_after_s) from last


def overloaded(exc: BackPressureError, retry_after_s: float) -> Overloaded:
    """The 503 of a call the DiT deployment's handle refused because its queue is full. Ray's own text counts the
    queue as this ingress replica sees it ("num_queued_requests=24, max_queued_requests=16"), which reads as a
    contradiction to a client, so it goes to the log and the answer says what happened."""
    logger.debug("DiT queue full, request refused with 503: %s", exc)
    return Overloaded("request", f"the server is at capacity (every DiT replica busy and its queue full); retry "
                      f"after {retry_after_s:g} s", retry_after_s=retry_after_s)


async def stream_dit(handle, validated: ValidatedRequest, retry_after_s: float = 2.0, progress: bool = False):
    """Stream ``validated`` from the DiT deployment (``DiTReplica.generate_stream``), keyed by its bucket shape:
    yields :data:`ACCEPTED` once the replica took it, then its previews (and with ``progress`` a
    :class:`~bcg_core.preview.StepProgress` after each denoising step), then its :class:`GenerationResult`.

    Not resent when the replica dies: previews may already have reached the client, so the failure is the
    caller's to report. Closing this iterator before the result (the client went away) cancels the call,
    which cancels the request on the replica at its next step.

    Raises:
        RequestError: the replica refused the request.
        Overloaded: the deployment's queue for this caller is full (with ``retry_after_s``).
        ReplicaUnavailable: the replica died mid-stream.
    """
    streamed = handle.options(multiplexed_model_id=bucket_shape(validated), stream=True).generate_stream
    gen = streamed.remote(validated, progress=True) if progress else streamed.remote(validated)
    finished = False
    try:
        async for event in gen:
            yield event
        finished = True
    except BackPressureError as exc:
        raise overloaded(exc, retry_after_s) from None
    except RayActorError as exc:
        raise ReplicaUnavailable("request", f"the DiT replica serving this request died ({type(exc).__name__}); "
                                 f"retry after {retry_after_s:g} s", retry_after_s=retry_after_s) from exc
    finally:
        if not finished:
            try:
                gen.cancel()
            except Exception as exc:  # noqa: BLE001 - a call refused for back-pressure raises its refusal again here
                logger.debug("cancelling the DiT stream raised %s: %s", type(exc).__name__, exc)
