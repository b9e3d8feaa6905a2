"""``benchmarks/bench_miss.py`` on the CPU: its ``main`` on the tiny default with a small miss writes the JSON the GPU
run reports (one unpadded forward of the miss, the host-clock ratio, a scripted chunked case), and its scripted
spare memory leaves room for exactly the rows asked, in both regimes of the margin."""

from __future__ import annotations

import json

from bcg_core.costs.miss_memory import MARGIN_BYTES, MissMemory
from benchmark_scripts import load

bench = load("bench_miss")


def test_the_scripted_spare_memory_holds_the_rows_asked_and_not_one_more():
    for per_row in (1_000.0 * 640, 200e6):  # the 1 GiB floor of the margin, then a fifth of the spare memory
        mem = MissMemory(lambda per_row=per_row: bench.spare_for(6, per_row))
        mem.set_bytes_per_row_token(per_row / 640)
        assert mem.chunk_rows(18, 640) == [6, 6, 6] and mem.chunk_rows(6, 640) == [6]
        assert mem.chunk_rows(7, 640) == [4, 3]
    assert bench.spare_for(1, 1.0) > MARGIN_BYTES


def test_main_on_the_tiny_model_writes_every_field(tmp_path):
    out = tmp_path / "miss.json"
    argv = ["--model", "tiny", "--sizes", "320x256", "--rows", "4", "--iters", "1", "--warmup", "0", "--chunks", "2",
            "--commit", "abc123", "--out", str(out)]
    assert bench.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "miss" and r["commit"] == "abc123" and r["argv"] == argv
    assert r["command"].startswith("python benchmarks/bench_miss.py --model tiny")
    assert r["date"] and r["torch"] and r["device"] == "cpu" and r["gpu"] is None and r["timer"] == "host_clock"
    assert r["table"]["bucket"] == ["b1_i256_t256"] and r["table"]["kernels"] == "eager"
    assert r["costs_measured"] is False  # a CPU: no graphs, nothing measured, no spare-memory source
    assert r["memory"] == {"bytes_per_row_token": None, "spare_bytes": None, "usable_bytes": None,
                           "spare_source": False}
    (case,) = r["cases"]
    assert (case["case"], case["size"], case["generated_at"], case["rows"]) == ("miss", "320x256", "320x256", 4)
    assert case["tokens_per_row"] == 320 + 256 and case["chunks"] == [[4]]  # one unpadded forward of all its rows
    assert case["ms_step"] > 0 and case["ms_forward"] > 0 and len(case["step_ms"]) == len(case["forward_ms"]) == 1
    # the ratio of the unrounded medians; the reported ms are rounded to 1e-3, so allow that rounding
    assert (abs(case["ratio"] - case["ms_step"] / case["ms_forward"])
            <= 1e-3 * (1 + case["ratio"]) / case["ms_forward"] + 1e-4)
    assert isinstance(case["within_target"], bool) and case["peak_bytes_per_row_token"] is None
    chunked = r["chunked"]
    assert chunked["chunks"] == [[2, 2]] and chunked["scripted_bytes_per_row_token"] is True
    assert chunked["usable_bytes"] >= 2 * chunked["bytes_per_row_token"] * case["tokens_per_row"]
    assert chunked["vs_one_forward"] == round(chunked["ms_step"] / case["ms_forward"], 4)
