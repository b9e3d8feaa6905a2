"""``bcg serve``'s shutdown under repeated Ctrl-C (``deployments/cli/serve_command.py`` ``shutdown_signals``): while the
application drains, a second Ctrl-C says what is happening and does not cut the stop short; a third stops at once."""

import os
import signal

import pytest

from deployments.cli.serve_command import shutdown_signals


def _previous():
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def test_one_more_ctrl_c_during_shutdown_is_reported_not_obeyed(capsys):
    before = _previous()
    finished = False
    with shutdown_signals(before):
        os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread before the next bytecode
        finished = True  # the graceful stop goes on
    assert finished
    assert "still shutting down: requests in flight are finishing" in capsys.readouterr().err
    assert _previous() == before  # the handlers are restored


def test_a_third_ctrl_c_or_sigterm_stops_at_once():
    before = _previous()
    with pytest.raises(KeyboardInterrupt), shutdown_signals(before):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    assert _previous() == before


def test_nothing_is_installed_when_the_server_never_became_ready():
    before = _previous()
    with shutdown_signals({}):
        assert _previous() == before
