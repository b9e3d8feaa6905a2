"""A DiT replica's model and its captures: the pipeline, its step scheduler, and which bucket shapes are ready.

:class:`ReplicaModel` loads the model, builds the :class:`~bcg_core.pipeline.DiTPipeline` and its
:class:`~bcg_core.scheduler.step_scheduler.StepScheduler`, and prepares (captures on CUDA) the batch buckets of the
shapes it is given, largest shape first, timing each shape's buckets for the scheduler's cost model. Which shapes
to prepare is decided elsewhere (:mod:`deployments.replica.membership`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from bcg_core import failpoints
from bcg_core.keys import BucketKey
from bcg_core.models import load_model
from bcg_core.pipeline import DiTPipeline
from bcg_core.scheduler.step_scheduler import StepScheduler

from ..settings import ServeConfig

__all__ = ["NO_BUDGET", "ReplicaModel"]

logger = logging.getLogger("ray.serve")

NO_BUDGET = 1 << 62
"""Graph budget reported to the coordinator when neither the config nor a GPU bounds it (CPU replicas)."""


class ReplicaModel:
    """Owns one replica's pipeline, step scheduler and capture state: the table's buckets by shape (``by_shape``),
    the shapes whose buckets are prepared (``ready``), the capture running now.

    Threads: :meth:`load`, :meth:`capture_in_background` and :attr:`capturing` run on the replica's event loop;
    :meth:`prepare` runs in a worker thread, one capture at a time: it holds ``capture_lock`` throughout (a caller
    holding the lock holds back the next capture). ``capture_task`` is the latest background capture (None when
    none was started); each waits for the one before it.

    Errors: a shape the table does not have is logged and skipped; a failed cost measurement is logged and leaves
    the shape on the token-count stand-in; anything else a capture raises propagates (at start, out of the
    replica's constructor; in the background, into ``capture_task``).

    Attributes:
        config: the replica's serving config.
        pipeline: the :class:`~bcg_core.pipeline.DiTPipeline`.
        scheduler: its :class:`~bcg_core.scheduler.step_scheduler.StepScheduler`.
        graph_budget_bytes: the graph memory this replica may use (``runner.graph_memory_budget_mib``, else 90% of
            the GPU memory free once the model was loaded, else :data:`NO_BUDGET`); the coordinator assigns shapes by
            it.
    """

    def __init__(self, config: ServeConfig, pipeline: DiTPipeline, replica_id: str):
        self.config = config
        self.pipeline = pipeline
        self._id = replica_id
        self.by_shape: dict[str, list[BucketKey]] = {}
        for k in pipeline.table.keys:
            self.by_shape.setdefault(k.shape, []).append(k)
        self.graph_budget_bytes = self._graph_budget()
        self.ready: set[str] = set()
        self.capture_lock = threading.Lock()
        self.capture_task: asyncio.Task | None = None
        self._capturing_since: float | None = None  # time.monotonic() when the running capture began
        self.costs_s = 0.0
        """Seconds spent timing the cost model's forwards (:meth:`_measure_costs`) since the replica started."""
        self.unmeasured: list[str] = []
        """Shapes prepared before ready whose costs are timed after it (``runner.ready_after_s``: the token-count
        stand-in prices them meanwhile), by the background capture (:meth:`capture_in_background`)."""
        self.scheduler = StepScheduler.from_pipeline(
            pipeline, load_window_s=config.autoscaling.look_back_period_s,
            retry_after_s=config.routing.retry_after_s)

    @classmethod
    async def load(cls, config: ServeConfig, replica_id: str) -> ReplicaModel:
        """Load ``config.model`` (in a worker thread) and build the pipeline, nothing prepared yet.

        Raises:
            ValueError: a bad bucket table; whatever :func:`~bcg_core.models.load_model` raises on a bad checkpoint.
        """
        model = await asyncio.to_thread(load_model, config.model)
        return cls(config, DiTPipeline(config, model, prepare=False), replica_id)

    @property
    def shapes(self) -> list[str]:
        """Every bucket shape of the table, sorted."""
        return sorted(self.by_shape)

    @property
    def capturing(self) -> bool:
        """Whether a background capture is running or waiting to."""
        return self.capture_task is not None and not self.capture_task.done()

    def capturing_s(self) -> float | None:
        """Seconds the running capture has taken (3 decimals), None when none runs."""
        since = self._capturing_since
        return None if since is None else round(time.monotonic() - since, 3)

    def _graph_budget(self) -> int:
        mib = self.config.runner.graph_memory_budget_mib
        if mib is not None:
            return int(mib * 2**20)
        if self.pipeline.model.device.type == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(self.pipeline.model.device)
            return int(0.9 * free)
        return NO_BUDGET

    def prepare(self, shapes: list[str], initial: bool = False, ready_after_s: float | None = None) -> list[str]:
        """Prepare (capture on CUDA) every batch bucket of ``shapes``, largest shape first; each shape is
        ready as soon as its buckets are. Runs in a worker thread. ``initial``: the capture at start (where the
        ``capture_stall`` failpoint of :mod:`bcg_core.failpoints` can fire). ``ready_after_s``: stop once this many
        seconds have passed and at least one shape is ready (None: prepare every shape); with it, the shapes
        prepared are not timed for the cost model now but after ready (:attr:`unmeasured`, timed by
        :meth:`capture_in_background` before it prepares the rest): their forwards are most of a start's cost
        measurement, which a request waiting for ready need not wait for.

        Returns:
            The shapes left unprepared (empty unless ``ready_after_s`` passed), largest first. Background compiles
            start only once none is left and every shape is timed (a capture, a timing and a compile would share the
            CPUs and the GPU)."""
        left: list[str] = []
        with self.capture_lock:
            self._capturing_since = started = time.monotonic()
            try:
                if initial:
                    failpoints.capture_stall()
                order = sorted(shapes,
                               key=lambda s: -max(k.tokens for k in self.by_shape.get(s, [BucketKey(0, 0, 0)])))
                for i, s in enumerate(order, 1):
                    keys = self.by_shape.get(s)
                    if not keys:
                        logger.warning("replica %s was assigned unknown shape %r; ignored", self._id, s)
                        continue
                    if ready_after_s is not None and self.ready and time.monotonic() - started >= ready_after_s:
                        left = order[i - 1:]
                        break
                    t0 = time.perf_counter()
                    self.pipeline.prepare(keys, defer_compiles=self.config.runner.compile_in_background)
                    if ready_after_s is None:
                        self._measure_costs(s, keys)
                    else:
                        self.unmeasured.append(s)
                    self.ready.add(s)
                    logger.info("replica %s: shape %s ready (%d buckets, %.1f s), %d of %d shapes", self._id, s,
                                len(keys), time.perf_counter() - t0, i, len(order))
                self.scheduler.measure_memory_budget()  # after capture and cost measurement
                if not left and not self.unmeasured:
                    # buckets on eager kernels for want of a cached compile: compiled, checked and swapped in now
                    self.scheduler.compile_in_background()
            finally:
                self._capturing_since = None
        return left

    def _measure_costs(self, shape: str, keys: list[BucketKey]) -> None:
        """Time ``shape``'s prepared buckets and its eager forwards for the step scheduler's cost model; a
        failed measurement leaves the shape on the token-count stand-in (logged). ``scheduler.measure_costs`` says
        whether to measure (:meth:`~bcg_core.scheduler.StepScheduler.measure_costs`)."""
        t0 = time.perf_counter()
        try:
            self.scheduler.measure_costs(keys)
        except Exception:
            logger.exception("replica %s: measuring the costs of shape %s failed", self._id, shape)
        finally:
            self.costs_s += time.perf_counter() - t0

    def measure_deferred(self) -> None:
        """Time the shapes prepared before ready (:attr:`unmeasured`) for the cost model, in a worker thread."""
        with self.capture_lock:
            while self.unmeasured:
                s = self.unmeasured.pop(0)
                self._measure_costs(s, self.by_shape[s])

    def capture_in_background(self, shapes: list[str]) -> None:
        """Time the shapes prepared before ready (:meth:`measure_deferred`), then prepare ``shapes``, in a worker
        thread, after the capture started before (``capture_task``). Call on the replica's event loop."""
        previous = self.capture_task

        async def run() -> None:
            if previous is not None:
                await asyncio.shield(previous)
            await asyncio.to_thread(self.measure_deferred)
            await asyncio.to_thread(self.prepare, shapes)

        self.capture_task = asyncio.get_running_loop().create_task(run())

    def device_memory(self) -> dict | None:
        """``{"allocated_bytes", "reserved_bytes"}`` of the model's CUDA device (torch's caching allocator: tensors
        alive, and what the allocator holds, graph pools included); None on a CPU."""
        device = self.pipeline.model.device
        if device.type != "cuda":
            return None
        import torch

        return {"allocated_bytes": torch.cuda.memory_allocated(device),
                "reserved_bytes": torch.cuda.memory_reserved(device)}

    def close(self) -> None:
        """Close the step scheduler: its threads stop; a request still in flight gets ``RequestCancelled``."""
        self.scheduler.close(timeout_s=5.0)
