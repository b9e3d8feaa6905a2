"""The mixed soak's memory readings (``benchmarks/soak_mixed.py``): resident memory per process below this one,
grouped by name (Ray's titles: ``DiTReplica``, ``Ingress``...), a group's heap, file and shared memory, and the
summary under load (slope per minute, first and last windows, the last half's growth).

Linux ``/proc`` only; no project imports.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path


def _descendants(root: int) -> list[int]:
    """Pids of every process below ``root`` (``/proc/<pid>/stat``'s parent field), ``root`` excluded."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def _group(cmdline: bytes) -> str:
    """A process's group name: Ray's title without ``ray::``, the application and the method it runs now
    (``ray::ServeReplica:bcg:DiTReplica.generate`` -> ``DiTReplica``, ``ray::ProxyActor.receive_asgi_messages`` ->
    ``ProxyActor``), else the program's file name (``raylet``, ``gcs_server``) or a Python program's script
    (``dashboard.py``)."""
    args = cmdline.split(b"\0")
    first = args[0].decode(errors="replace")
    if first.startswith("ray::"):  # Ray appends the method running now: ``ray::ServeReplica:bcg:Ingress.handle_...``
        title = first[5:].split()[0] if first[5:].strip() else "worker"
        return title.rsplit(":", 1)[-1].split(".", 1)[0]
    name = os.path.basename(first)
    if name.startswith("python") and len(args) > 1:  # a Python helper (dashboard agent, log monitor): its script
        script = next((a.decode(errors="replace") for a in args[1:] if a.endswith(b".py")), "")
        return os.path.basename(script) or name
    return name


def _statuses(root: int | None):
    """``(group, /proc/<pid>/status text)`` of each process below ``root`` (default: this one) with a command line
    (:func:`_group`); a process gone while being read is skipped."""
    for pid in _descendants(os.getpid() if root is None else root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if cmd:
            yield _group(cmd), status


def process_groups(root: int | None = None) -> dict[str, int]:
    """Resident memory (VmRSS, bytes) of the processes below ``root`` (default: this one), summed per group
    (:func:`_group`). Linux ``/proc`` only; a process gone while being read is skipped."""
    out: dict[str, int] = {}
    for name, status in _statuses(root):
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if kb is not None:
            out[name] = out.get(name, 0) + kb * 1024
    return out


def group_memory(group: str, root: int | None = None) -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``RssShmem`` (bytes) summed over the processes of ``group`` below
    ``root`` (:func:`process_groups`): private heap, mapped files and shared memory (Ray's object store)."""
    out = dict.fromkeys(("VmRSS", "RssAnon", "RssFile", "RssShmem"), 0)
    for name, status in _statuses(root):
        if name == group:
            for line in status.splitlines():
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] += int(line.split()[1]) * 1024
    return out


def slope_mb_per_min(series: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, bytes)`` samples in MB (2**20 bytes) per minute; None under 3 samples."""
    if len(series) < 3:
        return None
    ts, ys = [t for t, _ in series], [y for _, y in series]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return None if den == 0 else sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den * 60 / 2**20


def under_load_summary(series: list[tuple[float, dict[str, int]]], start_s: float, end_s: float,
                       window_s: float) -> dict:
    """The memory under load after ``start_s`` (end of warm-up) up to ``end_s``, per group and in total.

    Args:
        series: ``(seconds since the start, {group: bytes})`` samples.
        start_s, end_s: the span judged (seconds since the start).
        window_s: width of the first and last windows compared (seconds).

    Returns:
        ``{group: {"per_minute_median_mb", "slope_mb_per_min", "slope_last_half_mb_per_min", "first_window_mb",
        "last_window_mb", "change_first_to_last", "last_half_growth"}}`` with ``"total"`` for the sum;
        ``last_half_growth`` is the last half's slope times its length over its median (the target's measure).
    """
    span = [(t, s) for t, s in series if start_s <= t <= end_s]
    groups = sorted({g for _, s in span for g in s} | {"total"})
    mid = (start_s + end_s) / 2
    out = {}
    for g in groups:
        pts = [(t, float(sum(s.values()) if g == "total" else s.get(g, 0))) for t, s in span]
        if not pts:
            continue
        minutes: dict[int, list[float]] = {}
        for t, y in pts:
            minutes.setdefault(int(t // 60), []).append(y)
        first = [y for t, y in pts if t < start_s + window_s]
        last = [y for t, y in pts if t > end_s - window_s]
        half = [(t, y) for t, y in pts if t >= mid]
        f = statistics.median(first) if first else None
        la = statistics.median(last) if last else None
        sl_half = slope_mb_per_min(half)
        med_half = statistics.median([y for _, y in half]) if half else None
        out[g] = {
            "per_minute_median_mb": {m: round(statistics.median(v) / 2**20, 1) for m, v in sorted(minutes.items())},
            "slope_mb_per_min": _r(slope_mb_per_min(pts), 2),
            "slope_last_half_mb_per_min": _r(sl_half, 2),
            "first_window_mb": _r(f / 2**20 if f else None, 1), "last_window_mb": _r(la / 2**20 if la else None, 1),
            "change_first_to_last": _r((la - f) / f if f and la else None, 4),
            "last_half_growth": _r(sl_half * (end_s - mid) / 60 / (med_half / 2**20)
                                   if sl_half is not None and med_half else None, 4),
        }
    return out


def _r(x, nd):
    return None if x is None else round(x, nd)
