"""The demo: replay real prompts against the bcg-serve HTTP API and show what the bucket table did.

:func:`run_demo` (``bcg demo``) starts the local server (:func:`deployments.cli.local.start_local`: Ray and the
Serve application on a loopback port) or talks to a server already running (``url``), replays the first N
requests of the real request sample (:mod:`deployments.cli.demo_replay`; a ``503`` with ``Retry-After`` is waited
out and resent, :mod:`deployments.cli.retry_client`), writes the images as PNG files, then prints the replica's
per-bucket statistics from ``GET /v1/buckets`` (:mod:`deployments.cli.demo_report`). The names of those modules
are importable from here too; Ray, httpx, rich and tqdm are imported only by the functions that use them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from .demo_replay import (
    DATA_FILE,
    MAX_CONCURRENCY,
    SEED_MODULUS,
    DemoRequest,
    DemoResult,
    load_requests,
    read_requests,
    replay,
    send_request,
)
from .demo_report import render_report
from .local import check_config, start_local, stop_local, wait_healthy
from .retry_client import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    RETRY_DEADLINE_S,
    RETRY_MAX_RETRIES,
    apost_honouring_retry_after,
    parse_retry_after,
    post_honouring_retry_after,
    retry_after_delay,
)

__all__ = [
    "API_KEY_ENV",
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
    "check_access",
    "demo_api_key",
    "fit_to_limits",
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


API_KEY_ENV = "OPENAI_API_KEY"
"""The environment variable ``bcg demo`` reads an API key from, as the official ``openai`` client does."""
_KEY_WAYS = f"--api-key-file PATH (its first key) or the {API_KEY_ENV} environment variable"


def demo_api_key(api_key_file: str | Path | None = None,
                 environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """The API key ``bcg demo`` sends, and where it came from (for messages; the key itself is never printed).

    ``api_key_file`` wins: its first key (:func:`deployments.auth.read_key_file`); otherwise the
    :data:`API_KEY_ENV` variable, as the official ``openai`` client reads it (surrounding white space dropped;
    empty means unset).

    Args:
        api_key_file: a key file (one key a line, ``#`` comments), or None.
        environ: the environment; None reads ``os.environ``.

    Returns:
        ``(key, source)``: ``source`` is ``"--api-key-file PATH"`` or ``"the OPENAI_API_KEY environment
        variable"``; ``(None, None)`` when neither gives a key.

    Raises:
        ValueError: the file cannot be read or holds no key, or the key holds characters an HTTP header cannot
            carry (white space, control or non-ASCII characters); the message names the source, never the key.
    """
    from ..auth import read_key_file

    if api_key_file is not None:
        key, source = read_key_file(api_key_file)[0], f"--api-key-file {api_key_file}"
    else:
        key = (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip() or None
        source = None if key is None else f"the {API_KEY_ENV} environment variable"
    if key is not None and not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(f"the API key from {source} holds white space, control or non-ASCII characters, which an "
                         f"'Authorization: Bearer <key>' header cannot carry")
    return key, source


def check_access(url: str, api_key: str | None = None, source: str | None = None,
                 timeout_s: float = 30.0) -> Mapping:
    """Ask ``GET {url}/v1/models`` (a keyed route) whether the server accepts ``api_key``; refuse with one line
    naming both ways to pass a key when it answers 401. Any other answer or a failed connection passes (the
    replay reports those per request).

    Returns:
        The request limits the answer announces (``data[0].bcg.limits``, for :func:`fit_to_limits`), or ``{}``
        when it announces none (another server, an error).

    Args:
        url: the server's base URL.
        api_key: sent as ``Authorization: Bearer <key>``; None sends none.
        source: where the key came from (:func:`demo_api_key`), for the message.
        timeout_s: bound on the request, seconds.

    Raises:
        PermissionError: the server answered 401 (the message names the key's source, never the key).
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError:
        return {}
    if r.status_code != 401:
        try:
            r.raise_for_status()
            return r.json()["data"][0]["bcg"]["limits"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return {}
    if api_key is None:
        raise PermissionError(f"the server at {url} asks for an API key (HTTP 401): give one with {_KEY_WAYS}")
    raise PermissionError(f"the server at {url} refused the API key from {source} (HTTP 401): give a key it was "
                          f"configured with, with {_KEY_WAYS}")


def fit_to_limits(todo: list, limits: Mapping, steps: int) -> tuple[list, list[str]]:
    """The replay's requests as the server at hand takes them: ``n`` capped at its ``max_images``, requests whose
    size is outside its sides (``min_side_px``..``max_side_px``) left out. ``limits`` is ``GET /v1/models``'
    ``data[0].bcg.limits``; a missing key is not checked.

    Returns:
        The requests to send, and one line per change for the console (none when nothing changed).

    Raises:
        ValueError: ``steps`` above the server's ``max_steps``, or no request within its sides.
    """
    import dataclasses

    notes = []
    if steps > limits.get("max_steps", steps):
        raise ValueError(f"--steps {steps} is above the server's limits.max_steps {limits['max_steps']}; use --steps "
                         f"1 to {limits['max_steps']}")
    lo, hi = limits.get("min_side_px", 0), limits.get("max_side_px", 1 << 30)
    kept = [r for r in todo if lo <= min(r.width, r.height) and max(r.width, r.height) <= hi]
    if len(kept) < len(todo):
        if not kept:
            raise ValueError(f"none of the {len(todo)} requests has a size within the server's sides ({lo} to {hi} "
                             f"pixels, limits.min_side_px/max_side_px)")
        notes.append(f"left out {len(todo) - len(kept)} request(s) whose size is outside the server's sides ({lo} to "
                     f"{hi} pixels)")
    most = limits.get("max_images")
    if most is not None and any(r.n > most for r in kept):
        notes.append(f"n capped at the server's limits.max_images, {most}, for "
                     f"{sum(r.n > most for r in kept)} request(s)")
        kept = [dataclasses.replace(r, n=min(r.n, most)) for r in kept]
    return kept, notes


def run_demo(*, requests: int = 8, steps: int = 4, concurrency: int = 1, out: str | Path = "out/demo",
             port: int = 0, url: str | None = None, config: str | None = None, timeout_s: float = 600.0,
             num_cpus: int = 4, quiet: bool = True, data: str | Path | None = None,
             max_retries: int = RETRY_MAX_RETRIES, api_key_file: str | Path | None = None,
             environ: Mapping[str, str] | None = None) -> int:
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
        api_key_file: a file whose first key is sent as ``Authorization: Bearer <key>`` (to a server with API
            keys); None: the ``OPENAI_API_KEY`` environment variable when set (:func:`demo_api_key`).
        environ: the environment read for ``OPENAI_API_KEY``; None reads ``os.environ``.

    Returns:
        Process exit status: 0 when every request succeeded, 1 otherwise.

    Raises:
        ValueError: bad arguments (also ``config`` or ``port`` together with ``url``) or a bad config file
            (pydantic's ValidationError is a ValueError).
        FileNotFoundError: ``config`` or ``data`` does not exist.
        TimeoutError: the server did not answer ``GET /healthz``.
        PermissionError: the server answered 401: no key, or one it does not accept (:func:`check_access`).
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
    api_key, key_source = demo_api_key(api_key_file, environ)
    todo = load_requests(requests, data)
    served = check_config(config) if config is not None else None
    if url is None:  # a server started here has these limits: refuse before starting Ray
        from ..settings import ServeConfig

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
        if not started and url.endswith("/v1"):  # the openai client's base_url: the server's base is above it
            url = url.removesuffix("/v1")
            console.print(f"--url: the server's base URL is {url} (the openai client's base_url ends in /v1; "
                          f"bcg demo adds the routes itself)")
        if not started:  # one given with --url is expected to be up (start_local returns once /healthz answers)
            wait_healthy(url, timeout_s=min(10.0, timeout_s))
        limits = check_access(url, api_key, key_source, timeout_s=min(30.0, timeout_s))
        todo, notes = fit_to_limits(todo, limits, steps)
        for note in notes:
            console.print(f"the server's limits: {note}", highlight=False)
        n_images = sum(r.n for r in todo)
        plural = {k: "s" if v != 1 else "" for k, v in (("r", len(todo)), ("i", n_images), ("s", steps))}
        console.print(f"server {url}: sending {len(todo)} request{plural['r']} ({n_images} image{plural['i']}, {steps} "
                      f"step{plural['s']}, concurrency {concurrency}) from {Path(data).name if data else DATA_FILE}",
                      highlight=False)
        t0 = time.perf_counter()
        results = replay(url, todo, steps=steps, concurrency=concurrency, out_dir=out_dir, timeout_s=timeout_s,
                         max_retries=max_retries, api_key=api_key)
        wall_s = time.perf_counter() - t0
        stats = None
        try:
            r = httpx.get(f"{url}/v1/buckets", timeout=30.0, trust_env=False,
                          headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
            r.raise_for_status()
            stats = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            console.print(f"[red]GET /v1/buckets failed: {exc}[/red]")
        render_report(stats, results, wall_s, out_dir, console)
        return 0 if stats is not None and all(r.ok for r in results) else 1
    finally:
        if started:
            stop_local()
