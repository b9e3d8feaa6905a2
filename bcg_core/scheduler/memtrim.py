"""Hand the C heap's free memory back to the OS when a replica goes idle (glibc ``malloc_trim``).

Why: on a CPU replica a request's tensors (activations, latents, decoded images; up to 1024x1024 x 9 images) and
its PIL images and encoder buffers are freed when it is answered, but glibc keeps the freed memory in its heaps
(its mmap threshold rises (dynamically, up to 32 MiB) after large blocks are freed, so later tensors of many MiB come
from the heap and, once free, stay resident unless they sit at the top of the heap). The replica's resident memory
at rest then follows the high-water mark of the requests that happened to run together, not a leak.

Measured (2-core CPU, tiny default model, 2026-12-02). In-process (step scheduler, no Ray), ``benchmarks/soak.py``'s
request mix (krea sizes and image counts, steps 1/2/4, 30% streamed, 10% cancelled), 4 at a time, at rest every 10
requests: without trimming 1.70, 1.67, 2.00, 1.86, 2.02, 1.97, 2.03, 2.02, 2.04, 2.07 GB over 100 requests, while
the live torch tensors stayed at 640 +- 5 MB and the Python objects at 522.4k (+300 over 90 requests);
``malloc_trim(0)`` at each of those points brought it to 1.21-1.29 GB. With :class:`IdleTrimmer` in the scheduler:
1.23, 1.25, 1.26, 1.22, 1.30, 1.29 GB over 60 requests (a trim: 23 ms mean, 46 ms at most). ``benchmarks/soak.py
--duration-s 120 --warmup-share 0.3`` (Ray, one replica), memory at rest after warm-up -> at the end: 1.85 -> 2.17 GB
(+17.2%) before, 1.39 -> 1.37 GB (-1.3%) with it. ``MALLOC_ARENA_MAX=2`` does not help (+12%: the memory is in the
heaps, not in extra arenas).

``malloc_trim(0)`` (glibc >= 2.8 releases whole free pages anywhere in every arena with ``madvise``, not only the
heap's top; ``man 3 malloc_trim``) is called by :class:`IdleTrimmer` once the scheduler has had no request for
a moment (``scheduler.trim_idle_s``), so it seldom competes with a request for the heap's locks. Elsewhere (musl, macOS)
it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable

__all__ = ["IdleTrimmer", "malloc_trim", "resident_bytes", "set_mmap_threshold"]

log = logging.getLogger(__name__)

_libc_trim: Callable[[int], int] | None | bool = False  # False: not looked up yet


def _trim_fn() -> Callable[[int], int] | None:
    global _libc_trim
    if _libc_trim is False:
        fn = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = libc.malloc_trim  # glibc only
            fn.argtypes = [ctypes.c_size_t]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _libc_trim = fn
    return _libc_trim  # type: ignore[return-value]


def malloc_trim() -> bool:
    """Release the free memory of every glibc heap to the OS; True when some was released, False when none was
    or glibc's ``malloc_trim`` is not there."""
    fn = _trim_fn()
    return bool(fn(0)) if fn is not None else False


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""``mallopt``'s parameter numbers of the trim and mmap thresholds (glibc ``malloc.h``)."""


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve every C heap allocation of at least ``nbytes`` with its own ``mmap``, given back to the OS when freed
    (glibc ``mallopt(M_MMAP_THRESHOLD, nbytes)``, as the ``MALLOC_MMAP_THRESHOLD_`` environment variable; ``man 3
    mallopt``). Setting it also stops glibc from raising the threshold after large blocks are freed (its dynamic
    threshold climbs to 32 MiB), so the heaps no longer grow for large buffers (tensors, image files, request bodies),
    which freed would stay resident there and pin the heap around the small objects allocated beside them (a
    large request is still served from free space a heap already has). The trim threshold is set to twice it.

    Measured (2-core CPU, tiny default, ``benchmarks/soak_mixed.py`` 5 minutes: generations, previews, LoRA, edits,
    bad requests; docs/RELIABILITY.md): the DiT replica at rest 1,268 -> 1,437 MB (+13.3%) after warm-up without it,
    1,233 -> 1,292 MB (+4.7%) at 256 KiB; under load its median per minute 2.39 -> 2.86 GB without it, 1.40-1.67 GB at
    256 KiB, with the idle trim (:class:`IdleTrimmer`) on in both. 30 minutes at 256 KiB: +4.9% at rest, level under
    load.

    Args:
        nbytes: the threshold in bytes, 0 to 32 MiB (glibc's ``HEAP_MAX`` / 2 limit on 64-bit).

    Returns:
        True when set; False where glibc's ``mallopt`` is not there (musl, macOS) or refused the value.

    Raises:
        ValueError: ``nbytes`` outside 0 to 32 MiB.
    """
    if not 0 <= nbytes <= 32 * 2**20:
        raise ValueError(f"the mmap threshold must be 0 to 33554432 bytes (32 MiB), got {nbytes}")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallopt  # glibc only
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    # the trim threshold back to twice the mmap threshold, glibc's own ratio (its dynamic threshold may have raised
    # it to 64 MiB already): a heap's free top above it is given back at once
    return bool(fn(M_MMAP_THRESHOLD, int(nbytes))) and bool(fn(M_TRIM_THRESHOLD, 2 * int(nbytes)))


def resident_bytes() -> int | None:
    """This process's resident memory (``/proc/self/statm``), or None off Linux."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class IdleTrimmer:
    """A thread that calls ``trim`` once its owner has stayed idle ``delay_s`` after :meth:`notify`.

    Args:
        is_idle: True when no request is in flight (called on the trimmer's thread; must be thread-safe).
        delay_s: seconds of idleness before trimming (a request arriving meanwhile defers it to the next
            :meth:`notify`).
        trim: the call that releases memory (:func:`malloc_trim`).
    """

    def __init__(self, is_idle: Callable[[], bool], delay_s: float = 1.0, trim: Callable[[], bool] = malloc_trim):
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self._is_idle = is_idle
        self.delay_s = float(delay_s)
        self._trim = trim
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._trims = 0
        self._trim_s = 0.0
        self._trim_max_s = 0.0
        self._released = 0

    def notify(self) -> None:
        """The owner may have gone idle (its last request was answered): trim after ``delay_s`` if still idle."""
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(target=self._loop, name="bcg-trim", daemon=True)
                    self._thread.start()
        self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop.wait(self.delay_s):
                return
            if self._wake.is_set() or not self._is_idle():
                continue  # busy again: the next notify comes when it drains
            before = resident_bytes()
            t0 = time.perf_counter()
            try:
                self._trim()
            except Exception:  # noqa: BLE001 - best effort; serving goes on
                log.exception("malloc_trim failed")
            spent = time.perf_counter() - t0
            after = resident_bytes()
            with self._lock:
                self._trims += 1
                self._trim_s += spent
                self._trim_max_s = max(self._trim_max_s, spent)
                if before is not None and after is not None:
                    self._released += max(0, before - after)

    def describe(self) -> dict:
        """``trims`` done, milliseconds spent (``trim_ms_total``, ``trim_ms_max``) and ``released_bytes`` (resident
        memory before minus after, summed)."""
        with self._lock:
            return {"trims": self._trims, "trim_ms_total": round(self._trim_s * 1e3, 2),
                    "trim_ms_max": round(self._trim_max_s * 1e3, 2), "released_bytes": self._released,
                    "delay_s": self.delay_s}
