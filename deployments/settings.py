"""The serving configuration: the engine's sections plus routing, autoscaling and API keys, and its loader.

:class:`ServeConfig` is what ``bcg config`` prints, ``serve deploy`` passes as the application's ``config`` and every
deployment reads; the engine (``bcg_core``) takes it as the :class:`~bcg_core.config.EngineConfig` it extends and
reads only the engine's sections. :func:`backpressure_limits` derives the deployments' request limits from it.
Every field is documented; every check raises a ``ValueError`` naming the bad value and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bcg_core.config import EngineConfig

from .videos.config import VideosConfig

__all__ = [
    "AuthConfig", "AutoscalingSettings", "BackpressureLimits", "LOOPBACK", "MetricsConfig", "RoutingConfig",
    "ServeConfig", "VideosConfig", "api_key_digest", "backpressure_limits", "error_text", "load_config", "read_yaml",
]

API_KEY_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
"""An API key stored as its digest: ``sha256:`` and the lowercase hex SHA-256 of the key's UTF-8 bytes."""


class RoutingConfig(BaseModel):
    """Bucket ownership and shape-aware routing across DiT replicas (``router/``, docs/DESIGN.md section 5)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape_aware: bool = Field(
        default=True,
        description="Replicas own bucket shapes (assigned by the ownership coordinator) and capture only "
        "those; ShapeAwareRouter sends each request to an owner. False: Ray's default router, every "
        "replica captures every bucket.",
    )
    fallback_wait_s: float = Field(
        default=2.0, ge=0.0, le=600.0,
        description="Seconds a request waits for an owner of its shape before any replica may take it "
        "(eagerly, or by lazy capture there; counted).",
    )
    stats_period_s: float = Field(
        default=1.0, gt=0.0, le=60.0,
        description="Period of each replica's routing stats and ownership heartbeat in seconds.",
    )
    lease_s: float = Field(
        default=5.0, gt=0.0, le=600.0,
        description="A replica silent this long has left: its shapes move to the survivors.",
    )
    capture_stall_s: float | None = Field(
        default=600.0, gt=0.0, le=86400.0,
        description="A replica whose one capture has run this many seconds is stalled: the coordinator takes it "
        "out of the ownership assignment (its shapes move to the others, which capture them) until it reports "
        "the capture ended. None: never. Captures take seconds (docs/BENCHMARKS.md); the default leaves room "
        "for a slow first model load on a busy GPU.",
    )
    join_window_s: float = Field(
        default=60.0, ge=0.0, le=3600.0,
        description="At start, the first assignment waits up to this long for all expected replicas to join, "
        "so each captures only its own shapes.",
    )
    hot_share: float = Field(
        default=0.10, gt=0.0, le=1.0,
        description="A shape with at least this fraction of the expected requests (krea mix) gets >= 2 owners "
        "when >= 2 replicas exist; 1.0 gives every shape one owner (disjoint sets).",
    )
    max_retries: int = Field(
        default=2, ge=0, le=10,
        description="Times the ingress resends a request whose replica died before answering.",
    )
    max_ongoing_requests: int | None = Field(
        default=None, ge=1, le=1024,
        description="Requests one DiT replica accepts at once (waiting in its scheduler or running). None: "
        "derived from the scheduler's capacity (deployments.settings.backpressure_limits): scheduler.max_requests, "
        "else 2 x (scheduler.max_rows_in_flight // rows of a default request).",
    )
    max_queued_requests: int | None = Field(
        default=None, ge=1, le=100000,
        description="Requests each caller of the DiT deployment (each ingress replica) may hold waiting for a "
        "replica slot; beyond it a request is answered 503 with Retry-After at once (backpressure). None: "
        "max_ongoing_requests x the most DiT replicas (autoscaling.max_replicas, or the fixed replica count).",
    )
    retry_after_s: float = Field(
        default=2.0, gt=0.0, le=3600.0,
        description="Seconds sent in the Retry-After header of a 503 answered under overload.",
    )


class AutoscalingSettings(BaseModel):
    """Autoscaling of the DiT replicas by bucket load (``router/autoscaling.py``, docs/DESIGN.md section 5).

    Off by default: the replica count is then fixed (``dit_replicas``). On, :func:`deployments.build_app`
    gives the DiT deployment a Ray Serve ``autoscaling_config`` whose policy is
    :class:`router.autoscaling.BucketLoadPolicy`; the delays below are applied by that policy (Ray's own
    ``upscale_delay_s`` and ``downscale_delay_s`` are set to 0 so that they do not stack).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=False, description="Scale the DiT replicas by bucket load (else a fixed count).")
    min_replicas: int = Field(default=1, ge=1, le=1024, description="Fewest DiT replicas.")
    max_replicas: int = Field(default=4, ge=1, le=1024, description="Most DiT replicas (one GPU each).")
    initial_replicas: int | None = Field(
        default=None, ge=1, le=1024,
        description="DiT replicas at deploy time (None: min_replicas); the first ownership assignment waits "
        "for this many.",
    )
    target_utilization: float = Field(
        default=0.75, gt=0.0, le=1.0,
        description="Fraction of each ready replica's measured capacity the policy plans to use: replicas = "
        "ceil(bucket load / target_utilization) + replicas still capturing.",
    )
    backlog_drain_s: float = Field(
        default=10.0, gt=0.0, le=3600.0,
        description="Seconds in which the requests in flight (at replicas and queued at the ingress) should be "
        "served: a backlog counts as (its measured work in seconds) / backlog_drain_s replicas.",
    )
    upscale_delay_s: float = Field(
        default=3.0, ge=0.0, le=3600.0,
        description="Seconds the policy must want more replicas without a break before it adds them.",
    )
    downscale_delay_s: float = Field(
        default=30.0, ge=0.0, le=3600.0,
        description="Seconds the policy must want fewer replicas without a break before it removes them (to the "
        "most it wanted during that time).",
    )
    capture_grace_s: float = Field(
        default=30.0, ge=0.0, le=3600.0,
        description="A replica that is capturing graphs (shapes gained when a peer left) or has not reported yet is "
        "not capacity; after this many seconds of warming without a break it is added on top of what the load "
        "needs. Captures normally end sooner, so a downscale (which makes the survivors capture) does not bounce.",
    )
    look_back_period_s: float = Field(
        default=10.0, gt=0.0, le=600.0,
        description="Window in seconds of each replica's arrival rate and measured service time per bucket "
        "shape, and of Ray's metric aggregation.",
    )
    metrics_interval_s: float = Field(
        default=1.0, gt=0.0, le=60.0,
        description="Seconds between a replica's record_autoscaling_stats reports (Ray's metrics_interval_s).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling.min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        if self.look_back_period_s < self.metrics_interval_s:
            raise ValueError(f"autoscaling.look_back_period_s {self.look_back_period_s} is shorter than "
                             f"metrics_interval_s {self.metrics_interval_s}: a rate needs reports within its window")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"autoscaling.initial_replicas {self.initial_replicas} must be from min_replicas "
                             f"{self.min_replicas} to max_replicas {self.max_replicas}")
        return self

    @property
    def start_replicas(self) -> int:
        """Replicas at deploy time: ``initial_replicas``, else ``min_replicas``."""
        return self.initial_replicas if self.initial_replicas is not None else self.min_replicas


def api_key_digest(key: str) -> str:
    """``sha256:<hex>`` of ``key`` (what :class:`AuthConfig` stores instead of the key)."""
    import hashlib

    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


class _BadKey:
    """Stands in for a bad ``api_keys`` entry during validation; its repr (what pydantic prints) is the reason."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"<{self.reason}>"


class AuthConfig(BaseModel):
    """API keys the ingress asks for (``Authorization: Bearer <key>``); no keys: the API is open.

    Keys are stored as SHA-256 digests from the moment the config is read: a plain key in ``api_keys`` is
    replaced by ``sha256:<hex>`` (a value already of that form is kept as a digest), so the config that travels
    to the deployments, ``bcg config`` and every echo hold digests only. ``api_key_file`` is read by the ingress
    at start (``deployments/auth.py``): one key a line, blank lines and lines starting with ``#`` skipped.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)  # errors never echo a key

    api_keys: list[str] = Field(
        default_factory=list,
        description="API keys, or their digests 'sha256:<64 hex>'; stored as digests only. Empty (and no "
        "api_key_file): every request is served without a key.",
    )
    api_key_file: str | None = Field(
        default=None,
        description="A file of API keys, one a line ('#' comments), read by the ingress at start (on its node).",
    )

    @model_validator(mode="before")
    @classmethod
    def _digests(cls, data: Any) -> Any:
        """Replace every key by its digest before any field check, so that no error message (pydantic echoes a
        bad field's input) ever holds a key: a bad entry becomes a :class:`_BadKey` that says what is wrong."""
        if not isinstance(data, Mapping) or "api_keys" not in data:
            return data
        keys = data["api_keys"]
        if not isinstance(keys, list):
            return {**data, "api_keys": _BadKey("not a list of strings")}
        out: list[Any] = []
        for key in keys:
            if not isinstance(key, str):
                out.append(_BadKey("not a string"))
            elif not key or key != key.strip():
                out.append(_BadKey("empty, or padded with white space"))
            else:
                out.append(key if API_KEY_DIGEST.match(key) else api_key_digest(key))
        return {**data, "api_keys": out}

    def __repr_args__(self):
        yield "api_keys", f"[{len(self.api_keys)} digests]"
        yield "api_key_file", self.api_key_file

    @property
    def enabled(self) -> bool:
        """True when requests need a key."""
        return bool(self.api_keys) or self.api_key_file is not None


LOOPBACK = "127.0.0.1"
"""The address a local server (``bcg serve``, ``bcg demo``) binds unless the operator says otherwise."""


class MetricsConfig(BaseModel):
    """Where a local server's Prometheus metrics are served (``bcg serve``, ``bcg demo``).

    The source is Ray's own metrics exporter (each node's metrics agent, ``ray_`` prefix), started by
    :func:`deployments.cli.local.start_local` with ``ray.init(_metrics_export_port=port)``; there is no second
    metrics stack. On a cluster started with ``ray start`` (``cluster.yaml``, ``serve deploy``) this section is
    not read: the port is ``ray start --metrics-export-port``.

    ``host`` is where Ray's node, and with it the exporter, listens. ``127.0.0.1`` (the default) starts the
    local Ray bound to loopback: its node IP is 127.0.0.1, so the GCS, raylet, workers, object manager and the
    exporter listen on loopback only. ``0.0.0.0`` starts Ray as Ray does by default on Linux: its node IP is
    the machine's address, the exporter listens on every interface (Ray's choice for a non-loopback node,
    ``ray/dashboard/modules/reporter/reporter_agent.py``) and so do Ray's other services, on that address.
    Ray offers no bind address between the two. The API's HTTP port stays on 127.0.0.1 either way.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    port: int = Field(default=8080, ge=0, le=65535,
                      description="Prometheus port of the local Ray node (0: a free one; bcg demo always takes a "
                      "free one). 8080 is the port Ray's own metrics documentation uses.")
    host: Literal["127.0.0.1", "0.0.0.0"] = Field(
        default=LOOPBACK, description="127.0.0.1: the local Ray and its exporter on loopback only; 0.0.0.0: Ray's "
        "Linux default (node IP = this machine's address; the exporter on every interface).")


class ServeConfig(EngineConfig):
    """Everything one application needs: the embedded default is ``ServeConfig()``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys (stored as SHA-256 digests).")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig,
                                   description="Prometheus port and bind address of a local server (bcg serve).")
    videos: VideosConfig = Field(default_factory=VideosConfig,
                                 description="Video jobs (/v1/videos): the job store's folder and database, leases, "
                                 "retention (deployments/videos/config.py).")


def _section_fields(loc: tuple, model: Any) -> list[str] | None:
    """The field names of the section of ``model`` (a pydantic model class) at ``loc`` (``("limits",)`` of
    ``ServeConfig``: ``LimitsConfig``'s), or None where ``loc`` does not lead to a section."""
    import types
    import typing

    for part in loc:
        field = getattr(model, "model_fields", {}).get(part) if isinstance(part, str) else None
        model = field.annotation if field is not None else None
        if typing.get_origin(model) in (typing.Union, types.UnionType):
            model = next((a for a in typing.get_args(model) if a is not type(None)), None)  # an optional section
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return list(model.model_fields)


def error_text(exc: BaseException, model: Any = None, what: str = "configuration", top: str = "the config") -> str:
    """One line for an error: a pydantic ``ValidationError`` of ``model`` (default :class:`ServeConfig`: a bad
    configuration) as ``invalid <what>: field.path: message`` per error joined with ``;``, without pydantic's type
    names and documentation links (an unknown field names the section's fields and the closest one, ``top`` naming
    the top level; a bad API key says why, never the key); anything else as it is."""
    import difflib

    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        parts: list = []
        unknown: dict[tuple, list[str]] = {}  # section -> its unknown fields: one "takes ..." per section
        for e in exc.errors():
            loc = tuple(e.get("loc", ()))
            msg = str(e.get("msg", "")).removeprefix("Value error, ")
            fields = _section_fields(loc[:-1], model or ServeConfig) if e.get("type") == "extra_forbidden" else None
            if fields is not None:
                close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
                if not close and len(loc) == 1:  # a section's key written at the top level
                    close = [f"{s}.{loc[0]}" for s in fields if loc[0] in (_section_fields((s,), model or ServeConfig)
                                                                             or ())][:1]
                if loc[:-1] not in unknown:
                    unknown[loc[:-1]] = []
                    parts.append((loc[:-1], fields))
                unknown[loc[:-1]].append((".".join(map(str, loc)), f" (did you mean {close[0]!r}?)" if close else ""))
                continue
            elif type(e.get("input")).__name__ == "_BadKey":  # deployments.settings: says what is wrong, not the key
                why = e["input"].reason
                msg = (f"an API key that is {why}" if loc and isinstance(loc[-1], int) else
                       f"{why}: give a list of keys, e.g. [\"sk-...\"], or api_key_file")
            where = ".".join(str(x) for x in loc)
            parts.append(f"{where}: {msg}" if where else msg)
        for i, part in enumerate(parts):
            if isinstance(part, tuple):
                section, fields = part
                names = unknown[section]
                said = (f"{names[0][0]}: unknown field{names[0][1]}" if len(names) == 1 else
                        f"{', '.join(n + hint for n, hint in names)}: unknown fields")
                parts[i] = f"{said}; {'.'.join(map(str, section)) or top} takes {', '.join(fields)}"
        return f"invalid {what}: {'; '.join(parts)}"
    if isinstance(exc, FileNotFoundError) and exc.filename:  # "[Errno 2] No such file or directory: 'x'"
        return f"{exc.filename}: no such file"
    return str(exc)


def read_yaml(path: Path) -> Any:
    """The YAML (or JSON) document in ``path``, with a key given twice in one mapping refused (:func:`parse_yaml`).

    Raises:
        ValueError: a directory, not valid YAML/JSON, or a duplicate key (naming the file, the key and its line).
        OSError: the file cannot be read.
    """
    if path.is_dir():
        raise ValueError(f"config file {str(path)!r} is a directory; give a YAML or JSON file (see `bcg config`)")
    with path.open() as f:  # a stream, so that a syntax error names the file, not "<unicode string>"
        return parse_yaml(f, f"config file {str(path)!r}")


def parse_yaml(source: Any, where: str, first_line: int = 1) -> Any:
    """The YAML (or JSON) document in ``source`` (a text or a stream), with a key given twice in one mapping refused:
    YAML's own rule, which PyYAML does not enforce (it keeps the last), so an edited config's second ``limits:`` or
    ``max_images:`` would silently drop the first. ``where`` starts each error, e.g. ``config file 'my.yaml'``;
    ``first_line``: the line of ``where`` on which ``source`` starts (a text embedded in a file: its line there).

    Raises:
        ValueError: not valid YAML/JSON, or a duplicate key (naming the key and its line).
    """
    import yaml

    class _Loader(yaml.SafeLoader):
        def compose_mapping_node(self, anchor):  # each mapping as written, before merge keys are flattened
            node = super().compose_mapping_node(anchor)
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # "<<": merged keys may be overridden
                    continue
                key = (key_node.tag, key_node.value) if isinstance(key_node, yaml.ScalarNode) else id(key_node)
                if key in seen:
                    raise ValueError(f"{where}: key {key_node.value!r} is given twice in one mapping (line "
                                     f"{key_node.start_mark.line + first_line}); keep one")
                seen.add(key)
            return node

    try:
        return yaml.load(source, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass; YAML is a superset of JSON
    except yaml.YAMLError as e:
        raise ValueError(f"{where} is not valid YAML/JSON: {e}") from None


def load_config(config: Mapping[str, Any] | None = None, config_path: str | Path | None = None) -> ServeConfig:
    """Build a ``ServeConfig`` from a mapping or a YAML/JSON file (what ``bcg config`` prints).

    Raises:
        ValueError: both given, or a file that does not hold a mapping; pydantic.ValidationError (a
            ValueError) for a bad value, naming the field.
        FileNotFoundError: ``config_path`` does not exist.
    """
    if config is not None and config_path is not None:
        raise ValueError("give either config or config_path, not both")
    if config_path is not None:
        path = Path(config_path)
        data = read_yaml(path)
        if data is None:
            raise ValueError(f"config file {str(path)!r} is empty: write the sections to change (model, buckets, "
                             f"limits, runner, ...; `bcg config` prints them all), or leave out the file for the "
                             f"defaults")
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(path)!r} holds a {type(data).__name__}, not a mapping of sections "
                             f"(model, buckets, limits, runner, ...; `bcg config` prints them all)")
        config = data
    return ServeConfig.model_validate(dict(config or {}))


@dataclass(frozen=True)
class BackpressureLimits:
    """Request limits of the deployments (:func:`backpressure_limits`).

    Attributes:
        batch_capacity: requests of the default shape (n=1, default guidance) a replica runs at once.
        dit_max_ongoing: ``max_ongoing_requests`` of each DiT replica.
        dit_max_queued: ``max_queued_requests`` of the DiT deployment, per caller (ingress replica).
        ingress_max_ongoing: ``max_ongoing_requests`` of each ingress replica: enough to hold every DiT slot
            and the DiT queue, plus 8 for ``/v1/buckets`` and ``/healthz``, so the DiT deployment's queue,
            not the ingress, is what answers 503 under overload.
    """

    batch_capacity: int
    dit_max_ongoing: int
    dit_max_queued: int
    ingress_max_ongoing: int


def backpressure_limits(config: ServeConfig, dit_replicas: int = 1) -> BackpressureLimits:
    """The backpressure limits of an application, from the scheduler's capacity unless the config sets them.

    ``rows`` of a default request: 2 with classifier-free guidance (``limits.default_guidance_scale > 1``, or
    unset: the family's default, which runs CFG for SD3, PixArt-Sigma, SANA and the tiny default; counted
    without loading the model, so FLUX.1 and Qwen-Image, whose default requests run one row, are counted at 2
    too unless it is set to 1), else 1. ``batch_capacity`` (the requests a replica runs at once) is
    ``scheduler.max_rows_in_flight // rows``: the step scheduler splits forwards across buckets (or runs them eager), so
    the largest batch bucket does not bound it.

    ``max_ongoing_requests``: ``scheduler.max_requests`` when set, else ``2 x batch_capacity`` (one set running, one
    waiting for admission).
    ``max_queued_requests = max_ongoing_requests x most replicas`` (``autoscaling.max_replicas`` when
    autoscaling is on, else ``dit_replicas``): each ingress replica may hold one full deployment's worth of
    requests waiting, enough for a burst to wait while replicas are added. Explicit
    ``routing.max_ongoing_requests`` / ``max_queued_requests`` win.

    Args:
        config: the application's config.
        dit_replicas: the fixed DiT replica count (ignored when autoscaling is on).

    Returns:
        The limits. Default config (step scheduler, 64 rows, guidance 3.5): batch capacity 32, 64 ongoing
        per replica, 256 queued with 4 replicas at most.
    """
    guidance = config.limits.default_guidance_scale
    rows = 2 if guidance is None or guidance > 1 else 1
    scheduler = config.scheduler
    capacity = max(1, scheduler.max_rows_in_flight // rows)
    default_ongoing = scheduler.max_requests or 2 * capacity
    most = config.autoscaling.max_replicas if config.autoscaling.enabled else max(1, int(dit_replicas))
    ongoing = config.routing.max_ongoing_requests or default_ongoing
    queued = config.routing.max_queued_requests or ongoing * most
    return BackpressureLimits(capacity, ongoing, queued, ongoing * most + queued + 8)
