"""Shape-aware request routing across DiT replicas (docs/DESIGN.md section 5).

:class:`ShapeAwareRouter` is a Ray Serve ``RequestRouter`` (``ray.serve.request_router.RequestRouter``) for the
DiT replica deployment. It sends each request to a replica that owns (has captured, or is capturing) the
graphs of the request's bucket shape, and to any other replica only after a bounded wait.

Routing key. The key is the request's bucket SHAPE: its bucket key without the batch dimension
(``BucketKey.shape``), ``"i{image_tokens}[_m]_t{text_tokens}[_g{h}x{w}]"``, e.g. ``"i1024_t256"``,
``"i1024_m_t256"`` (image tokens masked) or ``"i1024_t256_g32x32"`` (token grid in the key). Every batch
bucket of one shape belongs to the same owners. Callers put it into the request metadata with
``handle.options(multiplexed_model_id=shape)`` (on the HTTP path Serve sees arguments only as opaque bytes).
An empty key means "no bucket": a miss served eagerly, or an un-keyed call such as stats; it goes to any
replica at once, lowest queue first.

A request that carries LoRA adapters appends them to the key, sorted: ``"i1024_t256|lora=anime,ink"``. The key is
one typed value, :class:`router.routing_key.RoutingKey`: :meth:`ShapeAwareRouter.choose_replicas` parses the
metadata string once and :func:`rank_replicas` takes the value.

Routing stats. Each DiT replica defines ``record_routing_stats()`` returning::

    {"owned": [shape, ...],     # shapes assigned to it (router.ownership.assign)
     "ready": [shape, ...],     # owned shapes whose graphs are captured
     "queue": {shape: int},     # requests of that shape waiting or running there
     "capturing": bool,         # it is capturing graphs now
     "adapters": [name, ...]}   # LoRA adapters resident in its GPU slots (absent: none)

Serve's controller calls it every ``request_routing_stats_period_s`` and broadcasts the result to every
router, where it is ``RunningReplica.routing_stats``; until the first poll it is ``{}`` and the replica
counts as owning nothing.

Tiers for a keyed request (:func:`rank_replicas`):

1. ``ready_owner``: replicas whose ``ready`` holds the shape;
2. ``warming_owner``: replicas whose ``owned`` holds it, graphs not yet ready;
3. ``fallback``: every other replica, offered only once the request has waited ``fallback_wait_s``
   (from ``PendingRequest.created_at``) without a tier-1/2 replica accepting it.

Adapters. Within a tier, a request with adapters prefers the replicas that hold all of them (no load, no
eviction): they come as a list of their own before the rest, unless the least loaded of them has more than
``adapter_slack`` queued requests of the shape above the least loaded other replica (then one list: a busy
holder does not keep the request from an idle replica, which loads the adapter; hot adapters so become resident
on several replicas).

Ray's base class takes the lists in order and, within one list, picks the replica with the fewest ongoing
requests (live count) that accepts; when every replica of every list is full it backs off and calls
:meth:`ShapeAwareRouter.choose_replicas` again. The order inside a list (fewest queued requests of the
shape first) breaks ties between equal live queues.

Importing this module imports ``ray.serve`` (the base class); :func:`rank_replicas` itself is pure.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .routing_key import RoutingKey

__all__ = [
    "DEFAULT_ADAPTER_SLACK",
    "DEFAULT_FALLBACK_WAIT_S",
    "METRIC_NAME",
    "TIERS",
    "ShapeAwareRouter",
    "rank_replicas",
]

log = logging.getLogger(__name__)

DEFAULT_FALLBACK_WAIT_S = 2.0
"""Seconds a keyed request waits for an owner before any replica may take it (docs/DESIGN.md section 5)."""

DEFAULT_ADAPTER_SLACK = 2.0
"""Queued requests of its shape by which a replica holding a request's adapters may exceed the least loaded other
replica of the same tier and still come first (about the time of one adapter load on a busy replica)."""

TIERS = ("ready_owner", "warming_owner", "fallback", "unkeyed")
"""Decision tiers, best first; ``unkeyed`` is the tier of requests without a routing key."""

METRIC_NAME = "bcg_router_decisions"
"""``ray.util.metrics.Counter`` of routing decisions, tag ``tier`` (one of :data:`TIERS`)."""

_CTX_ATTR = "bcg_router_tier"
"""Attribute set on ``PendingRequest.routing_context``: the tier last counted for that request."""


# ---------------------------------------------------------------------------------------------------------
# Pure ranking


def _stats(replica: Any) -> Mapping[str, Any]:
    """The replica's routing stats, ``{}`` when missing or not a mapping."""
    stats = getattr(replica, "routing_stats", None)
    return stats if isinstance(stats, Mapping) else {}


def _shapes(stats: Mapping[str, Any], field: str) -> frozenset[str]:
    """A list-of-shapes field of the stats as a set (empty when missing or malformed)."""
    value = stats.get(field)
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset)):
        return frozenset()
    return frozenset(s for s in value if isinstance(s, str))


def _queued(stats: Mapping[str, Any], key: str | None = None) -> float:
    """Queued requests of shape ``key`` (of all shapes when None); malformed values count as 0."""
    queue = stats.get("queue")
    if not isinstance(queue, Mapping):
        return 0.0
    values = queue.values() if key is None else [queue.get(key, 0)]
    total = 0.0
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f) and f > 0:
            total += f
    return total


def _by_adapters(ranked: list[tuple[tuple, Any]], adapters: frozenset[str], slack: float, load: int = 0) -> list[list]:
    """One tier's replicas (``(sort key, replica)``; ``sort key[load]`` is the queue the slack compares) as lists:
    those holding every adapter first, unless their least queue exceeds the others' by more than ``slack``."""
    ranked = sorted(ranked, key=lambda x: x[0])
    if not adapters:
        return [[r for _, r in ranked]]
    holds = [adapters <= _shapes(_stats(r), "adapters") for _, r in ranked]
    holders = [kr for kr, h in zip(ranked, holds, strict=True) if h]
    others = [kr for kr, h in zip(ranked, holds, strict=True) if not h]
    if not holders or not others or min(k[load] for k, _ in holders) > min(k[load] for k, _ in others) + slack:
        return [[r for _, r in ranked]]
    return [[r for _, r in holders], [r for _, r in others]]


def rank_replicas(key: RoutingKey, replicas: list, waited_s: float, fallback_wait_s: float = DEFAULT_FALLBACK_WAIT_S,
                  adapter_slack: float = DEFAULT_ADAPTER_SLACK) -> tuple[str, list[list]]:
    """Rank replicas for one request by tier (pure; reads only ``replica_id`` and ``routing_stats``).

    Args:
        key: the request's routing key: its bucket shape (e.g. ``"i1024_t256"``), ``""`` for a request without
            a bucket, and its LoRA adapters if any.
        replicas: the current replicas (``RunningReplica`` or any object with ``replica_id`` and
            ``routing_stats``; missing or malformed stats count as ``{}``, i.e. owning nothing).
        waited_s: seconds since the request was created.
        fallback_wait_s: seconds a keyed request waits before non-owners become candidates (<= 0: at once).
        adapter_slack: see the module docstring (adapters).

    Returns:
        ``(tier, lists)``: the non-empty candidate lists in tier order and the tier name (from
        :data:`TIERS`) of the first one; ``("", [])`` when there is no candidate yet (no replicas, or a
        keyed request without owners inside its fallback window).

        - un-keyed: ``("unkeyed", [all replicas])``, in the given order;
        - keyed: ready owners (``key.shape`` in ``ready``), then warming owners (in ``owned``, not in
          ``ready``), each ordered by fewest queued requests of the shape (``queue[key.shape]``), then fewest
          queued in total, then replica id; then, only when ``waited_s >= fallback_wait_s``, every other
          replica, those not capturing first, then by fewest queued in total, then replica id.
        - with adapters, each tier is split into the replicas holding them all and the rest (module docstring);
          an un-keyed request with adapters is ordered by fewest queued in total, holders first.
    """
    replicas = list(replicas)
    if not replicas:
        return "", []
    shape, adapters = key.shape, key.adapters
    if not shape:
        if not adapters:
            return "unkeyed", [replicas]
        ranked = [((_queued(_stats(r)), str(r.replica_id)), r) for r in replicas]
        return "unkeyed", _by_adapters(ranked, adapters, adapter_slack)

    ready: list[tuple[tuple, Any]] = []
    warming: list[tuple[tuple, Any]] = []
    others: list[tuple[tuple, Any]] = []
    for r in replicas:
        stats = _stats(r)
        total = _queued(stats)
        rid = str(r.replica_id)
        if shape in _shapes(stats, "ready"):
            ready.append(((_queued(stats, shape), total, rid), r))
        elif shape in _shapes(stats, "owned"):
            warming.append(((_queued(stats, shape), total, rid), r))
        else:
            others.append(((bool(stats.get("capturing", False)), total, rid), r))

    tiers: list[tuple[str, list, int]] = [("ready_owner", ready, 0), ("warming_owner", warming, 0)]
    if waited_s >= fallback_wait_s:  # its sort key is (capturing, total queued, id): the slack compares totals
        tiers.append(("fallback", others, 1))
    tiers = [(name, _by_adapters(rs, adapters, adapter_slack, load)) for name, rs, load in tiers if rs]
    if not tiers:
        return "", []
    return tiers[0][0], [rs for _, lists in tiers for rs in lists]


# ---------------------------------------------------------------------------------------------------------
# The Ray Serve request router


class ShapeAwareRouter(RequestRouter):
    """Ray Serve request router that sends a request to the replicas owning its bucket shape.

    Configure it on the DiT deployment::

        from ray.serve.config import RequestRouterConfig
        @serve.deployment(request_router_config=RequestRouterConfig(
            request_router_class=ShapeAwareRouter,        # or "router.shape_router.ShapeAwareRouter"
            request_routing_stats_period_s=1.0,           # how often replicas' routing stats are polled
            request_router_kwargs={"fallback_wait_s": 2.0}))

    and call it with ``handle.options(multiplexed_model_id=str(key))``, ``key`` a :class:`RoutingKey` (see the
    module docstring for the key and the ``record_routing_stats`` contract). Serve constructs one router per deployment
    handle (in the calling process), so counts are per handle, not per deployment.

    Tiers: see :func:`rank_replicas`. ``choose_replicas`` always sets
    ``pending_request.routing_context.should_backoff = True``: Ray's base class looks at it only after
    every returned list was tried and none accepted (or nothing was returned), i.e. exactly when the
    request could not be placed at once, and then backs off (``initial_backoff_s`` x
    ``backoff_multiplier`` ^ n, at most ``max_backoff_s`` from ``RequestRouterConfig``) before asking again.

    Placement: the chosen replica goes to the request it was chosen for (not to the oldest request, as
    Ray's ``FIFOMixin`` does, and not to a sibling call sharing the parent's ``internal_request_id``, as
    Ray's plain base class does: see :meth:`_fulfill_next_pending_request`), and requests waiting for busy
    owners do not hold up requests of other shapes (:attr:`max_num_routing_tasks`).

    Attributes:
        fallback_wait_s: seconds a keyed request waits for an owner before any replica may take it.
        decisions: decisions per tier (keys :data:`TIERS`). A decision is counted when ``choose_replicas``
            returns candidates, under the tier of its first list, once per request and tier: a request that
            backs off and is offered the same first tier again is not counted again.
    """

    max_num_routing_tasks_cap = 100
    """Most routing tasks at once (Ray's default: 50); see :attr:`max_num_routing_tasks`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fallback_wait_s: float = DEFAULT_FALLBACK_WAIT_S
        self.adapter_slack: float = DEFAULT_ADAPTER_SLACK
        self.decisions: dict[str, int] = {t: 0 for t in TIERS}
        self._counter: Any = None
        self._counter_failed = False
        # routing task -> the request it is routing (see _fulfill_next_pending_request)
        self._request_of_task: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def max_num_routing_tasks(self) -> int:
        """One routing task per pending request, at least ``2 x replicas``, at most the cap (0 with no replicas).

        Each routing task routes one request until it is placed; a request waiting for its busy owners keeps
        its task. Ray's limit (``2 x replicas``) lets requests of one saturated shape hold every task, so a
        request whose owner is idle would wait out their fallback window behind them.
        """
        if not self._replicas:
            return 0
        return min(self.max_num_routing_tasks_cap, max(2 * len(self._replicas), self.num_pending_requests))

    def initialize_state(self, fallback_wait_s: float = DEFAULT_FALLBACK_WAIT_S,
                         adapter_slack: float = DEFAULT_ADAPTER_SLACK, **kwargs) -> None:
        """Take the deployment's ``RequestRouterConfig.request_router_kwargs`` (Serve calls this once).

        Args:
            fallback_wait_s: seconds a keyed request waits for a ready or warming owner before any replica
                may take it (default 2.0; 0 = offer every replica at once, after the owners).
            adapter_slack: queued requests by which a replica holding a request's LoRA adapters may exceed the
                least loaded other one and still come first (default 2.0; see :func:`rank_replicas`).
            **kwargs: unknown keys are logged and ignored.

        Raises:
            ValueError: ``fallback_wait_s`` or ``adapter_slack`` is not a finite number >= 0.
        """
        wait, slack = float(fallback_wait_s), float(adapter_slack)
        for name, v in (("fallback_wait_s", wait), ("adapter_slack", slack)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        self.fallback_wait_s, self.adapter_slack = wait, slack
        if kwargs:
            log.warning("ShapeAwareRouter: ignoring unknown request_router_kwargs %s", sorted(kwargs))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Candidate lists for one routing attempt, best tier first (see :func:`rank_replicas`).

        Args:
            candidate_replicas: every replica currently known to this router (Serve passes them all).
            pending_request: the request to place; None (Serve's pick-only path) is routed as un-keyed.

        Returns:
            Non-empty lists of replicas in tier order; ``[]`` while a keyed request waits for an owner.
        """
        if pending_request is None:
            return [list(candidate_replicas)] if candidate_replicas else []
        # Read by the base class only once every list below failed (or none was returned): back off then.
        pending_request.routing_context.should_backoff = True
        task = asyncio.current_task()
        if task is not None:
            self._request_of_task[task] = pending_request
        key = RoutingKey.parse(pending_request.metadata.multiplexed_model_id)
        waited_s = max(0.0, self._get_curr_time_s() - pending_request.created_at)
        tier, lists = rank_replicas(key, candidate_replicas, waited_s, self.fallback_wait_s, self.adapter_slack)
        if lists:
            self._count(pending_request, tier)
        return lists

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Give the replica just chosen to the very request it was chosen for.

        Ray's base class matches the request by ``internal_request_id``, which every handle call made while
        serving one parent request inherits: concurrent sibling calls (one ingress request fanning out to
        several DiT calls) share it, only the first is indexed, and the replica chosen for one sibling
        (of another shape) goes to the other; the un-indexed sibling is then never fulfilled and hangs. Here
        the routing task remembers (in :meth:`choose_replicas`) which request it routes and fulfils exactly
        that one; anything unexpected falls back to Ray's matching.
        """
        task = asyncio.current_task()
        pr = self._request_of_task.get(task) if task is not None else None
        if pr is None or pr.metadata is not request_metadata or pr.future.done():
            super()._fulfill_next_pending_request(replica, request_metadata)
            return
        self._request_of_task.pop(task, None)
        try:
            self._record_queue_wait_time(pr)
        except Exception:  # a metric must never block placement
            log.debug("ShapeAwareRouter: queue wait metric failed", exc_info=True)
        pr.future.set_result(replica)
        by_id = getattr(self, "_pending_requests_by_id", None)
        if isinstance(by_id, dict) and by_id.get(request_metadata.internal_request_id) is pr:
            del by_id[request_metadata.internal_request_id]
        self._prune_model_index(pr)

    def _remove_pending_request_from_indices(self, pending_request: PendingRequest) -> None:
        """Ray's removal, plus pruning of the per-key index (see :meth:`_prune_model_index`)."""
        super()._remove_pending_request_from_indices(pending_request)
        self._prune_model_index(pending_request)

    def _prune_model_index(self, pending_request: PendingRequest) -> None:
        """Drop finished requests from Ray's per-``multiplexed_model_id`` index of pending requests.

        Ray appends every keyed request to ``_pending_requests_by_model_id`` and prunes it only in
        ``MultiplexMixin``'s matching, which this router does not use: unpruned, it would keep every request
        ever routed (its arguments included) alive.
        """
        index = getattr(self, "_pending_requests_by_model_id", None)
        key = pending_request.metadata.multiplexed_model_id
        if not isinstance(index, dict) or not key or key not in index:
            return
        waiting = [p for p in index[key] if not p.future.done()]
        if waiting:
            index[key] = deque(waiting)
        else:
            del index[key]

    def _count(self, pending_request: PendingRequest, tier: str) -> None:
        """Count a decision of ``tier`` unless this request's last counted decision had the same tier."""
        ctx = pending_request.routing_context
        if getattr(ctx, _CTX_ATTR, None) == tier:
            return
        try:
            setattr(ctx, _CTX_ATTR, tier)
        except AttributeError:  # a slotted context in some Ray version: count every decision instead
            pass
        self.decisions[tier] = self.decisions.get(tier, 0) + 1
        counter = self._decision_counter()
        if counter is not None:
            try:
                counter.inc(1, tags={"tier": tier})
            except Exception:  # metrics must never break routing
                log.debug("ShapeAwareRouter: metric update failed", exc_info=True)

    def _decision_counter(self) -> Any:
        """The ``bcg_router_decisions`` counter, created on first use; None when metrics are unavailable."""
        if self._counter is None and not self._counter_failed:
            try:
                from ray.util import metrics

                self._counter = metrics.Counter(
                    METRIC_NAME,
                    description="Shape-aware routing decisions of DiT requests by tier "
                                "(ready_owner, warming_owner, fallback, unkeyed).",
                    tag_keys=("tier",),
                )
            except Exception:
                self._counter_failed = True
                log.warning("ShapeAwareRouter: cannot create metric %s; counting in .decisions only",
                            METRIC_NAME, exc_info=True)
        return self._counter
