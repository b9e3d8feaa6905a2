"""Ray's Prometheus endpoint showing the ``ray_bcg_*`` series of a served application (own Ray instance, in a
subprocess: ``tests/prometheus_scenario.py``). The engine's counters and the exporter are
``tests/unit/test_prometheus.py`` and ``tests/engine/test_prometheus_engine.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$')


def _parse(lines: list[str]) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in lines:
        if line.startswith("#"):
            continue
        match = _LINE.match(line)
        assert match, line
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        out.append((match["name"], labels, float(match["value"])))
    return out


def _sum(series, name: str, **labels) -> float:
    return sum(v for n, lab, v in series if n == name and all(lab.get(k) == w for k, w in labels.items()))


@pytest.mark.serve
def test_prometheus_endpoint_shows_the_bucket_metrics(tmp_path):
    report_path = tmp_path / "report.json"
    env = {**os.environ, "RAY_metrics_report_interval_ms": "1000"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "prometheus_scenario.py"), str(report_path),
                             "--timeout-s", "60"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the scenario and the Ray processes it started
        out, _ = proc.communicate()
        pytest.fail(f"the Prometheus scenario timed out:\n{out[-4000:]}")
    assert proc.returncode == 0 and report_path.is_file(), out[-4000:]
    report = json.loads(report_path.read_text())
    stats, series = report["buckets"], _parse(report["metrics"])
    assert series, f"no ray_bcg_* series on :{report['metrics_port']}/metrics ({report.get('scrape_error')})"

    used = [b for b in stats["buckets"] if b["requests"]]
    assert {b["key"] for b in used} == {"b2_i256_t256", "b2_i1024_m_t256"}
    for b in used:  # the same numbers as /v1/buckets
        tags = {"bucket": b["key"], "shape": b["shape"]}
        assert _sum(series, "ray_bcg_requests_total", **tags) == b["requests"]
        assert _sum(series, "ray_bcg_hits_total", **tags) == b["hits"]
        assert _sum(series, "ray_bcg_forwards_total", **tags) == b["forwards"] > 0
        for mode, n in b["forwards_by_mode"].items():
            assert _sum(series, "ray_bcg_forwards_total", mode=mode, **tags) == n, mode
        assert _sum(series, "ray_bcg_real_tokens_total", **tags) == b["real_tokens"]
        assert _sum(series, "ray_bcg_padded_tokens_total", **tags) == b["padded_tokens"]
        assert _sum(series, "ray_bcg_step_latency_ms_count", **tags) == b["step_latency_ms"]["count"] > 0
        for le, n in b["step_latency_ms"]["buckets"].items():  # every bin, same le labels
            assert _sum(series, "ray_bcg_step_latency_ms_bucket", le=le, **tags) == n, le
        assert _sum(series, "ray_bcg_step_time_ms_total", **tags) == pytest.approx(b["step_latency_ms"]["sum"])
        assert _sum(series, "ray_bcg_padded_token_ratio", **tags) == pytest.approx(b["padded_token_ratio"])
    # 272 of the tier's 1,024 image tokens: on a CPU padding never pays, so the step ran them unpadded and eager,
    # counted under the bucket that holds them, computing only the real tokens
    masked = next(b for b in used if b["key"] == "b2_i1024_m_t256")
    assert masked["forwards_by_mode"]["eager"] == masked["forwards"] and masked["padded_token_ratio"] == 1.0
    assert _sum(series, "ray_bcg_forwards_total", mode="eager", bucket="b2_i1024_m_t256") == masked["forwards"]
    misses = stats["misses"]
    assert _sum(series, "ray_bcg_misses_total", dim="image_tokens") == misses["by_dim"]["image_tokens"] == 1
    assert _sum(series, "ray_bcg_requests_total", bucket="miss", shape="miss") == misses["requests"] == 1
    assert _sum(series, "ray_bcg_forwards_total", bucket="miss", mode="eager") == misses["forwards"] > 0
    assert not [s for s in series if s[0] == "ray_bcg_forwards_total" and s[1]["mode"] == "graph"]  # CPU: no replays
    queue = [lab["shape"] for n, lab, _ in series if n == "ray_bcg_queue_length"]
    assert set(queue) >= {"i256_t256", "i1024_t256", "i1024_m_t256"}
    pool = {lab["bucket"]: v for n, lab, v in series if n == "ray_bcg_graph_pool_bytes"}
    assert pool and set(pool.values()) == {0.0}  # CPU: no graph pool
    # Serve's tags, added by ray.serve.metrics; no tag is duplicated
    tagged = [lab for n, lab, _ in series if n == "ray_bcg_requests_total"]
    assert tagged and all(lab["deployment"] == "DiTReplica" and lab["application"] == "bcg" for lab in tagged)
    assert {lab["replica"] for lab in tagged} == {stats["replica"]}
    assert report["buckets_after"]["metrics_export"]["errors"] == 0
    assert report["buckets_after"]["metrics_export"]["pushes"] > 0
