"""The idle trimmer (bcg_core/scheduler/memtrim.py): the C heap's free memory goes back to the OS once the step
scheduler has no request in flight, never while one is."""

from __future__ import annotations

import threading
import time

from bcg_core.scheduler.memtrim import IdleTrimmer, malloc_trim, resident_bytes


def _wait_for(cond, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_malloc_trim_is_safe_to_call_and_resident_memory_is_read():
    assert isinstance(malloc_trim(), bool)
    rss = resident_bytes()
    assert rss is None or rss > 0


def test_trims_once_after_the_owner_stays_idle():
    trims = []
    t = IdleTrimmer(lambda: True, delay_s=0.05, trim=lambda: trims.append(time.monotonic()) or True)
    try:
        t.notify()
        assert _wait_for(lambda: t.describe()["trims"] == 1)
        time.sleep(0.2)
        assert t.describe()["trims"] == 1  # one notify, one trim: no polling while idle
        t.notify()
        assert _wait_for(lambda: t.describe()["trims"] == 2)
    finally:
        t.close()


def test_never_trims_while_busy_and_stops_on_close():
    busy = threading.Event()
    busy.set()
    trims = []
    t = IdleTrimmer(lambda: not busy.is_set(), delay_s=0.02, trim=lambda: trims.append(1) or True)
    t.notify()
    time.sleep(0.2)
    assert trims == []  # a request came in during the delay: left for the next notify
    t.close()
    busy.clear()
    t.notify()  # closed: no thread restarts
    time.sleep(0.1)
    assert trims == [] and t.describe()["trims"] == 0


def test_a_failing_trim_is_logged_and_the_thread_goes_on(caplog):
    calls = []

    def bad():
        calls.append(1)
        raise OSError("no")

    t = IdleTrimmer(lambda: True, delay_s=0.01, trim=bad)
    try:
        t.notify()
        assert _wait_for(lambda: t.describe()["trims"] == 1)
        t.notify()
        assert _wait_for(lambda: t.describe()["trims"] == 2)
    finally:
        t.close()
    assert len(calls) == 2
