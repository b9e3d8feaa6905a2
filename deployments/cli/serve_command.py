"""``bcg serve``: the local server run in the foreground until Ctrl-C, SIGTERM or ``--stop-after-s``.

:func:`run_serve` starts Ray and the application (:mod:`deployments.cli.local`), prints the ready block and the
compile progress (:mod:`deployments.cli.console`) and stops it; :func:`shutdown_signals` keeps a second Ctrl-C from
cutting the graceful stop short; :func:`with_key_file` adds ``--api-key-file``'s keys to the config as digests.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ..app import replicas_conflict
from ..settings import ServeConfig
from .console import ready_text, watch_compiles
from .local import api_server_metrics_url, check_config, start_local, stop_local

__all__ = ["run_serve", "shutdown_signals", "with_key_file"]


def with_key_file(config: ServeConfig | None, path: str) -> ServeConfig:
    """``config`` (the default when None) that also accepts the keys of the file ``path``, held as digests.

    Raises:
        ValueError: the file cannot be read or holds no key (naming the file, never a key).
    """
    from ..auth import read_key_file
    from ..settings import api_key_digest

    config = config or ServeConfig()
    digests = [*config.auth.api_keys, *(api_key_digest(k) for k in read_key_file(path))]
    return config.model_copy(update={"auth": config.auth.model_copy(update={"api_keys": digests})})


def _replica_stats() -> dict | None:
    """One DiT replica's ``stats()`` (None when none answers in 10 s): for the console only."""
    from ray import serve

    try:
        return serve.get_deployment_handle("DiTReplica", "bcg").stats.remote().result(timeout_s=10)
    except Exception:  # noqa: BLE001 - a note on the console only; the server serves either way
        return None


@contextlib.contextmanager
def shutdown_signals(previous: dict[int, Any]) -> Iterator[None]:
    """While the server shuts down, a second Ctrl-C (SIGINT or SIGTERM) does not cut the graceful stop short: it
    prints that requests in flight are finishing and how to stop at once; a third raises ``KeyboardInterrupt`` (the
    replicas are then killed with Ray, dropping what they held). ``previous``: the handlers to restore afterwards,
    by signal (empty: the server never became ready, and nothing is installed)."""
    presses: list[int] = []

    def during_shutdown(signum: int, frame: Any) -> None:
        presses.append(signum)
        if len(presses) > 1:
            raise KeyboardInterrupt
        print("bcg-serve: still shutting down: requests in flight are finishing; press Ctrl-C again to stop now "
              "and drop them", file=sys.stderr, flush=True)

    for s in previous:
        signal.signal(s, during_shutdown)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_serve(args: argparse.Namespace) -> int:
    """``bcg serve``: start the local server (:func:`~deployments.cli.local.start_local`), print the ready block
    and compile progress, serve until Ctrl-C, SIGTERM or ``--stop-after-s``, then stop it. Returns the exit status
    (2: the config's replica count conflicts with ``--replicas``)."""
    from bcg_core.models import describe_model

    from ..metrics import metrics_url

    config = check_config(args.config) if args.config else None
    if args.api_key_file is not None:
        config = with_key_file(config, args.api_key_file)
    if config is not None:
        conflict = replicas_conflict(config, None if args.replicas is None else f"--replicas {args.replicas}")
        if conflict:
            print(f"bcg serve: error: {conflict} (in {args.config})", file=sys.stderr)
            return 2
    config = config or ServeConfig()
    if args.metrics_host is not None:
        config = config.model_copy(update={"metrics": config.metrics.model_copy(update={"host": args.metrics_host})})
    metrics_port = config.metrics.port if args.metrics_port is None else args.metrics_port
    model = describe_model(config.model).name

    stop = threading.Event()
    got: list[int] = []  # the signal that stopped it

    def on_signal(signum: int, frame: Any) -> None:
        got.append(signum)
        stop.set()

    previous: dict[int, Any] = {}
    try:
        url = start_local(config, args.port, args.num_cpus, quiet=not args.verbose, replicas=args.replicas,
                          metrics_port=metrics_port)
        # After ray.init: Ray's core worker installs its own SIGTERM handler, which would kill the
        # process without shutting Serve down.
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        lora = (_replica_stats() or {}).get("lora") if config.lora.dir is not None else None
        print(ready_text(url, model, metrics_url(), config.auth.enabled, lora, api_server_metrics_url()), flush=True)
        # compiled kernels on a cold cache: progress lines until every bucket is compiled (deployments/cli/console.py)
        stopped = watch_compiles(stop, args.stop_after_s, _replica_stats, lambda s: print(s, flush=True),
                                 args.replicas or 1)
        why = (("Ctrl-C" if got[0] == signal.SIGINT else signal.Signals(got[0]).name) if stopped else
               f"--stop-after-s {args.stop_after_s:g}")
        print(f"bcg-serve: shutting down ({why}) ...", flush=True)
    finally:
        with shutdown_signals(previous):
            stop_local()
    if previous:  # it was ready: one last line, after Ray's processes are gone
        print(f"bcg-serve: stopped ({why}); served {url}", flush=True)
    return 0
