"""Fault injection for the fault scenarios (``benchmarks/faults.py``, ``tests/serve/test_fault_scenarios.py``).

Off unless its environment variable is set; a deployment never sets it. Each failpoint fires in one process
only: the first process to create its claim file (``O_CREAT | O_EXCL``), so that on a cluster of several
replicas exactly one misbehaves. It is armed once the claim file's folder exists: a scenario sets the variable
for the whole cluster at start and creates the folder when the fault should happen.

- ``BCG_FAILPOINT_CAPTURE_STALL="<seconds>:<claim file>"``: the replica that claims the file sleeps that long at
  the start of its first capture (:meth:`deployments.replica.model.ReplicaModel.prepare` from ``DiTReplica.__init__``):
  a replica stuck in capture. The stall ends sooner once ``<claim file>.release`` exists (polled every 0.1 s): a
  scenario that has judged what it needed while the replica was stuck releases it instead of waiting out a stall
  sized for the slowest machine.
- ``BCG_FAILPOINT_FORWARD_ERROR="<claim file>"``: the next padded bucket forward of the process that claims it
  (a replay on CUDA, the static-buffer forward on a CPU) raises ``RuntimeError("CUDA error: ... (simulated)")``:
  a CUDA error mid-replay (the runner demotes the bucket, :func:`bcg_core.runners.base.demote`).
- ``BCG_FAILPOINT_STEP_OOM="<claim file>"``: the next denoising step of the step scheduler in the process that
  claims it raises ``torch.OutOfMemoryError``: the GPU out of memory at run time.

A failpoint costs one dictionary lookup per call while its variable is unset, and nothing more once this
process has seen its claim file taken.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["CAPTURE_STALL_ENV", "FORWARD_ERROR_ENV", "SIMULATED_CUDA_ERROR", "STEP_OOM_ENV", "capture_stall", "claim",
           "forward_error", "release_path", "step_oom"]

log = logging.getLogger(__name__)

CAPTURE_STALL_ENV = "BCG_FAILPOINT_CAPTURE_STALL"
FORWARD_ERROR_ENV = "BCG_FAILPOINT_FORWARD_ERROR"
STEP_OOM_ENV = "BCG_FAILPOINT_STEP_OOM"
SIMULATED_CUDA_ERROR = "CUDA error: an illegal memory access was encountered (simulated by a failpoint)"

_spent: set[str] = set()  # claim files this process found taken (by itself or another): never tried again


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


def release_path(claim_file: str) -> str:
    """The file whose creation ends the capture stall of ``claim_file`` early (module docstring)."""
    return claim_file + ".release"


def capture_stall(poll_s: float = 0.1) -> float:
    """Sleep as ``BCG_FAILPOINT_CAPTURE_STALL`` says (module docstring) when this process claims it, until its
    seconds have passed or :func:`release_path` of its claim file exists (checked every ``poll_s`` seconds);
    returns the seconds slept: the full stall, less when released (0.0: off or claimed elsewhere).

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
    t0 = time.monotonic()
    release = release_path(path)
    while (left := stall - (time.monotonic() - t0)) > 0:
        if os.path.exists(release):
            slept = time.monotonic() - t0
            log.warning("failpoint %s: released after %.1f s", CAPTURE_STALL_ENV, slept)
            return slept
        time.sleep(min(poll_s, left))
    return stall


def _fires(env: str) -> bool:
    """True once, in the process that claims ``env``'s claim file (see the module docstring)."""
    path = os.environ.get(env)
    if not path or path in _spent:
        return False
    if not os.path.isdir(os.path.dirname(path) or "."):
        return False  # not armed yet
    won = claim(path)
    _spent.add(path)
    if won:
        log.warning("failpoint %s fires in this process (pid %d)", env, os.getpid())
    return won


def forward_error() -> None:
    """Raise :data:`SIMULATED_CUDA_ERROR` as a ``RuntimeError`` when ``BCG_FAILPOINT_FORWARD_ERROR`` fires here."""
    if _fires(FORWARD_ERROR_ENV):
        raise RuntimeError(SIMULATED_CUDA_ERROR)


def step_oom() -> None:
    """Raise ``torch.OutOfMemoryError`` when ``BCG_FAILPOINT_STEP_OOM`` fires here."""
    if _fires(STEP_OOM_ENV):
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated by a failpoint)")
