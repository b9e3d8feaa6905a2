"""The ingress's drain before the local server deletes its application (``bcg serve`` stopped by Ctrl-C, SIGTERM or
``--stop-after-s``, and every other caller of :func:`deployments.cli.local.stop_local`).

Why: deleting the application (``serve.delete``) takes its route out of Ray Serve's HTTP proxy at once, and the proxy
answers a path it has no route for with a plain-text 404 (``Path '/v1/models' not found. Ping http://.../-/routes for
available routes.``: Ray's ``ASGIProxyRequest.not_found_response``, not ours to change), which the ``openai`` client
raises as ``NotFoundError`` and never retries. So the server drains while the application is still deployed:

1. :func:`drain_ingress` (in the driver) asks the application's ingress, through its handle, to drain
   (``Ingress.drain``): from then on :class:`DrainMiddleware` answers every new HTTP request 503 with ``Retry-After``
   (``routing.retry_after_s``) in OpenAI's error shape, code ``server_stopping`` (:func:`stopping_response`: the
   ``openai`` client raises ``InternalServerError``, after retrying it), while the requests already in flight are
   served to the end (a streamed one to its last event).
2. It waits until no ingress replica has an HTTP request in flight, at most ``timeout_s`` seconds; then
   ``stop_local`` deletes the application (its replicas stop gracefully) and shuts Ray down.

A request that arrives after the deletion is still answered by the proxy's 404 (the route is gone), until Ray's
shutdown closes the port; docs/OPERATIONS.md says how long that lasts.

Ray is imported only by :func:`drain_ingress`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from .http_errors import unavailable_response
from .memory import InFlightCounter

__all__ = ["INGRESS_DRAIN", "STOPPING_CODE", "DrainGate", "DrainMiddleware", "DrainReport", "drain_ingress",
           "drain_replica", "stopping_response"]

STOPPING_CODE = "server_stopping"
"""The ``code`` of the error answered to a request that arrives while the server drains."""


def stopping_response(retry_after_s: float) -> JSONResponse:
    """The answer to an HTTP request that arrives while the server drains: 503 with ``Retry-After`` (whole seconds,
    at least 1) and an OpenAI-shaped error (type ``server_error``, code :data:`STOPPING_CODE`) saying the server is
    stopping."""
    seconds = max(1, round(retry_after_s))
    return unavailable_response(
        f"the server is stopping: it takes no new requests while it finishes those in flight; send this request "
        f"again in {seconds} s, to this server once it is back or to another", retry_after_s, code=STOPPING_CODE)


class DrainGate:
    """One ingress process's drain state: whether it drains, the ``Retry-After`` it answers with, and its HTTP
    requests in flight (counted by :class:`DrainMiddleware`, always, whatever the heap trimmer's setting)."""

    def __init__(self):
        self.in_flight = InFlightCounter()
        self.retry_after_s: float | None = None
        """None while serving; the seconds answered in ``Retry-After`` once draining."""
        self.id = uuid.uuid4().hex[:12]
        """This process's id in :func:`drain_ingress`'s report (one per ingress replica)."""

    @property
    def draining(self) -> bool:
        """True once :meth:`start` was called (it never stops: the replica is about to be deleted)."""
        return self.retry_after_s is not None

    def start(self, retry_after_s: float) -> None:
        """Answer every HTTP request that arrives from now on with :func:`stopping_response` (``retry_after_s``:
        its ``Retry-After``, seconds). Called again, only the seconds change."""
        self.retry_after_s = float(retry_after_s)

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Wait until no HTTP request is in flight, at most ``timeout_s`` seconds (polled every ``poll_s``).
        Returns the requests still in flight (0: idle)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self.in_flight.count and time.monotonic() < deadline:
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        return self.in_flight.count


INGRESS_DRAIN = DrainGate()
"""This process's drain state (one ingress replica per process); ``Ingress.drain`` starts it
(:func:`drain_replica`)."""


async def drain_replica(retry_after_s: float, wait_s: float) -> dict[str, int | str]:
    """Start this process's drain (:data:`INGRESS_DRAIN`, answering ``Retry-After: retry_after_s``) and wait up to
    ``wait_s`` seconds for its HTTP requests in flight. Returns ``{"replica": its id, "in_flight": those left}``.

    ``Ingress.drain`` calls this rather than naming :data:`INGRESS_DRAIN` itself: Serve ships the ingress class to
    its replica by value (cloudpickle: the name ``deployments.ingress.Ingress`` is the deployment, not the class), and
    a module-level object named in its methods would travel as a copy, apart from the one :class:`DrainMiddleware`
    reads there."""
    INGRESS_DRAIN.start(retry_after_s)
    return {"replica": INGRESS_DRAIN.id, "in_flight": await INGRESS_DRAIN.wait_idle(wait_s)}


class DrainMiddleware:
    """ASGI middleware: while ``gate`` drains, an HTTP request is answered :func:`stopping_response` without reaching
    the application (its body unread); otherwise it is counted in flight from its start until its answer's last body
    chunk was sent (or it failed or was cancelled). Other scopes (lifespan) pass through.

    Args:
        app: the wrapped ASGI application.
        gate: the drain state (default :data:`INGRESS_DRAIN`).
    """

    def __init__(self, app, gate: DrainGate | None = None):
        self.app = app
        self.gate = gate if gate is not None else INGRESS_DRAIN

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        # counted before the check: a drain that starts in between sees this request, then this request sees it
        self.gate.in_flight.enter()
        try:
            if self.gate.draining:
                return await stopping_response(self.gate.retry_after_s)(scope, receive, send)
            return await self.app(scope, receive, send)
        finally:
            self.gate.in_flight.leave()


@dataclass(frozen=True)
class DrainReport:
    """What :func:`drain_ingress` saw.

    Attributes:
        replicas: the ingress replicas that answered, by their gate's id, with their requests still in flight when
            each last answered.
        expected: the ingress replicas Serve reported running.
        waited_s: seconds from the first drain call to the report.
    """

    replicas: dict[str, int]
    expected: int
    waited_s: float

    @property
    def drained(self) -> bool:
        """Every running ingress replica answered and none has a request in flight."""
        return len(self.replicas) >= self.expected and not any(self.replicas.values())


def drain_ingress(app_name: str, timeout_s: float, deployment: str = "Ingress", poll_s: float = 1.0) -> DrainReport:
    """Drain every ingress replica of the Serve application ``app_name`` and wait, at most ``timeout_s`` seconds,
    until none has an HTTP request in flight (see the module docstring). Needs a connected Ray with the application
    running.

    Each call of ``Ingress.drain`` goes to one replica (Serve's handle picks it); the calls are repeated, each waiting
    up to ``poll_s`` seconds on its replica, until every replica Serve reports running (``deployment``'s ``RUNNING``
    count) has answered with nothing in flight. A draining replica takes no new HTTP request, so one that answered 0
    stays at 0.

    Args:
        app_name: the Serve application (``bcg`` for ``bcg serve``).
        timeout_s: the longest wait for the requests in flight, seconds.
        deployment: the application's ingress deployment.
        poll_s: the longest wait of one call, seconds.

    Returns:
        The :class:`DrainReport` (``drained`` False when ``timeout_s`` ran out first).

    Raises:
        ray.serve.exceptions.RayServeException: the application is not running. An ingress replica's failure, as
            Ray raises it.
    """
    from ray import serve

    t0 = time.monotonic()
    deadline = t0 + max(0.0, timeout_s)
    status = serve.status().applications.get(app_name)
    overview = status.deployments.get(deployment) if status is not None else None
    expected = max(1, overview.replica_states.get("RUNNING", 0)) if overview is not None else 1
    handle = serve.get_app_handle(app_name)
    seen: dict[str, int] = {}
    while True:
        wait_s = max(0.0, min(poll_s, deadline - time.monotonic()))
        answer = handle.drain.remote(wait_s).result(timeout_s=wait_s + 30.0)
        seen[answer["replica"]] = answer["in_flight"]
        report = DrainReport(dict(seen), expected, time.monotonic() - t0)
        if report.drained or time.monotonic() >= deadline:
            return report
