"""``bcg serve`` as an operator starts it: one readiness block printed once the server answers, with the API
and metrics URLs; Ray's exporter at that metrics URL serving the ``ray_bcg_`` series; and no socket of the
server's process tree listening outside loopback (``deployments/cli/local.py`` ``bind_ray_to``).

One server start (a subprocess with its own Ray, about a minute on 2 cores) checks all three."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from listeners import listening, outside_loopback

ROOT = Path(__file__).resolve().parents[2]
_START_S = 240.0


@pytest.mark.serve
def test_bcg_serve_prints_readiness_once_serves_metrics_and_listens_on_loopback_only():
    env = {**os.environ, "RAY_metrics_report_interval_ms": "1000", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.main", "serve", "--port", "0",
                             "--metrics-port", "0", "--num-cpus", "2", "--stop-after-s", "300"], cwd=ROOT, env=env,
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
        text = "".join(lines)
        assert text.count("bcg-serve is ready") == 1, text
        assert "model bcg-tiny-flux" in text
        api = re.search(r"API\s+(http://127\.0\.0\.1:\d+)", text)
        metrics = re.search(r"metrics\s+(http://127\.0\.0\.1:\d+/metrics)", text)
        assert api and metrics, text
        url = api[1]
        # ready means ready: the API answers the moment the line is out
        assert httpx.get(f"{url}/healthz", timeout=5.0, trust_env=False).status_code == 200
        r = httpx.post(f"{url}/v1/images/generations", timeout=120.0, trust_env=False,
                       json={"prompt": "a lighthouse", "size": "256x256", "num_inference_steps": 1, "seed": 3})
        assert r.status_code == 200, r.text

        # every listener of the server (Ray's GCS, raylet, workers, agents, Serve's proxy) is on loopback, but
        # for the one Ray hard-codes: each Serve replica's inter-deployment gRPC server on [::]:0
        # (ray/serve/_private/replica.py; docs/OPERATIONS.md says so and how to restrict it)
        sockets = listening(proc.pid)
        assert len(sockets) >= 5, sockets  # the tree was found: GCS, raylet, proxy, replicas, exporter at least
        unexpected, serve_grpc = outside_loopback(sockets)
        assert not unexpected, f"listening outside loopback: {unexpected}"
        assert len(serve_grpc) == 3, serve_grpc  # the ingress, the coordinator and the DiT replica
        assert int(metrics[1].rsplit(":", 1)[1].split("/")[0]) in {port for _, port in sockets}

        # Ray's exporter serves the replica's series (pushed every second, exported every RAY_metrics_report_...)
        body, deadline = "", time.monotonic() + 60.0
        while time.monotonic() < deadline:
            body = httpx.get(metrics[1], timeout=10.0, trust_env=False).text
            if re.search(r"^ray_bcg_requests_total\{.*\} [1-9]", body, re.M):
                break
            time.sleep(1.0)
        else:
            found = sorted({ln.split("{")[0] for ln in body.splitlines() if ln.startswith("ray_bcg_")})
            pytest.fail(f"no ray_bcg_requests_total > 0 at {metrics[1]} within 60 s; bcg series: {found}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        lines.append(out or "")
    assert proc.returncode == 0, "".join(lines)[-4000:]
    assert "bcg-serve: shutting down" in "".join(lines)
