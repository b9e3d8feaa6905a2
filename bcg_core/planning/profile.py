"""Whether CUDA graphs pay for a model and shape: eager vs graph vs kernel-busy time per step.

A graph removes the CPU's launch overhead and the GPU's idle gaps between kernels; it cannot make a
kernel faster. So the sum of kernel durations of one eager forward (the *kernel-busy floor*) bounds what
replay can reach, and ``eager_ms / floor_ms`` says how launch-bound the eager step is (docs/DESIGN.md section 1:
PixArt 512x512 ~4.4x, FLUX.1-dev 1024x1024 ~1.03x). ``bcg profile`` prints these per bucket;
``benchmarks/bench_graphs.py`` uses the same timers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bcg_core.devices import cuda_ms
from bcg_core.padding import DiTAdapter
from bcg_core.runners.base import BucketRunner
from bcg_core.verify_inputs import BoundaryCase, random_inputs

__all__ = ["ProfileRow", "cuda_ms", "kernel_floor", "profile_case"]

PAYS_RATIO = 1.10
"""Eager / graph ratio above which graphs are said to pay (10%: beyond eager's run-to-run swing)."""


def kernel_floor(fn) -> tuple[float, int]:
    """``(kernel-busy ms, kernel count)`` of one ``fn()`` call: the sum of CUDA kernel durations (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e3, len(kernels)


@dataclass
class ProfileRow:
    """One bucket's step timings in milliseconds (see the module docstring)."""

    key: str
    kernels: int
    eager_ms: float
    graph_ms: float
    floor_ms: float
    pool_bytes: int = 0
    """Bytes the bucket's capture added to the shared graph pool (0: not captured, or nothing added)."""

    @property
    def speedup(self) -> float:
        """Eager / graph."""
        return self.eager_ms / self.graph_ms

    @property
    def verdict(self) -> str:
        """``"graphs pay"`` when replay beats eager by more than :data:`PAYS_RATIO`, else why not."""
        if self.speedup >= PAYS_RATIO:
            return f"graphs pay ({self.speedup:.2f}x): the eager step is launch-bound"
        if self.eager_ms <= self.floor_ms * PAYS_RATIO:
            return f"compute-bound ({self.speedup:.2f}x): eager already keeps the GPU busy"
        return f"little gain ({self.speedup:.2f}x) although eager is {self.eager_ms / self.floor_ms:.2f}x the floor"


def profile_case(adapter: DiTAdapter, runner: BucketRunner, case: BoundaryCase, device, dtype,
                 iters: int = 10) -> ProfileRow:
    """Time one bucket: unpadded eager forward, runner forward (replay), and the kernel-busy floor.

    Raises:
        RuntimeError: without CUDA (the timers are CUDA events).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bcg profile needs a CUDA GPU: it times CUDA kernels and graph replay")
    x = random_inputs(adapter, case, device, dtype)
    with torch.inference_mode():
        eager = cuda_ms(lambda: adapter.forward_eager(x), iters)
        floor, kernels = kernel_floor(lambda: adapter.forward_eager(x))
    graph = cuda_ms(lambda: runner.run(case.key, x), iters)
    return ProfileRow(str(case.key), kernels, eager, graph, floor)
