"""What ``bcg serve`` prints: its ready block (:func:`ready_text`), then capture and compile progress
(:func:`watch_compiles`).

With compiled kernels and a cold compile cache a replica reports ready on eager kernels and compiles its buckets
afterwards (``runner.compile_in_background``, :mod:`bcg_core.runners.background`), and a replica whose capture passed
``runner.ready_after_s`` reports ready and captures its other shapes afterwards (one line each time a shape is
ready, one when the last is: ``stats()``'s ``routing`` owned and ready shapes). :func:`watch_compiles` polls the
DiT replicas' ``stats()`` (``scheduler.background_compiles``) and prints one line each time a replica's count of
buckets swapped in changes, and one line when a replica has nothing left pending: how many buckets were swapped in,
how many kept eager kernels, and how long it took. A warm cache prints one line at once (nothing to compile).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["CompileProgress", "ready_text", "watch_compiles"]

POLL_S = 2.0
"""Seconds between two polls of a replica's stats."""


def ready_text(url: str, model: str, metrics: str | None, auth: bool, lora: dict | None = None,
               api_server: str | None = None) -> str:
    """The lines ``bcg serve`` prints once, when the server is ready.

    Args:
        url: the API's base URL.
        model: the model's name.
        metrics: the Prometheus URL of Ray's exporter (None: a note that it does not run).
        auth: whether the API asks for a key (the ``try:`` line then sends one).
        lora: a replica's ``/v1/buckets`` ``lora`` section (None: no line), for what adapter rows cost.
        api_server: the metrics URL of Ray's API-server process (:func:`deployments.cli.local.api_server_metrics_url`),
            the one process of Ray's dashboard that runs without it; None when it was not found.

    Returns:
        The block, lines of at most 118 columns with the URLs as given.
    """
    import textwrap

    from bcg_core.lora.slots import cost_note

    header = " -H 'Authorization: Bearer <key>'" if auth else ""
    # ray.init(include_dashboard=False) still starts dashboard.py with only its usage-stats module and no HTTP
    # server (deployments/cli/local.py pin_api_server_metrics_port): say so, and where its own metrics listen.
    dashboard = "no web UI or REST API; Ray still runs its API-server process (dashboard.py, usage stats only)"
    return "\n".join([
        f"bcg-serve is ready: model {model} (Ctrl-C stops it)",
        f"  API        {url}  (OpenAI Images API: POST /v1/images/generations, GET /v1/models)",
        f"  metrics    {metrics}  (Prometheus, Ray's exporter)" if metrics else
        "  metrics    not exported (Ray's metrics agent is not running)",
        f"  dashboard  {dashboard}",
        f"             with its own metrics at {api_server}" if api_server else
        "             (its metrics address was not found)",
        *(textwrap.wrap(f"lora       {lora['slots']} slots; " + cost_note(
            lora["layers"], lora["delta_share"], lora["max_per_request"], lora["max_rank"]),
            width=118, initial_indent="  ", subsequent_indent=" " * 13) if lora else []),
        f"  try: curl -s{header} {url}/v1/models",
    ])


class CompileProgress:
    """The lines to print for successive ``DiTReplica.stats()`` snapshots (one replica or several, by ``replica``).

    Args:
        started: ``time.monotonic()`` when the server was ready (the times printed count from it).
    """

    def __init__(self, started: float):
        self.started = started
        self._seen: dict[str, tuple] = {}
        self.done: set[str] = set()
        """Replicas with nothing left pending (their final line printed)."""

    def lines(self, stats: dict, now: float) -> list[str]:
        """The new lines for one replica's snapshot (none when nothing changed).

        Raises:
            KeyError: ``stats`` is not a ``DiTReplica.stats()`` snapshot (no ``scheduler.background_compiles``).
        """
        replica, state = str(stats.get("replica", "?")), stats["scheduler"]["background_compiles"]
        tier = stats.get("kernels", {}).get("tier", "eager")
        routing = stats.get("routing") or {}
        owned, ready = len(routing.get("owned") or ()), len(routing.get("ready") or ())
        if replica in self.done:
            return []
        total = len(stats.get("buckets", ()))
        compiled = sum(1 for b in stats.get("buckets", ()) if b.get("kernels") not in ("eager", None))
        key = (ready, state["pending"], state["swapped"], state["failed"])
        if self._seen.get(replica) == key:
            return []
        first = replica not in self._seen
        self._seen[replica] = key
        after = f"{now - self.started:.0f} s after ready"
        name = f"replica {replica[:8]}: " if replica != "?" else ""
        if ready < owned:  # runner.ready_after_s passed before every shape was captured
            return [f"bcg-serve: {name}capturing in the background: {ready} of {owned} shapes ready (requests of "
                    f"the others run unpadded eager forwards until then), {after}"]
        if tier == "eager":
            self.done.add(replica)
            return [] if first else [f"bcg-serve: {name}every shape captured ({owned} of {owned}), {after}"]
        if state["pending"] == 0 and not state["running"]:
            self.done.add(replica)
            if state["swapped"] == 0 and state["failed"] == 0:
                return [f"bcg-serve: {name}{tier} kernels in {compiled} of {total} buckets from the compile cache; "
                        "nothing to compile"]
            kept = total - compiled
            if state["swapped"] == 0:
                return [f"bcg-serve: {name}no bucket compiled: {kept} kept eager kernels (see /v1/buckets notes), "
                        f"{after}"]
            return [f"bcg-serve: {name}every bucket compiled: {state['swapped']} swapped in from eager kernels, "
                    f"{kept} kept eager kernels{' (see /v1/buckets notes)' if kept else ''}, {after}"]
        return [f"bcg-serve: {name}compiling in the background: {state['swapped']} of "
                f"{state['swapped'] + state['pending'] + state['failed']} buckets swapped in, {state['pending']} "
                f"serving eager kernels until theirs are checked, {after}"]


def watch_compiles(stop: threading.Event, timeout_s: float | None, poll: Callable[[], dict | None],
                   out: Callable[[str], None], replicas: int = 1) -> bool:
    """Wait until ``stop`` is set or ``timeout_s`` passes (None: no bound), printing compile progress meanwhile.

    Args:
        stop: set by the signal handler.
        timeout_s: ``bcg serve --stop-after-s``.
        poll: returns one DiT replica's ``stats()`` (any replica; None when it did not answer).
        out: prints a line.
        replicas: DiT replicas to hear from before polling stops (once each has nothing pending).

    Returns:
        True when ``stop`` was set, False when ``timeout_s`` passed (as ``threading.Event.wait``).
    """
    started = time.monotonic()
    progress = CompileProgress(started)
    deadline = None if timeout_s is None else started + timeout_s
    while len(progress.done) < replicas:
        try:
            stats = poll()
            for line in progress.lines(stats, time.monotonic()) if stats else ():
                out(line)
        except Exception:  # noqa: BLE001 - progress is a console nicety; serving goes on either way
            pass
        wait = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
        if stop.wait(wait):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
    return stop.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
