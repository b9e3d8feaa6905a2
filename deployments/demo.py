"""The demo: replay real prompts against the bcg-serve HTTP API and show what the bucket table did.

It starts the local server (:func:`deployments.local.start_local`: Ray and the Serve application on a
loopback port), or talks to a server already running (``url``), reads the first N requests of the real request sample
``bcg_core/data/krea_open_prompts_1k_flat.csv`` (one row = one request for ``num_generations`` images at
its width x height; rows with an empty prompt are skipped), replays them over HTTP, writes the images as
PNG files, then prints the replica's per-bucket statistics from ``GET /v1/buckets``.

A ``503`` answer with a ``Retry-After`` header (a replica that cannot admit more, see
:func:`deployments.ingress.unavailable_response`) is not a failure: the request waits as long as the
header says and is sent again, bounded by a number of retries and a deadline
(:func:`post_honouring_retry_after`; the benchmarks use its asyncio twin :func:`apost_honouring_retry_after`).

The pure parts (:func:`read_requests`, :func:`load_requests`, :class:`DemoRequest`) import nothing heavy;
Ray, httpx, rich and tqdm are imported only by the functions that use them.
"""

from __future__ import annotations

import base64
import csv
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Any

from .local import check_config, start_local, stop_local, wait_healthy

__all__ = [
    "DATA_FILE",
    "MAX_CONCURRENCY",
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "RETRY_DEADLINE_S",
    "RETRY_MAX_RETRIES",
    "SEED_MODULUS",
    "DemoRequest",
    "DemoResult",
    "apost_honouring_retry_after",
    "load_requests",
    "parse_retry_after",
    "post_honouring_retry_after",
    "read_requests",
    "render_report",
    "replay",
    "retry_after_delay",
    "run_demo",
    "send_request",
]

DATA_FILE = "krea_open_prompts_1k_flat.csv"
"""The real request sample shipped in ``bcg_core/data`` (see its README.md)."""
SEED_MODULUS = 2**31
"""Seeds from the data (up to 2**32) are taken modulo this."""
MAX_CONCURRENCY = 16
"""Most requests the demo keeps in flight at once."""
RETRY_MAX_RETRIES = 20
"""Default bound on the resends of one request answered 503 with ``Retry-After``."""
RETRY_DEADLINE_S = 600.0
"""Default deadline of one request's resends, seconds from its first send (no resend starts after it)."""
RETRY_AFTER_MIN_S = 0.05
"""Shortest wait honoured for a ``Retry-After``, seconds (``0`` or a date in the past wait this long)."""
RETRY_AFTER_MAX_S = 30.0
"""Longest wait honoured for a ``Retry-After``, seconds (longer values wait this long, then resend)."""
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoRequest:
    """One request of the replay, built from one row of the data file.

    Attributes:
        number: 1-based position in the replay (names the output files).
        row: 0-based data row in the CSV file (the header is not a row).
        prompt: the prompt text, as in the file.
        width: image width in pixels.
        height: image height in pixels.
        n: images requested (the row's ``num_generations``; 1 when empty).
        seed: the row's seed modulo :data:`SEED_MODULUS`, or None when empty (the server picks one).
    """

    number: int
    row: int
    prompt: str
    width: int
    height: int
    n: int
    seed: int | None

    @property
    def size(self) -> str:
        """The OpenAI-style ``"WxH"`` size string."""
        return f"{self.width}x{self.height}"

    def body(self, steps: int) -> dict[str, Any]:
        """The JSON body of ``POST /v1/images/generations`` for this request.

        Args:
            steps: ``num_inference_steps`` to ask for.
        """
        body: dict[str, Any] = {
            "prompt": self.prompt,
            "n": self.n,
            "size": self.size,
            "response_format": "b64_json",
            "num_inference_steps": steps,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        return body

    def image_name(self, image: int) -> str:
        """File name of the request's image number ``image`` (1-based), e.g. ``req003_img1.png``."""
        return f"req{self.number:03d}_img{image}.png"

    def describe(self) -> str:
        """A short label for progress and error lines."""
        return f"req{self.number:03d} (data row {self.row}, {self.size}, n={self.n})"


def _number(row: Mapping[str, str], column: str, row_index: int) -> int | None:
    """The integer in ``row[column]`` ("512", "512.0" or "" for None); raises ValueError naming the cell."""
    text = (row.get(column) or "").strip()
    if not text:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite() or value != value.to_integral_value():
        raise ValueError(f"data row {row_index}: column {column!r} is {text!r}, not an integer")
    return int(value)


def read_requests(rows: Iterable[Mapping[str, str]], limit: int) -> list[DemoRequest]:
    """Turn data rows into replay requests.

    Args:
        rows: mappings with the data file's columns (``csv.DictReader`` rows): ``prompt``, ``width``,
            ``height`` (pixels, required), ``num_generations`` and ``seed`` (may be empty).
        limit: how many requests to return at most (>= 1); reading stops there.

    Returns:
        Up to ``limit`` requests, in file order, skipping rows whose prompt is empty or blank.

    Raises:
        ValueError: ``limit`` < 1, or a row with a missing or non-integer width/height, a
            non-integer seed or num_generations, or a num_generations < 1 (the message names the row).
    """
    if limit < 1:
        raise ValueError(f"limit {limit} must be at least 1")
    out: list[DemoRequest] = []
    for index, row in enumerate(rows):
        if len(out) >= limit:
            break
        prompt = row.get("prompt") or ""
        if not prompt.strip():
            continue
        width = _number(row, "width", index)
        height = _number(row, "height", index)
        if width is None or height is None:
            raise ValueError(f"data row {index}: width and height are required, got {row.get('width')!r} "
                             f"and {row.get('height')!r}")
        n = _number(row, "num_generations", index)
        n = 1 if n is None else n
        if n < 1:
            raise ValueError(f"data row {index}: num_generations {n} must be at least 1")
        seed = _number(row, "seed", index)
        if seed is not None:
            seed %= SEED_MODULUS
        out.append(DemoRequest(len(out) + 1, index, prompt, width, height, n, seed))
    return out


def load_requests(limit: int, path: str | Path | None = None) -> list[DemoRequest]:
    """Read the first ``limit`` requests of the data file.

    Args:
        limit: requests to read (>= 1).
        path: a CSV file with the data file's columns; None reads :data:`DATA_FILE` from the
            ``bcg_core`` package's ``data`` folder.

    Raises:
        ValueError: see :func:`read_requests`.
        FileNotFoundError: ``path`` does not exist.
    """
    if path is None:
        source = resources.files("bcg_core") / "data" / DATA_FILE
        with source.open("r", encoding="utf-8", newline="") as f:
            return read_requests(csv.DictReader(f), limit)
    with open(path, encoding="utf-8", newline="") as f:
        return read_requests(csv.DictReader(f), limit)


@dataclass
class DemoResult:
    """What happened to one request.

    Attributes:
        request: the request sent.
        ok: True when every image came back and was written.
        status: HTTP status, or None when no answer came (timeout, refused connection).
        latency_ms: time from the first send to the end of the final answer, milliseconds; it includes
            the waits for ``Retry-After`` and the resends after them.
        files: PNG files written.
        bucket: the bucket that served it (``"bcg"."bucket"`` of the answer), None on a miss or failure.
        hit: whether a bucket held it, None on failure.
        error: why it failed, None when ok.
        retries: resends after a ``503`` answer with ``Retry-After`` (0 when the first answer was final).
        retry_wait_s: seconds spent waiting for those ``Retry-After`` headers (in ``latency_ms`` too).
    """

    request: DemoRequest
    ok: bool
    status: int | None
    latency_ms: float
    files: list[Path] = field(default_factory=list)
    bucket: str | None = None
    hit: bool | None = None
    error: str | None = None
    retries: int = 0
    retry_wait_s: float = 0.0


def _error_message(response: Any) -> str:
    """The OpenAI-style ``error.message`` of a failed answer, else the start of its body."""
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and error.get("message"):
            param = f" (param {error['param']})" if error.get("param") else ""
            return f"{error['message']}{param}"
    except ValueError:
        pass
    return response.text[:300] or response.reason_phrase


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


def send_request(client: Any, url: str, request: DemoRequest, steps: int, out_dir: Path, *,
                 max_retries: int = RETRY_MAX_RETRIES, deadline_s: float = RETRY_DEADLINE_S,
                 sleep: Callable[[float], Any] = time.sleep) -> DemoResult:
    """POST one request and write its images; never raises for a failed request.

    A ``503`` answer with ``Retry-After`` is waited out and the request resent
    (:func:`post_honouring_retry_after`), at most ``max_retries`` times and not after ``deadline_s``; the
    result counts the resends and the seconds waited, and its ``latency_ms`` runs from the first send to the
    final answer (waits included).

    Args:
        client: an ``httpx.Client`` (its timeout bounds each send).
        url: server base URL, e.g. ``http://127.0.0.1:8000``.
        request: the request.
        steps: ``num_inference_steps``.
        out_dir: folder for the PNG files (must exist).
        max_retries: most resends after 503 + ``Retry-After`` (>= 0).
        deadline_s: seconds from the first send after which no resend starts (>= 0).
        sleep: called with the seconds of each wait.

    Returns:
        The outcome; ``ok`` is False with ``error`` set for a timeout, a refused connection, a 4xx/5xx
        answer (a 503 with ``Retry-After`` only once a bound stopped the resends; the error then says how many
        were made), or an answer with the wrong number of images or non-PNG data.

    Raises:
        ValueError: ``max_retries`` or ``deadline_s`` negative.
    """
    import httpx

    start = time.perf_counter()
    try:
        response, retries, waited = post_honouring_retry_after(
            client, f"{url}/v1/images/generations", request.body(steps), max_retries=max_retries,
            deadline_s=deadline_s, sleep=sleep)
    except httpx.HTTPError as exc:
        ms = (time.perf_counter() - start) * 1e3
        retries, waited = getattr(exc, "retries", 0), getattr(exc, "retry_wait_s", 0.0)
        after = f" (after {_plural(retries, 'retry', 'retries')} on 503 Retry-After)" if retries else ""
        if isinstance(exc, httpx.TimeoutException):
            error = f"no answer within the timeout ({type(exc).__name__}){after}"
        else:
            error = f"{type(exc).__name__}: {exc}{after}"
        return DemoResult(request, False, None, ms, error=error, retries=retries, retry_wait_s=waited)
    ms = (time.perf_counter() - start) * 1e3
    if response.status_code != 200:
        error = f"HTTP {response.status_code}: {_error_message(response)}"
        if retry_after_delay(response) is not None:
            error += (f" (gave up after {_plural(retries, 'retry', 'retries')} honouring Retry-After, "
                      f"{waited:.1f} s waited; bounds: {max_retries} retries, {deadline_s:g} s)")
        elif retries:
            error += f" (after {_plural(retries, 'retry', 'retries')} on 503 Retry-After)"
        return DemoResult(request, False, response.status_code, ms, error=error, retries=retries,
                          retry_wait_s=waited)
    try:
        payload = response.json()
        images = [base64.b64decode(item["b64_json"]) for item in payload["data"]]
        info = payload.get("bcg") or {}
    except (ValueError, KeyError, TypeError) as exc:
        return DemoResult(request, False, 200, ms, error=f"malformed answer: {type(exc).__name__}: {exc}",
                          retries=retries, retry_wait_s=waited)
    result = DemoResult(request, True, 200, ms, bucket=info.get("bucket"), hit=info.get("hit"),
                        retries=retries, retry_wait_s=waited)
    if len(images) != request.n:
        result.ok, result.error = False, f"asked for {request.n} images, got {len(images)}"
    for i, png in enumerate(images, start=1):
        if not png.startswith(_PNG_MAGIC):
            result.ok, result.error = False, f"image {i} is not a PNG file"
            continue
        path = out_dir / request.image_name(i)
        path.write_bytes(png)
        result.files.append(path)
    return result


def replay(url: str, requests: list[DemoRequest], *, steps: int, concurrency: int, out_dir: Path,
           timeout_s: float, max_retries: int = RETRY_MAX_RETRIES) -> list[DemoResult]:
    """Send every request with at most ``concurrency`` in flight, showing a tqdm progress bar.

    Args:
        url: server base URL.
        requests: the requests, sent in order.
        steps: ``num_inference_steps`` for each.
        concurrency: requests in flight at once, 1..:data:`MAX_CONCURRENCY`.
        out_dir: folder for the PNG files (created if absent).
        timeout_s: bound on each send of a request, seconds.
        max_retries: most resends of one request answered 503 with ``Retry-After`` (>= 0; see
            :func:`send_request`; the deadline of its resends is :data:`RETRY_DEADLINE_S`).

    Returns:
        One result per request, in request order.

    Raises:
        ValueError: ``concurrency`` out of range, ``timeout_s`` not positive or ``max_retries`` negative.
    """
    import httpx
    from tqdm import tqdm

    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency {concurrency} must be between 1 and {MAX_CONCURRENCY}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s {timeout_s} must be positive")
    if max_retries < 0:
        raise ValueError(f"max_retries {max_retries} must be at least 0")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[int, DemoResult] = {}
    timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
    limits = httpx.Limits(max_connections=concurrency)
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="demo")
    try:
        with httpx.Client(timeout=timeout, limits=limits, trust_env=False) as client, \
                tqdm(total=len(requests), unit="req", desc="generating", dynamic_ncols=True) as bar:
            futures = [pool.submit(send_request, client, url, r, steps, out_dir, max_retries=max_retries)
                       for r in requests]
            images = failed = 0
            for future in as_completed(futures):
                result = future.result()
                results[result.request.number] = result
                images += len(result.files)
                failed += not result.ok
                bar.set_postfix(images=images, failed=failed)
                if not result.ok:
                    bar.write(f"FAILED {result.request.describe()}: {result.error}")
                bar.update(1)
    finally:
        # On Ctrl-C do not wait for requests in flight (each is bounded by timeout_s anyway); the
        # caller shuts the server down, which ends them.
        pool.shutdown(wait=False, cancel_futures=True)
    return [results[r.number] for r in requests]


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def render_report(stats: Mapping[str, Any] | None, results: list[DemoResult], wall_s: float,
                  out_dir: Path, console: Any) -> None:
    """Print the per-bucket table, the failures and the one-line summary with rich.

    Args:
        stats: ``GET /v1/buckets`` answer, or None when it could not be fetched.
        results: one per request.
        wall_s: wall time of the replay, seconds.
        out_dir: where the images went.
        console: a ``rich.console.Console``.
    """
    from rich.table import Table

    if stats is not None:
        buckets = stats.get("buckets", [])
        used = [b for b in buckets if b.get("requests")]
        model = stats.get("model", {}).get("name", "?")
        policy = stats.get("table", {}).get("miss_policy", "?")
        modes = Counter(str(b.get("mode") or "?") for b in buckets)
        table = Table(title=f"Buckets of the replica (model {model}; counts since the server started)",
                      caption=f"{len(buckets)} buckets in the table ({', '.join(f'{m} {k}' for m, k in modes.items())}"
                              f"), {len(buckets) - len(used)} unused not shown; miss policy: {policy}")
        table.add_column("bucket", no_wrap=True)
        for name in ("requests", "hits", "misses", "padding waste %", "mean latency ms"):
            table.add_column(name, justify="right", min_width=min(len(name), 8))
        for b in used:
            hits = b.get("hits", 0)
            table.add_row(str(b.get("key")), str(b["requests"]), str(hits), str(b["requests"] - hits),
                          _fmt(b.get("padding_waste_pct")), _fmt(b.get("mean_latency_ms")))
        misses = stats.get("misses", {})
        missed = misses.get("requests", 0)
        by_dim = "".join(f"\n  {k} {v}" for k, v in misses.get("by_dim", {}).items())
        table.add_section()
        table.add_row(f"misses by dimension{by_dim}", str(missed), "0", str(missed), "0.0" if missed else "-",
                      _fmt(misses.get("mean_latency_ms") if missed else None),
                      style="yellow" if missed else None)
        console.print(table)
    else:
        console.print("[yellow]GET /v1/buckets failed: no bucket table to show[/yellow]")
    failed = [r for r in results if not r.ok]
    for r in failed:
        status = f"HTTP {r.status}" if r.status else "no answer"
        console.print(f"[red]failed[/red] {r.request.describe()}: {r.error or status}", highlight=False)
    retried = [r for r in results if r.retries]
    if retried:
        console.print(
            f"retried {_plural(len(retried), 'request')} after 503 Retry-After "
            f"({_plural(sum(r.retries for r in retried), 'retry', 'retries')}, "
            f"{sum(r.retry_wait_s for r in retried):.1f} s waited)", highlight=False)
    images = sum(len(r.files) for r in results)
    console.print(
        f"{_plural(len(results), 'request')} ({len(results) - len(failed)} ok, {len(failed)} failed), "
        f"{_plural(images, 'image')} in {wall_s:.1f} s wall -> {out_dir}/", highlight=False)


def _plural(count: int, noun: str, nouns: str | None = None) -> str:
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def run_demo(*, requests: int = 8, steps: int = 4, concurrency: int = 1, out: str | Path = "out/demo",
             port: int = 0, url: str | None = None, config: str | None = None, timeout_s: float = 600.0,
             num_cpus: int = 4, quiet: bool = True, data: str | Path | None = None,
             max_retries: int = RETRY_MAX_RETRIES) -> int:
    """The whole demo: start the server (unless ``url``), replay, report, shut down.

    Args:
        requests: how many requests to read from the data file and send.
        steps: ``num_inference_steps`` of each request.
        concurrency: requests in flight at once, 1..:data:`MAX_CONCURRENCY`.
        out: folder for the PNG files.
        port: local server port on 127.0.0.1 (0: a free one). Ignored with ``url``.
        url: base URL of a running server; None starts one locally.
        config: ServeConfig YAML/JSON file for the local server; None uses the embedded default.
        timeout_s: bound on each HTTP request, seconds.
        num_cpus: logical CPUs for the local Ray instance.
        quiet: keep Ray's logs out of the terminal.
        data: a CSV file with the data file's columns instead of :data:`DATA_FILE`.
        max_retries: most resends of one request answered 503 with ``Retry-After`` (see :func:`replay`).

    Returns:
        Process exit status: 0 when every request succeeded, 1 otherwise.

    Raises:
        ValueError: bad arguments (also ``config`` or ``port`` together with ``url``) or a bad config file
            (pydantic's ValidationError is a ValueError).
        FileNotFoundError: ``config`` or ``data`` does not exist.
        TimeoutError: the server did not answer ``GET /healthz``.
    """
    import httpx
    from rich.console import Console

    if url is not None and (config is not None or port):
        raise ValueError("--config and --port configure the local server; leave them out with --url")
    if steps < 1:
        raise ValueError(f"steps {steps} must be at least 1")
    if max_retries < 0:
        raise ValueError(f"max_retries {max_retries} must be at least 0")
    console = Console()
    todo = load_requests(requests, data)
    served = check_config(config) if config is not None else None
    if url is None:  # a server started here has these limits: refuse before starting Ray
        from bcg_core.config import ServeConfig

        limit = (served or ServeConfig()).limits.max_steps
        if steps > limit:
            raise ValueError(f"--steps {steps} is above the server's limits.max_steps {limit}; use --steps 1 to "
                             f"{limit}")
    out_dir = Path(out)
    started = url is None
    try:
        if started:
            console.print("starting Ray and the bcg-serve application (takes ~30-60 s) ...")
            url = start_local(served, port, num_cpus, quiet=quiet)
        url = url.rstrip("/")
        if not started and not url.startswith(("http://", "https://")):
            raise ValueError(f"--url {url!r} is not an http:// or https:// address; give the server's base URL, e.g. "
                             f"http://127.0.0.1:8000")
        # a server started here may take a while to answer; one given with --url is expected to be up
        wait_healthy(url, timeout_s=60.0 if started else min(10.0, timeout_s))
        n_images = sum(r.n for r in todo)
        console.print(f"server {url}: sending {len(todo)} requests ({n_images} images, {steps} steps, "
                      f"concurrency {concurrency}) from {Path(data).name if data else DATA_FILE}", highlight=False)
        t0 = time.perf_counter()
        results = replay(url, todo, steps=steps, concurrency=concurrency, out_dir=out_dir, timeout_s=timeout_s,
                         max_retries=max_retries)
        wall_s = time.perf_counter() - t0
        stats = None
        try:
            r = httpx.get(f"{url}/v1/buckets", timeout=30.0, trust_env=False)
            r.raise_for_status()
            stats = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            console.print(f"[red]GET /v1/buckets failed: {exc}[/red]")
        render_report(stats, results, wall_s, out_dir, console)
        return 0 if stats is not None and all(r.ok for r in results) else 1
    finally:
        if started:
            stop_local()

