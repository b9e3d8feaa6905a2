"""The ingress hands its C heap's free memory back to the OS once no HTTP request is in flight (glibc
``malloc_trim``), as the DiT replica's step scheduler does (:mod:`bcg_core.scheduler.memtrim`).

Why: the ingress holds each request's body (an edit's upload, up to ``limits.max_upload_bytes``), its parsed form,
and each answer's image files and their base64 text (a 9-image answer at 1024 px: tens of MB, twice). Freed, most of
it stays in glibc's heaps (its mmap threshold rises up to 32 MiB once large blocks are freed), so the ingress's
resident memory follows the largest answers that happened to be in flight together. Measured on the 2-core CPU with
``benchmarks/soak_mixed.py`` (5 clients: generations, streamed generations, LoRA, edits, bad requests), 5 minutes,
before this: the ingress at rest 457 MB after warm-up, 513 MB at the end (+12%); docs/RELIABILITY.md has the run
with it.

:class:`IdleTrimMiddleware` is a plain ASGI middleware (a streamed answer counts as in flight until its last
chunk is sent) that counts the HTTP requests in flight and notifies one :class:`IdleTrimmer` per process
(:data:`INGRESS_TRIM`) each time the count drops to zero; the trimmer waits ``delay_s`` (the Ingress sets it from
``scheduler.trim_idle_s``) and trims if nothing arrived meanwhile.

:func:`configure_heap` sets the process's mmap threshold (``runner.mmap_threshold_bytes``), so large buffers never
enter the heaps at all; the DiT replica calls it too.
"""

from __future__ import annotations

import logging
import threading

from bcg_core.scheduler.memtrim import IdleTrimmer, set_mmap_threshold

__all__ = ["INGRESS_TRIM", "IdleTrimMiddleware", "InFlightCounter", "configure_heap", "configure_ingress",
           "configure_trim"]

log = logging.getLogger("ray.serve")


class InFlightCounter:
    """HTTP requests in flight in this process (thread-safe); ``on_idle`` is called each time the count drops to
    zero."""

    def __init__(self, on_idle=None):
        self._n = 0
        self._lock = threading.Lock()
        self.on_idle = on_idle
        self.enabled = True
        """False: :class:`IdleTrimMiddleware` passes requests through uncounted (``scheduler.trim_idle_s`` None)."""

    @property
    def count(self) -> int:
        """Requests in flight now."""
        return self._n

    def idle(self) -> bool:
        """True when no request is in flight."""
        return self._n == 0

    def enter(self) -> None:
        """A request arrived."""
        with self._lock:
            self._n += 1

    def leave(self) -> None:
        """A request was answered (or its client went away); at zero, ``on_idle()`` is called."""
        with self._lock:
            self._n -= 1
            idle = self._n == 0
        if idle and self.on_idle is not None:
            self.on_idle()


INGRESS_TRIM = InFlightCounter()
"""This process's count of HTTP requests in flight; :func:`configure_trim` attaches its trimmer."""

_trimmer: IdleTrimmer | None = None


def configure_heap(runner) -> bool:
    """Set this process's mmap threshold to ``runner.mmap_threshold_bytes``
    (:func:`bcg_core.scheduler.memtrim.set_mmap_threshold`; None leaves glibc's dynamic threshold). The DiT replica
    and the ingress call it first thing at start. Returns whether it was set."""
    if runner.mmap_threshold_bytes is None:
        return False
    done = set_mmap_threshold(runner.mmap_threshold_bytes)
    if not done:
        log.info("runner.mmap_threshold_bytes: mallopt is not available here (not glibc); left as it is")
    return done


def configure_ingress(config) -> IdleTrimmer | None:
    """The ingress's memory settings from ``config`` (an engine or serve config): :func:`configure_heap` with its
    ``runner`` section, then :func:`configure_trim` with ``scheduler.trim_idle_s``; returns the trimmer or None."""
    configure_heap(config.runner)
    return configure_trim(config.scheduler.trim_idle_s)


def configure_trim(delay_s: float | None) -> IdleTrimmer | None:
    """Trim this process's heap ``delay_s`` seconds after its last HTTP request was answered (the ingress passes
    ``scheduler.trim_idle_s``); None: never. Returns the trimmer (its ``describe()`` counts trims and bytes released),
    or None. Called again, the delay is replaced."""
    global _trimmer
    if delay_s is None:
        INGRESS_TRIM.enabled, INGRESS_TRIM.on_idle = False, None
        return None
    if _trimmer is None:
        _trimmer = IdleTrimmer(INGRESS_TRIM.idle, delay_s)
    _trimmer.delay_s = float(delay_s)
    INGRESS_TRIM.enabled, INGRESS_TRIM.on_idle = True, _trimmer.notify
    return _trimmer


class IdleTrimMiddleware:
    """ASGI middleware: counts each HTTP request in :data:`INGRESS_TRIM` from its start until its answer's last
    body chunk was sent (or it failed or was cancelled); other scopes (lifespan) pass through.

    Args:
        app: the wrapped ASGI application.
        counter: the count to keep (default :data:`INGRESS_TRIM`).
    """

    def __init__(self, app, counter: InFlightCounter | None = None):
        self.app = app
        self.counter = counter if counter is not None else INGRESS_TRIM

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or not self.counter.enabled:
            return await self.app(scope, receive, send)
        self.counter.enter()
        try:
            return await self.app(scope, receive, send)
        finally:
            self.counter.leave()
