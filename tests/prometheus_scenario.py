"""Scenario of ``tests/serve/test_prometheus_serve.py``, run in its own process with its own Ray instance.

Starts Ray on this machine with Prometheus export on a given port (``_metrics_export_port``) and a short metrics
report interval, serves the small eager-miss application of ``tests/serve/conftest.py`` on 127.0.0.1, sends four small
requests over HTTP (two exact 256x256 hits, one 256x272 hit in a masked bucket, run eager as padding never pays on
a CPU, one image miss), reads ``GET /v1/buckets``, then scrapes ``http://127.0.0.1:PORT/metrics`` until the
``ray_bcg_*`` series show the same request counts (bounded wait), and writes a JSON report:
``{"metrics_port", "buckets" (the /v1/buckets answer), "metrics" (the ray_bcg_* lines), "waited_s",
"service_discovery" (Ray's Prometheus file-SD content), "service_discovery_path"}``.

Usage: ``python tests/prometheus_scenario.py REPORT.json [--metrics-port P] [--timeout-s T]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "serve"))  # its conftest.py: EAGER_CONFIG

REQUESTS = [
    {"prompt": "a red fox", "size": "256x256", "n": 1, "num_inference_steps": 1, "seed": 1},
    {"prompt": "a blue fox", "size": "256x256", "n": 1, "num_inference_steps": 1, "seed": 2},
    {"prompt": "a tall fox", "size": "256x272", "n": 1, "num_inference_steps": 1, "seed": 3},  # masked bucket
    {"prompt": "a wide fox", "size": "768x512", "n": 1, "guidance_scale": 2.0, "num_inference_steps": 1,
     "seed": 4},  # 1536 image tokens > the largest tier (1024): an image miss, run unpadded
]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 120.0) -> dict | str:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if r.headers.get_content_type() == "application/json" else text


def _bcg_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("ray_bcg_", "# HELP ray_bcg_", "# TYPE ray_bcg_"))]


def _caught_up(lines: list[str], buckets: dict) -> bool:
    """True when every counter and histogram the scenario checks reached the /v1/buckets numbers."""
    want_requests = {b["key"]: b["requests"] for b in buckets["buckets"] if b["requests"]}
    want_requests["miss"] = buckets["misses"]["requests"]
    got: dict[str, float] = {}
    steps = 0.0
    queue = pool = False
    for line in lines:
        if line.startswith("ray_bcg_requests_total{"):
            bucket = line.split('bucket="', 1)[1].split('"', 1)[0]
            got[bucket] = got.get(bucket, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("ray_bcg_step_latency_ms_count{"):
            steps += float(line.rsplit(" ", 1)[1])
        queue = queue or line.startswith("ray_bcg_queue_length{")
        pool = pool or line.startswith("ray_bcg_graph_pool_bytes{")
    total_steps = sum(b["step_latency_ms"]["count"] for b in buckets["buckets"])
    total_steps += buckets["misses"]["step_latency_ms"]["count"]
    return got == {k: float(v) for k, v in want_requests.items()} and steps == total_steps and queue and pool


def main() -> int:
    """Run the scenario; exit status 0 when the report was written (the test judges it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--metrics-port", type=int, default=0, help="0: a free port")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="bound on waiting for the scrape, seconds")
    args = ap.parse_args()
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # workers report every second, not 10 s

    import ray
    from ray import serve

    from conftest import EAGER_CONFIG
    from deployments import build_app

    metrics_port = args.metrics_port or free_port()
    http_port = free_port()
    report: dict = {"metrics_port": metrics_port}
    ray.init(address="local", num_cpus=2, include_dashboard=False, _metrics_export_port=metrics_port)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app({"config": EAGER_CONFIG}), name="bcg", route_prefix="/")
        base = f"http://127.0.0.1:{http_port}"
        for body in REQUESTS:
            _http(f"{base}/v1/images/generations", body)
        buckets = _http(f"{base}/v1/buckets")
        report["buckets"] = buckets
        t0 = time.monotonic()
        lines: list[str] = []
        while time.monotonic() - t0 < args.timeout_s:
            try:
                lines = _bcg_lines(_http(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10))
            except OSError as e:
                report["scrape_error"] = repr(e)
            if lines and _caught_up(lines, buckets):
                break
            time.sleep(1.0)
        report["waited_s"] = round(time.monotonic() - t0, 1)
        report["metrics"] = lines
        report["buckets_after"] = _http(f"{base}/v1/buckets")
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        sd = session / "prom_metrics_service_discovery.json"
        report["service_discovery_path"] = str(sd)
        report["nodes"] = [{"address": n["NodeManagerAddress"], "metrics_export_port": n["MetricsExportPort"]}
                           for n in ray.nodes()]
        report["service_discovery"] = json.loads(sd.read_text()) if sd.is_file() else None
    finally:
        Path(args.report).write_text(json.dumps(report, indent=1))
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
