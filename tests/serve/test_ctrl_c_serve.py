"""``bcg serve`` stopped as an operator stops it, with Ctrl-C, and what its ready block says of Ray's dashboard.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: ``bcg serve`` and every Ray process it
started. The server then says it is shutting down, stops (``deployments/cli/local.py`` ``stop_local``: the application
deleted, then Ray shut down) and ends with one line saying it stopped; Ray's driver prints nothing of its own
(``serve.shutdown()`` made it print ``(raylet) Task ServeController.graceful_shutdown failed ...``).

``ray.init(include_dashboard=False)`` still starts ``dashboard.py`` (Ray's API server, usage stats only): the ready
block says so, and the metrics URL it gives is a listener of that process.

One server start (a subprocess with its own Ray, 15-60 s on 2 cores) checks both."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from listeners import listening

ROOT = Path(__file__).resolve().parents[2]
_START_S = 240.0
_STOP_S = 90.0


def _listener_cmdline(root_pid: int, port: int) -> str:
    """The command line of the process of ``root_pid``'s tree that listens on ``port`` ('' if none)."""
    for p in [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections(kind="tcp")):
                return " ".join(p.cmdline())
        except psutil.Error:
            continue
    return ""


@pytest.mark.serve
def test_ctrl_c_stops_bcg_serve_with_one_clean_last_line_and_the_dashboard_line_names_what_runs():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.main", "serve", "--port", "0",
                             "--metrics-port", "0", "--num-cpus", "2", "--stop-after-s", "400"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"bcg serve exited ({proc.poll()}) before it was ready:\n{''.join(lines)[-4000:]}")
            lines.append(line)
            if line.lstrip().startswith("try:"):  # the last line of the readiness block
                break
        else:
            pytest.fail(f"bcg serve was not ready within {_START_S:.0f} s:\n{''.join(lines)[-4000:]}")
        ready = "".join(lines)
        api = re.search(r"API\s+(http://127\.0\.0\.1:\d+)", ready)
        assert api, ready
        assert "dashboard  no web UI or REST API; Ray still runs its API-server process (dashboard.py" in ready
        own = re.search(r"with its own metrics at http://127\.0\.0\.1:(\d+)/metrics", ready)
        assert own, ready
        port = int(own[1])
        assert port != 44227  # Ray's fixed default, which a second server on the machine could not bind
        assert "ray/dashboard/dashboard.py" in _listener_cmdline(proc.pid, port)
        assert "--modules-to-load=UsageStatsHead" in _listener_cmdline(proc.pid, port)
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0, trust_env=False).text
        assert "ray_dashboard_event_loop_lag_seconds" in body  # the API server's own metrics, not the exporter's
        # no web UI: nothing of the tree listens on Ray's dashboard port
        assert 8265 not in {p for _, p in listening(proc.pid)}

        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, _ = proc.communicate(timeout=_STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"bcg serve did not stop within {_STOP_S:.0f} s of Ctrl-C:\n{(''.join(lines) + out)[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    after = [ln for ln in out.splitlines() if ln.strip()]
    assert proc.returncode == 0, out
    assert after and after[-1] == f"bcg-serve: stopped (Ctrl-C); served {api[1]}", out
    assert after[0] == "bcg-serve: shutting down (Ctrl-C) ...", out
    assert len(after) == 2, out  # nothing of Ray's in between
    assert "graceful_shutdown" not in out and "(raylet)" not in out, out
