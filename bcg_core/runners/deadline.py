"""A compile's deadline (``runner.compile_timeout_s``): an exception raised inside the compiling thread.

``torch.compile`` takes no time limit, and a bucket's compile runs on the thread whose forward set it off (dynamo
compiles a frame when it is first called). :func:`compile_deadline` bounds it from outside: a timer thread sets
:class:`CompileTimeout` as the compiling thread's asynchronous exception (CPython's
``PyThreadState_SetAsyncExc``, https://docs.python.org/3/c-api/init.html#c.PyThreadState_SetAsyncExc), which
arrives at that thread's next Python bytecode, so a long call into C++ ends first. The compile unwinds through its
own ``with`` blocks (dynamo's compile lock is released) and nothing of it is kept.

Used by :meth:`~bcg_core.runners.kernels.CompiledKernels.compiling`, which turns the exception into
:class:`~bcg_core.runners.kernels.CompileFailed` (``compile_timeout:``): the bucket keeps eager kernels. Apart from
kernels.py because it is thread machinery, not kernels: it knows nothing of what runs under it.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

__all__ = ["CompileTimeout", "compile_deadline"]


class CompileTimeout(BaseException):
    """Raised inside a compile past its deadline (:func:`compile_deadline`, under
    :meth:`~bcg_core.runners.kernels.CompiledKernels.compiling`); a ``BaseException``, so that dynamo's and
    inductor's ``except Exception`` handlers let it through."""


@contextlib.contextmanager
def compile_deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`CompileTimeout` in this thread if the block is still running after ``seconds`` (None: never).

    The exception is set again every :data:`_REFIRE_S` until the block ends: one that lands where Python swallows
    exceptions (a ``__del__``, a weakref or gc callback print "Exception ignored" and go on) would otherwise let
    the compile run to its end. A pending exception that the timer set just as the block ended is withdrawn
    before leaving, so it never lands in the caller's code."""
    if not seconds:
        yield
        return
    tid, lock, done = threading.get_ident(), threading.Lock(), threading.Event()
    state = {"armed": True, "fired": False}

    def fire() -> None:
        wait = seconds
        while not done.wait(wait):
            with lock:
                if not state["armed"]:
                    return
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(CompileTimeout))
            wait = _REFIRE_S

    timer = threading.Thread(target=fire, name="bcg-compile-deadline", daemon=True)
    timer.start()
    try:
        yield
    finally:
        done.set()
        with lock:
            state["armed"] = False
            if state["fired"]:  # withdraw it if it has not been raised yet
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)


_REFIRE_S = 0.05
"""Seconds between repeats of a compile deadline's exception (:func:`compile_deadline`)."""
