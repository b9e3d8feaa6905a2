"""Kernel tiers: which kernels a bucket's forward runs, under its graph or on its static buffers.

- ``eager`` (:attr:`KernelTier.EAGER`): PyTorch's eager kernels, exactly diffusers' bits.
- ``compiled`` (:attr:`KernelTier.COMPILED`): the transformer's repeated blocks compiled by ``torch.compile``
  (inductor, ``dynamic=False``, ``fullgraph=True``), the rest eager: one compile per bucket shape, or with
  ``runner.compile_batch_dynamic`` (off until a server's cold start with it is measured on a GPU) one per token
  shape for the buckets of more than one row, their batch dimension left dynamic (:func:`shared_batch`), and one
  per token shape at one row.
  This is regional compilation as diffusers' ``ModelMixin.compile_repeated_blocks`` does it, on the blocks its
  ``_repeated_blocks`` names (FLUX.1, Qwen-Image) or, for transformers that name none, on their transformer
  blocks (:data:`REPEATED_BLOCKS`: SD3, PixArt-Sigma, SANA); a transformer with neither is compiled whole.
  bcg-serve owns the CUDA graphs: inductor's own (``mode="reduce-overhead"``) stay off, and its kernels are
  captured into the bucket's graph in the shared pool like eager ones.
- ``fp8`` (:attr:`KernelTier.FP8`): ``compiled``, with the linear layers of the repeated blocks in float8
  (:func:`~bcg_core.runners.fp8.quantize_fp8`: torchao's ``Float8DynamicActivationFloat8WeightConfig``, per-row
  scales: each activation row and each weight output channel scaled on its own). Modulation (the adaptive norms'
  linear layers), the embedders and the final projection stay in bf16. Needs a GPU with float8 matmuls (compute
  capability 8.9 or newer: Ada, Hopper) and torchao; anything else is a start-up error
  (:func:`~bcg_core.runners.fp8.check_fp8`). The float8 layers and the tier's compile check bound
  (:data:`~bcg_core.runners.fp8.FP8_RTOL`) are in :mod:`bcg_core.runners.fp8`.

:class:`CompiledKernels` installs the compiled blocks beside the eager ones and switches per forward
(:meth:`CompiledKernels.active`): a bucket whose compile failed, an unpadded eager forward (a miss, whose shapes
vary) and every forward outside a bucket keep eager kernels, so a failed compile costs speed, never service. A
server compiles a bucket not in the cache after it serves (:mod:`bcg_core.runners.background`). A compile is bounded
by ``runner.compile_timeout_s`` (:func:`~bcg_core.runners.deadline.compile_deadline`). On a CPU the same code runs
(inductor's C++ backend), which is what CI exercises; only the capture into a CUDA graph needs a GPU.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import torch

from bcg_core.errors import first_line
from bcg_core.runners.attention import (
    BACKENDS,
    AttentionChoice,
    ChoiceStore,
    RecordedCalls,
    choose,
    compiling_under,
    model_signature,
    record_sdpa_calls,
)
from bcg_core.runners.deadline import CompileTimeout, compile_deadline
from bcg_core.runners.precompiled import NotPrecompiled, PrecompiledBlocks, available

__all__ = ["REPEATED_BLOCKS", "CompileFailed", "CompiledKernels", "KernelTier", "raise_recompile_limits",
           "repeated_blocks", "use_cache_dir"]

log = logging.getLogger(__name__)


class KernelTier(str, enum.Enum):
    """The kernels of a deployment's bucket forwards (``runner.kernels``)."""

    EAGER = "eager"
    """PyTorch's eager kernels: diffusers' exact bits."""
    COMPILED = "compiled"
    """Regional ``torch.compile`` of the repeated transformer blocks (this module's docstring)."""
    FP8 = "fp8"
    """``compiled`` with the repeated blocks' linear layers in float8 (:func:`~bcg_core.runners.fp8.quantize_fp8`)."""


def raise_recompile_limits(per_code: int, accumulated: int) -> None:
    """Raise dynamo's recompile limits, process-wide, to at least ``per_code`` compiles of one code object and
    ``accumulated`` in all (``recompile_limit`` / ``accumulated_recompile_limit``, and their old names where this
    torch has them); past them dynamo runs the code eager without a word. Never lowers a limit."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), accumulated if "accumulated" in name else per_code))


REPEATED_BLOCKS: dict[str, tuple[str, ...]] = {
    "SD3Transformer2DModel": ("JointTransformerBlock",),
    "PixArtTransformer2DModel": ("BasicTransformerBlock",),
    "SanaTransformer2DModel": ("SanaTransformerBlock",),
}
"""Repeated blocks of the diffusers transformers whose class names none in ``_repeated_blocks`` (diffusers
0.42.1): their ``transformer_blocks`` entries."""


def _joint_views(kwargs: dict) -> dict:
    """FLUX.1's single-stream block (``FluxSingleTransformerBlock``): ``hidden_states`` and
    ``encoder_hidden_states`` as slices of one ``(batch, text + image tokens, dim)`` tensor, text first.

    Each single block returns its output that way (``hidden_states[:, :text_seq_len]``,
    ``hidden_states[:, text_seq_len:]``, diffusers' ``transformer_flux.py``), so every single block but the first
    receives such slices, while the first receives the double blocks' two separate tensors. Static-shape compiles
    guard on strides, so without this the first single block compiles a graph of its own for every bucket shape (a
    third of FLUX's compiles: "tensor 'hidden_states' stride mismatch at index 0"). One concatenation per forward
    gives the first block the same layout; values are unchanged (the block concatenates them itself first)."""
    hidden, text = kwargs.get("hidden_states"), kwargs.get("encoder_hidden_states")
    if hidden is None or text is None:
        return kwargs
    if (hidden._base is not None and hidden._base is text._base and hidden.stride() == text.stride()
            and hidden.storage_offset() == text.storage_offset() + text.shape[1] * text.stride(1)):
        return kwargs  # already the slices of one tensor, text first
    joint = torch.cat([text, hidden], dim=1)
    return {**kwargs, "encoder_hidden_states": joint[:, :text.shape[1]], "hidden_states": joint[:, text.shape[1]:]}


INPUT_LAYOUTS: dict[str, Callable[[dict], dict]] = {"FluxSingleTransformerBlock": _joint_views}
"""Per repeated-block class, a rewrite of its keyword inputs into the layout it receives from its predecessor, so
that one compiled graph per bucket shape serves every block of the class (:func:`_joint_views`)."""


INDEX_MARGIN = 64
"""A block's inputs share a compile across batch sizes only while each input has fewer than ``2**31 / INDEX_MARGIN``
elements: the block's largest intermediates (the MLP's 4x hidden width, q, k and v) then stay within 32-bit
indexing at every batch of the class, whatever batch it was traced at. Larger inputs compile per exact shape."""


def _tensors(values, depth: int = 0):
    """The tensors among ``values``, and inside the dicts, tuples and lists among them, two levels down: a block's
    inputs as its caller passes them (FLUX.1's masked tier passes its key-padding mask, whose first size is the
    batch, inside ``joint_attention_kwargs``)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif depth < 2 and isinstance(v, dict):
            yield from _tensors(v.values(), depth + 1)
        elif depth < 2 and isinstance(v, (tuple, list)):
            yield from _tensors(v, depth + 1)


def shared_batch(args: tuple, kwargs: dict) -> int | None:
    """Leave the batch dimension of a block call's inputs dynamic, so that every bucket of one token shape and more
    than one row shares one compile (``torch._dynamo.maybe_mark_dynamic`` on dimension 0 of each tensor input whose
    first size is the batch: ``hidden_states``' first size; tensors inside the inputs' dicts and tuples too, as the
    masked tier's key-padding mask in ``joint_attention_kwargs``: left static, its batch would specialize the
    compile to the batch it was traced at). Measured on an H100 (FLUX.1-dev width, 1-8 rows at
    1,024 and 4,096 tokens): 12 graphs compiled in 42.8 s instead of 24 in 65.9 s, and the replay of each bucket's
    CUDA graph within 3% of static shapes' (``benchmarks/bench_compile_shapes.py``, docs/BENCHMARKS.md
    2026-12-07). A batch of one stays specialized (dynamo specializes sizes 0 and 1), and so do inputs too large
    for :data:`INDEX_MARGIN`.

    Returns:
        The batch size marked dynamic, or None where the call compiles for its exact shape.
    """
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor) or hidden.ndim < 2 or hidden.shape[0] < 2:
        return None
    rows = hidden.shape[0]
    tensors = list(_tensors((*args, *kwargs.values())))
    if any(t.numel() * INDEX_MARGIN >= 2**31 for t in tensors):
        return None
    for t in tensors:
        if t.ndim >= 2 and t.shape[0] == rows:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return rows


class CompileFailed(RuntimeError):
    """A bucket's compile (or its first compiled forward) raised, passed ``runner.compile_timeout_s``, or its
    compiled forward failed the check against the eager one; the bucket keeps eager kernels."""


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
    gets its own compile instead of falling back to eager after eight shapes.

    Args:
        transformer: the family's transformer (an ``nn.Module``), already on its device and dtype.
        compile_fn: ``torch.compile`` (the default) or a stand-in with its signature (tests).
        mode: inductor's mode, ``"default"`` or ``"max-autotune-no-cudagraphs"`` (never one that captures CUDA
            graphs of its own).
        max_shapes: compiles each block may hold (one per bucket shape it serves; raises dynamo's
            ``recompile_limit`` and ``accumulated_recompile_limit`` to at least this).
        cache_dir: folder of torch.compile's on-disk caches (:func:`use_cache_dir`), or None for inductor's default.
        timeout_s: seconds one bucket's compile may take (:meth:`compiling`), None for no bound.
        rtol: tolerance of each bucket's compiled forward against its eager one
            (:func:`~bcg_core.verify.compile_entry`), None for no check.
        attention: ``runner.attention``: ``"auto"`` (each bucket's SDPA backend measured,
            :mod:`bcg_core.runners.attention`), ``"default"`` (PyTorch's priority) or a backend name.
        precompile: compile each block ahead of time and keep it in the cache folder
            (:mod:`bcg_core.runners.precompiled`: a warm start loads it without tracing), where this torch has the
            API and ``compile_fn`` is ``torch.compile``; a block whose ahead-of-time compile raises is compiled the
            plain way.
        batch_dynamic: buckets of one token shape and more than one row share one compile (:func:`shared_batch`;
            ``runner.compile_batch_dynamic``); False (the default): one compile per bucket shape. On an H100 the
            shared compile failed inside CUDA graph capture (2026-12-07); both causes fixed, its GPU test
            (tests/gpu/test_kernels_gpu.py) passes; off until a server's cold start with it is measured.

    Raises:
        ValueError: a mode that would capture inductor's own CUDA graphs.
    """

    def __init__(self, transformer: torch.nn.Module, compile_fn: Callable = torch.compile, mode: str = "default",
                 max_shapes: int = 256, cache_dir: str | None = None, timeout_s: float | None = None,
                 rtol: float | None = None, attention: str = "auto", precompile: bool = True,
                 batch_dynamic: bool = False):
        if "cudagraphs" not in mode and mode != "default":
            raise ValueError(f"inductor mode {mode!r} captures CUDA graphs of its own; bcg-serve owns the graphs: "
                             f"use 'default' or 'max-autotune-no-cudagraphs'")
        self.mode = mode
        self.batch_dynamic = batch_dynamic
        """Buckets of one token shape and more than one row share a compile (:func:`shared_batch`)."""
        self.cache_dir = use_cache_dir(cache_dir) if cache_dir else None
        self.timeout_s = timeout_s
        """Seconds one bucket's compile may take (``runner.compile_timeout_s``); None: no bound."""
        self.rtol = rtol
        """Tolerance of the check of each bucket's compiled forward against its eager one
        (:func:`~bcg_core.verify.compile_entry`); None: no check."""
        self.rtol_note = ""
        """Where :attr:`rtol` comes from, in words (``/v1/buckets``)."""
        self.cache_hits = self.cache_misses = 0
        """Cache hits and misses of the compiles run under :meth:`compiling`: inductor's FX graph cache's, and the
        precompiled blocks loaded from disk (hits) or compiled (misses)."""
        self.timeouts = 0
        """Compiles stopped at :attr:`timeout_s`."""
        if attention not in ("auto", "default", *BACKENDS):
            raise ValueError(f"runner.attention {attention!r}: use 'auto', 'default' or one of {', '.join(BACKENDS)}")
        self.attention = attention
        """``runner.attention``: how each bucket's SDPA backend is chosen (:meth:`attention_for`)."""
        self.choices: dict = {}
        """Bucket key -> its :class:`~bcg_core.runners.attention.AttentionChoice`, kept for the process: the
        compiled code of a bucket's shape stays traced for that backend, so a second runner reuses the choice."""
        self._store: ChoiceStore | None = None
        self._model_signature = model_signature(transformer)
        self._traced: set[str] = set()
        """Block classes whose ahead-of-time compile raised: every block of the class is traced by dynamo."""
        self.blocks = repeated_blocks(transformer) or [transformer]
        self.regional = self.blocks[0] is not transformer
        self._local = threading.local()
        options = dict(fullgraph=True, dynamic=False, backend="inductor")
        if mode != "default":
            options["mode"] = mode
        raise_recompile_limits(max_shapes, max_shapes * len(self.blocks))
        self.precompiled = None
        """The ahead-of-time compiled blocks (:class:`~bcg_core.runners.precompiled.PrecompiledBlocks`), or None
        where they are off or unavailable (every compile is then traced by dynamo)."""
        if precompile and available(compile_fn):
            from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

            device = next(transformer.parameters()).device
            self.precompiled = PrecompiledBlocks(os.path.join(self.cache_dir or inductor_cache_dir(),
                                                              "bcg-precompiled"), options, device)
        for block in self.blocks:
            eager = block.forward
            compiled = compile_fn(eager, **options)
            block.forward = self._switch(eager, compiled, INPUT_LAYOUTS.get(type(block).__name__), block)
        self.compile_s = 0.0
        """Seconds spent in forwards that compiled (first forwards of a shape under :meth:`compiling`)."""

    def _switch(self, eager: Callable, compiled: Callable, layout: Callable | None = None,
                block: torch.nn.Module | None = None) -> Callable:
        local, traced = self._local, self._traced

        def forward(*args, **kwargs):
            if not getattr(local, "on", False):
                return eager(*args, **kwargs)
            kwargs = layout(kwargs) if layout else kwargs
            batch = shared_batch(args, kwargs) if self.batch_dynamic else None
            pre, probe = self.precompiled, getattr(local, "cached_only", False)
            if probe and (pre is None or type(block).__qualname__ in traced):
                raise NotPrecompiled(f"{type(block).__qualname__} compiles through dynamo, never loaded whole")
            if pre is not None and type(block).__qualname__ not in traced:
                try:
                    fn = pre.function(block, args, kwargs, getattr(local, "attention", None), load_only=probe,
                                      batch=batch)
                except (CompileTimeout, torch.OutOfMemoryError, NotPrecompiled):
                    raise
                except Exception as e:  # noqa: BLE001 - e.g. a tensor subclass it cannot serialize
                    traced.add(type(block).__qualname__)
                    log.debug("ahead-of-time compile failure", exc_info=True)
                    log.warning("ahead-of-time compile of %s raised (%s: %s); compiling it the plain way",
                                type(block).__qualname__, type(e).__name__, first_line(e, limit=200))
                else:
                    return fn(block, *args, **kwargs)
            return compiled(*args, **kwargs)

        return forward

    @property
    def on(self) -> bool:
        """True inside :meth:`active` on this thread."""
        return bool(getattr(self._local, "on", False))

    @contextlib.contextmanager
    def active(self, on: bool = True, attention: str | None = None) -> Iterator[None]:
        """Forwards on this thread run the compiled blocks (``on``) or the eager ones, until the block exits. With
        ``attention`` (the bucket's SDPA backend, :attr:`~bcg_core.runners.base.BucketEntry.attention`), the blocks'
        functions are looked up under that backend, as the bucket's compile keyed them (a compile shared across batch
        sizes keeps one function per backend: :meth:`~bcg_core.runners.precompiled.PrecompiledBlocks.function`)."""
        before = self.on, getattr(self._local, "attention", None)
        self._local.on = on
        if attention is not None:
            self._local.attention = attention
        try:
            yield
        finally:
            self._local.on, self._local.attention = before

    def attention_for(self, key, forward: Callable[[], object], device: torch.device) -> AttentionChoice:
        """The SDPA backend of bucket ``key``'s compiled forward: kept from an earlier call for ``key``; else with
        ``attention="auto"`` the choice store beside the compile cache's entry for this model and bucket (a
        restart: no forward runs), or else the SDPA calls of ``forward()`` (the bucket's eager forward) are
        recorded and the backend is read from the store by those calls or measured
        (:func:`~bcg_core.runners.attention.choose`); else the configured one, if it can run the recorded calls on
        ``device`` (one timed call each), or else PyTorch's default, with ``source`` saying so. The model's part of
        the bucket entry is :attr:`_model_signature` (its class, config and dtype, and the diffusers version)."""
        if key in self.choices:
            return self.choices[key]
        if self.attention == "default":
            choice = choose(RecordedCalls(), device, "default", None)
        else:
            if self._store is None and self.attention == "auto":
                from torch._inductor.runtime.cache_dir_utils import cache_dir

                self._store = ChoiceStore(self.cache_dir or cache_dir())
            bucket = f"{self._model_signature} | {key}"
            stored = self._store.get_bucket(bucket) if self.attention == "auto" else None
            if stored is not None:  # a restart: the calls this bucket makes were measured before
                choice = AttentionChoice(stored, source="cached")
            else:
                with self.active(False):
                    calls = record_sdpa_calls(forward)
                choice = choose(calls, device, self.attention, self._store)
                if self.attention == "auto":
                    self._store.put_bucket(bucket, choice.backend)
        self.choices[key] = choice
        return choice

    @contextlib.contextmanager
    def cached_only(self, on: bool = True) -> Iterator[None]:
        """With ``on``, compiles on this thread only load; one that would compile raises :class:`NotPrecompiled`."""
        self._local.cached_only = on
        try:
            yield
        finally:
            self._local.cached_only = False

    @contextlib.contextmanager
    def compiling(self, attention: str | None = None) -> Iterator[None]:
        """:meth:`active`, timing the block into :attr:`compile_s`, bounding it by :attr:`timeout_s` and turning a
        compile error into :class:`CompileFailed` (out of memory is re-raised as it is: the caller degrades as for a
        capture). With ``attention`` (a backend name), compiles in the block trace SDPA to that backend and their
        cache entries are keyed by it (:func:`~bcg_core.runners.attention.compiling_under`).

        The deadline (:func:`~bcg_core.runners.deadline.compile_deadline`): a timer thread raises
        :class:`~bcg_core.runners.deadline.CompileTimeout` inside this thread when the block passes :attr:`timeout_s`
        (CPython's ``PyThreadState_SetAsyncExc``; it arrives at the next Python bytecode, so a long call into C++ ends
        first). The compile unwinds through its own ``with`` blocks (dynamo's compile lock is
        released) and nothing of it is kept: the bucket keeps eager kernels.

        Raises:
            CompileFailed: the compile, or the compiled forward, raised or passed the deadline (the message starts
                ``compile_failed:`` or ``compile_timeout:``).
            torch.OutOfMemoryError, NotPrecompiled: out of memory while compiling; a probe's block not cached.
        """
        t0 = time.perf_counter()
        hits, misses = _fx_cache_counts()
        before = self._precompiled_counts()
        self._local.attention = attention
        if self.precompiled is not None:
            self.precompiled.begin()
        try:
            with self.active(), compiling_under(attention), compile_deadline(self.timeout_s):
                yield
        except (torch.OutOfMemoryError, NotPrecompiled):
            raise
        except CompileTimeout:
            self.timeouts += 1
            raise CompileFailed(f"compile_timeout: the compile passed runner.compile_timeout_s "
                                f"({self.timeout_s:g} s)") from None
        except CompileFailed:
            raise
        except Exception as e:  # noqa: BLE001 - dynamo and inductor raise many types; the bucket goes eager
            first = first_line(e)
            raise CompileFailed(f"compile_failed: {type(e).__name__}: {first}"[:300]) from e
        finally:
            self._local.attention = None
            self.compile_s += time.perf_counter() - t0
            now_hits, now_misses = _fx_cache_counts()
            loads, compiles = (a - b for a, b in zip(self._precompiled_counts(), before, strict=True))
            self.cache_hits += now_hits - hits + loads
            self.cache_misses += now_misses - misses + compiles

    def _precompiled_counts(self) -> tuple[int, int]:
        """``(loads, compiles)`` of :attr:`precompiled`: files read, and compiles (they bypass the FX graph cache)."""
        p = self.precompiled
        return (p.loads, p.saves + p.unsaved) if p is not None else (0, 0)


def kernel_stats(kernels: CompiledKernels | None, state: dict[str, dict]) -> dict:
    """What ``/v1/buckets``' ``kernels`` shows of ``kernels`` (None: eager kernels), ``state`` being each bucket's
    runner description by key.

    ``start`` says how the buckets were prepared: ``cold`` (every compile missed inductor's FX graph cache),
    ``warm`` (every one hit it or loaded a precompiled block), ``partial``, or ``eager`` (nothing compiled).
    ``pending``: buckets on eager kernels until their background compile (:mod:`bcg_core.runners.background`);
    ``compile_failed``: on eager kernels for good. ``precompiled``: the ahead-of-time compiled blocks loaded, saved,
    rebuilt (a file that did not load), unsaved and discarded (their bucket failed its check) in this process
    (:mod:`bcg_core.runners.precompiled`; None where off)."""
    k = kernels
    hits, misses = (k.cache_hits, k.cache_misses) if k else (0, 0)
    on_eager = [bool(d.get("pending")) for d in state.values() if d.get("kernels") == "eager"] if k else []
    warm = hits and not misses and True not in on_eager  # a pending bucket's compile misses are still to come
    start = "eager" if k is None else "warm" if warm else "partial" if hits else "cold"
    pre, names = None if k is None else k.precompiled, ("loads", "saves", "rebuilt", "unsaved", "discarded")
    return {
        "mode": k and k.mode, "batch_dynamic": k and k.batch_dynamic, "regional": k and k.regional,
        "rtol": k and k.rtol, "rtol_from": k and k.rtol_note,
        "compile_s": round(k.compile_s, 3) if k else 0.0, "compile_failed": on_eager.count(False),
        "pending": on_eager.count(True), "compile_timeouts": k.timeouts if k else 0, "timeout_s": k and k.timeout_s,
        "cache_dir": k and k.cache_dir, "cache_hits": hits, "cache_misses": misses, "start": start,
        "attention": k and k.attention, "precompiled": None if pre is None else {n: getattr(pre, n) for n in names}}


def _fx_cache_counts() -> tuple[int, int]:
    """Inductor's FX graph cache hits and misses so far in this process (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def use_cache_dir(path: str) -> str:
    """Keep torch.compile's on-disk caches in ``path`` (created if absent): inductor's (``TORCHINDUCTOR_CACHE_DIR``:
    its FX graph and AOT autograd caches) and Triton's kernels (``TRITON_CACHE_DIR``, ``path/triton``). Inductor
    keys each entry by the traced graph, the torch version, the device and the compile options, so a different
    model, torch, GPU or bucket shape never loads another's entry; a restart with the same ones reads its kernels
    back instead of compiling them. Process-wide (environment variables, read when a compile needs them).
    Returns the absolute path."""
    import os

    path = os.path.abspath(path)
    os.makedirs(os.path.join(path, "triton"), exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")
    return path
