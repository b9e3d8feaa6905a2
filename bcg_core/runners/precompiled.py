"""Precompiled blocks: a warm start that loads each bucket's compiled block code from disk instead of tracing it.

With ``torch.compile`` alone, a restart with a warm inductor cache still runs dynamo on every repeated block at
every bucket shape (the FX graph cache is keyed by the traced graph, so the trace comes first). On an H200, a warm
start of a 12-graph FLUX.1-dev table spent 34.6 s compiling with traced blocks and 22.5 s with precompiled ones,
the rest being the buckets' warm-up and check forwards (docs/BENCHMARKS.md, 2026-12-03). PyTorch's ahead-of-time
compile (``torch.compile(fn, fullgraph=True).aot_compile((args, kwargs))``, ``save_compiled_function``,
``torch.compiler.load_compiled_function``: dynamo's bytecode and inductor's compiled code in one file, the
mechanism vLLM's ``VLLM_USE_AOT_COMPILE`` uses) removes the trace from a warm start.

The compiled function is ``run(block, *args, **kwargs) = type(block).forward(block, *args, **kwargs)``: the block
is an input, so its parameters are read at each call and one artifact serves every block of a class with the
same structure (regional compilation, as with ``torch.compile`` on the blocks). Dynamo's guards are skipped
(``torch.compiler.skip_all_guards_unsafe``), because they cannot all be serialized (a module's identity) and
because bcg-serve chooses the artifact itself, by a key (:meth:`PrecompiledBlocks.function`) of everything the
guards would check and more:

- the block: its class, the source of every class it runs (:func:`_code`), and its structure (every submodule's
  class and plain attributes, every parameter's and buffer's name, shape, stride, dtype and tensor class: a block
  built with other flags, such as SD3's last joint block with ``context_pre_only``, or a float8 block, gets its
  own);
- the inputs: every tensor's shape, stride, dtype, device and which inputs share storage, every other value, and
  whether autograd records;
- the compile: inductor's mode, the SDPA backend traced in (:mod:`bcg_core.runners.attention`);
- the environment: Python, torch (version and commit), diffusers, bcg-serve, Triton, torchao, the GPU and its
  compute capability; TF32 and float32 matmul precision.

A file of another environment, block or input layout has another name and is never looked up; a file that does
not load (torn, truncated, unpickling raises) is deleted and compiled again, never called; one this process may
not read (another user's) is left and compiled for this process only. Every bucket's compiled forward is also
checked against its eager one when it is prepared (:func:`bcg_core.verify.compile_entry`), as for a plain
compile.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from bcg_core.errors import first_line

log = logging.getLogger(__name__)

__all__ = ["NotPrecompiled", "PrecompiledBlocks", "available", "block_signature", "compile_options", "inputs_signature"]

_PLAIN = (bool, int, float, str, type(None))


def available(compile_fn: Callable) -> bool:
    """Whether this torch has the ahead-of-time compile API (torch 2.10 and newer) and ``compile_fn`` is
    ``torch.compile`` itself (tests pass stand-ins, which keep the traced path)."""
    return (compile_fn is torch.compile and hasattr(torch.compiler, "load_compiled_function")
            and hasattr(torch.compiler, "skip_all_guards_unsafe")
            and hasattr(torch._dynamo.config, "enable_aot_compile"))


def _plain(value, depth: int = 0):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and depth < 2:
        return tuple(_plain(v, depth + 1) for v in value)
    if isinstance(value, torch.dtype):
        return str(value)
    return None


def _attributes(obj) -> list:
    """``obj``'s plain attributes (numbers, strings, flags, dtypes, short tuples of them), sorted, and for each
    attribute that is another object (an attention processor, say) its class name and its own plain attributes."""
    out = []
    for k, v in sorted(vars(obj).items()):
        if k in ("training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set") or \
                k.endswith("hooks") or k.startswith("_forward") or k.startswith("_backward") or \
                k.startswith("_state_dict") or k.startswith("_load_state_dict"):
            continue
        p = _plain(v)
        if p is not None or v is None:
            out.append((k, p))
        elif isinstance(v, (torch.nn.Module, torch.Tensor)) or callable(v) and not hasattr(v, "__dict__"):
            continue
        elif hasattr(v, "__dict__"):
            out.append((k, type(v).__qualname__,
                        tuple((a, _plain(b)) for a, b in sorted(vars(v).items()) if _plain(b) is not None)))
    return out


def _tensor(t: torch.Tensor, batch: int | None = None) -> tuple:
    shape = tuple(t.shape)
    if batch is not None and t.ndim >= 2 and shape[0] == batch:  # a dynamic batch dimension (shared_batch)
        shape = ("B", *shape[1:])
    return (shape, tuple(t.stride()), str(t.dtype), str(t.device), type(t).__qualname__, t.requires_grad)


def block_signature(block: torch.nn.Module) -> str:
    """A text that differs between two blocks whenever one compiled code may not serve both: per submodule its
    class and :func:`_attributes`, per parameter and buffer its name, shape, stride, dtype, device, tensor class."""
    parts = []
    for name, m in block.named_modules():
        parts.append((name, type(m).__qualname__, _attributes(m)))
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
        parts.append((name, _tensor(t)))
    return repr(parts)


def inputs_signature(args: tuple, kwargs: dict, batch: int | None = None) -> str:
    """A text of a call's inputs: each tensor's :func:`_tensor` and the index of the first input sharing its
    storage, every other value's ``repr`` (None, numbers, flags; a value of another kind by its class name), and
    whether autograd records. With ``batch`` (a batch dimension left dynamic:
    :func:`~bcg_core.runners.kernels.shared_batch`), a tensor whose first size is ``batch`` reads ``B`` there, so
    every batch of the class has one signature (strides and offsets stay exact: a layout that depends on the batch
    is another signature)."""
    storages: dict[int, int] = {}
    index = [0]

    def one(v):
        if isinstance(v, torch.Tensor):
            ptr = v.untyped_storage().data_ptr()
            first = storages.setdefault(ptr, index[0])
            index[0] += 1
            return ("T", _tensor(v, batch), first, v.storage_offset())
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, tuple(one(x) for x in v))
        if isinstance(v, dict):
            return ("dict", tuple((k, one(x)) for k, x in sorted(v.items())))
        return repr(v) if isinstance(v, _PLAIN) else type(v).__qualname__

    return repr((tuple(one(a) for a in args), tuple((k, one(v)) for k, v in sorted(kwargs.items())),
                 torch.is_grad_enabled(), torch.is_inference_mode_enabled()))


def _environment(device: torch.device) -> str:
    import diffusers

    gpu = ""
    if device.type == "cuda":
        gpu = f"{torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"
    versions = []
    for name in ("triton", "torchao"):
        try:
            versions.append(getattr(__import__(name), "__version__", "?"))
        except ImportError:
            versions.append(None)
    try:
        from importlib.metadata import version

        bcg_version = version("bcg-serve")
    except Exception:  # noqa: BLE001 - a source tree that is not installed
        bcg_version = None
    return repr((sys.version, torch.__version__, torch.version.git_version, torch.version.cuda,
                 diffusers.__version__, bcg_version, versions, gpu))


def _numerics() -> tuple:
    """Process-wide settings that change what a compiled kernel computes (TF32, float32 matmul precision)."""
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32)


@functools.cache
def _class_code(cls: type) -> str:
    """``cls``'s source (read once per process: every block of a class asks for the same classes)."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return repr(sorted((k, v.__code__.co_code) for k, v in vars(cls).items() if hasattr(v, "__code__")))


def _code(block: torch.nn.Module) -> str:
    """SHA-256 of the source of every class the block's forward may run: each submodule's class and the class of
    each object attribute of theirs (an attention processor, say), with their bases up to ``nn.Module``; a change
    to any of them (another diffusers build of the same version, bcg-serve's own processors) is another key."""
    classes: dict[str, type] = {}
    for m in block.modules():
        for cls in type(m).__mro__:
            if cls in (torch.nn.Module, object):
                break
            classes.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
        for v in vars(m).values():
            if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type)) and \
                    not inspect.isroutine(v):
                classes.setdefault(f"{type(v).__module__}.{type(v).__qualname__}", type(v))
    text = repr(sorted((name, _class_code(cls)) for name, cls in classes.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _runner(cls: type) -> Callable:
    """The function compiled for blocks of class ``cls``: its ``forward`` with the block as an input (dynamo traces
    a plain function that takes a module, not ``type(block).forward``)."""
    forward = cls.forward

    def run(block, *args, **kwargs):
        return forward(block, *args, **kwargs)

    return run


def compile_options(options: dict) -> dict:
    """``torch.compile`` keyword arguments of an ahead-of-time block compile: ``options`` with every guard skipped
    (``guard_filter_fn``: the block runs only at the shapes it was compiled for). ``torch.compile`` refuses ``mode``
    beside ``options`` ("Either mode or options can be specified"), so a mode other than ``default`` is given as
    the inductor options it stands for (``torch._inductor.list_mode_options``: ``max-autotune-no-cudagraphs`` is
    ``max_autotune`` and ``coordinate_descent_tuning``). A fresh dict per call: torch.compile pops
    ``guard_filter_fn`` out of the one it is given."""
    from torch._inductor import list_mode_options

    rest = dict(options)
    mode = rest.pop("mode", None)
    inductor = {**(list_mode_options(mode) if mode not in (None, "default") else {}), **rest.pop("options", {})}
    return {**rest, "options": {**inductor, "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}}


class NotPrecompiled(Exception):
    """A block's compiled function is neither in memory nor on disk, and the caller asked only to load one
    (:meth:`PrecompiledBlocks.function` ``load_only``): compiling it now would take seconds to minutes."""


class PrecompiledBlocks:
    """The ahead-of-time compiled block functions of a replica, on disk under ``folder`` and in memory.

    Args:
        folder: where artifacts live (``<runner.compile_cache_dir>/bcg-precompiled``), created if absent.
        options: ``torch.compile`` keyword options (``fullgraph``, ``dynamic``, ``mode``...) of the blocks.
        device: the replica's device (for the environment in each key).

    Attributes:
        loads: artifacts read from disk in this process (warm).
        saves: artifacts compiled and written in this process (cold).
        rebuilt: files that failed to load (corrupt, another environment) and were compiled again.
        unsaved: compiled functions that could not be written (they serve this process only).
        discarded: files deleted because the bucket they compiled failed its check (:meth:`discard_used`).
    """

    SUFFIX = ".aot"

    def __init__(self, folder: str | os.PathLike, options: dict, device: torch.device):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.options = options
        self.mode = options.get("mode", "default")
        self.device = torch.device(device)
        self._env = _environment(self.device)
        self._fns: dict[str, Callable] = {}
        self._paths: dict[str, Path | None] = {}  # in-memory key -> its file (None: not saved)
        self._blocks: dict[int, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._used = threading.local()
        self.loads = self.saves = self.rebuilt = self.unsaved = self.discarded = 0

    def _block(self, block) -> tuple[str, str]:
        cached = self._blocks.get(id(block))
        if cached is None:
            cls = type(block)
            cached = (cls.__qualname__, repr((f"{cls.__module__}.{cls.__qualname__}", _code(block),
                                              block_signature(block))))
            self._blocks[id(block)] = cached
        return cached

    def _file_name(self, memory: str, block, attention) -> str:
        """The file's name: the block's class and a hash of ``memory`` (the in-memory key), inductor's mode, the
        SDPA backend, :func:`_numerics` and the environment (a process serves one backend per bucket shape, as
        dynamo's own guards assume, so the in-memory key leaves the backend out)."""
        text = repr((memory, self.mode, attention, _numerics(), self._env))
        return f"{self._block(block)[0]}-{hashlib.sha256(text.encode()).hexdigest()[:40]}"

    def function(self, block: torch.nn.Module, args: tuple, kwargs: dict, attention: str | None,
                 load_only: bool = False, batch: int | None = None) -> Callable:
        """The compiled ``run(block, *args, **kwargs)`` for this block structure and these inputs: from memory,
        else from disk, else compiled now (``aot_compile`` with ``args``, ``kwargs`` as the example) and written
        (atomically: a temp file renamed). Call it inside the bucket's compile context (SDPA backend, cache key,
        deadline: :meth:`~bcg_core.runners.kernels.CompiledKernels.compiling`).

        With ``batch`` (the inputs' batch dimension marked dynamic), one function serves every batch size above 1
        of these token shapes (:func:`inputs_signature`); buckets of several batch sizes may then choose different
        SDPA backends, so the in-memory key holds the backend too.

        Raises:
            NotPrecompiled: with ``load_only``, where neither memory nor a readable file holds it (nothing is
                compiled: the probe of a warm start, :meth:`~bcg_core.runners.kernels.CompiledKernels.cached_only`).
            Whatever ``aot_compile`` raises (the caller turns it into a bucket on eager kernels).
        """
        key = repr((self._block(block)[1], inputs_signature(args, kwargs, batch), attention if batch else None))
        used = getattr(self._used, "keys", None)
        if used is not None:
            used.add(key)
        fn = self._fns.get(key)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._fns.get(key)
            if fn is not None:
                return fn
            path = self.folder / (self._file_name(key, block, attention) + self.SUFFIX)
            if path.is_file():
                try:
                    with open(path, "rb") as f:
                        fn = torch.compiler.load_compiled_function(f)
                    self.loads += 1
                except PermissionError as e:  # another user's file: compile for this process, leave the file
                    log.warning("precompiled block %s cannot be read (%s); compiling it for this process", path.name, e)
                    path = None
                except Exception as e:  # noqa: BLE001 - a truncated or torn file: rebuild, never call it
                    log.warning("precompiled block %s did not load (%s: %s); compiling it again", path.name,
                                type(e).__name__, first_line(e, limit=200))
                    path.unlink(missing_ok=True)
                    self.rebuilt += 1
                    fn = None
            if fn is None and load_only:
                raise NotPrecompiled(f"{type(block).__qualname__} is not compiled for these inputs yet")
            if fn is None:
                options = compile_options(self.options)
                # torch 2.10-2.12 attach .aot_compile only under this flag (later ones always do)
                with torch._dynamo.config.patch(enable_aot_compile=True):
                    compiled = torch.compile(_runner(type(block)), **options)
                fn = compiled.aot_compile(((block, *args), kwargs))
                if path is None:
                    self.unsaved += 1
                else:
                    self._save(fn, path)
            self._fns[key] = fn
            self._paths[key] = path
            return fn

    def begin(self) -> None:
        """Start recording, on this thread, which functions a bucket's compile uses (:meth:`discard_used`)."""
        self._used.keys = set()

    def discard_used(self) -> int:
        """Forget the functions this thread's compile used since :meth:`begin` and delete their files: the bucket
        they compiled failed its check against eager kernels, so neither this process nor a restart may run
        them again (the next compile of those shapes starts from scratch). Returns the files deleted."""
        keys, self._used.keys = getattr(self._used, "keys", None) or set(), None
        deleted = 0
        with self._lock:
            for key in keys:
                self._fns.pop(key, None)
                path = self._paths.pop(key, None)
                if path is not None and path.is_file():
                    path.unlink(missing_ok=True)
                    deleted += 1
            self.discarded += deleted
        if deleted:
            log.warning("deleted %d precompiled block file(s) of a bucket that failed its check", deleted)
        return deleted

    def _save(self, fn, path: Path) -> None:
        """Write ``fn`` to ``path`` through a temp file renamed into place, readable by every user (torch writes
        0600; replicas may run as another user than ``bcg warm``); a failure leaves ``fn`` to this process."""
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            fn.save_compiled_function(str(tmp))
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            self.saves += 1
        except Exception as e:  # noqa: BLE001 - the compiled code runs; only the next start compiles again
            tmp.unlink(missing_ok=True)
            self.unsaved += 1
            log.warning("precompiled block %s could not be written (%s: %s); it serves this process only",
                        path.name, type(e).__name__, first_line(e, limit=200))
