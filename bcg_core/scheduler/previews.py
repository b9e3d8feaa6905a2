"""The preview thread of a step scheduler: takes latent copies off the denoising thread and draws them.

The denoising thread calls :meth:`PreviewWorker.take` after a step that gets a preview: it copies the request's
latents (on CUDA an event marks the copy's end) and puts the copy on a bounded queue (:data:`PREVIEW_QUEUE`;
full: the preview is dropped and counted, never waited for). That is its whole share, timed per preview
(``handoff_ms_*`` in :meth:`PreviewWorker.describe`). The worker's thread, at nice :data:`PREVIEW_NICE` on
Linux and on its own CUDA stream, waits for the copy, calls the family's ``preview`` hook
(:mod:`bcg_core.preview`), resizes each image to the requested size, encodes it with the encoders' fast
settings in the request's ``output_format`` and hands it to the request's callback as a
:class:`~bcg_core.preview.PartialImage`; then it tells the scheduler the preview left the queue.

Pure threads and torch, no Ray. The requests it handles are the step scheduler's: objects with ``state``
(:class:`~bcg_core.families.RequestState`), ``validated``, ``shape``, ``cancel`` (a ``threading.Event``),
``on_preview`` (a callable taking a :class:`PartialImage`) and ``preview_at`` (steps with a preview).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import torch

from bcg_core.images import encode_image, resize_image
from bcg_core.preview import PartialImage

__all__ = ["PREVIEW_NICE", "PREVIEW_QUEUE", "PreviewWorker", "stream_events"]

log = logging.getLogger(__name__)

PREVIEW_NICE = 10
"""Niceness of the preview thread (Linux): below the denoising and decode threads for the CPU."""

PREVIEW_QUEUE = 16
"""Latent copies waiting for the preview thread at most; one more is dropped (counted), never waited for."""


@dataclasses.dataclass
class _Stats:
    taken: int = 0
    dropped: int = 0
    sent: int = 0
    failed: int = 0
    handoff_s: float = 0.0
    handoff_max_s: float = 0.0
    draw_s: float = 0.0


class PreviewWorker:
    """The preview thread and its queue (see the module docstring).

    Args:
        model: the family (its ``preview(state, latents)`` draws, :class:`~bcg_core.capabilities.Previews`).
        device: the model's device (a CUDA one gets its own stream and events).
        left: called on the preview thread with the request each time one of its previews left the queue
            (drawn, failed or skipped because the request was cancelled).
        available: the family has the :class:`~bcg_core.capabilities.Previews` capability.
        queue_size: :data:`PREVIEW_QUEUE`.
    """

    def __init__(self, model, device: torch.device, left: Callable[[object], None], available: bool,
                 queue_size: int = PREVIEW_QUEUE):
        self.model = model
        self.available = available
        """The model has the :class:`~bcg_core.capabilities.Previews` capability (answered where the pipeline is
        built: ``pipeline.capabilities.previews``); without it no request takes a preview."""
        self._device = device
        self._cuda = torch.device(device).type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._left = left
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._stats = _Stats()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="bcg-preview", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after the previews queued now."""
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._q.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)

    def take(self, item) -> bool:
        """On the denoising thread: queue a copy of ``item.state.latents`` for a preview of its current step.

        Returns:
            True when queued (``left(item)`` follows once it leaves the queue); False when the queue was full and
            the preview is dropped.
        """
        t0 = time.perf_counter()
        state = item.state
        latents = state.latents.detach().clone()
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        try:
            self._q.put_nowait((item, item.preview_at.index(state.step_index), state.step_index, latents, event))
            queued = True
        except queue.Full:
            queued = False
        spent = time.perf_counter() - t0
        with self._lock:
            s = self._stats
            s.taken += queued
            s.dropped += not queued
            s.handoff_s += spent
            s.handoff_max_s = max(s.handoff_max_s, spent)
        return queued

    def _loop(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # Linux schedules threads apart: best effort
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREVIEW_NICE)
        while True:
            job = self._q.get()
            if job is None:
                break
            item = job[0]
            try:
                if not item.cancel.is_set():
                    self._draw(*job)
            finally:
                self._left(item)

    def _draw(self, item, index: int, step: int, latents: torch.Tensor, event) -> None:
        """Draw, resize and encode one preview of ``item`` and hand each image to its callback."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                if self._cuda:
                    # wait on the host (the GIL released) until the latent copy is done, so that no CUDA call of this
                    # thread waits inside the driver for the denoising stream's queued steps
                    event.synchronize()
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(event)
                        images = self.model.preview(item.state, latents)
                else:
                    images = self.model.preview(item.state, latents)
            r = item.validated.request
            files = [encode_image(resize_image(im, r.width, r.height), r.output_format, r.output_compression,
                                  fast=True) for im in images]
        except Exception:  # noqa: BLE001 - a preview that fails is skipped; the request goes on
            log.exception("a preview of a request of shape %s failed", item.shape)
            with self._lock:
                self._stats.failed += 1
                self._stats.draw_s += time.perf_counter() - t0
            return
        for i, data in enumerate(files):
            item.on_preview(PartialImage(index, i, step, data))
        with self._lock:
            self._stats.sent += 1
            self._stats.draw_s += time.perf_counter() - t0

    def describe(self) -> dict:
        """``previews`` of the scheduler's stats: ``taken``, ``dropped`` (queue full), ``sent``, ``failed``, the
        denoising thread's hand-off milliseconds (``handoff_ms_total``, ``_max``, ``_mean``) and the preview
        thread's milliseconds per preview (``draw_ms_mean``)."""
        with self._lock:
            s = dataclasses.replace(self._stats)
        drawn = s.sent + s.failed
        return {"taken": s.taken, "dropped": s.dropped, "sent": s.sent, "failed": s.failed,
                "handoff_ms_total": round(s.handoff_s * 1e3, 3), "handoff_ms_max": round(s.handoff_max_s * 1e3, 3),
                "handoff_ms_mean": round(s.handoff_s * 1e3 / s.taken, 4) if s.taken else None,
                "draw_ms_mean": round(s.draw_s * 1e3 / drawn, 2) if drawn else None}


async def stream_events(submit: Callable[[Callable], Awaitable]) -> AsyncIterator:
    """A request's previews as they are drawn, then its result, as an async iterator.

    ``submit(on_preview)`` submits the request with the callback the preview thread calls for each
    :class:`~bcg_core.preview.PartialImage` and returns its awaitable result; the result comes after every preview
    queued before it (the scheduler holds it until they are drawn). Closing the iterator early (its caller went
    away) cancels the submission, so the request leaves at its next step boundary.
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    task = loop.create_task(submit(lambda p: loop.call_soon_threadsafe(events.put_nowait, p)))
    try:
        while True:
            getter = loop.create_task(events.get())
            try:
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    getter.cancel()
            if getter in done:
                yield getter.result()
                continue
            while not events.empty():
                yield events.get_nowait()
            yield task.result()
            return
    finally:
        if not task.done():
            task.cancel()  # the submission's handler sets the request's cancel event
