"""Compiled VAE decode: inductor kernels for ``vae.decode``, per latent shape, kept only where they measure faster.

On an H200 (torch 2.11, bf16, random weights at the published configs), ``torch.compile(vae.decode,
dynamic=False)`` decoded in 0.42-0.46x the eager time with FLUX.1's VAE at 1024x1024 (85.6 to 35.9 ms for one
image, 307.9 to 142.6 ms for four) and in 0.46-0.62x with SANA's DC-AE, each compile taking 19-29 s and deviating
0.023-0.028 from eager relative to the image's largest value (``benchmarks/bench_decode.py``;
docs/BENCHMARKS.md, 2026-12-04). A compile that long cannot sit on a request's path, and one per image size at
start would add minutes, so :class:`CompiledDecode` compiles off the path:

- Each latent shape the decode has not seen is decoded with eager kernels and handed to one background thread.
- That thread compiles the decode for the shape (``dynamic=False``: one static compile per shape, as a bucket's
  forward), checks it against the eager decode of the same latents, and times both (alternating, median of
  :attr:`CompiledDecode.iters` calls each).
- The compiled decode is kept for the shape when its deviation is within the tolerance and it is faster. The
  tolerance is :func:`~bcg_core.verify.kernel_tolerance` of the ``compiled`` tier, from the eager decode's own
  rounding error on the first image against a float32 copy of the VAE (float64 for a float32 one), as for a
  bucket's forward.
- Later calls of a kept shape run the compiled decode; every other shape stays eager.

Every shape's state, times and deviation are in ``/v1/buckets`` (``kernels.decode``, :meth:`CompiledDecode.describe`).
Off by default (``runner.compile_decode``), on with the ``compiled`` and ``fp8`` tiers only.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable

import torch

from bcg_core.errors import first_line
from bcg_core.families.vae import has_call_state
from bcg_core.runners.fx_threads import isolate_fx_patches
from bcg_core.runners.kernels import raise_recompile_limits

log = logging.getLogger(__name__)

__all__ = ["CompiledDecode", "find_vae", "install", "unsupported"]


def find_vae(model) -> torch.nn.Module | None:
    """The family's VAE (:attr:`~bcg_core.families.Family.vae`), or None where it is no module."""
    return model.vae if isinstance(model.vae, torch.nn.Module) else None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|``, in float32 (NaN anywhere gives inf)."""
    a, b = a.float(), b.float()
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    return err if err == err else float("inf")


def _sample(out):
    """The image tensor of a ``decode`` result (``(sample,)`` or ``DecoderOutput``)."""
    return out[0] if isinstance(out, tuple) else out.sample


class CompiledDecode:
    """``vae.decode`` with compiled kernels for the latent shapes where they pay (this module's docstring).

    Installed in place of the VAE's ``decode`` (:func:`install`); called as ``vae.decode(z, return_dict=...)``.

    A shape is a key of the latents' shape, strides, dtype and device, ``return_dict``, whether inference mode is
    on and whether the latents are an inference tensor: what the compile's guards check. A kept shape runs through
    ``torch._dynamo.run`` (``guarded``): the compiled code whose guards hold, and eager kernels, never a new
    compile, should they not; so a request never waits for a compile and never gets kernels that were not checked.
    Dynamo's recompile limits are raised to hold ``max_shapes`` graphs (diffusers' ``apply_forward_hook`` wraps every
    VAE's ``decode`` and ``encode`` in one code object, which carries one count).

    The background thread runs on its own CUDA stream and times each path with CUDA events on it. It shares the GPU
    with serving while it works: one compile, 1 + 2 x ``iters`` decodes of the shape and one float32 decode of one
    image, per shape.

    Args:
        vae: the family's VAE (its bound ``decode`` is the eager path). A VAE that keeps per-call state on the module
            (``clear_cache``: Qwen-Image's) is refused, since the check runs it beside the decode thread.
        max_shapes: the most shapes compiled; later new shapes stay eager (``skipped``).
        iters: timed calls per path and shape in the measurement.
        compile_fn: ``torch.compile`` (tests may pass a stand-in).
        guarded: run kept shapes through ``torch._dynamo.run`` (see above); False calls what ``compile_fn`` returned
            (stand-ins that are not dynamo).
        timer: seconds of one call of a path (``timer(path, call) -> float``, ``path`` being ``"eager"`` or
            ``"compiled"``), by default :meth:`_elapsed`; tests pass a fake to decide the measurement.

    Raises:
        ValueError: a VAE with per-call state.
    """

    def __init__(self, vae: torch.nn.Module, max_shapes: int = 16, iters: int = 3,
                 compile_fn: Callable = torch.compile, guarded: bool = True,
                 timer: Callable[[str, Callable], float] | None = None):
        reason = unsupported(vae)
        if reason:
            raise ValueError(reason)
        self.vae = vae
        self.eager = vae.decode
        self._cuda = any(p.is_cuda for p in vae.parameters())
        self.max_shapes = max_shapes
        self.iters = iters
        self._compile_fn = compile_fn
        self._guarded = guarded
        self._timer = timer or self._elapsed
        self._compiled: dict[tuple, Callable] = {}
        self.shapes: dict[tuple, dict] = {}
        """Per shape key: ``state`` (``pending``, ``compiled``, ``eager_faster``, ``check_failed``, ``failed``), and
        once measured ``compile_s``, ``eager_ms``, ``compiled_ms``, ``rel_err``, ``rtol``, ``note``."""
        self.compiled_calls = 0
        self.eager_calls = 0
        self.skipped = 0
        self._closed = False
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        raise_recompile_limits(max_shapes + 8, max_shapes + 8)
        isolate_fx_patches()  # the compile traces beside serving threads (bcg_core/runners/fx_threads.py)
        self._worker = threading.Thread(target=self._work, name="bcg-decode-compile", daemon=True)
        self._worker.start()

    @staticmethod
    def _key(z: torch.Tensor, return_dict: bool) -> tuple:
        return (tuple(z.shape), tuple(z.stride()), str(z.dtype).removeprefix("torch."), str(z.device),
                bool(return_dict), torch.is_inference_mode_enabled(), z.is_inference())

    def __call__(self, z: torch.Tensor, return_dict: bool = True, *args, **kwargs):
        """Decode ``z`` (the family's latents, e.g. (n, 16, H/8, W/8) for FLUX.1's VAE) compiled where its shape
        is kept, eager otherwise; a new shape is queued for the background compile. Other arguments (a generator)
        always take the eager path."""
        key = self._key(z, return_dict)
        fn = None if args or kwargs else self._compiled.get(key)
        if fn is not None:
            self.compiled_calls += 1
            return fn(z, return_dict=return_dict)
        self.eager_calls += 1
        if not (args or kwargs):
            self._offer(key, z)
        return self.eager(z, return_dict, *args, **kwargs)

    def _offer(self, key: tuple, z: torch.Tensor) -> None:
        with self._lock:
            if key in self.shapes or self._closed:
                return
            if len(self.shapes) >= self.max_shapes:
                self.skipped += 1
                return
            self.shapes[key] = {"state": "pending"}
        with torch.inference_mode(z.is_inference()):  # the same kind of tensor: the guards check it
            latents = z.detach().clone()
        ready = None
        if latents.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._queue.put((key, latents, ready))

    def _elapsed(self, path: str, call: Callable) -> float:
        """Seconds of ``call()``: CUDA events on the current stream (the background thread's own) on a GPU, so
        other streams' queued work is not counted in; wall time on a CPU."""
        if not self._cuda:
            t0 = time.perf_counter()
            call()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def _work(self) -> None:
        stream = None
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, latents, ready = item
            try:
                if latents.is_cuda and stream is None:
                    stream = torch.cuda.Stream(latents.device)
                ctx = torch.cuda.stream(stream) if latents.is_cuda else contextlib.nullcontext()
                with ctx, torch.inference_mode(key[5]):
                    if ready is not None:
                        stream.wait_event(ready)
                        latents.record_stream(stream)  # allocated on the decode thread's stream, used on this one
                    result = self._measure(key, latents)
                    if latents.is_cuda:
                        stream.synchronize()
            except Exception as e:  # noqa: BLE001 - a failed compile keeps eager kernels, never stops decoding
                log.warning("decode compile for %s failed; it stays eager: %s", key[0], first_line(e))
                result = {"state": "failed", "note": f"compile_failed: {type(e).__name__}: {first_line(e)}"}
            finally:
                del latents
            with self._lock:
                self.shapes[key] = result
                if result["state"] == "compiled":
                    self._compiled[key] = result.pop("fn")
            self._queue.task_done()

    def _measure(self, key: tuple, z: torch.Tensor) -> dict:
        """Compile, check and time one shape (the background thread); the result record of :attr:`shapes`."""
        from bcg_core.verify import kernel_tolerance

        return_dict = key[4]
        ref = _sample(self.eager(z, return_dict=return_dict))
        wide_dtype = torch.float64 if z.dtype == torch.float32 else torch.float32
        wide = copy.deepcopy(self.vae, memo={id(self): None}).to(wide_dtype)  # not this wrapper (a thread, a lock)
        wide.__dict__.pop("decode", None)  # the class's own decode, on the copy
        try:  # one image: the rounding is per image, and a wide decode of 8 large images would hold gigabytes
            deviation = _rel(ref[:1], _sample(wide.decode(z[:1].to(wide_dtype), return_dict=return_dict)))
        finally:
            del wide
        rtol, note = kernel_tolerance("compiled", z.dtype, deviation)
        fn = self._compile_fn(self.eager, dynamic=False)
        t0 = time.perf_counter()
        out = _sample(fn(z, return_dict=return_dict))
        if z.is_cuda:
            torch.cuda.current_stream().synchronize()
        record = {"compile_s": round(time.perf_counter() - t0, 3), "rel_err": _rel(out, ref), "rtol": rtol,
                  "note": note}
        if not record["rel_err"] <= rtol:
            log.warning("compiled decode for %s deviates %.3g from eager (tolerance %.3g); it stays eager", key[0],
                        record["rel_err"], rtol)
            return {**record, "state": "check_failed"}
        kept = torch._dynamo.run(self.eager) if self._guarded else fn
        times = {"eager": [], "compiled": []}
        for i in range(self.iters):  # alternating, so drift hits both
            order = (("eager", self.eager), ("compiled", kept))
            if i % 2:
                order = order[::-1]
            for name, path in order:
                times[name].append(self._timer(name, lambda p=path: p(z, return_dict=return_dict)))
        eager_ms, compiled_ms = (1e3 * statistics.median(times[k]) for k in ("eager", "compiled"))
        record.update(eager_ms=round(eager_ms, 3), compiled_ms=round(compiled_ms, 3))
        if compiled_ms >= eager_ms:
            return {**record, "state": "eager_faster"}
        log.info("decode of %s compiled: %.1f ms against %.1f ms eager", key[0], compiled_ms, eager_ms)
        return {**record, "state": "compiled", "fn": kept}

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every queued shape is measured (tests, benchmarks); False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the background thread after the shapes queued now; new shapes are no longer queued (they decode
        eager), kept ones stay compiled."""
        with self._lock:
            self._closed = True
        self._queue.put(None)

    def describe(self) -> dict:
        """``/v1/buckets``' ``kernels.decode``: calls per path, shapes skipped past ``max_shapes``, and per shape
        (``"n x c x h x w dtype"``, with strides, ``return_dict``, grad mode and autograd tensors named where they
        are not what the families' decodes pass) its state, times in ms, deviation and tolerance."""
        with self._lock:
            shapes = {_label(k): {k2: v for k2, v in s.items() if k2 != "fn"} for k, s in self.shapes.items()}
        return {"enabled": True, "compiled_calls": self.compiled_calls, "eager_calls": self.eager_calls,
                "skipped": self.skipped, "max_shapes": self.max_shapes, "shapes": shapes}


def _label(key: tuple) -> str:
    shape, stride, dtype, _device, return_dict, inference, inference_tensor = key
    label = f"{'x'.join(map(str, shape))} {dtype}"
    if stride != torch.empty(shape, device="meta").stride():
        label += f" stride {'x'.join(map(str, stride))}"
    if return_dict:
        label += " return_dict"
    if not inference:
        label += " grad-mode"
    if not inference_tensor:
        label += " autograd-tensor"
    return label


def unsupported(vae: torch.nn.Module) -> str | None:
    """Why ``vae``'s decode cannot be compiled in the background, or None: a VAE with per-call state on the module
    (:func:`~bcg_core.families.vae.has_call_state`) gives wrong images when two threads decode at once."""
    if has_call_state(vae):
        return (f"{type(vae).__name__} keeps per-call state on the module (clear_cache), so its decode is not "
                "compiled in the background")
    return None


def install(model, **kwargs) -> CompiledDecode | str:
    """Put a :class:`CompiledDecode` in place of ``model``'s VAE ``decode`` (once; a second call returns the one
    installed). Where it cannot (no VAE, :func:`find_vae`; a VAE with per-call state, :func:`unsupported`), the
    reason, as a string."""
    vae = find_vae(model)
    if vae is None:
        log.warning("runner.compile_decode: %s has no VAE", type(model).__name__)
        return f"{type(model).__name__} has no VAE"
    current = vae.__dict__.get("decode")
    if isinstance(current, CompiledDecode):
        return current
    reason = unsupported(vae)
    if reason:
        log.warning("runner.compile_decode: %s", reason)
        return reason
    decoder = CompiledDecode(vae, **kwargs)
    vae.decode = decoder  # an instance attribute: every family's ``vae.decode(...)`` call goes through it
    return decoder
