"""``benchmarks/bench_saturation.py`` with several kernel tiers in one run (``--kernels eager,compiled,fp8``): the
servers it starts, their names and overrides, the ratios against the one naive server, and the wait for background
compiles before a compiled server's replay (against a stub ``GET /v1/buckets``)."""

import json

import pytest

from benchmark_scripts import load
from stub_http import StubServer

bench = load("bench_saturation")


def test_parse_kernels_keeps_order_and_refuses_unknown_tiers():
    assert bench.parse_kernels("eager, compiled,eager,fp8") == ["eager", "compiled", "fp8"]
    for bad in ("", "eager,fast"):
        with pytest.raises(ValueError, match="eager,compiled,fp8"):
            bench.parse_kernels(bad)
    assert bench.parse_args(["--kernels", "compiled"]).kernels == ["compiled"]
    assert bench.parse_args([]).kernels == ["eager"]


def test_one_step_server_per_tier_and_one_naive():
    # one tier: the names of a single-tier run, as before
    assert bench.server_runs(["naive", "step"], ["fp8"]) == [("naive", "naive", "eager"), ("step", "step", "fp8")]
    runs = bench.server_runs(["naive", "step", "planned"], ["eager", "compiled", "fp8"])
    assert runs == [("naive", "naive", "eager"),
                    ("step-eager", "step", "eager"), ("step-compiled", "step", "compiled"), ("step-fp8", "step", "fp8"),
                    ("planned-eager", "planned", "eager"), ("planned-compiled", "planned", "compiled"),
                    ("planned-fp8", "planned", "fp8")]


def test_each_tier_server_gets_its_kernels_and_naive_stays_eager():
    over = bench.server_overrides("step", {}, None, [], 16, kernels="compiled")
    assert over == {"runner": {"kernels": "compiled"}}
    assert bench.RUNNER_OVERRIDES["naive"]["kernels"] == "eager"


def test_ratios_of_every_tier_against_naive():
    r = bench.ratios({"naive": {"images_per_s": 2.0, "c1_p50_ms": 1000.0},
                      "step-eager": {"images_per_s": 6.0, "c1_p50_ms": 900.0},
                      "step-compiled": {"images_per_s": 7.0, "c1_p50_ms": 700.0},
                      "step-fp8": {"images_per_s": 9.0, "failures": 1}})
    assert r["images_per_s_vs_naive"] == {"step-eager": 3.0, "step-compiled": 3.5, "step-fp8": None}
    assert r["c1_vs_naive"] == {"step-eager": 0.9, "step-compiled": 0.7, "step-fp8": None}
    assert "planned_vs_step" not in r


def _stats(pending):
    return json.dumps({"scheduler": {"background_compiles": {"pending": pending}}}).encode()


def test_background_pending_reads_the_scheduler_section():
    assert bench.background_pending(json.loads(_stats(3))) == 3
    assert bench.background_pending({}) == 0 and bench.background_pending({"scheduler": {}}) == 0


def test_wait_compiles_polls_until_nothing_is_pending_or_the_bound():
    answers = iter([_stats(2), _stats(1), _stats(0)])
    with StubServer(lambda: next(answers, _stats(0))) as stub:
        waited, pending = bench.wait_compiles(stub.url, timeout_s=30, poll_s=0.01)
    assert pending == 0 and waited < 30 and len(stub.paths) == 3 and set(stub.paths) == {"/v1/buckets"}
    with StubServer(_stats(5)) as stub:
        waited, pending = bench.wait_compiles(stub.url, timeout_s=0.2, poll_s=0.05)
    assert pending == 5 and waited >= 0.2
