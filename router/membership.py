"""Replica membership and the live shape assignment: the state behind the ownership coordinator.

Pure logic with an injectable clock (no Ray): :class:`deployments.coordinator.BucketCoordinator` wraps one
:class:`OwnershipTable` in a Serve deployment, and the tests drive it directly.

Life of a replica:

1. ``join``: the replica registers with its graph budget. Before the first assignment the table waits for
   ``expected`` replicas (or the join window to close) so that a fresh deployment gets one balanced
   assignment in which each replica captures only its own shapes (``router.ownership.assign`` with no
   previous assignment). After that, a joiner is added with the previous assignment kept: it receives
   co-ownerships of the most loaded shapes and nobody else changes.
2. ``heartbeat`` every ``routing.stats_period_s`` (from the replica's ``record_routing_stats``): it renews
   the replica's lease, reports its ready shapes, queue and counters, and returns its owned shapes (which
   grow when a peer leaves). A heartbeat from an unknown replica (the coordinator restarted, or its lease
   had expired) re-joins it, adopting the shapes it reports as owned.
   Before the first assignment such re-joins are remembered, and the first assignment keeps what they hold
   (a restarted coordinator rebuilds the ownership the replicas still serve, and fills in only the gaps).
3. ``leave`` (graceful shutdown) or lease expiry (``lease_s`` without a heartbeat: the replica died): its
   shapes move to the survivors (``assign`` with the previous assignment: only the leaver's ownerships are
   re-homed).
4. A **stalled capture**: a replica whose heartbeat says it has been capturing for longer than
   ``capture_stall_s`` (``stats["capturing_s"]``) is alive but not serving what it owns. It is taken out of
   the assignment as if it had left (event ``stalled``; its shapes move to the survivors, which capture them),
   as long as another replica remains. Its later heartbeats are answered None (it keeps its own shapes) until
   one says the capture ended; then it re-joins, adopting the shapes it holds (event ``recovered``).

Scale events (a join after the first assignment, a leave) re-assign by the **measured** load: each
heartbeat's ``stats["load"]`` is ``{shape: replicas' worth of work}`` (arrival rate x measured service time,
:mod:`bcg_core.scheduler.load`); summed over the replicas (a leaver's last report included) it replaces the krea prior's
shares for that re-assignment, so a replica added because one shape is hot becomes a co-owner of that shape.
With no measured load yet the prior is used. ``snapshot()["demand"]`` shows the shares and their source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .ownership import DEFAULT_GRAPH_OVERHEAD_BYTES, Assignment, BucketDemand, ReplicaCapacity, assign

__all__ = ["MemberState", "OwnershipTable"]


@dataclass
class MemberState:
    """What the table knows of one replica.

    Attributes:
        replica_id: Ray Serve's unique replica id.
        budget_bytes: its graph budget in bytes.
        last_seen: clock time (seconds) of its last join or heartbeat.
        ready: shapes it reported captured and serving.
        queue: requests per shape it reported waiting or running.
        stats: the last counters it reported (free-form, shown in ``/v1/buckets``).
    """

    replica_id: str
    budget_bytes: int
    last_seen: float
    ready: tuple[str, ...] = ()
    queue: dict[str, int] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


class OwnershipTable:
    """Live bucket-shape ownership over a changing replica set.

    Args:
        demands: per shape, its expected share of requests and its graph bytes
            (:func:`router.ownership.shape_demands`).
        expected: replicas the first assignment waits for.
        join_window_s: seconds after the first join at which the first assignment is made even if fewer
            than ``expected`` replicas joined.
        lease_s: seconds without a heartbeat after which a replica counts as gone.
        hot_share: shapes with at least this share get >= 2 owners (see :func:`router.ownership.assign`).
        graph_overhead_bytes: bytes each owned graph adds beyond the largest (ownership memory model).
        capture_stall_s: seconds of one capture after which a replica counts as stalled (module docstring, 4);
            None: never.
        clock: monotonic seconds (``time.monotonic`` by default; tests pass a fake).

    Raises:
        ValueError: ``expected`` < 1, a negative window, or a lease or stall time that is not positive.
    """

    def __init__(self, demands: Mapping[str, BucketDemand], expected: int = 1, join_window_s: float = 60.0,
                 lease_s: float = 5.0, hot_share: float = 0.10,
                 graph_overhead_bytes: int = DEFAULT_GRAPH_OVERHEAD_BYTES, capture_stall_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if expected < 1 or join_window_s < 0 or lease_s <= 0 or (capture_stall_s is not None and capture_stall_s <= 0):
            raise ValueError(f"need expected >= 1, join_window_s >= 0, lease_s > 0 and capture_stall_s > 0 or None; "
                             f"got {expected}, {join_window_s}, {lease_s}, {capture_stall_s}")
        self.prior = dict(demands)
        self.demands = dict(demands)
        self.demand_source = "prior"
        self.expected = expected
        self.join_window_s = join_window_s
        self.lease_s = lease_s
        self.hot_share = hot_share
        self.overhead = graph_overhead_bytes
        self.capture_stall_s = capture_stall_s
        self.clock = clock
        self.members: dict[str, MemberState] = {}
        self.stalled: dict[str, float] = {}  # stalled replica -> clock time of its last heartbeat
        self._held: dict[str, tuple[str, ...]] = {}  # before the first assignment: shapes re-joiners hold
        self.assignment: Assignment | None = None
        self.version = 0
        self.first_join: float | None = None
        self.events: list[dict] = []
        self.moves = 0

    # -- membership ---------------------------------------------------------------------------------

    @property
    def assigned(self) -> bool:
        """True once the first assignment was made."""
        return self.assignment is not None

    def window_closed(self) -> bool:
        """True when the first assignment may be made: all expected replicas joined, or the window passed."""
        if len(self.members) >= self.expected:
            return True
        return self.first_join is not None and self.clock() - self.first_join >= self.join_window_s

    def join(self, replica_id: str, budget_bytes: int, owned: tuple[str, ...] = (),
             ready: tuple[str, ...] = ()) -> None:
        """Register (or re-register) a replica; reassigns when the first assignment exists.

        Args:
            replica_id: the replica's unique id.
            budget_bytes: its graph budget.
            owned: shapes it already holds (a re-join after a coordinator restart): adopted as its previous
                ownership so it keeps them.
            ready: shapes it has captured.
        """
        now = self.clock()
        if self.first_join is None:
            self.first_join = now
        known = replica_id in self.members
        self.members[replica_id] = MemberState(replica_id, int(budget_bytes), now, tuple(ready))
        if not known:
            self._event("join", replica_id)
        if self.assignment is not None and not known:
            self._refresh_demands()
            self._reassign(adopt={replica_id: tuple(owned)})
        elif self.assignment is None:
            if owned:
                self._held[replica_id] = tuple(owned)
            if self.window_closed():
                self._reassign()

    def leave(self, replica_id: str, why: str = "leave") -> bool:
        """Remove a replica (graceful shutdown or expired lease); its shapes move to the survivors.

        Returns:
            True when it was a member.
        """
        if replica_id not in self.members:
            return False
        self._refresh_demands()  # the leaver's last load still counts: its traffic moves to the survivors
        self.members.pop(replica_id)
        self._held.pop(replica_id, None)
        self._event(why, replica_id)
        if self.assignment is not None:
            self._reassign()
        return True

    def heartbeat(self, replica_id: str, budget_bytes: int, owned: tuple[str, ...] = (), ready: tuple[str, ...] = (),
                  queue: Mapping[str, int] | None = None, stats: Mapping | None = None) -> tuple[str, ...] | None:
        """Renew a replica's lease and record what it reports.

        ``stats["capturing_s"]``: seconds the replica's current capture has run (None or absent: not capturing);
        past ``capture_stall_s`` the replica is taken out of the assignment (module docstring, 4).

        Returns:
            Its owned shapes, or None while the first assignment is still waiting for replicas, or while it is
            stalled (it keeps the shapes it has).
        """
        capturing = (stats or {}).get("capturing_s")
        if replica_id in self.stalled:
            if capturing is not None:
                self.stalled[replica_id] = self.clock()  # its lease while out: heard from now
                return None  # still stuck: stays out of the assignment
            self.stalled.pop(replica_id)
            self._event("recovered", replica_id)
        member = self.members.get(replica_id)
        if member is None:
            self.join(replica_id, budget_bytes, owned, ready)
            member = self.members[replica_id]
        member.last_seen = self.clock()
        member.ready = tuple(ready)
        member.queue = dict(queue or {})
        member.stats = dict(stats or {})
        if (self.capture_stall_s is not None and isinstance(capturing, (int, float))
                and capturing > self.capture_stall_s and len(self.members) > 1):
            self.stalled[replica_id] = self.clock()
            self.leave(replica_id, why="stalled")
            return None
        if self.assignment is None and self.window_closed():
            self._reassign()
        return self.owned(replica_id)

    def touch(self, replica_id: str) -> None:
        """Renew a replica's lease without a report (it is alive: e.g. waiting in ``join``)."""
        member = self.members.get(replica_id)
        if member is not None:
            member.last_seen = self.clock()

    def expire(self) -> list[str]:
        """Remove every replica whose lease ran out; returns their ids (sorted)."""
        now = self.clock()
        gone = sorted(r for r, m in self.members.items() if now - m.last_seen > self.lease_s)
        for r in gone:
            self.leave(r, why="expired")
        self.stalled = {r: t for r, t in self.stalled.items() if now - t <= self.lease_s}  # died while stalled
        if self.assignment is None and self.members and self.window_closed():
            self._reassign()
        return gone

    def owned(self, replica_id: str) -> tuple[str, ...] | None:
        """Shapes ``replica_id`` owns; None before the first assignment or for an unknown replica."""
        if self.assignment is None or replica_id not in self.members:
            return None
        return tuple(self.assignment.buckets.get(replica_id, ()))

    # -- assignment ---------------------------------------------------------------------------------

    def measured_load(self) -> dict[str, float]:
        """Replicas' worth of work per shape, summed over the members' last reports (``stats["load"]``);
        shapes outside the table are ignored."""
        total: dict[str, float] = {}
        for m in self.members.values():
            for shape, v in (m.stats.get("load") or {}).items():
                if shape in self.prior and isinstance(v, (int, float)) and v > 0:
                    total[shape] = total.get(shape, 0.0) + float(v)
        return total

    def _refresh_demands(self) -> None:
        """Set each shape's share from the measured load (the prior's when nothing is measured)."""
        load = self.measured_load()
        whole = sum(load.values())
        if whole <= 0:
            self.demands, self.demand_source = dict(self.prior), "prior"
            return
        self.demands = {s: BucketDemand(load.get(s, 0.0) / whole, d.graph_bytes) for s, d in self.prior.items()}
        self.demand_source = "measured"

    def _reassign(self, adopt: Mapping[str, tuple[str, ...]] | None = None) -> None:
        """Assign again, keeping the previous assignment and adding ``adopt`` (replica -> shapes it holds) and the
        shapes re-joiners reported before the first assignment to it; with no previous assignment the adopted
        shapes alone are kept."""
        replicas = [ReplicaCapacity(r, m.budget_bytes) for r, m in sorted(self.members.items())]
        previous = self.assignment
        adopt = {r: shapes for r, shapes in {**self._held, **(adopt or {})}.items() if r in self.members and shapes}
        if adopt:
            owners = {b: set(rs) for b, rs in previous.owners.items()} if previous else {}
            buckets = {r: set(bs) for r, bs in previous.buckets.items()} if previous else {}
            for r, shapes in adopt.items():
                for b in shapes:
                    if b in self.demands:
                        owners.setdefault(b, set()).add(r)
                        buckets.setdefault(r, set()).add(b)
            previous = Assignment({b: tuple(sorted(rs)) for b, rs in owners.items()},
                                  {r: tuple(sorted(bs)) for r, bs in buckets.items()})
        new = assign(self.demands, replicas, previous=previous if replicas else None, hot_share=self.hot_share,
                     graph_overhead_bytes=self.overhead)
        self.moves += new.moved_from(self.assignment)
        self.assignment = new
        self._held.clear()
        self.version += 1

    def _event(self, kind: str, replica_id: str) -> None:
        self.events.append({"event": kind, "replica": replica_id, "t": round(self.clock(), 3),
                            "replicas": len(self.members)})
        del self.events[:-50]

    # -- introspection ------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """JSON-ready view for ``/v1/buckets``: version, moves, events, unplaceable shapes, and per replica
        its owned and ready shapes, expected load share, modelled graph bytes, queue and last counters; and
        ``demand``: the shares the last re-assignment used and their ``source`` (``"prior"``: the krea mix,
        ``"measured"``: the replicas' reported load)."""
        a = self.assignment
        now = self.clock()
        replicas = {}
        for r, m in sorted(self.members.items()):
            replicas[r] = {
                "owned": list(a.buckets.get(r, ())) if a else [],
                "ready": list(m.ready),
                "expected_load": round(a.loads.get(r, 0.0), 4) if a else 0.0,
                "graph_bytes_model": a.graph_bytes.get(r, 0) if a else 0,
                "queue": dict(m.queue),
                "seen_s_ago": round(now - m.last_seen, 2),
                "stats": m.stats,
            }
        return {
            "assigned": a is not None,
            "version": self.version,
            "expected_replicas": self.expected,
            "moves": self.moves,
            "owners": {b: list(rs) for b, rs in a.owners.items()} if a else {},
            "unplaceable": list(a.unplaceable) if a else [],
            "stalled": sorted(self.stalled),
            "under_replicated": list(a.under_replicated) if a else [],
            "replicas": replicas,
            "events": list(self.events),
            "demand": {"source": self.demand_source,
                       "shares": {s: round(d.share, 4) for s, d in sorted(self.demands.items())}},
        }
