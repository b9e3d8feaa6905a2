"""Bucket runners: each runs the forward it is handed on a bucket's static buffers and decides nothing.

``base.py`` holds the contract (:class:`BucketRunner`, :class:`RunMode`, the per-bucket :class:`BucketEntry`),
``eager.py`` the eager runner (CPU, CI), ``cuda_graph.py`` capture into one shared memory pool and replay, and
``fused.py`` the guidance and Euler update captured after the transformer, ``build.py`` the runner and kernels
``config.runner`` asks for. docs/DESIGN.md section 3.
"""

from bcg_core.runners.base import BucketEntry, BucketFault, BucketRunner, RunMode
from bcg_core.runners.eager import EagerBucketRunner

__all__ = ["BucketEntry", "BucketFault", "BucketRunner", "CudaGraphRunner", "EagerBucketRunner", "RunMode"]


def __getattr__(name: str):
    """:class:`CudaGraphRunner`, imported on first use."""
    if name == "CudaGraphRunner":
        from bcg_core.runners.cuda_graph import CudaGraphRunner

        return CudaGraphRunner
    raise AttributeError(f"module 'bcg_core.runners' has no attribute {name!r}")
