"""What ``bcg serve`` prints after ready while replicas compile in the background (``deployments/cli/console.py``):
scripted ``DiTReplica.stats()`` snapshots, no Ray."""

from __future__ import annotations

import threading

from deployments.cli.console import CompileProgress, watch_compiles


def _stats(pending: int, swapped: int, failed: int = 0, running: bool | None = None, replica: str = "r1abcdefgh",
           tier: str = "compiled", ready: int = 2, owned: int = 2) -> dict:
    total = pending + swapped + failed
    kernels = ["eager"] * (pending + failed) + [tier] * swapped
    return {"replica": replica, "kernels": {"tier": tier},
            "routing": {"owned": [f"s{i}" for i in range(owned)], "ready": [f"s{i}" for i in range(ready)]},
            "buckets": [{"key": f"b{i}", "kernels": k} for i, k in enumerate(kernels)] if total else
            [{"key": "b0", "kernels": tier}],
            "scheduler": {"background_compiles": {"pending": pending, "swapped": swapped, "failed": failed,
                                                  "running": pending > 0 if running is None else running}}}


def test_progress_prints_a_line_per_change_and_one_final_line_per_replica():
    p = CompileProgress(started=100.0)
    assert p.lines(_stats(3, 0), 101.0) == ["bcg-serve: replica r1abcdef: compiling in the background: 0 of 3 "
                                            "buckets swapped in, 3 serving eager kernels until theirs are checked, "
                                            "1 s after ready"]
    assert p.lines(_stats(3, 0), 103.0) == []  # nothing changed: nothing printed
    assert "1 of 3 buckets swapped in, 2 serving" in p.lines(_stats(2, 1), 140.0)[0]
    final = p.lines(_stats(0, 2, failed=1), 190.0)
    assert final == ["bcg-serve: replica r1abcdef: every bucket compiled: 2 swapped in from eager kernels, 1 kept "
                     "eager kernels (see /v1/buckets notes), 90 s after ready"]
    assert p.done == {"r1abcdefgh"} and p.lines(_stats(0, 2, failed=1), 200.0) == []
    # a second replica that started warm: one line, at once
    warm = p.lines(_stats(0, 0, replica="r2zzzzzzzz"), 101.0)
    assert warm == ["bcg-serve: replica r2zzzzzz: compiled kernels in 1 of 1 buckets from the compile cache; "
                    "nothing to compile"]
    assert CompileProgress(0.0).lines(_stats(0, 0, tier="eager"), 1.0) == []  # eager kernels: nothing to say
    failed = CompileProgress(0.0)
    failed.lines(_stats(2, 0), 1.0)
    assert failed.lines(_stats(0, 0, failed=2), 9.0) == [  # every compile failed: not "every bucket compiled"
        "bcg-serve: replica r1abcdef: no bucket compiled: 2 kept eager kernels (see /v1/buckets notes), "
        "9 s after ready"]


def test_watch_returns_on_stop_or_timeout_and_stops_polling_once_every_replica_is_done():
    snapshots = iter([_stats(2, 0), None, _stats(1, 1), _stats(0, 2)])
    polls, printed = [], []

    def poll():
        polls.append(1)
        return next(snapshots, _stats(0, 2))

    import deployments.cli.console as console

    before, console.POLL_S = console.POLL_S, 0.01
    try:
        assert watch_compiles(threading.Event(), 0.5, poll, printed.append) is False  # timed out, not stopped
        assert len(printed) == 3 and printed[-1].startswith("bcg-serve: replica r1abcdef: every bucket compiled")
        assert len(polls) == 4  # no poll after the replica was done
        stop = threading.Event()
        stop.set()
        assert watch_compiles(stop, None, lambda: _stats(1, 0), printed.append) is True
    finally:
        console.POLL_S = before


def test_a_replica_ready_before_every_shape_is_captured_prints_its_capture_then_its_compiles():
    """``runner.ready_after_s`` passed: the shapes left are captured after ready (one line per shape), then the
    background compiles run as usual; with eager kernels one line says every shape is captured."""
    p = CompileProgress(started=100.0)
    assert p.lines(_stats(0, 0, running=False, ready=1, owned=3), 101.0) == [
        "bcg-serve: replica r1abcdef: capturing in the background: 1 of 3 shapes ready (requests of the others run "
        "unpadded eager forwards until then), 1 s after ready"]
    assert p.lines(_stats(0, 0, running=False, ready=1, owned=3), 102.0) == []
    assert "2 of 3 shapes ready" in p.lines(_stats(0, 0, running=False, ready=2, owned=3), 110.0)[0]
    assert p.done == set()  # not "nothing to compile": the buckets of the last shape are still to come
    assert "0 of 2 buckets swapped in" in p.lines(_stats(2, 0, ready=3, owned=3), 115.0)[0]
    assert "every bucket compiled" in p.lines(_stats(0, 2, ready=3, owned=3), 150.0)[0]

    eager = CompileProgress(started=0.0)
    assert "1 of 2 shapes ready" in eager.lines(_stats(0, 0, tier="eager", running=False, ready=1), 3.0)[0]
    assert eager.lines(_stats(0, 0, tier="eager", running=False), 9.0) == [
        "bcg-serve: replica r1abcdef: every shape captured (2 of 2), 9 s after ready"]
    assert eager.done == {"r1abcdefgh"}
