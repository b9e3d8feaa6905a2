"""Attention backend per bucket: the SDPA kernel a bucket's compiled forward runs, chosen by measurement.

PyTorch's ``scaled_dot_product_attention`` dispatches to one of several kernels (cuDNN, FlashAttention-2, the
memory-efficient one, the math fallback) by a fixed priority, not by speed. At FLUX.1's shape (24 heads of 128,
1,536 to 4,608 tokens) cuDNN ran 1.9-2.0x faster than flash on an H200 (``benchmarks/bench_attention.py``,
docs/BENCHMARKS.md), and which one wins moves with the shape and with an attention mask. So for each bucket with
compiled kernels (:class:`~bcg_core.runners.kernels.CompiledKernels`), before its compile:

1. :func:`record_sdpa_calls` runs the bucket's eager forward once and records every SDPA call it makes (query,
   key, value shapes, dtype, mask, causal flag, scale), counting repeats (a FLUX.1-dev forward makes 57 calls of
   one shape);
2. :func:`choose_backend` times each candidate (:data:`CANDIDATES`: on CUDA cuDNN, flash and memory-efficient; on
   a CPU flash and math) on those calls with random inputs of the same shapes and the bucket's own mask, and picks
   the fastest that runs (a backend that cannot run a call, e.g. flash with a mask, is skipped);
3. the bucket compiles under :func:`attention_backend` of that choice: inductor lowers SDPA to the chosen
   backend's op when it traces, so the compiled forward, its check and its graph run that kernel.

Eager-kernel buckets and unpadded forwards keep PyTorch's own choice: that is diffusers' kernel, so its bits.

Two traps of torch.compile's on-disk caches are handled here. Inductor's FX graph and AOT autograd cache keys do
not include the SDPA backend selection (pytorch/pytorch issues 185449 and 194007): a process asking for cuDNN
would load a graph compiled for flash. :func:`compile_key` adds the backend to the key through inductor's
``post_grad_custom_post_pass`` slot, whose ``uuid()`` is hashed into both keys (a pass that changes nothing).
And a restart measures again; a near tie could pick another backend and miss the cache, so the choice is kept
in ``bcg-attention.json`` in the compile cache folder (:class:`ChoiceStore`), keyed by GPU, torch, cuDNN and the
calls, and a restart reuses it (``source: "cached"``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

__all__ = ["BACKENDS", "CANDIDATES", "ORDER_LOCK", "AttentionChoice", "ChoiceStore", "KeptValues", "RecordedCalls",
           "SdpaCall", "attention_backend", "choose", "choose_backend", "compile_key", "compiling_under", "environment",
           "model_signature", "record_sdpa_calls", "time_backend"]

log = logging.getLogger(__name__)

BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
"""``runner.attention`` names of PyTorch's SDPA backends (``torch.nn.attention.SDPBackend``)."""

CANDIDATES: dict[str, tuple[str, ...]] = {"cuda": ("cudnn", "flash", "efficient"), "cpu": ("flash", "math")}
"""Backends measured per device type. Math is a CPU candidate only: on a GPU it materialises the attention matrix
and is never the fastest. A FlashAttention-3 package is not a candidate (not a backend of SDPA)."""


@dataclass(frozen=True)
class SdpaCall:
    """One distinct ``scaled_dot_product_attention`` call of a forward (shapes, not values).

    Attributes:
        query, key, value: shapes, e.g. (batch, heads, tokens, head_dim).
        dtype: the inputs' dtype, e.g. ``"torch.bfloat16"``.
        mask: the attention mask's shape, or None.
        mask_dtype: its dtype (``torch.bool`` or floating), or None.
        is_causal, scale, enable_gqa: the call's arguments.
    """

    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: str
    mask: tuple[int, ...] | None = None
    mask_dtype: str | None = None
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    def describe(self) -> str:
        """A short stable text of the call (the key of :class:`ChoiceStore`)."""
        m = f" mask {self.mask} {self.mask_dtype}" if self.mask is not None else ""
        return (f"q{self.query} k{self.key} v{self.value} {self.dtype}{m} causal {self.is_causal} scale "
                f"{self.scale} gqa {self.enable_gqa}")


@dataclass
class RecordedCalls:
    """:func:`record_sdpa_calls`' result: each distinct call, how often it ran, and one mask it ran with."""

    counts: dict[SdpaCall, int] = field(default_factory=dict)
    masks: dict[SdpaCall, torch.Tensor] = field(default_factory=dict)

    def signature(self) -> str:
        """Every distinct call and its count, in a stable order."""
        return "; ".join(f"{n} x {c.describe()}" for c, n in sorted(self.counts.items(), key=lambda i: i[0].describe()))


class _Recorder(TorchFunctionMode):
    def __init__(self, calls: RecordedCalls):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            a = {**dict(zip(names, args, strict=False)), **kwargs}
            mask = a.get("attn_mask")
            call = SdpaCall(tuple(a["query"].shape), tuple(a["key"].shape), tuple(a["value"].shape),
                            str(a["query"].dtype), None if mask is None else tuple(mask.shape),
                            None if mask is None else str(mask.dtype), bool(a.get("is_causal", False)),
                            a.get("scale"), bool(a.get("enable_gqa", False)))
            self.calls.counts[call] = self.calls.counts.get(call, 0) + 1
            if mask is not None and call not in self.calls.masks:
                self.calls.masks[call] = mask.detach().clone()
        return func(*args, **kwargs)


def record_sdpa_calls(forward: Callable[[], object]) -> RecordedCalls:
    """Run ``forward()`` (an eager forward, under ``torch.inference_mode``) and record its SDPA calls.

    Calls made through ``torch.nn.functional.scaled_dot_product_attention`` are seen (diffusers' attention
    processors and its native attention dispatch use it); a kernel called some other way is not, and a forward
    without any SDPA call records nothing (:func:`choose_backend` then keeps PyTorch's default)."""
    calls = RecordedCalls()
    with torch.inference_mode(), _Recorder(calls):
        forward()
    return calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_backend(calls: RecordedCalls, backend: str, device: torch.device, iters: int = 5,
                 warmup: int = 2) -> float | None:
    """Milliseconds the calls of one forward take on ``backend``: each distinct call timed on random inputs of its
    shapes (and its recorded mask), mean of ``iters`` after ``warmup``, times its count, summed.

    Returns:
        None if ``backend`` cannot run one of the calls (PyTorch raises "No available kernel").
    """
    total = 0.0
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        # PyTorch warns for every backend that cannot run a call ("... kernel not used because"); here that is the
        # answer being measured, so the warnings are kept out of the replica's log
        with ORDER_LOCK, torch.inference_mode(), sdpa_kernel([BACKENDS[backend]]), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for call, count in calls.counts.items():
                dtype = getattr(torch, call.dtype.removeprefix("torch."))
                q, k, v = (torch.randn(s, generator=gen, device=device, dtype=dtype)
                           for s in (call.query, call.key, call.value))
                kw = dict(attn_mask=calls.masks.get(call), is_causal=call.is_causal, scale=call.scale)
                if call.enable_gqa:
                    kw["enable_gqa"] = True
                for _ in range(warmup):
                    F.scaled_dot_product_attention(q, k, v, **kw)
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(iters):
                    F.scaled_dot_product_attention(q, k, v, **kw)
                _sync(device)
                total += count * (time.perf_counter() - t0) * 1e3 / iters
    except RuntimeError as e:
        log.debug("SDPA backend %s cannot run these calls: %s", backend, str(e).splitlines()[0])
        return None
    return total


@dataclass
class AttentionChoice:
    """The SDPA backend of one bucket's compiled forward.

    Attributes:
        backend: a :data:`BACKENDS` name, or ``"default"`` (PyTorch's own priority; no SDPA call was seen, none of
            the candidates ran, or ``runner.attention: default``).
        times_ms: per candidate, the measured milliseconds of the forward's SDPA calls, None where it cannot run;
            empty when not measured in this process.
        source: ``"measured"``, ``"cached"`` (read from :class:`ChoiceStore`) or ``"configured"``.
    """

    backend: str
    times_ms: dict[str, float | None] = field(default_factory=dict)
    source: str = "measured"

    def describe(self) -> dict:
        """For ``/v1/buckets``: ``backend``, ``source`` and ``times_ms`` (rounded to 3 decimals)."""
        return {"backend": self.backend, "source": self.source,
                "times_ms": {k: None if v is None else round(v, 3) for k, v in self.times_ms.items()}}


def choose_backend(calls: RecordedCalls, device: torch.device, candidates: tuple[str, ...] | None = None,
                   iters: int = 5) -> AttentionChoice:
    """The fastest of ``candidates`` (default :data:`CANDIDATES` of ``device``'s type) on ``calls``
    (:func:`time_backend`); ``"default"`` when ``calls`` is empty or no candidate runs."""
    device = torch.device(device)
    if not calls.counts:
        return AttentionChoice("default")
    candidates = candidates or CANDIDATES.get(device.type, ())
    times = {b: time_backend(calls, b, device, iters=iters) for b in candidates}
    ran = {b: t for b, t in times.items() if t is not None}
    return AttentionChoice(min(ran, key=ran.get) if ran else "default", times)


ORDER_LOCK = threading.RLock()
"""Held while a compile sets SDPA's process-wide priority order (:func:`attention_backend`) or a backend is timed alone
(:func:`time_backend`), and by every forward that picks its SDPA kernel at run time
(:func:`bcg_core.runners.base.eager_forward`, a static forward of eager kernels): a compile in the background
(:mod:`bcg_core.runners.background`) would otherwise hand such a forward its bucket's backend instead of PyTorch's
default, and its bits would no longer be diffusers'. Graph replays and compiled code do not read the order (their kernel
is baked in) and never wait on it."""


def attention_backend(backend: str | None) -> contextlib.AbstractContextManager:
    """The context in which a bucket's compiled blocks are traced: ``backend`` first in SDPA's priority order, the
    others after it (``sdpa_kernel(..., set_priority=True)``), or nothing for ``"default"`` / None.

    The order is process-wide while the block runs; an SDPA call elsewhere in that time (a VAE decode on another
    thread) still finds a kernel that runs, since every backend stays enabled. Only tracing reads it: inductor
    bakes the chosen backend's op into the compiled code (and dynamo does not guard on it), so the compiled
    forward runs that kernel afterwards without the context, under its graph and outside it."""
    if backend is None or backend == "default":
        return contextlib.nullcontext()
    order = [BACKENDS[backend], *(b for name, b in BACKENDS.items() if name != backend)]
    stack = contextlib.ExitStack()
    stack.enter_context(ORDER_LOCK)  # eager forwards of other threads wait (ORDER_LOCK)
    stack.enter_context(sdpa_kernel(order, set_priority=True))
    return stack


@functools.cache
def _backend_key_class() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class BackendKey(CustomGraphPass):
        """A post-grad pass that changes nothing; its ``uuid()`` puts the SDPA backend in inductor's cache keys."""

        def __init__(self, backend: str):
            self.backend = backend

        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return f"bcg-serve sdpa backend {self.backend}"

    return BackendKey


def compile_key(backend: str | None) -> contextlib.AbstractContextManager:
    """While compiling under backend ``backend``: inductor's ``post_grad_custom_post_pass`` is a no-op
    :class:`torch._inductor.custom_graph_pass.CustomGraphPass` whose ``uuid()`` names the backend, so the FX graph
    and AOT autograd cache entries of different backends never collide (see the module docstring)."""
    from torch._inductor import config

    return config.patch(post_grad_custom_post_pass=_backend_key_class()(backend or "default"))


def environment() -> str:
    """What a choice depends on besides the calls: GPU (or CPU), torch and cuDNN versions."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return f"{gpu} | torch {torch.__version__} | cudnn {cudnn}"


class KeptValues:
    """A small JSON mapping kept beside the compile cache (``<folder>/<file>``), for what a restart would otherwise
    measure again. Every value must pass ``valid``; an unreadable file, or one with a single invalid value, is
    ignored (and rewritten on the next :meth:`put`), never trusted in part. A write creates the folder if needed,
    re-reads the file under an exclusive lock (``<file>.lock``, ``fcntl.flock``) so that replicas starting together
    keep each other's entries, and renames a temporary file into place; a write that fails (a read-only or full
    disk) is logged and the value kept in memory only: the next start measures it again.

    Args:
        folder: the compile cache folder, or None to keep values in memory only.
        file: the file's name in ``folder``.
        valid: whether a stored value may be used.
    """

    def __init__(self, folder: str | None, file: str, valid: Callable[[object], bool]):
        self.path = os.path.join(folder, file) if folder else None
        self._valid = valid
        self._lock = threading.Lock()
        self._data: dict[str, object] = self._read(warn=True)

    def _read(self, warn: bool = False) -> dict[str, object]:
        if not self.path or not os.path.exists(self.path):
            return {}
        try:
            data = json.loads(open(self.path).read())
            if isinstance(data, dict) and all(self._valid(v) for v in data.values()):
                return data
            why = "a value is not what it keeps"
        except (OSError, ValueError) as e:
            why = str(e)
        if warn:
            log.warning("ignoring %s: %s", self.path, why)
        return {}

    def get(self, key: str) -> object | None:
        """The value kept under ``key`` in this :func:`environment`, or None."""
        return self._data.get(f"{environment()} | {key}")

    def put(self, key: str, value: object) -> None:
        """Keep ``value`` under ``key`` in this :func:`environment` (written at once: class docstring)."""
        import fcntl

        with self._lock:
            self._data[f"{environment()} | {key}"] = value
            if not self.path:
                return
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                with open(f"{self.path}.lock", "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    self._data = {**self._read(), **self._data}  # another process's entries since this one read
                    tmp = f"{self.path}.{os.getpid()}.tmp"
                    with open(tmp, "w") as f:
                        json.dump(self._data, f, indent=1, sort_keys=True)
                    os.replace(tmp, self.path)
            except OSError as e:
                log.warning("could not write %s (%s); kept for this process only", self.path, e)


class ChoiceStore(KeptValues):
    """Measured choices kept beside the compile cache (``<folder>/bcg-attention.json``), so that a restart picks
    the backend its cached kernels were compiled for. Keyed by :func:`environment` and
    :meth:`RecordedCalls.signature`, or by a bucket's name (:meth:`get_bucket`).

    Args:
        folder: the compile cache folder, or None to keep choices in memory only.
    """

    FILE = "bcg-attention.json"

    def __init__(self, folder: str | None):
        super().__init__(folder, self.FILE, lambda v: isinstance(v, str) and v in (*BACKENDS, "default"))

    def get(self, calls: RecordedCalls) -> str | None:
        """The stored backend for ``calls`` in this environment, or None."""
        return super().get(calls.signature())

    def get_bucket(self, name: str) -> str | None:
        """The stored backend of bucket ``name`` (a model signature and a bucket key: what decides its calls) in
        this environment, or None: lets a restart skip the forward that records the calls."""
        return super().get(f"bucket {name}")

    def put_bucket(self, name: str, backend: str) -> None:
        """Keep ``backend`` for bucket ``name`` (:meth:`get_bucket`)."""
        super().put(f"bucket {name}", backend)

    def put(self, calls: RecordedCalls, backend: str) -> None:
        """Keep ``backend`` for ``calls`` (written at once, atomically)."""
        super().put(calls.signature(), backend)


def model_signature(transformer: torch.nn.Module) -> str:
    """16 hex digits that change with the transformer's class, its config, its parameters' dtype and the diffusers
    version: what decides a bucket's attention calls and compiled code (not its weights' values)."""
    import hashlib

    import diffusers

    first = next(transformer.parameters(), None)
    config = dict(getattr(transformer, "config", None) or {})
    return hashlib.sha256(repr((
        type(transformer).__qualname__, sorted((k, repr(v)) for k, v in config.items() if not k.startswith("_")),
        None if first is None else str(first.dtype), diffusers.__version__)).encode()).hexdigest()[:16]


def choose(calls: RecordedCalls, device: torch.device, configured: str, store: ChoiceStore | None) -> AttentionChoice:
    """The backend of one bucket under ``runner.attention: configured``.

    - ``default``: PyTorch's own priority.
    - A backend name: that backend if it can run ``calls`` on ``device`` (one timed call each), else PyTorch's
      default, with ``source`` ``"configured <name> cannot run here"`` (logged).
    - ``auto``: the choice ``store`` keeps for these calls if there is one, else :func:`choose_backend`, then kept.
    """
    if configured == "default":
        return AttentionChoice("default", source="configured")
    if configured != "auto":
        ms = time_backend(calls, configured, torch.device(device), iters=1, warmup=0) if calls.counts else 0.0
        if ms is None:
            log.warning("runner.attention %r cannot run these attention calls on %s: PyTorch's default runs them",
                        configured, device)
            return AttentionChoice("default", {configured: None}, source=f"configured {configured} cannot run here")
        return AttentionChoice(configured, source="configured")
    stored = store.get(calls)
    if stored is not None:
        return AttentionChoice(stored, source="cached")
    choice = choose_backend(calls, device)
    store.put(calls, choice.backend)
    return choice


@contextlib.contextmanager
def compiling_under(backend: str | None) -> Iterator[None]:
    """:func:`attention_backend` and :func:`compile_key` of ``backend`` together: the context of a bucket's
    compile."""
    with attention_backend(backend), compile_key(backend):
        yield
