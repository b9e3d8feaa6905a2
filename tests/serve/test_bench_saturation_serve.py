"""``benchmarks/bench_saturation.py`` end to end on the CPU: one small run (tiny model, naive and step servers,
in a subprocess: it starts its own Ray). Its pure parts are ``tests/unit/test_bench_saturation.py``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # outside the default run (README, Tests)

ROOT = Path(__file__).resolve().parents[2]
_PATH = ROOT / "benchmarks" / "bench_saturation.py"


# -- end to end ------------------------------------------------------------------------------------------------


@pytest.mark.serve
def test_end_to_end_tiny_naive_and_step_on_the_cpu(tmp_path):
    """The brief's smoke command, with the concurrency-1 phase cut to 2 requests and no warm-up (CI time)."""
    out = tmp_path / "sat.json"
    cmd = [sys.executable, str(_PATH), "--model", "tiny", "--requests", "2", "--steps", "1", "--concurrency", "2",
           "--servers", "naive,step", "--c1-requests", "2", "--warmup", "none", "--out", str(out),
           "--scratch", str(tmp_path), "--commit", "abc1234"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["commit"] == "abc1234" and data["device"] == "cpu" and data["gpu"] is None and data["torch"]
    assert "--servers naive,step" in data["command"] and data["errors"] == []
    assert [s["server"] for s in data["servers"]] == ["naive", "step"]
    naive, step = (s["summary"] for s in data["servers"])
    for s in (naive, step):
        assert s["ok"] == s["requests"] == 2 and s["failures"] == 0 and s["images"] == 18
        assert s["images_per_s"] > 0 and s["latency_ms"]["p50"] > 0 and s["c1_p50_ms"] > 0
        assert s["gpu_busy"] is None and s["floor_s"] is None
    assert naive["misses"] == 2 and naive["padded_token_waste"] == 0.0
    assert step["hits"] == 2 and step["waste_source"] == "scheduler"
    assert data["servers"][0]["overrides"]["runner"] == {"mode": "eager", "kernels": "eager"}
    assert data["kernels"] == "eager" and data["servers"][1]["overrides"]["runner"] == {"kernels": "eager"}
    assert len(data["servers"][0]["requests"]) == 2 and len(data["servers"][0]["c1_requests"]) == 2
    assert data["ratios"]["images_per_s_vs_naive"]["step"] == pytest.approx(
        step["images_per_s"] / naive["images_per_s"], rel=1e-2)
