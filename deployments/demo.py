"""The demo: replay real prompts against the bcg-serve HTTP API and show what the bucket table did.

It starts the local server (:func:`deployments.local.start_local`: Ray and the Serve application on a
loopback port), or talks to a server already running (``url``), reads the first N requests of the real request sample
``bcg_core/data/krea_open_prompts_1k_flat.csv`` (one row = one request for ``num_generations`` images at
its width x height; rows with an empty prompt are skipped), replays them over HTTP, writes the images as
PNG files, then prints the replica's per-bucket statistics from ``GET /v1/buckets``.

The pure parts (:func:`read_requests`, :func:`load_requests`, :class:`DemoRequest`) import nothing heavy;
Ray, httpx, rich and tqdm are imported only by the functions that use them.
"""

from __future__ import annotations

import base64
import csv
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Any

from .local import check_config, start_local, stop_local, wait_healthy

__all__ = [
    "DATA_FILE",
    "MAX_CONCURRENCY",
    "SEED_MODULUS",
    "DemoRequest",
    "DemoResult",
    "load_requests",
    "read_requests",
    "render_report",
    "replay",
    "run_demo",
    "send_request",
]

DATA_FILE = "krea_open_prompts_1k_flat.csv"
"""The real request sample shipped in ``bcg_core/data`` (see its README.md)."""
SEED_MODULUS = 2**31
"""Seeds from the data (up to 2**32) are taken modulo this."""
MAX_CONCURRENCY = 16
"""Most requests the demo keeps in flight at once."""
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
        latency_ms: time from send to the end of the answer, milliseconds.
        files: PNG files written.
        bucket: the bucket that served it (``"bcg"."bucket"`` of the answer), None on a miss or failure.
        hit: whether a bucket held it, None on failure.
        error: why it failed, None when ok.
    """

    request: DemoRequest
    ok: bool
    status: int | None
    latency_ms: float
    files: list[Path] = field(default_factory=list)
    bucket: str | None = None
    hit: bool | None = None
    error: str | None = None


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


def send_request(client: Any, url: str, request: DemoRequest, steps: int, out_dir: Path) -> DemoResult:
    """POST one request and write its images; never raises for a failed request.

    Args:
        client: an ``httpx.Client`` (its timeout bounds the request).
        url: server base URL, e.g. ``http://127.0.0.1:8000``.
        request: the request.
        steps: ``num_inference_steps``.
        out_dir: folder for the PNG files (must exist).

    Returns:
        The outcome; ``ok`` is False with ``error`` set for a timeout, a refused connection, a 4xx/5xx
        answer, or an answer with the wrong number of images or non-PNG data.
    """
    import httpx

    start = time.perf_counter()
    try:
        response = client.post(f"{url}/v1/images/generations", json=request.body(steps))
    except httpx.TimeoutException as exc:
        ms = (time.perf_counter() - start) * 1e3
        return DemoResult(request, False, None, ms, error=f"no answer within the timeout ({type(exc).__name__})")
    except httpx.HTTPError as exc:
        ms = (time.perf_counter() - start) * 1e3
        return DemoResult(request, False, None, ms, error=f"{type(exc).__name__}: {exc}")
    ms = (time.perf_counter() - start) * 1e3
    if response.status_code != 200:
        return DemoResult(request, False, response.status_code, ms,
                          error=f"HTTP {response.status_code}: {_error_message(response)}")
    try:
        payload = response.json()
        images = [base64.b64decode(item["b64_json"]) for item in payload["data"]]
        info = payload.get("bcg") or {}
    except (ValueError, KeyError, TypeError) as exc:
        return DemoResult(request, False, 200, ms, error=f"malformed answer: {type(exc).__name__}: {exc}")
    result = DemoResult(request, True, 200, ms, bucket=info.get("bucket"), hit=info.get("hit"))
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
           timeout_s: float) -> list[DemoResult]:
    """Send every request with at most ``concurrency`` in flight, showing a tqdm progress bar.

    Args:
        url: server base URL.
        requests: the requests, sent in order.
        steps: ``num_inference_steps`` for each.
        concurrency: requests in flight at once, 1..:data:`MAX_CONCURRENCY`.
        out_dir: folder for the PNG files (created if absent).
        timeout_s: bound on each request, seconds.

    Returns:
        One result per request, in request order.

    Raises:
        ValueError: ``concurrency`` out of range or ``timeout_s`` not positive.
    """
    import httpx
    from tqdm import tqdm

    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency {concurrency} must be between 1 and {MAX_CONCURRENCY}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s {timeout_s} must be positive")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[int, DemoResult] = {}
    timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
    limits = httpx.Limits(max_connections=concurrency)
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="demo")
    try:
        with httpx.Client(timeout=timeout, limits=limits, trust_env=False) as client, \
                tqdm(total=len(requests), unit="req", desc="generating", dynamic_ncols=True) as bar:
            futures = [pool.submit(send_request, client, url, r, steps, out_dir) for r in requests]
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
    images = sum(len(r.files) for r in results)
    console.print(
        f"{_plural(len(results), 'request')} ({len(results) - len(failed)} ok, {len(failed)} failed), "
        f"{_plural(images, 'image')} in {wall_s:.1f} s wall -> {out_dir}/", highlight=False)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def run_demo(*, requests: int = 8, steps: int = 4, concurrency: int = 1, out: str | Path = "out/demo",
             port: int = 0, url: str | None = None, config: str | None = None, timeout_s: float = 600.0,
             num_cpus: int = 4, quiet: bool = True, data: str | Path | None = None) -> int:
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
    console = Console()
    todo = load_requests(requests, data)
    served = check_config(config) if config is not None else None
    out_dir = Path(out)
    started = url is None
    try:
        if started:
            console.print("starting Ray and the bcg-serve application (takes ~30-60 s) ...")
            url = start_local(served, port, num_cpus, quiet=quiet)
        url = url.rstrip("/")
        wait_healthy(url)
        n_images = sum(r.n for r in todo)
        console.print(f"server {url}: sending {len(todo)} requests ({n_images} images, {steps} steps, "
                      f"concurrency {concurrency}) from {Path(data).name if data else DATA_FILE}", highlight=False)
        t0 = time.perf_counter()
        results = replay(url, todo, steps=steps, concurrency=concurrency, out_dir=out_dir, timeout_s=timeout_s)
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

