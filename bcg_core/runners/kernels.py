"""Kernel tiers: which kernels a bucket's forward runs, under its graph or on its static buffers.

- ``eager`` (:attr:`KernelTier.EAGER`): PyTorch's eager kernels, exactly diffusers' bits.
- ``compiled`` (:attr:`KernelTier.COMPILED`): the transformer's repeated blocks compiled by ``torch.compile``
  (inductor, ``dynamic=False``, ``fullgraph=True``: one static-shape compile per bucket shape), the rest eager.
  This is regional compilation as diffusers' ``ModelMixin.compile_repeated_blocks`` does it, on the blocks its
  ``_repeated_blocks`` names (FLUX.1, Qwen-Image) or, for transformers that name none, on their transformer
  blocks (:data:`REPEATED_BLOCKS`: SD3, PixArt-Sigma, SANA); a transformer with neither is compiled whole.
  bcg-serve owns the CUDA graphs: inductor's own (``mode="reduce-overhead"``) stay off, and its kernels are
  captured into the bucket's graph in the shared pool like eager ones.

:class:`CompiledKernels` installs the compiled blocks beside the eager ones and switches per forward
(:meth:`CompiledKernels.active`): a bucket whose compile failed, an unpadded eager forward (a miss, whose shapes
vary) and every forward outside a bucket keep eager kernels, so a failed compile costs speed, never service.
On a CPU the same code runs (inductor's C++ backend; it needs a C++ compiler), which is what CI exercises; only
the capture into a CUDA graph needs a GPU.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch

__all__ = ["REPEATED_BLOCKS", "CompileFailed", "CompiledKernels", "KernelTier", "repeated_blocks"]

log = logging.getLogger(__name__)


class KernelTier(str, enum.Enum):
    """The kernels of a deployment's bucket forwards (``runner.kernels``)."""

    EAGER = "eager"
    """PyTorch's eager kernels: diffusers' exact bits."""
    COMPILED = "compiled"
    """Regional ``torch.compile`` of the repeated transformer blocks (this module's docstring)."""


REPEATED_BLOCKS: dict[str, tuple[str, ...]] = {
    "SD3Transformer2DModel": ("JointTransformerBlock",),
    "PixArtTransformer2DModel": ("BasicTransformerBlock",),
    "SanaTransformer2DModel": ("SanaTransformerBlock",),
}
"""Repeated blocks of the diffusers transformers whose class names none in ``_repeated_blocks`` (diffusers
0.42.1): their ``transformer_blocks`` entries."""


class CompileFailed(RuntimeError):
    """A bucket's compile (or its first compiled forward) raised; the bucket keeps eager kernels."""


def repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules :class:`CompiledKernels` compiles: those of ``transformer`` whose class name is in its
    ``_repeated_blocks`` (diffusers' own list) or in :data:`REPEATED_BLOCKS`; empty when it has neither."""
    names = tuple(getattr(transformer, "_repeated_blocks", None) or ()) or REPEATED_BLOCKS.get(
        type(transformer).__name__, ())
    return [m for m in transformer.modules() if type(m).__name__ in names]


class CompiledKernels:
    """Compiled kernels installed beside a transformer's eager ones, chosen per forward.

    Each repeated block's ``forward`` is replaced by a switch: inside :meth:`active` it calls
    ``compile_fn(original forward)``, elsewhere the original. Parameters, buffers, state dict and hooks are the
    block's own (nothing is copied or renamed). Dynamo's recompile limits are raised so that every bucket shape
    gets its own static compile instead of falling back to eager after eight shapes.

    Args:
        transformer: the family's transformer (an ``nn.Module``), already on its device and dtype.
        compile_fn: ``torch.compile`` (the default) or a stand-in with its signature (tests).
        mode: inductor's mode, ``"default"`` or ``"max-autotune-no-cudagraphs"`` (never one that captures CUDA
            graphs of its own).
        max_shapes: compiles each block may hold (one per bucket shape it serves; raises dynamo's
            ``recompile_limit`` and ``accumulated_recompile_limit`` to at least this).

    Raises:
        ValueError: a mode that would capture inductor's own CUDA graphs.
    """

    def __init__(self, transformer: torch.nn.Module, compile_fn: Callable = torch.compile, mode: str = "default",
                 max_shapes: int = 256):
        if "cudagraphs" not in mode and mode != "default":
            raise ValueError(f"inductor mode {mode!r} captures CUDA graphs of its own; bcg-serve owns the graphs: "
                             f"use 'default' or 'max-autotune-no-cudagraphs'")
        self.mode = mode
        self.blocks = repeated_blocks(transformer) or [transformer]
        self.regional = self.blocks[0] is not transformer
        self._local = threading.local()
        options = dict(fullgraph=True, dynamic=False, backend="inductor")
        if mode != "default":
            options["mode"] = mode
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), max_shapes * (len(self.blocks) if "accumulated" in name
                                                                          else 1)))
        for block in self.blocks:
            eager = block.forward
            compiled = compile_fn(eager, **options)
            block.forward = self._switch(eager, compiled)
        self.compile_s = 0.0
        """Seconds spent in forwards that compiled (first forwards of a shape under :meth:`compiling`)."""

    def _switch(self, eager: Callable, compiled: Callable) -> Callable:
        local = self._local

        def forward(*args, **kwargs):
            return (compiled if getattr(local, "on", False) else eager)(*args, **kwargs)

        return forward

    @property
    def on(self) -> bool:
        """True inside :meth:`active` on this thread."""
        return bool(getattr(self._local, "on", False))

    @contextlib.contextmanager
    def active(self, on: bool = True) -> Iterator[None]:
        """Forwards on this thread run the compiled blocks (``on``) or the eager ones, until the block exits."""
        before = self.on
        self._local.on = on
        try:
            yield
        finally:
            self._local.on = before

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """:meth:`active`, timing the block into :attr:`compile_s` and turning a compile error into
        :class:`CompileFailed` (out of memory is re-raised as it is: the caller degrades as for a capture).

        Raises:
            CompileFailed: the compile, or the compiled forward, raised (the message names the first line).
            torch.OutOfMemoryError: out of memory while compiling.
        """
        t0 = time.perf_counter()
        try:
            with self.active():
                yield
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - dynamo and inductor raise many types; the bucket goes eager
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CompileFailed(f"compile_failed: {type(e).__name__}: {first}"[:300]) from e
        finally:
            self.compile_s += time.perf_counter() - t0
