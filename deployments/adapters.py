"""The LoRA adapters the ingress sees in ``lora.dir``: the names ``GET /v1/models`` lists, and a cheap check that
refuses a request naming an adapter with no file, before it is routed to a replica.

The ingress reads ``lora.dir`` on its own node, as it reads ``model.path`` (the folder is on a filesystem every
node shares). :class:`AdapterCatalog` keeps the last listing (at most :data:`MAX_LISTED` names, with the rule of
:meth:`bcg_core.lora.files.AdapterFiles.names`) and reads the folder again at most every :data:`RELIST_S`
seconds. A name in the listing passes at once (no file access); a name that is not is looked up by its two
possible paths (two ``stat`` calls, so a file added since the listing passes at once too), and only a name with
neither file is refused, naming the adapters listed. The replica's own check stays the authority: it reads the
file, refuses one it cannot serve (HTTP 422) and refuses a name whose file went away since.

A folder the ingress cannot read turns the check off (every name goes on to the replicas, which decide) and
``GET /v1/models`` says why.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bcg_core.config import LimitsConfig, LoRAConfig
from bcg_core.errors import RequestError
from bcg_core.lora.files import AdapterError, adapter_path

__all__ = ["AdapterCatalog", "MAX_LISTED", "RELIST_S", "SHOWN_IN_ERRORS", "list_adapters"]

logger = logging.getLogger("ray.serve")

MAX_LISTED = 1000
"""Most adapter names ``GET /v1/models`` lists (``truncated`` says when the folder holds more); the ingress's check
finds a name beyond them by its path."""

RELIST_S = 5.0
"""Seconds a listing of ``lora.dir`` is reused before the folder is read again (on the next request that needs it:
``GET /v1/models`` or a name not in the listing)."""

SHOWN_IN_ERRORS = 20
"""Adapter names an error for an unknown name lists (then ``and N more``), as the replica's own message."""


def list_adapters(folder: Path, limit: int) -> list[str]:
    """Adapter names in ``folder``, sorted, at most ``limit``: :func:`bcg_core.lora.files.list_names`, the replicas'
    own rule (a link out of the folder is never listed; a name with both layouts once).

    Raises:
        OSError: the folder cannot be read.
    """
    from bcg_core.lora.files import list_names

    return list_names(folder.resolve(), limit)


class AdapterCatalog:
    """The adapters of ``lora.dir`` as the ingress sees them (module docstring).

    Args:
        folder: ``lora.dir`` (a relative path is taken from the process's working directory, as the replicas
            take it).
        max_listed: most names listed.
        relist_s: seconds a listing is reused.
        clock: monotonic seconds (tests pass their own).
        config: the served ``lora`` section (the limits of :meth:`card`, the phrase of a refusal); None: the
            defaults with ``dir=folder``.
    """

    def __init__(self, folder: str | Path, max_listed: int = MAX_LISTED, relist_s: float = RELIST_S,
                 clock: Callable[[], float] = time.monotonic, config: LoRAConfig | None = None):
        self.folder = Path(folder).resolve()
        self.config = config or LoRAConfig(dir=str(folder))
        self.max_listed, self.relist_s, self._clock = max_listed, relist_s, clock
        self._lock = threading.Lock()
        self._names: list[str] = []
        self._known: set[str] = set()
        self._truncated = False
        self._error: str | None = None
        self._listed_at: float | None = None
        self._listing = False
        self.listings = 0
        """Times the folder was read (tests check the throttle)."""

    @classmethod
    def for_config(cls, config) -> AdapterCatalog | None:
        """The catalog of a ``ServeConfig``'s ``lora.dir``, listed once (file access), or None without one."""
        if config.lora.dir is None:
            return None
        catalog = cls(config.lora.dir, config=config.lora)
        catalog.refresh()
        return catalog

    @staticmethod
    async def fresh(catalog: AdapterCatalog | None) -> None:
        """:meth:`arefresh` of ``catalog`` unless it is None (no ``lora.dir``)."""
        if catalog is not None:
            await catalog.arefresh()

    # -- the listing ----------------------------------------------------------------------------------

    def _stale(self) -> bool:
        return self._listed_at is None or self._clock() - self._listed_at >= self.relist_s

    def refresh(self, force: bool = False) -> None:
        """Read the folder again when the listing is older than ``relist_s`` (or ``force``); blocking (file
        access): the ingress calls it in a worker thread. The folder is read outside the lock (the event loop
        never waits for a slow filesystem), by one thread at a time."""
        with self._lock:
            if self._listing or (not force and not self._stale()):
                return
            self._listing = True
            self._listed_at = self._clock()
            self.listings += 1
        try:
            names, error = list_adapters(self.folder, self.max_listed + 1), None
        except OSError as e:
            names, error = [], f"lora.dir cannot be read by the ingress ({type(e).__name__})"  # no server path
            if self._error is None:
                logger.warning("lora.dir %s cannot be read by the ingress (%s); adapter names are checked by the "
                               "replicas only", self.folder, e)
        except BaseException:
            with self._lock:
                self._listing = False
            raise
        with self._lock:
            self._listing = False
            self._error = error
            self._truncated = len(names) > self.max_listed
            self._names = names[:self.max_listed]
            self._known = set(self._names)

    async def arefresh(self) -> None:
        """:meth:`refresh` in a worker thread, skipped without a thread hop while the listing is fresh."""
        if self._stale():
            await asyncio.to_thread(self.refresh)

    def describe(self) -> dict:
        """The listing: ``adapters`` (sorted names), ``truncated`` (more files than listed) and ``error`` (why
        the folder could not be read, else None)."""
        with self._lock:
            return {"adapters": list(self._names), "truncated": self._truncated, "error": self._error}

    def card(self) -> dict:
        """``bcg.lora`` of ``GET /v1/models``: :meth:`describe` and the limits (``slots``, ``max_rank``,
        ``max_per_request``, ``max_scale``) and ``default_scale`` (1.0, an entry without ``scale``)."""
        cfg = self.config
        return {**self.describe(), "slots": cfg.slots, "max_rank": cfg.max_rank,
                "max_per_request": cfg.max_per_request, "max_scale": cfg.max_scale, "default_scale": 1.0}

    # -- the check of a request -----------------------------------------------------------------------

    def _why_missing(self, name: str) -> AdapterError | None:
        """None if ``name`` has a file (blocking: two ``stat`` calls; found names join the listing's set), else
        why not (:func:`~bcg_core.lora.files.adapter_path`'s error): no such file, or a link that leads out of the
        folder (``link``: never served, so never listed)."""
        try:
            adapter_path(self.folder.resolve(), name)
        except AdapterError as e:
            return e
        with self._lock:
            self._known.add(name)
        return None

    def _unknown(self, names: list[str]) -> dict[str, AdapterError]:
        """Names in ``names`` with no file, and why, after re-reading the folder if the listing is stale
        (blocking)."""
        missing = {n: why for n in names if (why := self._why_missing(n)) is not None}
        if missing:
            self.refresh()  # for the message's list of names; at most every relist_s
        return missing

    async def check(self, lora: tuple[tuple[str, float], ...]) -> None:
        """Refuse ``lora`` (a validated request's entries) when a name has no file in ``lora.dir``.

        Args:
            lora: ``((name, scale), ...)``, names already checked against ``NAME_RE`` by the validator.

        Raises:
            RequestError: field ``lora``, HTTP 422: the unknown names and the adapters listed.
        """
        if not lora:
            return
        await self.arefresh()
        with self._lock:
            if self._error is not None:
                return  # the folder cannot be read here: the replicas decide
            missing = [n for n, _ in lora if n not in self._known]
        if not missing:
            return
        missing = await asyncio.to_thread(self._unknown, missing)
        if not missing:
            return
        from bcg_core.validation import engine_field_phrase

        allowed = engine_field_phrase("lora", LimitsConfig(), lora=self.config)  # the lora phrase reads no limit
        with self._lock:
            if self._error is not None:
                return
            names, more = self._names[:SHOWN_IN_ERRORS], len(self._names) - SHOWN_IN_ERRORS
        shown = ", ".join(names) + (f" and {more}{'+' if self._truncated else ''} more" if more > 0 else "")
        links = [e.reason for e in missing.values() if e.link]
        absent = ", ".join(repr(n) for n, e in missing.items() if not e.link)
        what = "; ".join([*(f"{why}: a link that leaves the folder is not served" for why in links),
                          *([f"no adapter {absent} in lora.dir"] if absent else [])])
        reason = f"{what} (adapters: {shown or 'none'}; GET /v1/models lists them)"
        # the reason names each refused adapter, so the message quotes no "got" before it
        raise RequestError("lora", f"invalid 'lora': {reason}; allowed: {allowed}")
