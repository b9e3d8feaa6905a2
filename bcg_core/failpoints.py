"""Fault injection for the fault scenarios (``benchmarks/faults.py``, ``tests/test_fault_scenarios.py``).

Off unless its environment variable is set; a deployment never sets it. Each failpoint fires in one process
only: the first process to create its claim file (``O_CREAT | O_EXCL``), so that on a cluster of several
replicas exactly one misbehaves. It is armed once the claim file's folder exists: a scenario sets the variable
for the whole cluster at start and creates the folder when the fault should happen.

- ``BCG_FAILPOINT_CAPTURE_STALL="<seconds>:<claim file>"``: the replica that claims the file sleeps that long at
  the start of its first capture (:meth:`deployments.dit.DiTReplica._prepare_shapes` from ``__init__``): a
  replica stuck in capture.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["CAPTURE_STALL_ENV", "capture_stall", "claim"]

log = logging.getLogger(__name__)

CAPTURE_STALL_ENV = "BCG_FAILPOINT_CAPTURE_STALL"


def claim(path: str) -> bool:
    """True for the one process that creates ``path`` first (it writes its pid there); False for every other, and
    while the folder of ``path`` does not exist (not armed)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except (FileExistsError, FileNotFoundError):
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def capture_stall() -> float:
    """Sleep as ``BCG_FAILPOINT_CAPTURE_STALL`` says (module docstring) when this process claims it; returns the
    seconds slept (0.0: off or claimed elsewhere).

    Raises:
        ValueError: the variable is set but not ``<seconds>:<claim file>``.
    """
    spec = os.environ.get(CAPTURE_STALL_ENV)
    if not spec:
        return 0.0
    seconds, sep, path = spec.partition(":")
    try:
        stall = float(seconds)
    except ValueError:
        stall = -1.0
    if not sep or not path or stall < 0:
        raise ValueError(f"{CAPTURE_STALL_ENV} must be '<seconds>:<claim file>'; got {spec!r}")
    if not claim(path):
        return 0.0
    log.warning("failpoint %s: this process (pid %d) stalls its capture for %.1f s", CAPTURE_STALL_ENV, os.getpid(),
                stall)
    time.sleep(stall)
    return stall
