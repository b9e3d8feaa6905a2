"""How a miss's step is cut into forwards: one unpadded eager forward while its activations fit the memory the
replica can spare now; beyond that, as few and as even chunks of rows as fit.

A miss (a request no bucket shape holds) runs unpadded and eager (:meth:`.decider.StepDecider.decide`). A forward of
``rows`` rows of ``tokens_per_row`` real tokens is expected to need ``bytes_per_row_token * rows * tokens_per_row``
bytes of activations. ``bytes_per_row_token`` is measured, never estimated: on CUDA, :func:`.measure.measure_costs`
records the peak memory above the starting allocation of each unpadded eager forward it times (each shape at 1, 2,
4, ... rows and at every batch size; :class:`ActivationPeaks`) over that forward's rows x real tokens per row, and
:class:`MissMemory` keeps the largest figure seen. A forward's fixed part (workspaces and the like) weighs most at
1 row, and the largest figure never underestimates a forward like one measured; attention whose memory grows with
the square of a row's tokens is not linear in them, so a miss of longer rows than any measured shape can need more.

The memory the replica can spare now (:func:`cuda_spare_bytes`, which the step scheduler gives its pipeline's
decider on CUDA) is the driver's free device memory plus what the caching allocator holds reserved but unallocated;
a miss may use it less a safety margin, :data:`MARGIN_FRACTION` of it and at least :data:`MARGIN_BYTES` (a stated
margin, not a measurement: the decode thread and the preview worker allocate beside a forward).

On a CPU nothing is measured and nothing bounds a miss: it runs in one forward, as a user's own server runs a
request's rows. So it does on CUDA until a measurement arrives (never with ``scheduler.measure_costs: never``, nor
under ``auto`` on the eager runner, as the naive server of ``benchmarks/bench_saturation.py`` runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["MARGIN_BYTES", "MARGIN_FRACTION", "ActivationPeaks", "MissMemory", "cuda_spare_bytes"]

T = TypeVar("T")

MARGIN_FRACTION = 0.2
"""Share of the spare memory a miss's forward leaves alone (see the module docstring)."""
MARGIN_BYTES = 1 << 30
"""Bytes of spare memory a miss's forward leaves alone at least: 1 GiB."""


def cuda_spare_bytes(device) -> Callable[[], int] | None:
    """The spare-memory source of a replica on ``device``: on CUDA a callable returning
    ``torch.cuda.mem_get_info`` free bytes plus ``memory_reserved - memory_allocated`` (reserved by the caching
    allocator, unallocated) in bytes, now; None elsewhere (nothing bounds a miss)."""
    import torch

    if torch.device(device).type != "cuda":
        return None

    def spare() -> int:
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))

    return spare


class ActivationPeaks:
    """Peak activation bytes per row x real token of measured forwards (:func:`~.costs.measure_costs` wraps each
    eager point's timed calls in :meth:`measure`).

    Args:
        device: the model's device; off CUDA nothing is measured (:attr:`most` stays None).

    Attributes:
        per_row_token: one figure per :meth:`measure` call on CUDA: the peak bytes allocated on ``device`` during
            the call above the allocation at its start (``torch.cuda.max_memory_allocated`` after
            ``reset_peak_memory_stats``), over the inputs' rows x (image tokens + text tokens). Another thread's
            allocations meanwhile count too: an overestimate, never an underestimate.
    """

    def __init__(self, device):
        import torch

        self.device = device
        self.cuda = torch.device(device).type == "cuda"
        self.per_row_token: list[float] = []

    def measure(self, inputs, fn: Callable[[], T]) -> T:
        """Run ``fn`` (forwards of ``inputs``, a :class:`~bcg_core.padding.DenoiseInputs`) and return its result,
        recording its peak bytes per row-token on CUDA."""
        if not self.cuda:
            return fn()
        import torch

        torch.cuda.synchronize(self.device)
        start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = fn()
        torch.cuda.synchronize(self.device)
        peak = max(0, torch.cuda.max_memory_allocated(self.device) - start)
        self.per_row_token.append(peak / (inputs.rows * (inputs.image_tokens + inputs.text.shape[1])))
        return out

    @property
    def most(self) -> float | None:
        """The largest figure recorded, bytes per row-token; None where none was (off CUDA)."""
        return max(self.per_row_token, default=None)


class MissMemory:
    """The memory bound on a miss's unpadded eager forwards (module docstring).

    Args:
        spare_bytes: returns the bytes the replica can spare now, before the margin (:func:`cuda_spare_bytes` on
            CUDA, set by the step scheduler; tests script it); None: nothing bounds a miss. Also an attribute,
            read at each miss step.

    Attributes:
        bytes_per_row_token: activation bytes per row x real token of an unpadded eager forward, the largest
            measured (:meth:`observe`), or set (:meth:`set_bytes_per_row_token`); None until then (no bound).
    """

    def __init__(self, spare_bytes: Callable[[], int | None] | None = None):
        self.spare_bytes = spare_bytes
        self.bytes_per_row_token: float | None = None
        self._lock = threading.Lock()

    def observe(self, bytes_per_row_token: float | None) -> None:
        """Keep the largest of ``bytes_per_row_token`` (a new measurement; None: none) and the figure held."""
        if bytes_per_row_token is None:
            return
        self._check(bytes_per_row_token)
        with self._lock:
            self.bytes_per_row_token = max(self.bytes_per_row_token or 0.0, float(bytes_per_row_token))

    def set_bytes_per_row_token(self, bytes_per_row_token: float | None) -> None:
        """Replace the figure held (None: no bound).

        Raises:
            ValueError: ``bytes_per_row_token`` below 0.
        """
        if bytes_per_row_token is not None:
            self._check(bytes_per_row_token)
        with self._lock:
            self.bytes_per_row_token = None if bytes_per_row_token is None else float(bytes_per_row_token)

    @staticmethod
    def _check(value: float) -> None:
        if value < 0:
            raise ValueError(f"bytes_per_row_token must be >= 0, got {value}")

    def usable_bytes(self) -> int | None:
        """Bytes a miss's forward may use now: the spare bytes less ``max(MARGIN_BYTES, MARGIN_FRACTION x spare)``,
        at least 0; None where no source is set or it returns None."""
        spare = self.spare_bytes() if self.spare_bytes is not None else None
        if spare is None:
            return None
        return max(0, int(spare - max(MARGIN_BYTES, MARGIN_FRACTION * spare)))

    def chunk_rows(self, rows: int, tokens_per_row: int | None) -> list[int]:
        """The rows of each forward of a miss's step of ``rows`` rows of ``tokens_per_row`` real tokens: ``[rows]``
        (one forward) while ``bytes_per_row_token x rows x tokens_per_row`` fits :meth:`usable_bytes`, or with no
        figure, no spare-memory source or ``tokens_per_row`` None; else ``n`` chunks, the fewest that fit, of
        ``rows // n`` or one more rows, larger first (one row a chunk where not even one row fits: a row cannot be
        split).

        Raises:
            ValueError: ``rows`` below 1, or ``tokens_per_row`` below 1.
        """
        if rows < 1:
            raise ValueError(f"a step needs at least 1 row, got {rows}")
        if tokens_per_row is not None and tokens_per_row < 1:
            raise ValueError(f"tokens_per_row must be at least 1, got {tokens_per_row}")
        per_row = None if tokens_per_row is None or not self.bytes_per_row_token else \
            self.bytes_per_row_token * tokens_per_row
        usable = self.usable_bytes() if per_row else None
        if per_row is None or usable is None or per_row * rows <= usable:
            return [rows]
        n = -(-rows // max(1, int(usable // per_row)))
        return [rows // n + (i < rows % n) for i in range(n)]

    def describe(self) -> dict:
        """JSON-ready view for ``/v1/buckets``: ``bytes_per_row_token`` (None: not measured, no bound) and
        ``usable_bytes`` now (None: no spare-memory source)."""
        per = self.bytes_per_row_token
        return {"bytes_per_row_token": None if per is None else round(per, 3), "usable_bytes": self.usable_bytes()}
