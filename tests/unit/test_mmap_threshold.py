"""``runner.mmap_threshold_bytes`` (``bcg_core.scheduler.memtrim.set_mmap_threshold``; issue 45, part 5): with it
set, glibc no longer raises its mmap threshold after large frees, so a large buffer gets its own mapping (given
back when freed) instead of growing a heap. Each case runs in a fresh interpreter: the setting is per process."""

import subprocess
import sys
import textwrap

import pytest

from bcg_core.scheduler.memtrim import set_mmap_threshold

PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    from bcg_core.scheduler.memtrim import set_mmap_threshold
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    class Info(ctypes.Structure):  # glibc's struct mallinfo2
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = Info
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "set":
        assert set_mmap_threshold(256 * 1024)
    libc.free(libc.malloc(8 << 20))  # an 8 MiB block, mapped, freed: glibc's dynamic threshold rises past 8 MiB
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(4 << 20)
    print(libc.mallinfo2().hblkhd - before)  # bytes of the 4 MiB block that were mapped on their own
    libc.free(p)
""")


def _mapped_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_large_buffer_after_a_large_free_is_mapped_only_with_the_threshold_set():
    assert _mapped_bytes("default") == 0  # glibc's dynamic threshold: the 4 MiB come from a heap, and stay there
    assert _mapped_bytes("set") >= 4 << 20  # fixed at 256 KiB: its own mapping, unmapped when freed


def test_the_threshold_is_bounded_by_what_glibc_accepts():
    with pytest.raises(ValueError, match="0 to 33554432"):
        set_mmap_threshold(64 << 20)
    with pytest.raises(ValueError):
        set_mmap_threshold(-1)
