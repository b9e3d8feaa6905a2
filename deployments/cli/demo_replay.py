"""The demo's requests and their replay over HTTP.

:func:`read_requests` / :func:`load_requests` turn rows of the real request sample (:data:`DATA_FILE`, one row
= one request for ``num_generations`` images at its width x height; blank prompts skipped) into
:class:`DemoRequest` values; :func:`send_request` posts one (resending after ``503`` + ``Retry-After``,
:mod:`deployments.cli.retry_client`) and writes its PNG images, and :func:`replay` sends a list with bounded
concurrency and a progress bar. Each request's outcome is a :class:`DemoResult`; a failed request never raises.
The request parsing imports nothing heavy; httpx and tqdm are imported only by the functions that send.
"""

from __future__ import annotations

import base64
import csv
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Any

from .retry_client import RETRY_DEADLINE_S, RETRY_MAX_RETRIES, post_honouring_retry_after, retry_after_delay

__all__ = [
    "DATA_FILE",
    "MAX_CONCURRENCY",
    "SEED_MODULUS",
    "DemoRequest",
    "DemoResult",
    "load_requests",
    "read_requests",
    "replay",
    "send_request",
]

DATA_FILE = "krea_open_prompts_1k_flat.csv"
"""The real request sample shipped in ``bcg_core/data`` (see its README.md)."""
SEED_MODULUS = 2**31
"""Seeds from the data (up to 2**32) are taken modulo this."""
MAX_CONCURRENCY = 16
"""Most requests the demo keeps in flight at once."""
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
        cache: the request's ``cache`` extension (a step cache, e.g. ``{"method": "first_block", "threshold":
            0.5}``), or None: the server's default.
    """

    number: int
    row: int
    prompt: str
    width: int
    height: int
    n: int
    seed: int | None
    cache: dict | None = None

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
        if self.cache is not None:
            body["cache"] = dict(self.cache)
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
           timeout_s: float, max_retries: int = RETRY_MAX_RETRIES, api_key: str | None = None) -> list[DemoResult]:
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
        api_key: sent as ``Authorization: Bearer <key>`` with every request (a server with API keys); None: no
            header.

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
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        with httpx.Client(timeout=timeout, limits=limits, trust_env=False, headers=headers) as client, \
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


def _plural(count: int, noun: str, nouns: str | None = None) -> str:
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"
