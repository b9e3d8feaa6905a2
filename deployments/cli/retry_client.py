"""Client side of ``503`` + ``Retry-After``: wait as long as the server asks, then resend the same body.

:func:`parse_retry_after` reads the header (delay-seconds or an HTTP-date), :func:`retry_after_delay` clamps it
for a 503 answer to [:data:`RETRY_AFTER_MIN_S`, :data:`RETRY_AFTER_MAX_S`] (any other answer is final), and
:func:`post_honouring_retry_after` / :func:`apost_honouring_retry_after` (httpx sync / async) resend within a
bound on resends and a deadline. httpx is never imported here: any client with ``post`` works.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "RETRY_DEADLINE_S",
    "RETRY_MAX_RETRIES",
    "apost_honouring_retry_after",
    "parse_retry_after",
    "post_honouring_retry_after",
    "retry_after_delay",
]

RETRY_MAX_RETRIES = 20
"""Default bound on the resends of one request answered 503 with ``Retry-After``."""
RETRY_DEADLINE_S = 600.0
"""Default deadline of one request's resends, seconds from its first send (no resend starts after it)."""
RETRY_AFTER_MIN_S = 0.05
"""Shortest wait honoured for a ``Retry-After``, seconds (``0`` or a date in the past wait this long)."""
RETRY_AFTER_MAX_S = 30.0
"""Longest wait honoured for a ``Retry-After``, seconds (longer values wait this long, then resend)."""


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """The seconds a ``Retry-After`` header value asks to wait, unclamped.

    Args:
        value: the header value: delay-seconds (``"2"``; a decimal such as ``"1.5"`` is accepted too) or an
            HTTP-date (RFC 9110, e.g. ``"Wed, 21 Oct 2015 07:28:00 GMT"``); None when the header is absent.
        now: the current time for an HTTP-date (aware datetime); None takes the clock.

    Returns:
        Seconds to wait (negative for a date in the past), or None when ``value`` is None, empty, or neither a
        finite number nor an HTTP-date. Never raises.
    """
    from email.utils import parsedate_to_datetime

    text = (value or "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; "-0000" parses as naive
        when = when.replace(tzinfo=timezone.utc)
    return (when - (now or datetime.now(timezone.utc))).total_seconds()


def retry_after_delay(response: Any) -> float | None:
    """How long to wait before resending, for an answer that asks for it; None for any other answer.

    Args:
        response: an ``httpx.Response`` (anything with ``status_code`` and ``headers``).

    Returns:
        For a ``503`` with a parseable ``Retry-After`` (:func:`parse_retry_after`), its seconds clamped to
        [:data:`RETRY_AFTER_MIN_S`, :data:`RETRY_AFTER_MAX_S`]; None for every other status, for a 503 without
        the header and for a header that does not parse (such answers are final). Never raises.
    """
    if response.status_code != 503:
        return None
    seconds = parse_retry_after(response.headers.get("retry-after"))
    if seconds is None:
        return None
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, seconds))


def _check_bounds(max_retries: int, deadline_s: float) -> None:
    if max_retries < 0:
        raise ValueError(f"max_retries {max_retries} must be at least 0")
    if not deadline_s >= 0:
        raise ValueError(f"deadline_s {deadline_s} must be at least 0")


def _post_kwargs(json: Any, timeout: float | None) -> dict[str, Any]:
    return {"json": json} if timeout is None else {"json": json, "timeout": timeout}


def _resend_delay(response: Any, retries: int, elapsed_s: float, max_retries: int, deadline_s: float) -> float | None:
    """Seconds to wait before resending after ``response``, or None to return it: not a 503 with
    ``Retry-After``, ``max_retries`` resends made, or the wait would end past ``deadline_s`` from the first
    send (``elapsed_s`` ago)."""
    delay = retry_after_delay(response)
    if delay is None or retries >= max_retries or elapsed_s + delay > deadline_s:
        return None
    return delay


def _give_up(exc: BaseException, retries: int, waited_s: float) -> None:
    """Record the resends made so far on a transport error before it propagates."""
    try:
        exc.retries = retries  # type: ignore[attr-defined]
        exc.retry_wait_s = waited_s  # type: ignore[attr-defined]
    except AttributeError:  # an exception type without a __dict__: the counts are lost, the error is not
        pass


def post_honouring_retry_after(client: Any, url: str, json: Any, *, timeout: float | None = None,
                               max_retries: int = RETRY_MAX_RETRIES, deadline_s: float = RETRY_DEADLINE_S,
                               sleep: Callable[[float], Any] = time.sleep,
                               clock: Callable[[], float] = time.monotonic) -> tuple[Any, int, float]:
    """POST ``json`` to ``url``; while the answer is ``503`` with ``Retry-After``, wait that long and resend.

    The wait is :func:`retry_after_delay` (the header's seconds or HTTP-date, clamped to
    [:data:`RETRY_AFTER_MIN_S`, :data:`RETRY_AFTER_MAX_S`] seconds). Every other answer, a 503 without
    ``Retry-After`` included, is returned at once. The same body is resent each time.

    Args:
        client: an ``httpx.Client`` (any object whose ``post(url, json=..., timeout=...)`` returns a
            response).
        url: the full URL, e.g. ``http://127.0.0.1:8000/v1/images/generations``.
        json: the JSON body.
        timeout: bound on each send, seconds; None keeps the client's own timeout.
        max_retries: most resends (>= 0; 0 sends once).
        deadline_s: seconds from the first send (>= 0) after which no resend starts: a wait that would end
            past it is not taken and the 503 is returned.
        sleep: called with the seconds to wait (tests pass a recorder).
        clock: monotonic clock in seconds for the deadline.

    Returns:
        ``(response, retries, waited_s)``: the final answer, the resends made, and the seconds waited for
        ``Retry-After`` in total. When a bound stopped the resends the response is the last 503 (then
        ``retry_after_delay(response)`` is not None).

    Raises:
        ValueError: ``max_retries`` < 0 or ``deadline_s`` < 0.
        httpx.HTTPError: (and whatever else ``client.post`` raises) a send failed; the exception carries
            ``retries`` and ``retry_wait_s`` attributes with the resends made before it.
    """
    _check_bounds(max_retries, deadline_s)
    start = clock()
    retries, waited = 0, 0.0
    while True:
        try:
            response = client.post(url, **_post_kwargs(json, timeout))
        except Exception as exc:
            _give_up(exc, retries, waited)
            raise
        delay = _resend_delay(response, retries, clock() - start, max_retries, deadline_s)
        if delay is None:
            return response, retries, waited
        response.close()
        sleep(delay)
        retries, waited = retries + 1, waited + delay


async def apost_honouring_retry_after(client: Any, url: str, json: Any, *, timeout: float | None = None,
                                      max_retries: int = RETRY_MAX_RETRIES,
                                      deadline_s: float = RETRY_DEADLINE_S,
                                      sleep: Callable[[float], Awaitable[Any]] | None = None,
                                      clock: Callable[[], float] = time.monotonic) -> tuple[Any, int, float]:
    """:func:`post_honouring_retry_after` for an ``httpx.AsyncClient``: the same bounds, waits and result.

    Args:
        client: an ``httpx.AsyncClient`` (any object whose ``post`` is a coroutine returning a response).
        url, json, timeout, max_retries, deadline_s, clock: as in :func:`post_honouring_retry_after`.
        sleep: coroutine function called with the seconds to wait; None is ``asyncio.sleep``.

    Returns:
        ``(response, retries, waited_s)`` as :func:`post_honouring_retry_after`.

    Raises:
        ValueError: ``max_retries`` < 0 or ``deadline_s`` < 0.
        httpx.HTTPError: a send failed (with ``retries`` and ``retry_wait_s`` attributes, as there).
    """
    import asyncio

    _check_bounds(max_retries, deadline_s)
    wait = asyncio.sleep if sleep is None else sleep
    start = clock()
    retries, waited = 0, 0.0
    while True:
        try:
            response = await client.post(url, **_post_kwargs(json, timeout))
        except Exception as exc:
            _give_up(exc, retries, waited)
            raise
        delay = _resend_delay(response, retries, clock() - start, max_retries, deadline_s)
        if delay is None:
            return response, retries, waited
        await response.aclose()
        await wait(delay)
        retries, waited = retries + 1, waited + delay
