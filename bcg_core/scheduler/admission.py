"""Admission: which waiting requests the step scheduler starts at a step boundary.

Oldest first, while the rows in flight stay within ``max_rows`` and, on CUDA, their tensors within the measured
memory budget (a group's first request is admitted alone until its tensors are measured). Admission is FIFO
within a batch group (bucket shape and token grid): a request that does not fit holds back the later requests of
its group only, so an incompatible request at the head never blocks the others. A request that has waited longer
than ``fair_wait_s`` holds back every later request until it fits, so no request (and no rare shape) waits
without bound. A request larger than the whole budget is admitted alone, when nothing else is in flight.
Cancelled requests leave the queue here; one waiting past ``max_queue_wait_s`` expires (its caller gets 503).

:class:`InFlight` is what the scheduler tracks of one request from submission to answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import deque
from collections.abc import Callable

import torch

from bcg_core.families import RequestState
from bcg_core.keys import BucketKey, BucketShape
from bcg_core.preview import PartialImage, StepProgress
from bcg_core.request import GenerationResult, ValidatedRequest
from bcg_core.step_cache.state import RequestCache

__all__ = ["Admission", "Admitted", "InFlight", "tensor_bytes"]


@dataclasses.dataclass(eq=False)
class InFlight:
    """One submitted request and what the step scheduler tracks of it (times are ``time.perf_counter()``)."""

    validated: ValidatedRequest
    rows: int
    group: tuple
    shape: BucketShape | None
    cancel: threading.Event
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float
    admitted: float = 0.0
    started: float = 0.0
    denoised: float = 0.0
    decoded: float = 0.0
    state: RequestState | None = None
    first_key: BucketKey | None = None
    first_share: int = 0
    company: int = 1  # most requests that shared one step with it
    nbytes: int = 0
    done_event: object | None = None
    on_preview: Callable[[PartialImage], None] | None = None  # called from the preview thread
    on_step: Callable[[StepProgress], None] | None = None  # called on the denoising thread after each step
    preview_at: tuple[int, ...] = ()  # steps done after which a preview is taken
    previews_pending: int = 0  # queued for the preview thread, not drawn yet
    held: GenerationResult | None = None  # the result, waiting for the request's pending previews
    lease: object | None = None  # its LoRA adapters' slots (bcg_core.lora.slots.Lease), released once answered
    edit_encode_s: float | None = None  # an edit's seconds in VAE encodes on the edit-start stage (None: no edit)

    def answer(self, value: GenerationResult | BaseException) -> None:
        """Hand ``value`` to the caller's future, on the caller's event loop (thread-safe; nothing happens if the
        future is already done or the caller's loop has closed)."""
        def set_it():
            if self.future.done():
                return
            if isinstance(value, BaseException):
                self.future.set_exception(value)
            else:
                self.future.set_result(value)

        try:
            self.loop.call_soon_threadsafe(set_it)
        except RuntimeError:  # the caller's loop has closed
            pass


def tensor_bytes(state: RequestState) -> int:
    """Bytes of a request state's tensors held while it is in flight: latents, text rows, and the tensors of its
    ``extras`` (an inpainting edit's mask, image latents and noise: about 3x its latents), two levels down; a step
    cache's (:class:`~bcg_core.step_cache.RequestCache`) as it will hold them once computed, from the start."""
    total = state.latents.numel() * state.latents.element_size()
    for rows in (state.cond, state.uncond):
        if rows is None:
            continue
        for f in dataclasses.fields(rows):  # not astuple: it would deep-copy the tensors
            t = getattr(rows, f.name)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()

    def extra(obj, depth: int = 0) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if depth < 2 and isinstance(obj, (tuple, list)):
            return sum(extra(o, depth + 1) for o in obj)
        if isinstance(obj, RequestCache):
            return obj.budget_bytes
        return 0  # a LoRA lease, a guidance float ...: nothing held per request here
    return total + sum(extra(v) for v in state.extras.values())


@dataclasses.dataclass
class Admitted:
    """What one admission pass decided (:meth:`Admission.admit`).

    Attributes:
        start: requests to start now, in order.
        cancelled: requests whose caller cancelled while they waited (they leave the queue).
        expired: requests that waited past ``max_queue_wait_s`` (their callers get 503).
        rows: rows in flight once ``start`` is counted.
    """

    start: list[InFlight]
    cancelled: list[InFlight]
    expired: list[InFlight]
    rows: int


class Admission:
    """The waiting queue and the admission policy (module docstring). Not thread-safe: the step scheduler calls
    it with its lock held.

    Args:
        max_rows: most transformer rows in flight.
        memory_budget_bytes: most bytes of request tensors in flight (None: unbounded).
        fair_wait_s: a request waiting longer than this holds back every later request.
        max_queue_wait_s: a request not admitted within this many seconds expires; None: no deadline.
    """

    def __init__(self, max_rows: int, memory_budget_bytes: int | None, fair_wait_s: float,
                 max_queue_wait_s: float | None):
        self.max_rows = int(max_rows)
        self.memory_budget_bytes = memory_budget_bytes
        self.fair_wait_s = float(fair_wait_s)
        self.max_queue_wait_s = None if max_queue_wait_s is None else float(max_queue_wait_s)
        self.waiting: deque[InFlight] = deque()
        self._bytes_per_unit: dict[tuple, float] = {}  # bytes per row of a bucket group, per row-token of a miss
        self._unmeasured: set[tuple] = set()  # keys with a request admitted before their bytes are known

    def admit(self, rows: int, nbytes: int, now: float) -> Admitted:
        """Pop the waiting requests to start now, given ``rows`` and ``nbytes`` in flight at time ``now``."""
        out = Admitted([], [], [], rows)
        held: set[tuple] = set()
        for item in list(self.waiting):
            if item.cancel.is_set():
                self.waiting.remove(item)
                out.cancelled.append(item)
                continue
            if self.max_queue_wait_s is not None and now - item.submitted > self.max_queue_wait_s:
                self.waiting.remove(item)
                out.expired.append(item)
                continue
            if item.group in held:
                continue
            key = _basis(item)[0]
            known = key in self._bytes_per_unit
            if self.memory_budget_bytes is not None and not known and key in self._unmeasured:
                held.add(item.group)  # one request of a new group first: its tensors give the estimate
                continue
            estimate = self.estimate(item)
            alone = out.rows == 0 and nbytes == 0 and not out.start  # nothing in flight, nothing being decoded
            fits = out.rows + item.rows <= self.max_rows and (
                self.memory_budget_bytes is None or nbytes + estimate <= self.memory_budget_bytes)
            if fits or alone:
                self.waiting.remove(item)
                if not known:
                    self._unmeasured.add(key)
                out.start.append(item)
                out.rows += item.rows
                nbytes += estimate
                continue
            held.add(item.group)
            if now - item.submitted > self.fair_wait_s:
                break  # it has waited past the bound: nothing later jumps ahead of it
        return out

    def estimate(self, item: InFlight) -> int:
        """Bytes ``item``'s tensors are expected to take once started: its group's bytes per row times its rows,
        for a miss the most bytes per row-token of any miss times its rows x tokens per row (0 until measured). An edit
        holds this much of the budget while it starts off the loop."""
        key, units = _basis(item)
        return int(self._bytes_per_unit.get(key, 0.0) * units)

    def measured(self, item: InFlight) -> None:
        """``item`` started: its tensors (``item.nbytes``) give its group's bytes per row. A miss's give bytes per
        row-token under one key for every miss (each miss is a group of its own; one key per miss kept every miss's
        estimate forever and never used one), the most seen: text is stored per prompt and latents per image, so
        bytes per row-token vary about 3x between misses (an n=1 miss most, n=4 with guidance least, on the tiny
        model), and the largest never underestimates a miss like one seen before; a burst of n=1 misses after
        only n=4 misses with guidance can pass the budget, up to 2.7x on the tiny model."""
        key, units = _basis(item)
        per_unit = item.nbytes / max(1, units)
        if key == MISS_KEY:
            per_unit = max(per_unit, self._bytes_per_unit.get(key, 0.0))
        self._bytes_per_unit[key] = per_unit
        self._unmeasured.discard(key)

    def failed(self, item: InFlight) -> None:
        """``item``'s start failed: its group's next request may go first again."""
        self._unmeasured.discard(_basis(item)[0])


MISS_KEY = ("miss",)
"""The one key under which :class:`Admission` remembers what a miss's tensors take, per row-token."""


def _basis(item: InFlight) -> tuple[tuple, int]:
    """The key ``item``'s bytes are remembered under, and its size in that key's unit: its group and rows for a
    bucket shape; :data:`MISS_KEY` and rows x tokens per row (image and text) for a miss, whose group
    (``("miss", n)``, :meth:`~bcg_core.scheduler.step_scheduler.StepScheduler.submit`) is its own."""
    if item.group[:1] != MISS_KEY:
        return item.group, item.rows
    return MISS_KEY, item.rows * max(1, item.validated.lookup.query.tokens_per_row)
