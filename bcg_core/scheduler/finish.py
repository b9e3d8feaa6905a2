"""Finishing a request: the decode thread and the image-encoding pool, ending in the one place a result is built.

Off the denoising thread's path, a :class:`Finisher` takes requests whose last step is queued, batches those of
one image size (up to ``decode_batch_images`` images) into one family decode call on its own CUDA stream
(waiting on an event recorded after each request's last step), so decoding overlaps the next denoising steps;
a thread pool encodes each decoded image (PNG, JPEG or WebP, the request's ``output_format``). The step
scheduler's requests and the synchronous :meth:`~bcg_core.pipeline.DiTPipeline.generate` both end in
:func:`~bcg_core.results.build_result`, so a result means the same on either path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from bcg_core.errors import RequestCancelled, non_finite_error
from bcg_core.families import RequestState
from bcg_core.images import encode_image
from bcg_core.results import build_result
from bcg_core.scheduler.admission import InFlight

__all__ = ["Finisher"]

log = logging.getLogger(__name__)


class Finisher:
    """The decode thread and the image-encoding pool of one step scheduler (module docstring).

    Args:
        pipeline: the replica's pipeline (its family decodes; its metrics record each result).
        decode_batch_images: most images of one decode call.
        encode_threads: image encoder threads.
        release: frees a request's tensor bytes once its latents are decoded or dropped.
        fail: answers a request with an error, ``fail(item, error, cancelled=False, failed=False)``.
        done: hands a finished request's result over, ``done(item, result)``.
    """

    def __init__(self, pipeline, decode_batch_images: int, encode_threads: int, release: Callable,
                 fail: Callable, done: Callable):
        self._pipeline = pipeline
        self.decode_batch_images = int(decode_batch_images)
        self._release, self._fail, self._done = release, fail, done
        self._queue: queue.Queue = queue.Queue()
        self._pool = ThreadPoolExecutor(max_workers=int(encode_threads), thread_name_prefix="bcg-encode")
        device = pipeline.model.device
        self._cuda = torch.device(device).type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the decode thread."""
        self._thread = threading.Thread(target=self._run, name="bcg-decode", daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        """``item``'s last step is queued (on CUDA ``item.done_event`` marks its end): decode and encode it."""
        self._queue.put(item)

    def close(self, timeout_s: float) -> None:
        """Stop the decode thread after what is queued now and drop what the pool has not started."""
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _decode_key(item: InFlight) -> tuple:
        s = item.state
        r = s.request
        return (tuple(s.latents.shape[1:]), s.latents.dtype, r.width, r.height, s.extras.get("size"))

    @staticmethod
    def _images(item: InFlight) -> int:
        """Images ``item``'s decode makes, as ``decode_batch_images`` counts them: its ``n`` images, or every frame of
        its ``n`` videos (``num_frames`` each), so that a video's decode (81 frames by default) is never merged with
        another request's."""
        return item.state.n * (item.validated.request.num_frames or 1)

    def _run(self) -> None:
        pending: deque[InFlight] = deque()
        while True:
            item = pending.popleft() if pending else self._queue.get()
            if item is None:
                break
            batch = [item]
            key, images = self._decode_key(item), self._images(item)
            while True:  # take every finished request queued now; same size joins this decode
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    pending.append(None)  # stop after this batch
                    break
                if self._decode_key(nxt) == key and images + self._images(nxt) <= self.decode_batch_images:
                    batch.append(nxt)
                    images += self._images(nxt)
                else:
                    pending.append(nxt)
            self._decode(batch)

    def _decode(self, batch: list[InFlight]) -> None:
        live = []
        for item in batch:
            if item.cancel.is_set():
                self._release(item)
                self._fail(item, RequestCancelled("the request was cancelled by its caller"), cancelled=True)
            else:
                live.append(item)
        if not live:
            return
        try:
            with torch.inference_mode(), torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext():
                for item in live:
                    if self._cuda:
                        self._stream.wait_event(item.done_event)
                finite = torch.stack([i.state.latents.isfinite().all() for i in live])  # no sync yet
                images = self._decode_many([i.state for i in live])
                finite = finite.tolist()  # the decode has synchronised the stream already
        except Exception as e:
            log.exception("decoding %d requests failed", len(live))
            for item in live:
                self._release(item)
                self._fail(item, e, failed=True)
            return
        now = time.perf_counter()
        for item, imgs, ok in zip(live, images, finite, strict=True):
            item.decoded = now
            if ok:
                self._release(item)
                if self._pipeline.model.spec.video:  # a video's frames are its result: nothing to encode here
                    self._finish(item, [], now, videos=imgs)
                else:
                    self._encode(item, imgs)
            else:  # its images are dropped; the VAE decodes each image alone, so its company's are unaffected
                self._non_finite(item)

    def _non_finite(self, item: InFlight) -> None:
        """Fail ``item``, whose latents hold NaN or inf (:func:`~bcg_core.errors.non_finite_error`: HTTP 500,
        counted as failed in its shape's stats), and log it."""
        error = non_finite_error(item.state.latents)
        log.error("a request of %d images (%dx%d) failed: %s", item.state.n, item.validated.request.width,
                  item.validated.request.height, error)
        self._release(item)
        self._fail(item, error, failed=True)

    def _decode_many(self, states: list[RequestState]) -> list[list]:
        """Decode requests of one image size in one family decode call; the images of each, in order.

        The states are merged into one (their latents concatenated along rows; a family's decode reads only
        the latents, the requested size and ``extras["size"]``), decoded, and split back by image counts.
        """
        if len(states) == 1:
            return [self._pipeline.model.decode(states[0])]
        merged = dataclasses.replace(states[0], latents=torch.cat([s.latents for s in states]))
        images = self._pipeline.model.decode(merged)
        if len(images) != merged.n:  # a family decode that reads more than the latents: fail, never hang
            raise ValueError(f"the family's decode of {merged.n} merged images gave {len(images)}")
        out, a = [], 0
        for s in states:
            out.append(images[a : a + s.n])
            a += s.n
        return out

    def _encode(self, item: InFlight, images: list) -> None:
        """Encode ``images`` in the pool (the request's ``output_format``, :func:`~bcg_core.images.encode_image`);
        the last one done resolves the caller's future."""
        files: list[bytes | None] = [None] * len(images)
        fmt, compression = item.validated.request.output_format, item.validated.request.output_compression
        remaining = [len(images)]
        lock = threading.Lock()
        t0 = time.perf_counter()

        def one(i: int, image) -> None:
            try:
                files[i] = encode_image(image, fmt, compression)
            except Exception as e:  # noqa: BLE001
                files[i] = e  # type: ignore[assignment]
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._finish(item, files, t0)

        for i, image in enumerate(images):
            self._pool.submit(one, i, image)

    def _finish(self, item: InFlight, files: list, encode_t0: float, videos: list | None = None) -> None:
        """The last image of ``item`` is encoded (or, for a video model, its ``videos`` decoded): build its result
        (:func:`~bcg_core.results.build_result`) and hand it over."""
        failed = next((p for p in files if isinstance(p, BaseException)), None)
        if failed is not None:
            self._fail(item, failed, failed=True)
            return
        if item.cancel.is_set():  # its caller left while the images were decoded or encoded
            self._fail(item, RequestCancelled("the request was cancelled by its caller"), cancelled=True)
            return
        t_end = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1e3, 2)  # noqa: E731
        self._done(item, build_result(item.validated, files, item.first_key, item.first_share, item.company,
                                      self._pipeline.metrics, {
            "queue": ms(item.submitted, item.admitted), "encode": ms(item.admitted, item.started),
            "denoise": ms(item.started, item.denoised), "decode": ms(item.denoised, item.decoded),
            "image_encode": ms(encode_t0, t_end), "total": ms(item.submitted, t_end),
            **({"lora_load": round(item.lease.waited_s * 1e3, 2)} if item.lease is not None else {}),
            **({"edit_encode": round(item.edit_encode_s * 1e3, 2)} if item.edit_encode_s is not None else {})},
            state=item.state, videos=videos))
