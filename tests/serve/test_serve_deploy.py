"""``serve deploy`` of ``deploy/serve_config_cpu.yaml`` onto a Ray cluster started with ``ray start --head``.

This is docs/DEPLOY.md's "On this machine" flow, run for real with the ``ray`` and ``serve`` CLIs in
subprocesses: start a head node with its dashboard (``serve deploy``/``status``/``shutdown`` talk to the
dashboard's REST API), deploy the config file, wait until the application is RUNNING, generate one image
over HTTP, shut Serve down.

The cluster is isolated from every other Ray instance on this machine (the session's
``ray.init(address="local")`` of ``tests/serve/conftest.py``, anybody else's):

- each of its ports is a free one (GCS, dashboard, dashboard agent HTTP and gRPC, metrics export, runtime
  env agent, Ray client server) and Ray's temp dir is a fresh folder;
- token authentication with its own token (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH`` in that folder),
  never ``~/.ray/auth_token``;
- it runs under ``ray start --block``, and SIGTERM to that process stops exactly this node's processes.
  ``ray stop`` (that flow's last step) is not used: it kills every Ray process on the machine, conftest's too.
"""

from __future__ import annotations

import base64
import io
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from PIL import Image

from listeners import listening, outside_loopback

ROOT = Path(__file__).resolve().parents[2]
CPU_CONFIG = ROOT / "deploy" / "serve_config_cpu.yaml"
BIN = Path(sys.executable).parent
RAY, SERVE = BIN / "ray", BIN / "serve"
APP = "bcg"
READY_TIMEOUT_S = 240  # app RUNNING after `serve deploy`; ~60-90 s on a busy 2-core machine
CLI_TIMEOUT_S = 120

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not (RAY.exists() and SERVE.exists()), reason=f"no ray and serve CLIs in {BIN}"),
]


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (all held open at once, so they differ)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[19])


def _tree(root: int, marker: str) -> dict[int, int]:
    """Processes of this node: ``root``'s descendants and any process whose command line names ``marker``
    (this test's own temp dir). Returns {pid: start time}, to kill them later without hitting a reused pid."""
    stats, cmdlines = {}, {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            pid = int(entry.name)
            st = _proc_stat(pid)
            if st is not None:
                stats[pid] = st
                try:
                    cmdlines[pid] = (entry / "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    cmdlines[pid] = ""
    found, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in stats.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    found |= {pid for pid, cmd in cmdlines.items() if marker in cmd}
    found.discard(os.getpid())
    return {pid: stats[pid][1] for pid in found if pid in stats}


def _kill_leftovers(procs: dict[int, int]) -> list[int]:
    """SIGKILL those of ``procs`` still alive (same pid and start time); returns their pids."""
    killed = []
    for pid, started in procs.items():
        st = _proc_stat(pid)
        if st is not None and st[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


@dataclass
class Head:
    """A running ``ray start --head --block`` node of this test."""

    proc: subprocess.Popen
    env: dict[str, str]
    dashboard_url: str
    http_port: int
    token: str
    temp_dir: Path
    log: Path

    def cli(self, *args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], env=self.env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)

    def api(self, path: str, *, token: bool = True) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if token else {}
        return httpx.get(f"{self.dashboard_url}{path}", headers=headers, timeout=30)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@pytest.fixture
def ray_head():
    """A Ray head node of its own (see the module docstring), stopped afterwards whatever happened."""
    # a short folder: Ray's socket paths under it must stay below the 107-character limit of Unix sockets
    temp_dir = Path(tempfile.mkdtemp(prefix="bcgray-", dir="/tmp"))
    token = secrets.token_hex(32)
    (temp_dir / "auth_token").write_text(token)
    gcs, dash, agent_http, agent_grpc, metrics, runtime_env, client, http = _free_ports(8)
    # nothing of the session's Ray (conftest's ray.init sets RAY_AUTH_MODE in this process, for one)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # as docs/DEPLOY.md starts it: a node on loopback only (deployments/cli/local.py bind_ray_to says why both)
    base_env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(temp_dir / "auth_token"),
                    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    cmd = [str(RAY), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
           "--num-cpus", "4", "--num-gpus", "0",
           "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
           "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(runtime_env),
           "--ray-client-server-port", str(client), "--temp-dir", str(temp_dir / "ray"),
           "--object-store-memory", str(200 * 1024 * 1024), "--include-log-monitor=false",
           "--disable-usage-stats"]
    log = temp_dir / "ray_start.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=base_env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    env = dict(base_env, RAY_ADDRESS=f"127.0.0.1:{gcs}", RAY_DASHBOARD_ADDRESS=f"http://127.0.0.1:{dash}")
    head = Head(proc, env, f"http://127.0.0.1:{dash}", http, token, temp_dir, log)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"ray start exited with {proc.returncode}:\n{head.log_tail()}"
            try:
                if head.api("/api/serve/applications/").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"no dashboard within 120 s:\n{head.log_tail()}"
            time.sleep(1)
        yield head
    finally:
        members = _tree(proc.pid, str(temp_dir))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes, then exits
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        time.sleep(1)
        members.update(_tree(proc.pid, str(temp_dir)))  # anything started since, still findable by its folder
        _kill_leftovers(members)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _app_status(head: Head) -> tuple[str | None, dict]:
    body = head.api("/api/serve/applications/").json()
    app = body.get("applications", {}).get(APP)
    return (app or {}).get("status"), body


def test_serve_deploy_of_the_cpu_config_serves_an_image_over_http(ray_head: Head):
    head = ray_head
    # token authentication is on: the dashboard refuses a request without the token
    assert head.api("/api/serve/applications/", token=False).status_code == 401

    # the CPU config, on this test's free HTTP port
    config = yaml.safe_load(CPU_CONFIG.read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    config["http_options"]["port"] = head.http_port
    config_file = head.temp_dir / "serve_config_cpu.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))

    deployed = head.cli(SERVE, "deploy", config_file, "--address", head.dashboard_url)
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-3000:]

    deadline = time.monotonic() + READY_TIMEOUT_S
    status, body = _app_status(head)
    while status != "RUNNING":
        assert status != "DEPLOY_FAILED", body
        assert time.monotonic() < deadline, f"not RUNNING after {READY_TIMEOUT_S} s: {body}"
        time.sleep(2)
        status, body = _app_status(head)

    shown = head.cli(SERVE, "status", "--address", head.dashboard_url)
    assert shown.returncode == 0, shown.stderr[-3000:]
    app = yaml.safe_load(shown.stdout)["applications"][APP]
    assert app["status"] == "RUNNING"
    assert set(app["deployments"]) == {"Ingress", "BucketCoordinator", "DiTReplica"}
    assert all(d["status"] == "HEALTHY" for d in app["deployments"].values()), app["deployments"]

    base = f"http://127.0.0.1:{head.http_port}"
    request = {"prompt": "a lighthouse at dusk", "size": "256x256", "n": 1, "seed": 7,
               "num_inference_steps": 1}
    answer = httpx.post(f"{base}/v1/images/generations", json=request, timeout=120)
    assert answer.status_code == 200, answer.text[:2000]
    result = answer.json()
    (image,) = result["data"]
    png = base64.b64decode(image["b64_json"])
    assert Image.open(io.BytesIO(png)).size == (256, 256)
    assert result["bcg"]["seed"] == 7 and result["bcg"]["hit"] is True
    # the replica serves the config file's bucket table, not the embedded default
    table = httpx.get(f"{base}/v1/buckets", timeout=30).json()["table"]
    assert table["batch_sizes"] == [1, 2, 4] and table["resolutions"] == ["256x256", "512x512"]
    # the node started as docs/DEPLOY.md says listens on loopback only, but for Serve's hard-coded gRPC servers
    unexpected, _ = outside_loopback(listening(head.proc.pid))
    assert not unexpected, f"listening outside loopback: {unexpected}"

    stopped = head.cli(SERVE, "shutdown", "-y", "--address", head.dashboard_url)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    deadline = time.monotonic() + 60
    while _app_status(head)[0] is not None:
        assert time.monotonic() < deadline, "the application was still there 60 s after `serve shutdown`"
        time.sleep(2)
