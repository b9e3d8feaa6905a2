"""``bcg serve`` stopped as an operator stops it, with Ctrl-C, and what its ready block says of Ray's dashboard.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: ``bcg serve`` and every Ray process it
started. The server then says it is shutting down, stops (``deployments/cli/local.py`` ``stop_local``: the application
deleted, then Ray shut down) and ends with one line saying it stopped; Ray's driver prints nothing of its own
(``serve.shutdown()`` made it print ``(raylet) Task ServeController.graceful_shutdown failed ...``).

``ray.init(include_dashboard=False)`` still starts ``dashboard.py`` (Ray's API server, usage stats only): the ready
block says so, and the metrics URL it gives is a listener of that process.

A Ctrl-C drains before it deletes the application (``deployments/drain.py``): a streamed generation already accepted
(its 200 came once the DiT replica took it) runs to its last event, while a request that arrives meanwhile is answered
503 with ``Retry-After`` in OpenAI's error shape (code ``server_stopping``); only after the stream ended does Serve's
proxy answer its plain-text 404 (the application deleted, its route gone), then nothing listens.

One server start (a subprocess with its own Ray, 15-60 s on 2 cores) checks all three; the drain adds the streamed
generation's few seconds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from listeners import listening
from sse import parse_sse

ROOT = Path(__file__).resolve().parents[2]
_START_S = 240.0
_STOP_S = 90.0
# 512x512 at 16 steps: long enough (2-6 s on 2 cores) that the drain starts while it streams
_IN_FLIGHT = {"prompt": "a lighthouse at dusk", "size": "512x512", "num_inference_steps": 16, "seed": 7, "stream": True}


def _answers_until_gone(url: str, timeout_s: float) -> list[tuple[float, int | None, httpx.Response | None]]:
    """``GET url`` every 0.05 s until an answer is neither 200 nor 503 (the proxy's 404) or the connection fails:
    each change of status as ``(time.monotonic(), status or None for a failed connection, the response)``."""
    seen: list[tuple[float, int | None, httpx.Response | None]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=10.0, trust_env=False)
        except httpx.HTTPError:
            r = None
        status = None if r is None else r.status_code
        if not seen or seen[-1][1] != status:
            seen.append((time.monotonic(), status, r))
        if status not in (200, 503):
            break
        time.sleep(0.05)
    return seen


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

        stream_end: list[float] = []
        with httpx.Client(timeout=120.0, trust_env=False) as client, \
                client.stream("POST", f"{api[1]}/v1/images/generations", json=_IN_FLIGHT) as streamed:
            assert streamed.status_code == 200, streamed.read()  # accepted: in flight at the ingress
            reader = threading.Thread(target=lambda: (streamed.read(), stream_end.append(time.monotonic())))
            reader.start()
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
            answers = _answers_until_gone(f"{api[1]}/v1/models", _STOP_S)
            reader.join(timeout=_STOP_S)
            events = parse_sse(streamed.content)
        out, _ = proc.communicate(timeout=_STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"bcg serve did not stop within {_STOP_S:.0f} s of Ctrl-C:\n{(''.join(lines) + out)[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    # the stream accepted before Ctrl-C ran to its image
    assert [name for name, _ in events][-1:] == ["image_generation.completed"], events[-1:]
    statuses = [status for _, status, _ in answers]
    assert 503 in statuses and statuses[-1] in (404, None), statuses
    refused = answers[statuses.index(503)]
    body = refused[2].json()["error"]
    assert body["code"] == "server_stopping" and body["type"] == "server_error" and "stopping" in body["message"], body
    assert int(refused[2].headers["retry-after"]) >= 1, refused[2].headers
    # refused while the stream was still running, and the application deleted (404, or gone) only after it ended
    assert stream_end and refused[0] < stream_end[0] <= answers[statuses.index(503) + 1][0], (answers, stream_end)
    after = [ln for ln in out.splitlines() if ln.strip()]
    assert proc.returncode == 0, out
    assert after and after[-1] == f"bcg-serve: stopped (Ctrl-C); served {api[1]}", out
    assert after[0] == "bcg-serve: shutting down (Ctrl-C) ...", out
    assert len(after) == 2, out  # nothing of Ray's in between
    assert "graceful_shutdown" not in out and "(raylet)" not in out, out
