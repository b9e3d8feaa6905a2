"""A failed capture of a bucket's step-cache graphs is tried again (``bcg_core/runners/piecewise.py``).

The capture runs on the request path while other threads use the GPU, so a failure may be passing; the bucket's
halves run unpadded and eager meanwhile, and the capture is tried again at its next cached step after
``PIECE_RETRY_S`` seconds, then twice that, at most ``PIECE_CAPTURE_ATTEMPTS`` times. The runner here is
:class:`PiecewiseReplay` itself with a stand-in capture (the graphs need CUDA), on a clock the test moves.
"""

from __future__ import annotations

import threading

import pytest
import torch

from bcg_core.keys import BucketKey
from bcg_core.runners import piecewise
from bcg_core.runners.base import BucketEntry, CaptureStats
from bcg_core.runners.piecewise import PIECE_CAPTURE_ATTEMPTS, PIECE_RETRY_S, PiecewiseReplay


class Runner(PiecewiseReplay):
    """The attributes :meth:`PiecewiseReplay._pieces_of` uses; its capture fails its first ``fails`` calls."""

    def __init__(self, fails: int):
        self.gate, self.stats, self.device = threading.RLock(), CaptureStats(), torch.device("cpu")
        self.fails, self.calls = fails, 0

    def _capture_pieces(self, entry, split):
        self.calls += 1
        if self.calls <= self.fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        return "captured"


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(piecewise.time, "monotonic", lambda: now[0])
    return now


def _entry() -> BucketEntry:
    return BucketEntry(BucketKey(batch=4, image_tokens=1024, text_tokens=512), {})


def test_a_passing_failure_is_captured_at_a_later_cached_step(clock):
    runner, entry = Runner(fails=1), _entry()
    assert runner._pieces_of(entry, None) is None  # failed: halves unpadded and eager
    assert entry.pieces is False and entry.piece_attempts == 1 and runner.stats.piece_failures == 1
    assert "no step-cache graphs: RuntimeError" in entry.note
    clock[0] += PIECE_RETRY_S - 1
    assert runner._pieces_of(entry, None) is None and runner.calls == 1  # too soon: no capture on this step
    clock[0] += 1
    assert runner._pieces_of(entry, None) == "captured" and runner.calls == 2
    assert runner._pieces_of(entry, None) == "captured" and runner.calls == 2  # kept, not captured again


def test_captures_that_keep_failing_stop_after_the_last_attempt_with_doubling_waits(clock):
    runner, entry = Runner(fails=100), _entry()
    waits = []
    for _ in range(PIECE_CAPTURE_ATTEMPTS):
        assert runner._pieces_of(entry, None) is None
        waits.append(entry.piece_retry_at - clock[0])
        clock[0] = entry.piece_retry_at
    assert runner.calls == PIECE_CAPTURE_ATTEMPTS and entry.piece_attempts == PIECE_CAPTURE_ATTEMPTS
    assert waits == [PIECE_RETRY_S * 2**i for i in range(PIECE_CAPTURE_ATTEMPTS)]
    clock[0] += 10 * PIECE_RETRY_S
    assert runner._pieces_of(entry, None) is None and runner.calls == PIECE_CAPTURE_ATTEMPTS
    assert runner.stats.piece_failures == PIECE_CAPTURE_ATTEMPTS
