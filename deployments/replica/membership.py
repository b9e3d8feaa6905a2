"""A DiT replica's membership in the bucket-ownership assignment: join, heartbeats, leave.

With a coordinator (:class:`~deployments.coordinator.BucketCoordinator`) the replica joins with its graph budget
and is assigned the shapes it owns; heartbeats renew its lease every ``routing.stats_period_s`` from the moment it
joined (so a long capture never lets the lease expire), report what it serves, and bring the shapes the
coordinator newly assigns (a peer left), which the replica then captures in the background. Without a coordinator
it owns every shape of its table and sends nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

__all__ = ["Membership"]

logger = logging.getLogger("ray.serve")


class Membership:
    """Owns the shapes this replica owns (``owned``) and its heartbeat task.

    Runs on the replica's event loop: :meth:`join` is awaited once, at start; :meth:`start_heartbeats` starts the
    heartbeat task there; :meth:`leave` may run from ``__del__`` (it only cancels and sends, fire and forget).

    Errors: :meth:`join` raises what the coordinator's ``join`` raises (the replica does not start); a failed
    heartbeat is logged and the next one comes a period later, the owned shapes kept; a failed leave is ignored
    (the coordinator drops the replica when its lease expires).

    Args:
        coordinator: the coordinator's handle, or None to own every shape.
        replica_id: this replica's id, as the coordinator knows it.
        budget_bytes: the graph memory this replica may use, sent with the join and every heartbeat.
    """

    def __init__(self, coordinator, replica_id: str, budget_bytes: int):
        self._coord = coordinator
        self._id = replica_id
        self._budget = budget_bytes
        self.owned: set[str] = set()
        self._task: asyncio.Task | None = None

    async def join(self, shapes: list[str]) -> set[str]:
        """Join the assignment; returns (and keeps in ``owned``) the shapes this replica owns: all of ``shapes``
        without a coordinator."""
        owned = shapes if self._coord is None else await self._coord.join.remote(self._id, self._budget)
        self.owned = set(owned)
        return self.owned

    def start_heartbeats(self, period_s: float, view: Callable[[], dict], stats: Callable[[], dict],
                         gained: Callable[[list[str]], None]) -> None:
        """Heartbeat the coordinator every ``period_s`` (nothing without a coordinator): each sends ``view()`` (the
        routing view: ``owned``, ``ready``, ``queue``) and ``stats()`` (what the replica served, its capture, faults,
        traffic), and calls ``gained`` with the shapes the coordinator newly assigned, sorted."""
        if self._coord is not None:
            self._task = asyncio.get_running_loop().create_task(self._heartbeat_loop(period_s, view, stats, gained))

    async def _heartbeat_loop(self, period_s: float, view, stats, gained) -> None:
        while True:
            await asyncio.sleep(period_s)
            v = view()
            try:
                owned = await self._coord.heartbeat.remote(
                    self._id, self._budget, v["owned"], v["ready"], v["queue"], stats())
            except Exception:
                logger.exception("ownership heartbeat failed; keeping %d owned shapes", len(self.owned))
                continue
            if owned is not None:
                new = set(owned) - self.owned
                self.owned = set(owned)
                if new:
                    logger.info("replica %s gained shapes %s; capturing them in the background", self._id, sorted(new))
                    gained(sorted(new))

    def stop_heartbeats(self) -> None:
        """Cancel the heartbeat task, if any."""
        if self._task is not None:
            self._task.cancel()

    def leave(self, traffic: dict | None) -> None:
        """Tell the coordinator this replica leaves (fire and forget), with its recorded ``traffic`` snapshot, so the
        survivors take its shapes at once."""
        if self._coord is None:
            return
        try:
            self._coord.leave.remote(self._id, traffic)
        except Exception:  # noqa: BLE001 - the lease expiry covers a failed leave
            pass
