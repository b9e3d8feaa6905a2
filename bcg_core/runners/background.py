"""Ready first, compiled later: a cold start serves eager kernels in each bucket's graph and compiles in the background.

Compiling a bucket's repeated blocks takes seconds to minutes (inductor's code generation and Triton's builds; a
cold start of the default table with compiled kernels took 244-257 s on one H100 against 26-27 s with eager kernels,
docs/DESIGN.md section 11). So a server prepares each bucket with ``defer_compiles``
(:meth:`~bcg_core.runners.base.BucketRunner.prepare`): where every compiled block the bucket runs loads from the
compile cache (:meth:`~bcg_core.runners.kernels.CompiledKernels.cached_only`, a warm restart), the bucket is compiled
at once, as before; otherwise it is captured with eager kernels, serves at once, and is marked
:attr:`~bcg_core.runners.base.BucketEntry.pending`.

:class:`BackgroundCompiles` then takes the pending buckets one at a time, largest first, on a thread of its own
(:func:`compile_pending`):

1. a fresh set of static buffers (the serving graph keeps its own), on which the bucket's blocks are compiled and
   checked against its eager forward exactly as at a blocking start (:func:`~bcg_core.verify.compile_entry`: the
   tier's tolerance, ``runner.compile_timeout_s``), on a CUDA stream of its own while requests are served;
2. the runner's :meth:`~bcg_core.runners.base.BucketRunner.swap_in` captures the compiled forward into the shared
   pool under the runner's lock (between two forwards: no request waits more than one capture) and serves the
   bucket from it from the next forward on. A compile that fails, times out, fails its check or runs out of memory
   leaves the bucket on its eager graph (noted, counted); no request fails or waits on it.

While the thread runs GPU work it holds the runner's ``gate`` (CUDA graph runner), which captures also take: a
device-wide synchronization (the compile's own, inductor's benchmarking) during another thread's capture would
invalidate that capture.

The compile must not starve serving. Its thread is pinned (``os.sched_setaffinity``, the calling thread's mask on
Linux, inherited by the compiler processes inductor starts from it) to every CPU but the first
:func:`reserved_cpus` ones, which stay free for the denoising, decode and HTTP threads, and runs at ``nice`` +10;
Python's switch interval is shortened meanwhile (:data:`SWITCH_INTERVAL_S`), and the heap built before is frozen
(``gc.freeze``: dynamo's allocations trigger full collections, each a pause of every thread, that would scan it). The
bucket that served the most forwards so far is compiled first. What serving keeps meanwhile is measured in
docs/BENCHMARKS.md (``benchmarks/bench_background_compile.py``).

A compile must not break the requests served beside it. Inductor traces with ``torch.fx``'s ``Tracer`` (AOTAutograd's
``make_fx``, the pattern matcher), whose ``_Patcher`` replaces ``torch.nn.Module.__call__`` and ``__getattr__``
process-wide while it traces: a module call on a serving thread in that window went through the tracer's wrapper and
raised ``NameError: module is not installed as a submodule`` (seen in one CPU test run of three).
:func:`~bcg_core.runners.fx_threads.isolate_fx_patches` binds every such patch to the thread that made it; background
compiles run only where it could be installed (:meth:`BackgroundCompiles.start`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

from bcg_core.keys import BucketKey
from bcg_core.runners.base import BucketEntry, fused_buffers
from bcg_core.runners.fx_threads import isolate_fx_patches
from bcg_core.runners.kernels import CompileFailed, KernelTier
from bcg_core.verify import compile_entry

__all__ = ["BackgroundCompiles", "compile_pending", "reserved_cpus"]

log = logging.getLogger(__name__)

NICE = 10
"""``nice`` increment of the background compile thread: the scheduler favours the serving threads."""

SWITCH_INTERVAL_S = 0.0005
"""Python's thread switch interval while a background compile runs (``sys.setswitchinterval``; CPython's default is
5 ms). Dynamo's tracing and inductor's code generation are Python that holds the GIL; a serving thread that released
it (a CUDA synchronization, a queue wait) waits up to one interval to take it back, several times per denoising step.
The old interval is restored when nothing is left to compile."""


def reserved_cpus(count: int) -> int:
    """CPUs left to serving while a background compile runs, of ``count`` this process may use: a quarter, at least
    one, at most four (the denoising, decode, image-encode and HTTP threads; a 16-core GPU host keeps 4, gives the
    compile 12); none on a single CPU."""
    return 0 if count <= 1 else max(1, min(4, count // 4))


def _pin_this_thread() -> str:
    """Pin the calling thread to all but :func:`reserved_cpus` of its CPUs and lower its priority; what was done."""
    done = []
    try:
        cpus = sorted(os.sched_getaffinity(0))
        keep = reserved_cpus(len(cpus))
        if keep:
            os.sched_setaffinity(0, cpus[keep:])
            done.append(f"CPUs {cpus[keep]}-{cpus[-1]} ({len(cpus) - keep} of {len(cpus)})")
    except (AttributeError, OSError) as e:  # not Linux, or a mask the container refuses
        done.append(f"not pinned ({e})")
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        done.append(f"nice +{NICE}")
    except (AttributeError, OSError) as e:
        done.append(f"priority unchanged ({e})")
    return ", ".join(done)


def compile_pending(runner, key: BucketKey, stream=None) -> tuple[str, float | None]:
    """Compile pending bucket ``key`` of ``runner`` on new static buffers, check it, and swap it in (module docstring).

    Args:
        runner: a bucket runner with compiled kernels (``runner.kernels``).
        key: a bucket :meth:`~bcg_core.runners.base.BucketRunner.pending_compiles` lists.
        stream: the CUDA stream to compile on (None: the current one).

    Returns:
        ``(outcome, factor)``: ``"swapped"`` with the new forward's time over the old one's (None where unmeasured),
        ``"failed"`` (the bucket keeps eager kernels: the reason is its note) or ``"gone"`` (it no longer serves
        from the entry that was pending: dropped, demoted or replaced), factor None.
    """
    old = runner.entries.get(key)
    if old is None or not old.pending:
        return "gone", None
    t0 = time.perf_counter()
    try:
        on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with runner.gate, torch.inference_mode(), on_stream:
            new = BucketEntry(key, runner.adapter.allocate(key, runner.device, runner.dtype),
                              kernels=KernelTier.COMPILED)
            if runner.fused:
                new.fused = fused_buffers(key.batch, runner.device)
            compile_entry(runner.kernels, runner.adapter, new, lambda: runner.adapter.forward(new.buffers))
            if stream is not None:
                stream.synchronize()
    except (CompileFailed, torch.OutOfMemoryError) as e:
        return _failed(runner, old, str(e) if isinstance(e, CompileFailed) else f"out of memory while compiling: {e}")
    try:
        factor = runner.swap_in(old, new)
    except KeyError:
        return "gone", None
    except Exception as e:  # noqa: BLE001 - a capture of compiled kernels that raises: the eager graph stays
        if stream is not None:
            torch.cuda.synchronize(runner.device)
        return _failed(runner, old, f"compiled capture failed: {type(e).__name__}: {e}")
    log.info("bucket %s: compiled kernels swapped in after %.1f s%s", key, time.perf_counter() - t0,
             "" if factor is None else f" (forward x{factor:.3f} of the eager graph's)")
    return "swapped", factor


def _failed(runner, entry: BucketEntry, why: str) -> tuple[str, None]:
    """``entry`` keeps eager kernels for good: noted, counted, logged."""
    entry.pending = False
    entry.note = why.splitlines()[0][:300] if why else "compile failed"
    log.warning("bucket %s keeps eager kernels: %s", entry.key, entry.note)
    return "failed", None


class BackgroundCompiles:
    """The thread that compiles a runner's pending buckets, one at a time, busiest first (module docstring).

    Args:
        runner: the replica's bucket runner (compiled kernels; buckets prepared with ``defer_compiles``).
        on_swap: called on the compile thread after each swap with the bucket and the new forward's time over the
            old one's (None where unmeasured): the step scheduler rescales its cost model.
        pin: pin the thread's CPUs and lower its priority (:func:`reserved_cpus`); tests on a shared CPU turn it off.

    Attributes:
        swapped, failed: buckets swapped in, and left on eager kernels, by this object.
        started_at, finished_at: ``time.monotonic()`` of the first start and of the moment nothing was left pending
            (None until then).
    """

    def __init__(self, runner, on_swap: Callable[[BucketKey, float | None], None] | None = None, pin: bool = True):
        self.runner = runner
        self.on_swap = on_swap
        self.pin = pin
        self.swapped = self.failed = 0
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.current: BucketKey | None = None
        self.pinning = ""
        """What pinning did, in words (``/v1/buckets``)."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> bool:
        """Start the thread if buckets are pending and it is not running (again after buckets were added); True if
        it runs now."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return True
            if self.runner.kernels is None or not self.runner.pending_compiles() or self._stop.is_set():
                return False
            if not isolate_fx_patches():
                log.warning("this torch has no torch.fx _Patcher to isolate: %d bucket(s) keep eager kernels "
                            "(set runner.compile_in_background: false to compile before ready)",
                            len(self.runner.pending_compiles()))
                for key in self.runner.pending_compiles():
                    _failed(self.runner, self.runner.entries[key], "compile_failed: no background compile on this "
                            "torch (torch.fx patches could not be isolated)")
                return False
            self.started_at = self.started_at or time.monotonic()
            self.finished_at = None
            self._thread = threading.Thread(target=self._run, name="bcg-background-compile", daemon=True)
            self._thread.start()
            return True

    def _run(self) -> None:
        if self.pin:
            self.pinning = _pin_this_thread()
        device = self.runner.device
        stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
        total = len(self.runner.pending_compiles())
        log.info("compiling %d bucket(s) in the background (%s)", total, self.pinning or "not pinned")
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
        gc.freeze()  # the replica's heap so far is long-lived: the compiles' full collections need not scan it
        try:
            self._compile_all(stream)
        finally:
            sys.setswitchinterval(interval)
        self.current = None
        if not self.runner.pending_compiles():
            self.finished_at = time.monotonic()
            log.info("every bucket compiled in the background: %d swapped, %d kept eager kernels, %.1f s",
                     self.swapped, self.failed, self.finished_at - (self.started_at or self.finished_at))

    def _compile_all(self, stream) -> None:
        """Compile the pending buckets one at a time: first the one that served the most forwards so far (the
        traffic gains most from it), ties in preparation order (largest first)."""
        while not self._stop.is_set():
            pending = self.runner.pending_compiles()
            if not pending:
                break
            entries = self.runner.entries
            self.current = max(pending, key=lambda k: (entries[k].forwards if k in entries else 0,
                                                       -pending.index(k)))
            try:
                outcome, factor = compile_pending(self.runner, self.current, stream)
            except Exception as e:  # noqa: BLE001 - never leave a bucket pending forever
                outcome, factor = _failed(self.runner, self.runner.entries[self.current], f"{type(e).__name__}: {e}")
            if outcome == "swapped":
                self.swapped += 1
                if self.on_swap is not None:
                    try:
                        self.on_swap(self.current, factor)
                    except Exception:  # noqa: BLE001 - the swap stands; only the cost model missed it
                        log.exception("after the swap of bucket %s", self.current)
            elif outcome == "failed":
                self.failed += 1

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end; True when nothing is pending any more."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return not self.runner.pending_compiles()

    def stop(self, timeout_s: float | None = 5.0) -> None:
        """Stop after the bucket being compiled (its compile is not interrupted) and wait up to ``timeout_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def describe(self) -> dict:
        """JSON-ready state for ``/v1/buckets``' ``kernels.background``: buckets pending, swapped and failed, the
        one compiling, seconds since the start (until the last one finished), ``done`` (nothing pending and nothing
        running: also on a warm start, where nothing was ever pending), and the pinning."""
        end = self.finished_at or time.monotonic()
        pending, running = len(self.runner.pending_compiles()), self._thread is not None and self._thread.is_alive()
        return {"pending": pending, "swapped": self.swapped, "failed": self.failed,
                "compiling": None if self.current is None else str(self.current), "running": running,
                "elapsed_s": None if self.started_at is None else round(end - self.started_at, 3),
                "done": not pending and not running, "pinning": self.pinning}
