"""Which adapters sit in which GPU slots: leases, least-recently-used eviction and loading off the step thread.

A request that names adapters takes a :class:`Lease` before it is queued: each adapter is pinned in a slot for
as long as the request is in flight, so no row ever reads a slot that is being overwritten. An adapter already
resident is a *hit* (pinned at once, on the caller's thread). Any other is loaded by one loader thread: read from
disk into host memory (:class:`~bcg_core.lora.files.AdapterFiles`; the last ``host_cache`` adapters read are kept
there), copied into a free slot or the least recently used slot that no lease pins (an *eviction*), on a CUDA
stream of its own, synchronized before the lease is handed out. The denoising thread never waits for a load:
a request joins the step scheduler only with its lease. A caller waits at most ``timeout_s`` (then
:class:`~bcg_core.errors.ServiceUnavailable`, HTTP 503 with Retry-After); an adapter that cannot be served is a
:class:`~bcg_core.errors.RequestError` naming it and the reason (HTTP 422), and the replica serves on.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from bcg_core.errors import RequestError, ServiceUnavailable
from bcg_core.lora.files import AdapterError, AdapterFiles, AdapterWeights
from bcg_core.lora.layers import LoRALayers

__all__ = ["AdapterSlots", "Lease", "check_served", "cost_note", "unserved"]

log = logging.getLogger(__name__)

DELTA_SHARE_WARN = 0.05
"""Above this :attr:`~bcg_core.lora.layers.LoRALayers.delta_share` a start logs a warning with the settings to
lower. The share counts the deltas' multiply-adds only, which grow with ``max_per_request x max_rank`` and are
mostly zero padding when those exceed what the adapters need. The deltas' other cost, their extra passes over
each layer's activations, does not depend on those settings and is not in it: it is what the benchmarks measured
at 2-4% of multiply-adds (0.95x at FLUX.1-dev width, 0.84-0.89x at SD3-medium, and no difference between ranks
16 and 64 at FLUX.1-dev width, docs/BENCHMARKS.md). So the warning is about the settings, not a prediction of
throughput: 5% of multiply-adds is already more than those runs paid for them."""


@dataclass
class Lease:
    """Slots pinned for one request. ``slots[i]`` holds ``names[i]``; ``scales[i]`` is its request scale."""

    names: tuple[str, ...]
    slots: tuple[int, ...]
    scales: tuple[float, ...]
    owner: AdapterSlots | None = field(default=None, repr=False)
    waited_s: float = 0.0
    """Seconds the request waited for a load (0 for a hit)."""

    def release(self) -> None:
        """Unpin the slots (idempotent)."""
        owner, self.owner = self.owner, None
        if owner is not None:
            owner._unpin(self.slots)


@dataclass
class _Counts:
    requests: int = 0
    hits: int = 0
    loads: int = 0
    load_s: float = 0.0
    evictions: int = 0
    refused: int = 0
    timeouts: int = 0  # answered 503: not loaded within lora.load_timeout_s (slots pinned, or loads slow or queued)
    cancelled: int = 0  # the caller gave up (a disconnected client) while waiting for the adapter


class AdapterSlots:
    """The replica's adapter slots (module docstring).

    Args:
        files: the adapter folder.
        layers: the transformer's LoRA layers (``layers.slots`` slots).
        timeout_s: ``lora.load_timeout_s``: most seconds a request waits for its adapters.
        host_cache: adapters kept in host memory after they were read.
        retry_after_s: the ``Retry-After`` of a 503.
    """

    def __init__(self, files: AdapterFiles, layers: LoRALayers, timeout_s: float = 30.0, host_cache: int = 32,
                 retry_after_s: float = 2.0):
        self.files, self.layers = files, layers
        self.timeout_s, self.host_cache, self.retry_after_s = timeout_s, host_cache, retry_after_s
        self._cv = threading.Condition()
        self._resident: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU first
        self._pins: collections.Counter[int] = collections.Counter()
        self._free = list(range(layers.slots, 0, -1))
        self._stamps: dict[str, tuple] = {}  # resident name -> the stamp of the file its slot holds
        self._orphans: set[int] = set()  # slots of a replaced file, still pinned by requests in flight
        self._host: collections.OrderedDict[str, tuple[tuple, AdapterWeights]] = collections.OrderedDict()
        self._refused: dict[str, tuple[tuple, str]] = {}
        self.counts: dict[str, _Counts] = collections.defaultdict(_Counts)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bcg-lora-load")
        cuda = layers.device.type == "cuda"
        self._stream = torch.cuda.Stream(layers.device) if cuda else None

    # -- leases ---------------------------------------------------------------------------------------

    def acquire(self, names: tuple[str, ...], scales: tuple[float, ...]) -> concurrent.futures.Future:
        """A future of the :class:`Lease` of ``names`` (resolved at once when all are resident, else by the
        loader thread). Its exception: :class:`RequestError` (field ``lora``) for an adapter that cannot be
        served, :class:`ServiceUnavailable` when no slot frees within ``timeout_s``."""
        t0 = time.perf_counter()
        stamps = {n: self._stamp(n) for n in names}  # None: no such file
        with self._cv:
            for n, stamp in stamps.items():
                if stamp is not None:  # counters only for real files, not for any name a caller sends
                    self.counts[n].requests += 1
                if n in self._resident and self._stamps.get(n) != stamp:
                    self._retire(n)  # its file was replaced, rewritten or removed: load it again
            if all(n in self._resident for n in names):
                for n in names:
                    self.counts[n].hits += 1
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.set_result(self._pin(names, scales))
                return fut
        return self._pool.submit(self._load_lease, names, scales, t0)

    def _stamp(self, name: str) -> tuple | None:
        """The file stamp of ``name`` (:meth:`AdapterFiles.stamp`), None where there is no such file."""
        try:
            return self.files.stamp(name)
        except AdapterError:
            return None

    def _retire(self, name: str) -> None:
        """``name`` stops being resident (call with the lock held): its slot is free at once, or once the requests
        in flight that pin it are answered; its host copy is dropped."""
        slot = self._resident.pop(name)
        self._stamps.pop(name, None)
        self._host.pop(name, None)
        if self._pins[slot] > 0:
            self._orphans.add(slot)
        else:
            self._free.append(slot)

    def lease(self, names: tuple[str, ...], scales: tuple[float, ...]) -> Lease:
        """:meth:`acquire`, waiting on this thread (scripts and :meth:`~bcg_core.pipeline.DiTPipeline.generate`)."""
        fut = self.acquire(names, scales)
        try:
            return fut.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            fut.add_done_callback(_release_result)
            self._count(names, "timeouts")
            raise self._busy(names) from None
        except ServiceUnavailable:  # the loader's own deadline
            self._count(names, "timeouts")
            raise

    async def lease_async(self, names: tuple[str, ...], scales: tuple[float, ...],
                          retry_after_s: float | None = None) -> Lease:
        """:meth:`acquire`, awaited (the step scheduler's front); a caller cancelled or timed out while waiting
        leaves nothing pinned. ``retry_after_s``: the ``Retry-After`` of its 503 (None: :attr:`retry_after_s`)."""
        fut = self.acquire(names, scales)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            fut.add_done_callback(_release_result)
            if isinstance(e, asyncio.CancelledError):
                self._count(names, "cancelled")
                raise
            self._count(names, "timeouts")
            raise self._busy(names, retry_after_s) from None
        except ServiceUnavailable as e:  # the loader's own deadline: the caller's Retry-After
            self._count(names, "timeouts")
            if retry_after_s is not None:
                e.retry_after_s = retry_after_s
            raise

    def _count(self, names, counter: str) -> None:
        """Add one to ``counter`` (``timeouts``, ``cancelled``) of the adapters of ``names`` the request waited for:
        those not resident now (else all of them, where the last load finished just after the deadline), each with
        a counter (a real file: :meth:`acquire`)."""
        with self._cv:
            waited = [n for n in names if n not in self._resident] or list(names)
            for n in waited:
                if n in self.counts:
                    setattr(self.counts[n], counter, getattr(self.counts[n], counter) + 1)

    def _busy(self, names, retry_after_s: float | None = None) -> ServiceUnavailable:
        return ServiceUnavailable("lora", f"adapters {list(names)} were not loaded within lora.load_timeout_s "
                                          f"({self.timeout_s:g} s): every slot is in use; retry",
                                  retry_after_s=self.retry_after_s if retry_after_s is None else retry_after_s)

    def _pin(self, names, scales) -> Lease:
        """Pin resident ``names`` (call with the lock held)."""
        slots = tuple(self._resident[n] for n in names)
        for n in names:
            self._resident.move_to_end(n)
        for s in slots:
            self._pins[s] += 1
        return Lease(tuple(names), slots, tuple(float(x) for x in scales), self)

    def _unpin(self, slots) -> None:
        with self._cv:
            for s in slots:
                self._pins[s] -= 1
                if self._pins[s] <= 0:
                    del self._pins[s]
                    if s in self._orphans:  # a replaced file's slot, no longer read by any row
                        self._orphans.discard(s)
                        self._free.append(s)
            self._cv.notify_all()

    # -- the loader thread ----------------------------------------------------------------------------

    def _load_lease(self, names, scales, t0: float) -> Lease:
        held: list[str] = []
        try:
            for n in names:
                self._ensure(n, t0)
                with self._cv:  # pinned one by one, so the next load cannot evict it
                    self._pins[self._resident[n]] += 1
                    held.append(n)
        except BaseException:
            with self._cv:
                slots = [self._resident[n] for n in held]
            self._unpin(slots)
            raise
        with self._cv:  # every name is pinned once now: the lease holds those pins
            for n in names:
                self._resident.move_to_end(n)
            lease = Lease(tuple(names), tuple(self._resident[n] for n in names), tuple(float(x) for x in scales), self)
        lease.waited_s = time.perf_counter() - t0
        return lease

    def _ensure(self, name: str, t0: float) -> None:
        """Make ``name`` resident (the loader thread only)."""
        with self._cv:
            if name in self._resident:
                self.counts[name].hits += 1
                return
        stamp, weights = self._read(name)
        deadline = t0 + self.timeout_s
        with self._cv:
            while not self._free and not any(self._pins[s] <= 0 for s in self._resident.values()):
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise self._busy([name])
                self._cv.wait(left)
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(n for n, s in self._resident.items() if self._pins[s] <= 0)
                slot = self._resident.pop(victim)
                self._stamps.pop(victim, None)
                self.counts[victim].evictions += 1
        start = time.perf_counter()
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self.layers.write(slot, weights)
                self._stream.synchronize()
            else:
                self.layers.write(slot, weights)
        except BaseException:
            with self._cv:
                self._free.append(slot)
            raise
        with self._cv:
            self._resident[name] = slot
            self._stamps[name] = stamp
            c = self.counts[name]
            c.loads += 1
            c.load_s += time.perf_counter() - start

    def _read(self, name: str) -> tuple[tuple, AdapterWeights]:
        """``(stamp, weights)`` of ``name``: from the host cache while its file is unchanged, else from disk
        (refusals remembered until the file changes)."""
        try:
            stamp = self.files.stamp(name)
            with self._cv:
                cached = self._host.get(name)
                if cached is not None and cached[0] == stamp:
                    self._host.move_to_end(name)
                    return cached
            refused = self._refused.get(name)
            if refused is not None and refused[0] == stamp:
                raise AdapterError(name, refused[1])
            try:
                weights = self.files.read(name)
            except AdapterError as e:
                if not e.unknown:
                    self._refused[name] = (stamp, e.reason)
                raise
        except AdapterError as e:
            if not e.unknown:  # a file that exists (bounded by the folder), not any name a caller sends
                self.counts[name].refused += 1
            raise self._request_error(e) from None
        if self._stream is not None:
            for d in weights.layers.values():
                object.__setattr__(d, "A", d.A.pin_memory())
                object.__setattr__(d, "B", d.B.pin_memory())
        with self._cv:
            self._host[name] = (stamp, weights)
            while len(self._host) > self.host_cache:
                self._host.popitem(last=False)
        return stamp, weights

    def _request_error(self, e: AdapterError) -> RequestError:
        if e.unknown:
            try:
                names = self.files.names()
            except OSError:  # the folder itself is gone or unreadable: still the caller's 422, not a 500
                return RequestError("lora", f"lora: {e.reason} (lora.dir cannot be listed on this replica)")
            shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
            return RequestError("lora", f"lora: {e.reason}; adapters: {shown or 'none'} (GET /v1/models lists them)")
        return RequestError("lora", f"lora: {e.reason}")

    def attach(self, part, lease: Lease | None):
        """``part`` (one request's :class:`~bcg_core.padding.DenoiseInputs`) with its lease's LoRA entries on every
        row, on the layers' device (:func:`~bcg_core.lora.rows.request_rows`); without a lease ``part`` unchanged
        (``lora_slots`` None: a forward whose rows all have none replays the bucket's graph without the deltas,
        :class:`~bcg_core.lora.rows.LoRAAdapter`)."""
        from bcg_core.lora.rows import request_rows

        if lease is None or not lease.slots:
            return part
        part.lora_slots, part.lora_scales = request_rows(lease.slots, lease.scales, part.rows,
                                                         self.layers.max_per_request, self.layers.device)
        return part

    # -- introspection --------------------------------------------------------------------------------

    def resident(self) -> dict[str, int]:
        """Adapter name -> slot, least recently used first."""
        with self._cv:
            return dict(self._resident)

    def describe(self) -> dict:
        """``/v1/buckets``' ``lora`` section: slots, rank, bytes, residents and per adapter its counters."""
        with self._cv:
            return {
                "slots": self.layers.slots, "max_rank": self.layers.max_rank,
                "max_per_request": self.layers.max_per_request, "layers": len(self.layers.layers),
                "slot_bytes": self.layers.nbytes, "delta_share": round(self.layers.delta_share, 4),
                "resident": dict(self._resident),
                "pinned": {n: self._pins[s] for n, s in self._resident.items() if self._pins[s] > 0},
                "adapters": {n: {**vars(c), "load_s": round(c.load_s, 4)} for n, c in sorted(self.counts.items())},
            }

    def close(self) -> None:
        """Stop the loader thread (loads in progress finish)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _release_result(fut: concurrent.futures.Future) -> None:
    """Release the lease a future resolved to after its caller stopped waiting."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result().release()


def install(config, model) -> AdapterSlots | None:
    """Set up ``config.lora`` on a loaded family, before its runner is built: wrap the transformer's targeted
    layers (:class:`~bcg_core.lora.layers.LoRALayers`), put :class:`~bcg_core.lora.rows.LoRAAdapter` in place of
    ``model.adapter``, and return the replica's slots. None when ``lora.dir`` is unset (nothing changes).

    Raises:
        ValueError: a family that serves no adapters (:func:`unserved`: PixArt-Sigma, whose diffusers pipeline has no
            LoRA loader, or a family whose adapters are not served yet), or a ``lora.dir`` that is not a folder, or
            ``lora.targets`` that match no linear layer.
    """
    cfg = config.lora
    if cfg.dir is None:
        return None
    import diffusers

    from bcg_core.lora.rows import LoRAAdapter

    loader = model.lora_loader
    if loader is None:
        raise ValueError(unserved(loader, model.spec.pipeline_class, model.spec.family))
    layers = LoRALayers(model.adapter.model, cfg.slots, cfg.max_rank, cfg.max_per_request, cfg.targets)
    files = AdapterFiles(cfg.dir, getattr(diffusers, loader), layers.shapes(), cfg.max_rank)
    model.adapter = LoRAAdapter(model.adapter, layers)
    note = cost_note(len(layers.layers), layers.delta_share, cfg.max_per_request, cfg.max_rank)
    log.log(logging.WARNING if layers.delta_share > DELTA_SHARE_WARN else logging.INFO, "lora: %s", note)
    return AdapterSlots(files, layers, cfg.load_timeout_s, cfg.host_cache)


def unserved(loader: str | None, pipeline_class: str, family: str) -> str | None:
    """Why ``lora.dir`` cannot be served for a ``pipeline_class`` checkpoint whose family reads adapters with
    ``loader`` (:attr:`~bcg_core.families.Family.lora_loader`), or None where it can. A family without a loader is
    told apart by the installed diffusers: where its pipeline has a LoRA loader mixin (e.g. ``WanLoraLoaderMixin``),
    bcg-serve does not serve adapters for that family yet; where it has none (PixArt-Sigma), no adapter of it can be
    read as diffusers reads it."""
    if loader is not None:
        return None
    import diffusers

    mixins = [c.__name__ for c in getattr(getattr(diffusers, pipeline_class, None), "__mro__", ())
              if c.__name__.endswith("LoraLoaderMixin")]
    if mixins:
        return (f"lora.dir is set but {pipeline_class} (family {family}) takes no adapters here: bcg-serve does not "
                f"serve LoRA adapters for this family yet (diffusers loads them with {mixins[0]}, outside bcg-serve's "
                f"per-request adapter rows); unset lora.dir")
    return (f"lora.dir is set but {pipeline_class} (family {family}) has no LoRA loader in diffusers, so no adapter "
            f"of it can be read as diffusers reads it; unset lora.dir")


def check_served(model_config) -> None:
    """Refuse ``lora.dir`` for the configured model before anything loads (``bcg config --check``, ``bcg serve``
    before Ray starts), as :func:`install` would at a replica's start: its checkpoint's family, read from
    ``model_index.json`` only (the tiny default, ``model.path`` None, serves adapters).

    Raises:
        ValueError: the model's family serves no adapters (:func:`unserved`), or the folder is not a servable
            checkpoint (:func:`bcg_core.models.read_checkpoint`).
    """
    if model_config.path is None:
        return
    from pathlib import Path

    from bcg_core.families import family_class
    from bcg_core.models import read_checkpoint

    kind = read_checkpoint(Path(model_config.path))["_class_name"]
    family = family_class(kind)
    reason = unserved(family.lora_loader, kind, family.name)
    if reason is not None:
        raise ValueError(reason)


def cost_note(layers: int, share: float, max_per_request: int, max_rank: int) -> str:
    """What adapter rows add to a forward, in one line: logged at start (a warning above :data:`DELTA_SHARE_WARN`,
    with the settings to lower) and printed by ``bcg serve`` from ``/v1/buckets``' ``lora`` section."""
    return (f"{layers} layers wrapped; a forward with adapter rows adds {100 * share:.1f}% to their matmul work (every "
            f"row computes lora.max_per_request {max_per_request} x lora.max_rank {max_rank} rank rows per layer, "
            f"zero-padded ones too)" + ("; lower lora.max_rank and lora.max_per_request to what the adapters need "
                                        "(docs/OPERATIONS.md, LoRA adapters)" if share > DELTA_SHARE_WARN else ""))


def lease_for(slots: AdapterSlots | None, lora: tuple[tuple[str, float], ...]) -> Lease | None:
    """The lease of a request's ``lora`` entries, waiting on this thread (:meth:`AdapterSlots.lease`); None for
    none.

    Raises:
        RequestError: adapters asked of a pipeline without ``lora.dir`` (``slots`` None), or one that cannot be
            served.
        ServiceUnavailable: no slot freed within ``lora.load_timeout_s``.
    """
    if not lora:
        return None
    if slots is None:
        raise RequestError("lora", "lora: this deployment serves no LoRA adapters (lora.dir is unset)")
    return slots.lease(tuple(n for n, _ in lora), tuple(s for _, s in lora))
