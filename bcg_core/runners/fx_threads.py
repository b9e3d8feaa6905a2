"""Tracing on one thread, serving on the others: ``torch.fx``'s process-wide patches bound to the thread that traces.

``torch.fx.Tracer.trace`` (which inductor runs through AOTAutograd's ``make_fx`` and its pattern matcher on every
compile) installs its wrappers through ``torch.fx._symbolic_trace._Patcher``: ``module_call_wrapper`` as
``torch.nn.Module.__call__``, ``module_getattr_wrapper`` as ``torch.nn.Module.__getattr__``, and wrapped functions in
module globals, for the whole process, until the trace ends. A module called on another thread meanwhile goes
through the tracer's wrapper, which looks the module up in the traced root and raises
``NameError: module is not installed as a submodule`` (a request served beside a background compile failed so in one
CPU test run of three). :func:`isolate_fx_patches` makes each installed function run only on the thread that
installed it; every other thread calls what it replaced. Used by the background compiles of bucket forwards
(:mod:`bcg_core.runners.background`) and of the VAE decode (:mod:`bcg_core.runners.decode`).
"""

from __future__ import annotations

import builtins
import functools
import threading
from collections.abc import Callable

__all__ = ["isolate_fx_patches"]


def _thread_bound(new_fn: Callable, fallback: Callable | None) -> Callable:
    """``new_fn`` on the thread that calls this, ``fallback`` (what ``new_fn`` replaces) on every other thread."""
    owner = threading.get_ident()

    @functools.wraps(new_fn)
    def bound(*args, **kwargs):
        if fallback is None or threading.get_ident() == owner:
            return new_fn(*args, **kwargs)
        return fallback(*args, **kwargs)

    return bound


_FX_LOCK = threading.Lock()


def isolate_fx_patches(on: bool = True) -> bool:
    """Bind ``torch.fx``'s tracing patches to the thread that traces (module docstring), process-wide, once.

    ``torch.fx._symbolic_trace._Patcher.patch`` and ``patch_method`` are wrapped so that the function they install
    (``Tracer.trace``'s ``module_call_wrapper`` and ``module_getattr_wrapper`` on ``torch.nn.Module``, its wrapped
    globals) runs only on the tracing thread; any other thread calls the function it replaced. The tracing thread
    sees exactly what torch does (dedup, revert and re-apply are torch's own). ``on=False`` restores torch's methods
    (tests).

    Returns:
        True if the patches are isolated now; False where this torch has no ``_Patcher`` with those methods (then a
        compile may not run beside serving: :class:`~bcg_core.runners.background.BackgroundCompiles` refuses to start).
    """
    try:
        from torch.fx._symbolic_trace import _Patcher
    except ImportError:
        return False
    with _FX_LOCK:
        saved = getattr(_Patcher, "_bcg_torch_methods", None)
        if not on:
            if saved is not None:
                _Patcher.patch, _Patcher.patch_method = saved
                del _Patcher._bcg_torch_methods
            return False
        if saved is not None:
            return True
        patch, patch_method = getattr(_Patcher, "patch", None), getattr(_Patcher, "patch_method", None)
        if not (callable(patch) and callable(patch_method)):
            return False

        def isolated_patch(self, frame_dict, name, new_fn, *args, **kwargs):
            current = frame_dict[name] if name in frame_dict else getattr(builtins, name, None)
            return patch(self, frame_dict, name, _thread_bound(new_fn, current), *args, **kwargs)

        def isolated_patch_method(self, cls, name, new_fn, *args, **kwargs):
            return patch_method(self, cls, name, _thread_bound(new_fn, getattr(cls, name, None)), *args, **kwargs)

        _Patcher._bcg_torch_methods = (patch, patch_method)
        _Patcher.patch, _Patcher.patch_method = isolated_patch, isolated_patch_method
        return True
