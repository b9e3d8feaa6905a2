"""The request shapes a replica has seen: a bounded, thread-safe histogram (an input of ``bcg plan``).

A replica records every request it accepts (``traffic.record``) by its :class:`TrafficKey`: the requested
size in pixels, the image count, the counted prompt tokens and the denoising steps. The histogram holds at
most ``max_shapes`` distinct keys; a request whose key would exceed that bound is counted in ``dropped``, so
``total == sum(counts) + dropped`` always holds. ``GET /v1/buckets`` shows it under ``traffic`` (merged over
the replicas, with shape-aware routing), and :func:`load_traffic` reads it back from a server or a JSON file.

The snapshot (``version`` 1), JSON-safe::

    {"version": 1, "total": 12, "dropped": 0, "max_shapes": 512, "since": "2025-01-01T00:00:00+00:00",
     "shapes": [{"width": 512, "height": 512, "n": 1, "text_tokens": 23, "steps": 4, "count": 9,
                 "cfg_count": 9, "edit_count": 0}, ...]}

``shapes`` is sorted by ``count``, largest first (ties by key). ``text_tokens`` is the prompt's token count as the
validator counted it (:attr:`bcg_core.request.ValidatedRequest.prompt_tokens`: the family's own tokenizer count, before
any padding to a text bucket or to a fixed native length); the negative prompt's count is not part of the key (a
validated request does not keep it), so for masked-text families a long negative prompt can make a request's text
dimension larger than ``text_tokens``. ``cfg_count`` is how many of ``count`` ran classifier-free guidance with uncond
rows (two transformer rows per image). ``steps`` is the denoising steps the request runs: its ``num_inference_steps``,
or for an edit (``POST /v1/images/edits``) the share its ``strength`` runs
(:attr:`~bcg_core.request.ValidatedRequest.steps_run`: 17 of 28 at 0.6), so ``bcg plan`` weighs an edit's bucket
forwards as they run; ``edit_count`` is how many of ``count`` were edits.

Never imports Ray; reading a server uses ``urllib.request`` only.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["SNAPSHOT_VERSION", "TrafficHistogram", "TrafficKey", "load_traffic", "text_bucket"]

SNAPSHOT_VERSION = 1
"""Version of the snapshot format written by :meth:`TrafficHistogram.snapshot`."""

_KEY_FIELDS = ("width", "height", "n", "text_tokens", "steps")


class TrafficKey(NamedTuple):
    """The shape of one request, as it was asked for.

    Attributes:
        width: requested width in pixels (not the bucket's, nor the aspect-ratio bin's).
        height: requested height in pixels.
        n: images requested.
        text_tokens: the prompt's counted tokens (:attr:`~bcg_core.request.ValidatedRequest.prompt_tokens`).
        steps: the denoising steps it runs (:attr:`~bcg_core.request.ValidatedRequest.steps_run`:
            ``num_inference_steps`` with the configured default filled in; an edit's strength's share of them).
    """

    width: int
    height: int
    n: int
    text_tokens: int
    steps: int


def text_bucket(tokens: int, text_lengths: Sequence[int]) -> str:
    """The text bucket that holds ``tokens``: the smallest of ``text_lengths`` at or above it, as a string.

    Args:
        tokens: counted text tokens of a request.
        text_lengths: the table's text buckets (``buckets.text_lengths``), any order.

    Returns:
        e.g. ``"256"``; ``"over"`` when no bucket holds ``tokens`` (or ``text_lengths`` is empty).
    """
    fits = [t for t in text_lengths if t >= tokens]
    return str(min(fits)) if fits else "over"


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _int_field(data: Mapping, name: str, where: str, lo: int) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"traffic snapshot field '{where}{name}' must be an integer >= {lo}, got {value!r}")
    return value


class TrafficHistogram:
    """Counts requests by :class:`TrafficKey`, keeping at most ``max_shapes`` distinct keys (thread-safe).

    Args:
        max_shapes: most distinct keys held (``traffic.max_shapes``); requests of further keys are counted in
            :attr:`dropped`.
        since: ISO 8601 time the counting started; default now (UTC).

    Raises:
        ValueError: ``max_shapes`` is not a positive integer.
    """

    def __init__(self, max_shapes: int = 512, since: str | None = None):
        if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"max_shapes must be a positive integer, got {max_shapes!r}")
        self.max_shapes = max_shapes
        self.since = since if since is not None else _now_iso()
        self._lock = threading.Lock()
        self._counts: dict[TrafficKey, int] = {}
        self._cfg: dict[TrafficKey, int] = {}
        self._edits: dict[TrafficKey, int] = {}
        self._total = 0
        self._dropped = 0

    @property
    def total(self) -> int:
        """Requests recorded, dropped ones included."""
        return self._total

    @property
    def dropped(self) -> int:
        """Requests whose key did not fit under ``max_shapes`` (counted in :attr:`total`, in no shape)."""
        return self._dropped

    def __len__(self) -> int:
        """Distinct keys held."""
        return len(self._counts)

    def count(self, key: TrafficKey | tuple) -> int:
        """Requests recorded under ``key`` (``(width, height, n, text_tokens, steps)``); 0 if never seen."""
        with self._lock:
            return self._counts.get(TrafficKey(*key), 0)

    @staticmethod
    def key_of(validated) -> TrafficKey:
        """The :class:`TrafficKey` of a :class:`~bcg_core.request.ValidatedRequest` (defaults already filled in)."""
        r = validated.request
        return TrafficKey(int(r.width), int(r.height), int(r.n), int(validated.prompt_tokens), int(validated.steps_run))

    def record(self, validated) -> None:
        """Count one accepted request.

        Args:
            validated: its :class:`~bcg_core.request.ValidatedRequest`; whether it ran CFG is read from its rows
                (``lookup.query.batch`` above ``n``: uncond rows were added), whether it is an edit from its
                ``image``.
        """
        key = self.key_of(validated)
        cfg = 1 if validated.lookup.query.batch > validated.request.n else 0
        with self._lock:
            self._add(key, 1, cfg, 1 if validated.request.image is not None else 0)

    def _add(self, key: TrafficKey, count: int, cfg: int, edits: int = 0) -> None:
        """Add ``count`` requests of ``key`` (``cfg`` of them with CFG rows, ``edits`` of them edits); the caller
        holds the lock."""
        self._total += count
        if key in self._counts or len(self._counts) < self.max_shapes:
            self._counts[key] = self._counts.get(key, 0) + count
            if cfg:
                self._cfg[key] = self._cfg.get(key, 0) + cfg
            if edits:
                self._edits[key] = self._edits.get(key, 0) + edits
        else:
            self._dropped += count

    def snapshot(self) -> dict[str, Any]:
        """The histogram as a JSON-safe dict (the format in the module docstring), shapes by count, largest
        first; ``total == sum(count) + dropped``."""
        with self._lock:
            items = list(self._counts.items())
            cfg, edits = dict(self._cfg), dict(self._edits)
            total, dropped = self._total, self._dropped
        items.sort(key=lambda kv: (-kv[1], kv[0]))
        shapes = [{**k._asdict(), "count": c, "cfg_count": cfg.get(k, 0), "edit_count": edits.get(k, 0)}
                  for k, c in items]
        return {"version": SNAPSHOT_VERSION, "total": total, "dropped": dropped, "max_shapes": self.max_shapes,
                "since": self.since, "shapes": shapes}

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any], max_shapes: int | None = None) -> TrafficHistogram:
        """Rebuild a histogram from :meth:`snapshot`'s dict (unknown keys are ignored).

        Args:
            data: the snapshot.
            max_shapes: the new histogram's bound; default the snapshot's ``max_shapes``.

        Raises:
            ValueError: naming the bad field: not a mapping, an unknown ``version``, a count that is not a
                non-negative integer, a shape entry without a key field, a duplicate key, more shapes than
                ``max_shapes``, ``cfg_count`` or ``edit_count`` above ``count``, an unparsable ``since``, or a ``total``
                other than ``sum(count) + dropped``.
        """
        if not isinstance(data, Mapping):
            raise ValueError(  # noqa: TRY004 - bad data, one error type
                f"traffic snapshot must be a JSON object, got {type(data).__name__}")
        if data.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"traffic snapshot field 'version' must be {SNAPSHOT_VERSION}, "
                             f"got {data.get('version')!r}")
        total = _int_field(data, "total", "", 0)
        dropped = _int_field(data, "dropped", "", 0)
        bound = _int_field(data, "max_shapes", "", 1) if max_shapes is None else max_shapes
        since = data.get("since")
        try:
            datetime.fromisoformat(since)
        except (TypeError, ValueError):
            raise ValueError(f"traffic snapshot field 'since' must be an ISO 8601 time, got {since!r}") from None
        shapes = data.get("shapes")
        if not isinstance(shapes, list):
            raise ValueError(  # noqa: TRY004 - bad data, one error type
                f"traffic snapshot field 'shapes' must be a list, got {type(shapes).__name__}")
        if len(shapes) > bound:
            raise ValueError(f"traffic snapshot field 'shapes' has {len(shapes)} entries, more than max_shapes {bound}")
        out = cls(bound, since=since)
        for i, entry in enumerate(shapes):
            where = f"shapes[{i}]."
            if not isinstance(entry, Mapping):
                raise ValueError(  # noqa: TRY004 - bad data, one error type
                    f"traffic snapshot field 'shapes[{i}]' must be an object, got {type(entry).__name__}")
            key = TrafficKey(*(_int_field(entry, f, where, 0 if f == "text_tokens" else 1) for f in _KEY_FIELDS))
            count = _int_field(entry, "count", where, 1)
            cfg = _int_field(entry, "cfg_count", where, 0) if "cfg_count" in entry else 0
            if cfg > count:
                raise ValueError(f"traffic snapshot field 'shapes[{i}].cfg_count' ({cfg}) is above its count ({count})")
            edits = _int_field(entry, "edit_count", where, 0) if "edit_count" in entry else 0
            if edits > count:
                raise ValueError(f"traffic snapshot field 'shapes[{i}].edit_count' ({edits}) is above its count "
                                 f"({count})")
            if key in out._counts:
                raise ValueError(f"traffic snapshot field 'shapes[{i}]' repeats the shape {dict(key._asdict())}")
            out._add(key, count, cfg, edits)
        counted = sum(out._counts.values())
        if total != counted + dropped:
            raise ValueError(f"traffic snapshot field 'total' is {total}, but the shapes count {counted} and "
                             f"'dropped' {dropped}: total must be their sum")
        out._dropped += dropped
        out._total = total
        return out

    def merge(self, other: Mapping[str, Any] | TrafficHistogram) -> None:
        """Add another histogram's counts into this one (counts of equal keys summed; ``since`` the earlier).

        Keys that would exceed this histogram's ``max_shapes`` are counted in ``dropped``, as in :meth:`record`.

        Args:
            other: a :meth:`snapshot` dict (validated) or a :class:`TrafficHistogram`.

        Raises:
            ValueError: ``other`` is not a valid snapshot (see :meth:`from_snapshot`).
        """
        src = other if isinstance(other, TrafficHistogram) else TrafficHistogram.from_snapshot(other)
        with src._lock:
            items = [(k, c, src._cfg.get(k, 0), src._edits.get(k, 0)) for k, c in src._counts.items()]
            dropped, since = src._dropped, src.since
        items.sort(key=lambda t: (-t[1], t[0]))  # keep the most frequent when the bound bites
        with self._lock:
            for key, count, cfg, edits in items:
                self._add(key, count, cfg, edits)
            self._dropped += dropped
            self._total += dropped
            if _parse_time(since) < _parse_time(self.since):
                self.since = since

    @classmethod
    def merged(cls, sources: Iterable[Mapping[str, Any] | TrafficHistogram]) -> TrafficHistogram:
        """One histogram summing ``sources`` (e.g. every replica's; snapshot dicts or histograms), bounded by the
        sum of their ``max_shapes`` so that merging drops nothing the sources held.

        Raises:
            ValueError: a snapshot is invalid (see :meth:`from_snapshot`), or ``sources`` is empty.
        """
        parts = [s if isinstance(s, TrafficHistogram) else cls.from_snapshot(s) for s in sources]
        if not parts:
            raise ValueError("merged() needs at least one traffic snapshot")
        out = cls(sum(p.max_shapes for p in parts), since=min((p.since for p in parts), key=_parse_time))
        for p in parts:
            out.merge(p)
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`snapshot` to ``path`` as JSON (through a temporary file, replaced atomically).

        Raises:
            OSError: the file cannot be written.
        """
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.snapshot(), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TrafficHistogram:
        """Read a JSON file written by :meth:`save`, or a saved ``GET /v1/buckets`` answer (its ``traffic``).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not JSON, no traffic in it, or an invalid snapshot (the message names the file).
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"traffic file {str(path)!r} is not JSON: {e}") from None
        return _from_document(data, f"traffic file {str(path)!r}")


def _parse_time(text: str) -> datetime:
    t = datetime.fromisoformat(text)
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def _from_document(data: Any, source: str) -> TrafficHistogram:
    """A snapshot, or a ``/v1/buckets`` answer holding one under ``traffic``."""
    if isinstance(data, Mapping) and {"chosen", "curve", "max_graphs"} <= set(data):
        raise ValueError(f"{source} is a `bcg plan --json` report (the plan of some traffic), not recorded traffic: "
                         f"give a server's URL, a saved GET /v1/buckets answer or a traffic snapshot")
    if isinstance(data, Mapping) and "shapes" not in data and "traffic" in data:
        data = data["traffic"]
        if data is None:
            raise ValueError(f"{source} has 'traffic': null: the replica does not record traffic "
                             f"(set traffic.record: true)")
    elif isinstance(data, Mapping) and "shapes" not in data:
        raise ValueError(f"{source} has no 'traffic' section (nor a traffic snapshot's 'shapes'); a server "
                         f"records it with traffic.record: true")
    try:
        return TrafficHistogram.from_snapshot(data)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load_traffic(source: str, timeout_s: float = 10.0, api_key: str | None = None) -> TrafficHistogram:
    """The traffic histogram of a running server or of a JSON file.

    Args:
        source: an ``http://`` or ``https://`` URL of a bcg-serve application (``http://127.0.0.1:8000``, or the
            OpenAI client's base URL ending in ``/v1``; its ``GET /v1/buckets`` answer is read, unless the URL
            already ends in ``/v1/buckets``), or the path of
            a JSON file (a :meth:`TrafficHistogram.save` file or a saved ``/v1/buckets`` answer).
        timeout_s: seconds to wait for the server.
        api_key: sent as ``Authorization: Bearer`` to a server with API keys (never logged or echoed).

    Raises:
        ConnectionError: the server could not be reached or answered an HTTP error (the message names the URL).
        FileNotFoundError: no such file.
        ValueError: the answer or file is not JSON, has no ``traffic`` section, or holds an invalid snapshot
            (the message names the URL or file).
    """
    if not source.startswith(("http://", "https://")):
        return TrafficHistogram.load(source)
    base = source.rstrip("/")
    url = base if base.endswith("/v1/buckets") else base.removesuffix("/v1") + "/v1/buckets"
    try:
        headers = {"Accept": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as answer:
            body = answer.read()
    except urllib.error.HTTPError as e:
        hint = (" (the server wants an API key: give it with --api-key-file or OPENAI_API_KEY)"
                if e.code == 401 and not api_key else "")
        raise ConnectionError(f"GET {url} answered HTTP {e.code}{hint}: "
                              f"{e.read()[:300].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as e:  # refused, unresolvable, timed out
        reason = getattr(e, "reason", e)
        raise ConnectionError(f"could not read {url} within {timeout_s:g} s: {reason}") from None
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"GET {url} did not answer JSON: {e}") from None
    return _from_document(data, f"GET {url}")
