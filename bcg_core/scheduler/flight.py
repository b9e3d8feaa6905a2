"""The requests one step scheduler holds, from submission to answer, under one lock.

A request is *waiting* (in :class:`~bcg_core.scheduler.admission.Admission`), *starting* (admitted, its rows counted),
*encoding* (an edit starting on the edit-start thread, :mod:`bcg_core.scheduler.edit_start`: its image read,
VAE-encoded), *encoded* (started there, to be adopted by the denoising loop at its next step boundary), *running* (in
its group: one bucket shape and token grid), *finishing* (denoised, being decoded and its images encoded) and *live*
until its caller has its answer. :class:`Flight` keeps those sets, the rows and tensor bytes in flight and the
per-shape counters, and is the one place a request leaves flight and is answered: the denoising loop, the decode
thread, the preview thread and the asyncio front all go through it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from bcg_core.errors import RequestCancelled
from bcg_core.request import GenerationResult
from bcg_core.scheduler.admission import Admission, InFlight
from bcg_core.scheduler.load import LoadMeter
from bcg_core.scheduler.stats import SchedulerStats, queue_lengths
from bcg_core.step_cache.step import request_cache

__all__ = ["Flight"]


class Flight:
    """The requests in flight and what they hold (module docstring).

    Args:
        admission: the waiting queue and the admission policy.
        meter: the load meter (running requests and completions per shape) autoscaling reads.
        on_idle: called once no request is live (the idle trim).

    Attributes:
        cv: the lock (a condition: the denoising loop waits on it for work).
        starting, encoding, encoded, running, finishing, live: the requests in each state (module docstring).
        rows, bytes: transformer rows and request tensor bytes in flight.
        stats: the per-shape counters.
        closed: the scheduler is shutting down.
    """

    def __init__(self, admission: Admission, meter: LoadMeter, on_idle: Callable[[], None] | None = None):
        self.cv = threading.Condition()
        self.admission = admission
        self.meter = meter
        self.starting: deque[InFlight] = deque()  # admitted (rows counted), not started yet
        self.encoding: set[InFlight] = set()  # edits starting on the edit-start thread
        self.encoded: deque[InFlight] = deque()  # edits started there, not running yet
        self.running: dict[tuple, list[InFlight]] = {}
        self.finishing: set[InFlight] = set()  # denoised, being decoded and encoded
        self.live: set[InFlight] = set()  # every request submitted and not answered yet
        self.rows = 0
        self.bytes = 0
        self.stats = SchedulerStats()
        self.closed = False
        self._on_idle = on_idle

    def in_flight(self) -> list[InFlight]:
        """Starting (on either thread) and running requests (call with the lock held)."""
        return [*self.starting, *self.encoding, *self.encoded, *(i for g in self.running.values() for i in g)]

    def resolve(self, item: InFlight, value: GenerationResult | BaseException) -> None:
        """``item`` is answered: it leaves flight (its LoRA lease released) and its caller gets ``value``."""
        with self.cv:
            self.live.discard(item)
            self.finishing.discard(item)
            self.encoding.discard(item)
            idle = not self.live
        if item.lease is not None:  # answered: no forward of it runs any more, its adapters' slots may go
            item.lease.release()
        if idle and self._on_idle is not None:
            self._on_idle()
        item.answer(value)

    def idle(self) -> bool:
        """No request submitted and not answered yet, and not closed (the idle trimmer's test)."""
        with self.cv:
            return not self.live and not self.closed

    def leave_running(self, item: InFlight) -> None:
        """Take ``item`` out of its running group and free its rows; call with the lock held."""
        group = self.running.get(item.group)
        if group is not None and item in group:
            group.remove(item)
            if not group:
                del self.running[item.group]
        self.rows -= item.rows

    def retire(self, item: InFlight, error: BaseException | None, cancelled: bool = False,
               failed: bool = False) -> None:
        """Take a started ``item`` out of flight (its rows and bytes freed, its step cache dropped); with ``error``,
        answer it."""
        cache = None if item.state is None else request_cache(item.state)
        if cache is not None:
            cache.free()
        with self.cv:
            self.leave_running(item)
            self.bytes -= item.nbytes
            item.nbytes = 0
            st = self.stats.shape(item.shape)
            st.cancelled += cancelled
            st.failed += failed
            self.cv.notify_all()
        self.meter.finish(item, 0)
        if error is not None:
            self.resolve(item, error)

    def release_bytes(self, item: InFlight) -> None:
        """``item``'s latents are decoded or dropped: its tensor bytes leave the budget."""
        with self.cv:
            self.bytes -= item.nbytes
            item.nbytes = 0
            self.cv.notify_all()

    def retire_done(self, item: InFlight, error: BaseException, cancelled: bool = False, failed: bool = False):
        """A request that finished denoising but will not be answered with images."""
        with self.cv:
            st = self.stats.shape(item.shape)
            st.cancelled += cancelled
            st.failed += failed
        self.meter.finish(item, 0)
        self.resolve(item, error)

    def answer(self, item: InFlight, result: GenerationResult) -> None:
        """A finished request's result: counted, held for its pending previews or handed to its caller; once the
        scheduler is closing, :class:`RequestCancelled` instead (close answers every request not answered yet
        that way, whichever thread finishes it)."""
        if self.closed:
            self.retire_done(item, RequestCancelled("the replica is shutting down"), cancelled=True)
            return
        with self.cv:
            self.stats.shape(item.shape).completed += 1
            held = item.previews_pending > 0
            if held:  # its previews are still being drawn: the last one resolves it, so they all come first
                item.held = result
        self.meter.finish(item, 1)
        if not held:
            self.resolve(item, result)

    def preview_left(self, item: InFlight) -> None:
        """One preview of ``item`` left the preview queue; the last one releases a result held for it."""
        with self.cv:
            item.previews_pending -= 1
            held = item.held if item.previews_pending == 0 else None
            item.held = None if held is not None else item.held
        if held is not None:
            self.resolve(item, held)

    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting, starting, running, decoding or encoding per bucket shape (misses left out)."""
        with self.cv:
            return queue_lengths([*self.admission.waiting, *self.in_flight(), *self.finishing])
