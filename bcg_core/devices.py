"""Where the engine's work runs and how long it took there: the configured device and dtype, and timing marks.

On CUDA a timing mark is an event recorded on the current stream (read later, without a host sync); elsewhere
the host clock. :func:`cuda_ms` times a callable with CUDA events (the host clock on a CPU).
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["cuda_ms", "elapsed_ms", "resolve_device", "timing_mark", "torch_dtype"]


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU.

    Raises:
        ValueError: ``"cuda"`` asked for where no CUDA device is visible.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device is 'cuda' but no CUDA device is visible here; use 'auto' or 'cpu'")
    return torch.device(device)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config name (``"float32"``, ``"bfloat16"``, ``"float16"``)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def timing_mark(device: torch.device) -> float | torch.cuda.Event:
    """A point in time of work on ``device``: on CUDA an event recorded on the current stream (the GPU's time
    when it gets there, read later without a host sync), elsewhere the host clock in seconds."""
    if torch.device(device).type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def elapsed_ms(a: float | torch.cuda.Event, b: float | torch.cuda.Event) -> float:
    """Milliseconds between two :func:`timing_mark` points (CUDA events: ``b`` must have completed)."""
    return float(a.elapsed_time(b)) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def cuda_ms(fn, iters: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, timed with CUDA events after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
