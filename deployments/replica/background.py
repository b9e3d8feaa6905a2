"""A DiT replica's background tasks besides capture and heartbeats: the Prometheus push and the plan-drift check.

Both run as asyncio tasks on the replica's event loop and only observe: neither changes what or how the replica
serves.
"""

from __future__ import annotations

import asyncio
import logging

from bcg_core.planning.traffic import TrafficHistogram

from ..metrics import BucketExporter
from ..settings import ServeConfig

__all__ = ["DriftWatch", "MetricsPush"]

logger = logging.getLogger("ray.serve")


class DriftWatch:
    """Scores the recorded traffic against the bucket plan (``buckets.plan``, written by ``bcg plan``); owns the
    latest report (``report``, None before the first) and its task.

    Every ``traffic.drift_check_s``, once ``traffic.drift_min_requests`` are recorded, it scores the traffic on this
    table (:func:`bcg_core.planning.drift.drift_report`, in a worker thread). A drift logs one warning (again only
    after the traffic was back within the plan); the table is never changed. :meth:`start` starts it on the running
    event loop, only where there is a plan and a traffic histogram. Errors: a failing check is logged and retried at
    the next period.
    """

    def __init__(self, config: ServeConfig, traffic: TrafficHistogram | None, table_size: int, replica_id: str):
        self._config = config
        self._traffic = traffic
        self._table_size = table_size
        self._id = replica_id
        self.report: dict | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the check on the running event loop (nothing without a plan or with ``traffic.record`` off)."""
        if self._traffic is not None and self._config.buckets.plan is not None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        from bcg_core.planning.drift import drift_report

        cfg = self._config.traffic
        warned = False
        while True:
            await asyncio.sleep(cfg.drift_check_s)
            if self._traffic.total < cfg.drift_min_requests:
                continue
            try:
                report = await asyncio.to_thread(drift_report, self._config, self._traffic.snapshot(),
                                                 self._table_size)
            except Exception:
                logger.exception("replica %s: the drift check failed", self._id)
                continue
            self.report = report
            if report["drifted"] and not warned:
                logger.warning("replica %s: traffic drifted from the bucket plan: %s", self._id, report["note"])
            warned = report["drifted"]

    def stop(self) -> None:
        """Cancel the check, if it runs."""
        if self._task is not None:
            self._task.cancel()


class MetricsPush:
    """Pushes the replica's bucket counters, step latencies, queue lengths, traffic and plan drift into Ray's metrics
    every second (:class:`~deployments.metrics.BucketExporter`, exported to Prometheus by Ray's metrics agent); owns
    the exporter and its task.

    :meth:`start` runs on the replica's event loop. Errors: a replica whose exporter cannot be made serves without
    it (logged; :meth:`status` is None).
    """

    def __init__(self, exporter: BucketExporter | None, task: asyncio.Task | None):
        self._exporter = exporter
        self._task = task

    @classmethod
    def start(cls, pipeline, scheduler, traffic: TrafficHistogram | None, drift: DriftWatch,
              replica_id: str) -> MetricsPush:
        """Make the exporter and start its task on the running event loop."""
        try:
            exporter = BucketExporter.for_replica(pipeline, scheduler, traffic=traffic, drift=lambda: drift.report)
        except Exception:
            logger.exception("replica %s: Prometheus metrics export is off", replica_id)
            return cls(None, None)
        return cls(exporter, asyncio.get_running_loop().create_task(exporter.run()))

    def status(self) -> dict | None:
        """The exporter's pushes and errors (:meth:`BucketExporter.status`); None when the export is off."""
        return self._exporter.status() if self._exporter is not None else None

    def stop(self) -> None:
        """Cancel the push task, if it runs."""
        if self._task is not None:
            self._task.cancel()
