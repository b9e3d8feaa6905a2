"""Ownership coordinator: one small CPU deployment holding the live shape-to-replica assignment.

DiT replicas join it at start (and capture only the shapes it assigns them), heartbeat it from their
``record_routing_stats`` (every ``routing.stats_period_s``), and leave it on shutdown. A replica that stops
heartbeating for ``routing.lease_s`` is removed and its shapes move to the survivors, which capture them in
the background and report them as warming, then ready. A replica whose capture has run longer than
``routing.capture_stall_s`` is taken out of the assignment the same way until it reports the capture ended.
A restarted coordinator rebuilds the assignment from the replicas' heartbeats, which carry the shapes each
holds. The state machine is
:class:`router.membership.OwnershipTable`; this deployment adds the join window wait, lease expiry on a
timer, and the Serve plumbing.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from bcg_core.planning.traffic import TrafficHistogram
from router.membership import OwnershipTable
from router.ownership import demands_for_config

from .settings import ServeConfig

__all__ = ["DEPARTED_KEPT", "EARLIER", "BucketCoordinator"]

logger = logging.getLogger("ray.serve")

DEPARTED_KEPT = 32
"""Departed replicas whose traffic histograms are kept apart, by replica (one whose lease lapsed and comes back
reports its own again); beyond that the least recently reported are summed into one entry, :data:`EARLIER`."""

EARLIER = "(earlier replicas)"
"""The ``departed_traffic`` entry summing departed replicas beyond :data:`DEPARTED_KEPT`."""


@serve.deployment(name="BucketCoordinator", num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0})
class BucketCoordinator:
    """The ownership coordinator of one application.

    Args:
        config: the ``ServeConfig`` mapping (its ``routing`` section sets window, lease and hot share).
        expected_replicas: DiT replicas the first assignment waits for (the deployment's replica count, or
            its autoscaling minimum).

    Raises:
        pydantic.ValidationError: bad config; ``FileNotFoundError``/``ValueError``: unreadable checkpoint.
    """

    async def __init__(self, config: dict, expected_replicas: int = 1):
        cfg = ServeConfig.model_validate(config)
        r = cfg.routing
        self.table = OwnershipTable(demands_for_config(cfg), expected=expected_replicas,
                                    join_window_s=r.join_window_s, lease_s=r.lease_s, hot_share=r.hot_share,
                                    capture_stall_s=r.capture_stall_s)
        self._changed = asyncio.Event()
        self._traffic: dict[str, dict] = {}
        """Replica id -> the traffic snapshot it last reported (heartbeat, or its final one on leaving), most
        recently reported last. Those of replicas no longer in the assignment (left, removed by autoscaling, dead,
        stalled in a capture, or with a lapsed lease) are ``departed_traffic`` of :meth:`snapshot`, so their
        requests stay in ``traffic`` of ``/v1/buckets`` (what ``bcg plan --from URL`` plans for). Kept in memory: a
        restarted coordinator forgets them."""
        self._reaper = asyncio.get_running_loop().create_task(self._expire_loop(r.lease_s))

    def _record(self, replica_id: str, traffic: dict | None) -> None:
        """Keep ``traffic``, a replica's snapshot, if it is valid (an invalid one is logged and the last kept)."""
        if traffic is None:
            return
        try:
            TrafficHistogram.from_snapshot(traffic)
        except ValueError:
            logger.exception("replica %s reported an invalid traffic snapshot; its last valid one is kept", replica_id)
            return
        self._traffic.pop(replica_id, None)
        self._traffic[replica_id] = traffic
        self._trim()

    def _departed(self) -> dict[str, dict]:
        """``_traffic`` of the replicas that are not members of the assignment."""
        return {r: t for r, t in self._traffic.items() if r not in self.table.members}

    def _trim(self) -> None:
        """Past :data:`DEPARTED_KEPT` departed entries, sum the least recently reported into one entry,
        ``(earlier replicas)``; one of those that comes back is then counted twice (its old share stays there)."""
        departed = self._departed()
        if len(departed) <= DEPARTED_KEPT:
            return
        old = list(departed)[: len(departed) - DEPARTED_KEPT + 1]
        merged = TrafficHistogram.merged(self._traffic.pop(r) for r in old).snapshot()
        self._traffic = {EARLIER: merged, **self._traffic}

    async def _expire_loop(self, lease_s: float) -> None:
        while True:
            await asyncio.sleep(max(0.1, lease_s / 4))
            try:
                gone = self.table.expire()
                self._trim()
                if gone:
                    logger.warning("replicas %s stopped heartbeating for %.1f s: their shapes moved to %d survivors "
                                   "(assignment v%d)", gone, lease_s, len(self.table.members), self.table.version)
                self._wake()
            except Exception:  # noqa: BLE001 - the reaper must survive a bad tick
                logger.exception("ownership expiry failed")

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def join(self, replica_id: str, budget_bytes: int, owned: list[str] | None = None,
                   ready: list[str] | None = None, timeout_s: float | None = None) -> list[str]:
        """Register a replica and return its owned shapes, waiting (up to the join window, or
        ``timeout_s``) for the first assignment.

        Returns:
            The owned shapes; every shape when the wait timed out with no assignment (the replica then
            serves as a single owner would).
        """
        self.table.join(replica_id, budget_bytes, tuple(owned or ()), tuple(ready or ()))
        self._wake()
        limit = self.table.join_window_s if timeout_s is None else timeout_s
        deadline = asyncio.get_running_loop().time() + limit
        while (owned_now := self.table.owned(replica_id)) is None:
            self.table.touch(replica_id)  # a replica waiting here is alive
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                self.table.expire()  # closes the window if it passed
                owned_now = self.table.owned(replica_id)
                if owned_now is None:
                    logger.warning("no ownership assignment for %s after %.0f s; it serves every shape",
                                   replica_id, limit)
                    return sorted(self.table.demands)
                break
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                self.table.touch(replica_id)
                self.table.expire()
        logger.info("replica %s owns %d shapes (assignment v%d)", replica_id, len(owned_now), self.table.version)
        return list(owned_now)

    def heartbeat(self, replica_id: str, budget_bytes: int, owned: list[str], ready: list[str],
                  queue: dict[str, int] | None = None, stats: dict | None = None) -> list[str] | None:
        """Renew a replica's lease; returns its owned shapes (None while the first assignment waits, or while
        the replica is stalled in a capture)."""
        before = self.table.version
        self._record(replica_id, (stats or {}).get("traffic"))
        owned_now = self.table.heartbeat(replica_id, budget_bytes, tuple(owned), tuple(ready), queue, stats)
        if self.table.version != before:
            if replica_id in self.table.stalled:
                logger.warning("replica %s has been capturing for %.0f s (routing.capture_stall_s %.0f): its shapes "
                               "moved to %d other replicas (assignment v%d)", replica_id,
                               (stats or {}).get("capturing_s") or 0.0, self.table.capture_stall_s or 0.0,
                               len(self.table.members), self.table.version)
            self._wake()
        return None if owned_now is None else list(owned_now)

    def leave(self, replica_id: str, traffic: dict | None = None) -> bool:
        """A replica shuts down gracefully; its shapes move to the survivors, and its traffic snapshot (``traffic``,
        its final one, else its last heartbeat's) is kept for ``/v1/buckets``."""
        self._record(replica_id, traffic)
        left = self.table.leave(replica_id)
        self._trim()
        if left:
            self._wake()
        return left

    def snapshot(self) -> dict:
        """The assignment and every replica's last report (:meth:`OwnershipTable.snapshot`), and
        ``departed_traffic``: ``{replica id: traffic snapshot}`` of replicas no longer in it (the ingress adds them
        to ``traffic``, but for its own answering replica's: a replica with a lapsed lease may still answer)."""
        return {**self.table.snapshot(), "departed_traffic": self._departed()}
