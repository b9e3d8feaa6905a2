"""The failpoints of the fault scenarios (:mod:`bcg_core.failpoints`) in this process: armed by their folder,
fired once. The scenarios on a Ray cluster are ``tests/serve/test_fault_scenarios.py``."""

from __future__ import annotations

import pytest

from bcg_core import failpoints


def test_the_capture_stall_failpoint_fires_in_one_process_once_armed(tmp_path, monkeypatch):
    armed = tmp_path / "armed"
    monkeypatch.setenv(failpoints.CAPTURE_STALL_ENV, f"0.05:{armed / 'claim'}")
    assert failpoints.capture_stall() == 0.0  # not armed: the folder does not exist
    armed.mkdir()
    assert failpoints.capture_stall() == 0.05
    assert failpoints.capture_stall() == 0.0  # claimed already
    monkeypatch.delenv(failpoints.CAPTURE_STALL_ENV)
    assert failpoints.capture_stall() == 0.0


def test_the_capture_stall_ends_once_released(tmp_path, monkeypatch):
    import threading
    import time

    armed = tmp_path / "armed"
    armed.mkdir()
    claim_file = str(armed / "claim")
    monkeypatch.setenv(failpoints.CAPTURE_STALL_ENV, f"30:{claim_file}")
    timer = threading.Timer(0.3, lambda: open(failpoints.release_path(claim_file), "w").close())
    timer.start()
    t0 = time.monotonic()
    slept = failpoints.capture_stall(poll_s=0.02)
    timer.join()
    assert 0.3 <= slept < 5 and time.monotonic() - t0 < 5  # not the 30 s of its spec


def test_the_forward_and_oom_failpoints_fire_once_per_cluster(tmp_path, monkeypatch):
    import torch

    failpoints._spent.clear()
    armed = tmp_path / "armed"
    monkeypatch.setenv(failpoints.FORWARD_ERROR_ENV, str(armed / "forward"))
    monkeypatch.setenv(failpoints.STEP_OOM_ENV, str(armed / "oom"))
    failpoints.forward_error()  # not armed
    failpoints.step_oom()
    armed.mkdir()
    with pytest.raises(RuntimeError, match="CUDA error"):
        failpoints.forward_error()
    with pytest.raises(torch.OutOfMemoryError):
        failpoints.step_oom()
    failpoints.forward_error()  # fired already: never again
    failpoints.step_oom()


@pytest.mark.parametrize("spec", ["5", "x:/tmp/a", "-1:/tmp/a", "5:"])
def test_a_bad_failpoint_spec_is_refused(monkeypatch, spec):
    monkeypatch.setenv(failpoints.CAPTURE_STALL_ENV, spec)
    with pytest.raises(ValueError, match=failpoints.CAPTURE_STALL_ENV):
        failpoints.capture_stall()
