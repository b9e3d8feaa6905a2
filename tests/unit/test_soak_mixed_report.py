"""``benchmarks/soak_mixed.py``'s pure parts: process grouping, the slope and level under load, the request mix and
its bad requests (the mixed soak of docs/RELIABILITY.md; issue 45, part 5)."""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak_mixed as sm  # noqa: E402  from benchmarks/, put on the path just above


def test_ray_titles_group_by_deployment_whatever_method_runs():
    assert sm._group(b"ray::ServeReplica:bcg:DiTReplica\0") == "DiTReplica"
    assert sm._group(b"ray::ServeReplica:bcg:DiTReplica.generate_stream\0") == "DiTReplica"
    assert sm._group(b"ray::ServeReplica:bcg:Ingress.handle_request_with_rejection\0") == "Ingress"
    assert sm._group(b"ray::ProxyActor.receive_asgi_messages\0") == "ProxyActor"
    assert sm._group(b"/x/ray/core/src/ray/raylet/raylet\0--raylet_socket_name=/tmp/s\0") == "raylet"
    assert sm._group(b"/v/bin/python\0-u\0/v/ray/_private/log_monitor.py\0--x\0") == "log_monitor.py"


def test_the_slope_is_in_mb_per_minute_and_level_memory_has_none():
    rising = [(t, 1000 * 2**20 + t / 60 * 10 * 2**20) for t in range(0, 600, 5)]  # +10 MB a minute
    assert abs(sm.slope_mb_per_min(rising) - 10.0) < 1e-6
    assert sm.slope_mb_per_min([(t, 5 * 2**20) for t in range(0, 600, 5)]) == 0.0
    assert sm.slope_mb_per_min([(0, 1), (1, 2)]) is None


def test_under_load_summary_judges_the_last_half_per_group_and_in_total():
    series = [(t, {"DiTReplica": int((1000 + (t / 60) * 20) * 2**20), "Ingress": 400 * 2**20})
              for t in range(0, 1800, 5)]
    out = sm.under_load_summary(series, 360, 1800, 120)
    dit, ingress, total = out["DiTReplica"], out["Ingress"], out["total"]
    assert abs(dit["slope_last_half_mb_per_min"] - 20.0) < 0.01
    # 20 MB/min over the last 12 minutes is 240 MB on a median of about 1,480 MB: 16%, far above 5%
    assert 0.15 < dit["last_half_growth"] < 0.17
    assert ingress["slope_mb_per_min"] == 0.0 and ingress["last_half_growth"] == 0.0
    assert total["first_window_mb"] == dit["first_window_mb"] + 400
    assert set(dit["per_minute_median_mb"]) == set(range(6, 30))  # minutes 6 to 29 (samples up to 1,795 s)


def test_the_mix_sums_to_one_and_each_bad_request_is_one_the_server_must_refuse():
    assert abs(sum(sm.MIX.values()) - 1.0) < 1e-9 and sm.MIX["bad"] == 0.10
    row = type("Row", (), {"prompt": "a lighthouse", "width": 512, "height": 768, "n": 3})()
    rng = random.Random(0)
    bads = [sm.build_request("bad", row, 2, rng, i) for i in range(len(sm.BAD_KINDS))]
    assert [b["bad"] for b in bads] == list(sm.BAD_KINDS)
    assert bads[0]["json"]["size"] == "500x500" and bads[2]["json"]["n"] == 1000
    edit = sm.build_request("inpaint", row, 2, rng, 0)
    assert edit["path"] == "/v1/images/edits" and set(edit["files"]) == {"image", "mask"} and edit["n"] == 2
    two = sm.build_request("lora2", row, 2, rng, 0)
    assert [a["name"] for a in two["json"]["lora"]] == list(sm.ADAPTERS)
