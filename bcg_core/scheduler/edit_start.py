"""The edit-start stage: an edit request's start (its image read, resized and VAE-encoded) off the denoising thread,
the images of several edits encoded in one VAE call.

An edit's start (:meth:`~bcg_core.pipeline.DiTPipeline.start` of a request with an ``image``: text rows, the image
read and preprocessed, VAE-encoded, sampled and noised) takes tens to hundreds of milliseconds at 1024²; on the
denoising thread it would stall every request in flight. The denoising loop hands its admitted edits to an
:class:`EditStarter` instead (text to image still starts on the denoising thread: its start is cheap). The edit-start
thread takes every edit queued (up to ``batch_requests``) as one *round*: each start runs on a worker thread of
its own, in the family's and diffusers' own code, and each ``vae.encode(x)`` it makes through its
:class:`~bcg_core.families.edit_view.PipelineView` (:func:`~bcg_core.families.edit_view.vae_encodes`) waits in
the round's :class:`EncodeRound` until every start of the round waits there or has finished (or ``gather_s``
passed since the first one came). Then the edit-start thread encodes the waiting images of one VAE, size and dtype
in one VAE call (at most ``batch_images`` images), and each start gets its own rows of it as a latent distribution
of its own, which diffusers samples with the request's own generators, in its own order. A batched call differs
from encoding each image alone only in the reduction order of batched kernels (about 1e-6 relative on the CPU;
``tests/engine/test_edit_start.py`` gates the final latents within 1e-5 of diffusers'). A batched call that raises
is tried again one image at a time, so a failing encode is its own request's error.

On CUDA the starts and the encodes run on the edit starter's own stream, synchronised before the states are handed
back; the denoising loop adopts a ready state at its next step boundary (marking its tensors used on its own
stream, so the caching allocator does not hand their memory to the edit-start stream while a step still reads
them). Timing: the seconds a start spent in VAE encodes (waiting for and running the round's calls) become the
result's ``timings_ms["edit_encode"]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from bcg_core.families import RequestState
from bcg_core.families.edit_view import vae_encodes
from bcg_core.scheduler.admission import InFlight

__all__ = ["EditStarter", "EncodeRound", "is_edit", "use_on_stream"]

log = logging.getLogger(__name__)


def is_edit(item: InFlight) -> bool:
    """Whether ``item`` starts on the edit-start stage (an edit: its request has an ``image``)."""
    return item.validated.request.image is not None


def _tensors(obj, depth: int = 0):
    """The tensors in ``obj``: a tensor, or tuples, lists and dicts of them, three levels down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, depth + 1)


def use_on_stream(state: RequestState, stream) -> int:
    """Mark every CUDA tensor of ``state`` (latents, timesteps, text rows, extras but its LoRA lease, its
    scheduler's tensors) as used on ``stream`` (``Tensor.record_stream``): made on another stream, its memory is
    not reused there until the work ``stream`` has queued by the time it is freed is done. Returns the tensors
    marked."""
    rows = [getattr(r, f.name) for r in (state.cond, state.uncond) if r is not None for f in dataclasses.fields(r)]
    extras = {k: v for k, v in state.extras.items() if k != "lora"}
    seen, marked = set(), 0
    for t in [*_tensors([state.latents, state.timesteps, rows, extras]), *_tensors(vars(state.scheduler))]:
        if t.is_cuda and id(t) not in seen:
            seen.add(id(t))
            t.record_stream(stream)
            marked += 1
    return marked


@dataclasses.dataclass(eq=False)
class _Encode:
    """One ``vae.encode(x)`` call of a start, waiting in its round."""

    vae: object
    x: torch.Tensor
    out: object = None
    error: BaseException | None = None
    done: bool = False


class EncodeRound:
    """The rendezvous of one round's starts (module docstring): each start's ``vae.encode(x)`` waits in
    :meth:`encode` until :meth:`serve`, on the edit-start thread, has encoded it with the others waiting.

    Args:
        members: the starts of the round (each calls :meth:`leave` once, when it has finished).
        gather_s: once an encode waits, at most this many seconds more for the other starts to reach theirs.
        batch_images: most images of one VAE call.
    """

    def __init__(self, members: int, gather_s: float, batch_images: int):
        self._cv = threading.Condition()
        self._active = int(members)
        self._waiting: list[_Encode] = []
        self._first = 0.0
        self.gather_s = float(gather_s)
        self.batch_images = max(1, int(batch_images))
        self.calls: list[int] = []  # images of each VAE call made, in order

    def encode(self, vae, x: torch.Tensor):
        """On a start's thread: ``vae.encode(x)`` as :meth:`serve` computes it (``x``: (b, 3, ...) images).

        Raises:
            Exception: whatever the VAE raised encoding ``x`` alone.
        """
        job = _Encode(vae, x)
        with self._cv:
            if not self._waiting:
                self._first = time.perf_counter()
            self._waiting.append(job)
            self._cv.notify_all()
            while not job.done:
                self._cv.wait()
        if job.error is not None:
            raise job.error
        return job.out

    def leave(self) -> None:
        """On a start's thread: this start has finished (with its state or its error)."""
        with self._cv:
            self._active -= 1
            self._cv.notify_all()

    def serve(self) -> None:
        """On the edit-start thread: encode what the starts wait for, in batches, until every start has left."""
        while True:
            with self._cv:
                while self._active > 0 and not (self._waiting and (  # one image a call: nothing to gather
                        self.batch_images == 1 or len(self._waiting) >= self._active
                        or time.perf_counter() - self._first >= self.gather_s)):
                    self._cv.wait(None if not self._waiting else
                                  max(1e-3, self.gather_s - (time.perf_counter() - self._first)))
                if self._active == 0:
                    return
                jobs, self._waiting = self._waiting, []
            for group in self._groups(jobs):
                self._run(group)
            with self._cv:
                for job in jobs:
                    job.done = True
                self._cv.notify_all()

    def _groups(self, jobs: list[_Encode]) -> list[list[_Encode]]:
        """Jobs of one VAE, image size, dtype and device, in order, at most ``batch_images`` images a group."""
        by: dict[tuple, list[list[_Encode]]] = {}
        for job in jobs:
            key = (id(job.vae), tuple(job.x.shape[1:]), job.x.dtype, job.x.device)
            runs = by.setdefault(key, [[]])
            if runs[-1] and sum(j.x.shape[0] for j in runs[-1]) + job.x.shape[0] > self.batch_images:
                runs.append([])
            runs[-1].append(job)
        return [g for runs in by.values() for g in runs]

    def _run(self, group: list[_Encode]) -> None:
        """One VAE call for ``group`` split back into each job's own output; alone where that cannot be done."""
        if len(group) > 1:
            try:
                out = group[0].vae.encode(torch.cat([j.x for j in group]))
                self.calls.append(sum(j.x.shape[0] for j in group))
                parts = _split(out, [j.x.shape[0] for j in group])
            except Exception:  # noqa: BLE001 - each image alone: a failure is its own request's
                log.warning("a batched VAE encode of %d edits failed; encoding each alone", len(group), exc_info=True)
                parts = None
            if parts is not None:
                for job, part in zip(group, parts, strict=True):
                    job.out = part
                return
        for job in group:
            try:
                job.out = job.vae.encode(job.x)
                self.calls.append(job.x.shape[0])
            except Exception as e:  # noqa: BLE001 - this request's own error
                job.error = e


def _split(out, sizes: list[int]) -> list | None:
    """``out`` of one VAE call over images of ``sizes`` rows each, as each image's own output (a
    ``latent_dist`` of the same class over its rows of the moments, or its rows of ``latents``); None for an
    output of any other form."""
    dist = getattr(out, "latent_dist", None)
    params = getattr(dist, "parameters", None)
    bounds, a = [], 0
    for n in sizes:
        bounds.append((a, a + n))
        a += n
    if isinstance(params, torch.Tensor) and params.shape[0] == a:
        return [type(out)(latent_dist=type(dist)(params[i:j], deterministic=dist.deterministic)) for i, j in bounds]
    latents = getattr(out, "latents", None)
    if dist is None and isinstance(latents, torch.Tensor) and latents.shape[0] == a:
        return [type(out)(latents=latents[i:j]) for i, j in bounds]
    return None


class EditStarter:
    """The edit-start thread of one step scheduler and its round's start threads (module docstring).

    Args:
        pipeline: the replica's pipeline (its ``start`` runs here; its model's device picks the stream).
        batch_requests: most edits of one round (and start threads).
        batch_images: most images of one VAE call (1: each image alone; the step scheduler batches on CUDA only,
            where it pays).
        ready: ``ready(item, state, error)`` on the edit-start thread once a start has finished: its state (error
            None) or the exception its start raised (state None).
        closed: whether the scheduler is closing (then a queued edit is left to ``close`` to answer).
        gather_s: see :class:`EncodeRound`.

    Attributes:
        rounds, vae_calls, images_encoded: rounds run, VAE encode calls made and images they encoded.
    """

    def __init__(self, pipeline, batch_requests: int, batch_images: int, ready: Callable, closed: Callable[[], bool],
                 gather_s: float = 0.25):
        self._pipeline = pipeline
        self.batch_requests = max(1, int(batch_requests))
        self.batch_images = max(1, int(batch_images))
        self.gather_s = float(gather_s)
        self._ready, self._closed = ready, closed
        self._queue: queue.Queue = queue.Queue()
        self._pool = ThreadPoolExecutor(max_workers=self.batch_requests, thread_name_prefix="bcg-edit-start-worker")
        device = pipeline.model.device
        self._cuda = torch.device(device).type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._thread: threading.Thread | None = None
        self.rounds = self.vae_calls = self.images_encoded = 0

    def start(self) -> None:
        """Start the edit-start thread."""
        self._thread = threading.Thread(target=self._run, name="bcg-edit-start", daemon=True)
        self._thread.start()

    def put_many(self, items: list[InFlight]) -> None:
        """Start ``items`` (admitted edits, handed over together so that one round can take them all)."""
        for item in items:
            self._queue.put(item)

    def close(self, timeout_s: float) -> None:
        """Stop the edit-start thread after its round in progress (edits still queued are left to ``close``)."""
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict:
        """``rounds``, ``vae_calls``, ``images_encoded``, ``batch_requests`` and ``batch_images`` (the scheduler's
        stats)."""
        return {"rounds": self.rounds, "vae_calls": self.vae_calls, "images_encoded": self.images_encoded,
                "batch_requests": self.batch_requests, "batch_images": self.batch_images}

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while len(batch) < self.batch_requests:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            if self._closed():
                return
            try:
                results = self._round(batch)
            except Exception as e:  # noqa: BLE001 - the thread goes on; the round's requests get the error
                log.exception("an edit-start round of %d edits failed", len(batch))
                results = [(None, e)] * len(batch)
            for item, (state, error) in zip(batch, results, strict=True):
                self._ready(item, state, error)
            if stop:
                return

    def _round(self, batch: list[InFlight]) -> list[tuple]:
        """Start ``batch`` together (module docstring): each start's ``(state, None)`` or ``(None, error)``."""
        rnd = EncodeRound(len(batch), self.gather_s, self.batch_images)
        spent = [0.0] * len(batch)
        futures = [self._pool.submit(self._start_one, rnd, item, spent, k) for k, item in enumerate(batch)]
        with self._on_stream(), torch.inference_mode():
            rnd.serve()
        results = [f.result() for f in futures]
        if self._cuda:
            self._stream.synchronize()
        self.rounds += 1
        self.vae_calls += len(rnd.calls)
        self.images_encoded += sum(rnd.calls)
        for item, s in zip(batch, spent, strict=True):
            item.edit_encode_s = s
        return results

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext()

    def _start_one(self, rnd: EncodeRound, item: InFlight, spent: list[float], k: int):
        """On a start thread: ``item``'s start, its VAE encodes through ``rnd``; (state, None) or (None, error)."""
        def encode(vae, x):
            t0 = time.perf_counter()
            try:
                return rnd.encode(vae, x)
            finally:
                spent[k] += time.perf_counter() - t0

        try:
            with self._on_stream(), vae_encodes(encode):
                return self._pipeline.start(item.validated, item.cancel, item.lease), None
        except Exception as e:  # noqa: BLE001 - this request's own error
            return None, e
        finally:
            rnd.leave()
