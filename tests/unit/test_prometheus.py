"""Per-bucket metrics: the engine's counters and the exporter's delta logic (fake backend: ``fake_metrics``, no
Ray). A real pipeline's and step scheduler's metrics are ``tests/engine/test_prometheus_engine.py``; the real
thing, Ray's Prometheus endpoint showing the ``ray_bcg_*`` series of a served application, is
``tests/serve/test_prometheus_serve.py``."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import pytest

from bcg_core.families.tiny import TINY_TEXT_TOKENS
from bcg_core.keys import BucketKey
from bcg_core.metrics import STEP_MS_BOUNDS, BucketMetrics, histogram_quantile
from deployments.metric_specs import METRICS
from deployments.metrics import BucketExporter
from fake_metrics import FakeBackend

ROOT = Path(__file__).resolve().parents[2]
T = TINY_TEXT_TOKENS
K1, K2 = BucketKey(1, 256, T), BucketKey(2, 256, T)


def _lookup(key: BucketKey | None, rows: int = 1):
    from bcg_core.keys import Dim, ShapeQuery
    from bcg_core.table import BucketLookup

    q = ShapeQuery(rows, 256, T)
    return BucketLookup(q, key, () if key is not None else (Dim.BATCH,))


def _stats_of(metrics: BucketMetrics, pool: dict[str, int] | None = None):
    def stats() -> dict:
        snap = metrics.snapshot()
        for b in snap["buckets"]:
            b.update({"pool_bytes": (pool or {}).get(b["key"], 0), "capture_s": 0.0})
        return snap
    return stats


# -- the engine's counters ----------------------------------------------------------------------------------


def test_histogram_quantile_interpolates_within_a_bin():
    bins = [0] * (len(STEP_MS_BOUNDS) + 1)
    assert histogram_quantile(0.5, bins) is None
    bins[STEP_MS_BOUNDS.index(20)] = 4  # four steps in (15, 20] ms
    assert histogram_quantile(0.5, bins) == pytest.approx(17.5)
    assert histogram_quantile(1.0, bins) == pytest.approx(20.0)
    bins[-1] = 4  # four more above the last bound: the upper half is reported as the last finite bound
    assert histogram_quantile(0.95, bins) == STEP_MS_BOUNDS[-1]


def test_bucket_metrics_count_forward_modes_captures_and_steps():
    m = BucketMetrics([K1, K2])
    m.record_forward(K1)  # default: static_eager for a bucket
    m.record_forward(K1, "graph")
    m.record_forward(K1, "eager")
    m.record_forward(None)  # default: eager for a miss
    with pytest.raises(ValueError, match="forward mode"):
        m.record_forward(K1, "replay")
    m.record_capture(K2, 1.5)
    m.record_steps(K1, [0.4, 0.5, 12.0, 20000.0])
    c = m.counters(K1)
    assert (c.forwards, c.replays, c.unpadded_forwards) == (3, 1, 1)
    assert c.forwards_by_mode == {"graph": 1, "static_eager": 1, "eager": 1}
    assert (m.counters(K2).captures, m.counters(K2).capture_s) == (1, 1.5)
    lat = c.step_latency()
    assert lat["count"] == 4 and lat["sum"] == pytest.approx(20012.9)
    assert lat["buckets"]["0.5"] == 2 and lat["buckets"]["15.0"] == 3 and lat["buckets"]["10000.0"] == 3
    assert lat["buckets"]["+Inf"] == 4 and list(lat["buckets"])[-1] == "+Inf"
    c.step_ms_bins[0] += 100  # counters() hands out a copy
    assert m.counters(K1).step_ms_bins[0] == 2
    snap = {b["key"]: b for b in m.snapshot()["buckets"]}[str(K1)]
    assert snap["replays"] == 1 and snap["forwards_by_mode"]["eager"] == 1 and snap["shape"] == K1.shape
    assert snap["step_latency_ms"] == lat and snap["padded_token_ratio"] is None
    assert m.snapshot()["misses"]["forwards_by_mode"] == {"graph": 0, "static_eager": 0, "eager": 1}


def test_step_samples_are_read_by_cursor_and_report_what_was_dropped():
    m = BucketMetrics([K1])
    m.record_steps(K1, [1.0, 2.0])
    last, samples, lost = m.step_samples(0)
    assert (last, samples, lost) == (2, [(K1, 1.0), (K1, 2.0)], 0)
    assert m.step_samples(last) == (2, [], 0)
    m._samples = deque(m._samples, maxlen=3)  # a tiny buffer, to fall behind
    m.record_steps(None, [3.0, 4.0, 5.0, 6.0])
    last2, samples, lost = m.step_samples(last)
    assert last2 == 6 and samples == [(None, 4.0), (None, 5.0), (None, 6.0)] and lost == 1


def test_padded_token_ratio_is_padded_over_real_tokens():
    m = BucketMetrics([K2])
    m.record_request(_lookup(K2, rows=1), 10.0)  # 1 real row in a 2-row bucket
    c = m.counters(K2)
    assert c.padded_token_ratio == pytest.approx(2.0) and c.padding_waste_pct == pytest.approx(50.0)
    assert {b["key"]: b for b in m.snapshot()["buckets"]}[str(K2)]["padded_token_ratio"] == 2.0


# -- the exporter (fake backend) ---------------------------------------------------------------------------


def test_exporter_pushes_only_the_increase_of_each_counter():
    m = BucketMetrics([K1, K2])
    queue = {"i256_t256": 2}
    backend = FakeBackend()
    ex = BucketExporter(_stats_of(m, {str(K2): 4096}), m, lambda: dict(queue), ["i256_t256", "i1024_t256"], backend)
    assert {s.name for s in METRICS} == set(backend.m)
    m.record_request(_lookup(K1), 5.0)
    m.record_forward(K1)
    m.record_steps(K1, [3.0])
    m.record_request(_lookup(None, rows=6), 9.0)
    m.record_forward(None)
    m.record_steps(None, [40.0])
    ex.push()
    b = backend.m
    assert b["bcg_requests"].total(bucket=str(K1), shape="i256_t256") == 1
    assert b["bcg_hits"].total(bucket=str(K1)) == 1 and b["bcg_hits"].total(bucket="miss") == 0
    assert b["bcg_requests"].total(bucket="miss", shape="miss") == 1
    assert b["bcg_misses"].total(dim="batch") == 1 and b["bcg_misses"].total(dim="image_tokens") == 0
    assert b["bcg_forwards"].total(bucket=str(K1), mode="static_eager") == 1
    assert b["bcg_forwards"].total(bucket="miss", mode="eager") == 1
    assert b["bcg_step_latency_ms"].calls == [(3.0, {"bucket": str(K1), "shape": "i256_t256"}),
                                              (40.0, {"bucket": "miss", "shape": "miss"})]
    assert b["bcg_step_latency_ms"].boundaries == list(STEP_MS_BOUNDS)
    assert b["bcg_step_time_ms"].total(bucket=str(K1)) == pytest.approx(3.0)
    assert b["bcg_graph_pool_bytes"].total(bucket=str(K2)) == 4096
    assert b["bcg_graph_pool_bytes"].total(bucket=str(K1)) == 0
    assert b["bcg_padded_token_ratio"].total(bucket=str(K1)) == 1.0
    assert b["bcg_padded_token_ratio"].total(bucket=str(K2)) is None  # no traffic: not set
    assert b["bcg_queue_length"].total(shape="i256_t256") == 2 and b["bcg_queue_length"].total(shape="i1024_t256") == 0

    before = backend.calls()
    ex.push()  # nothing new: no counter moves, no step observed again
    assert backend.calls() == before
    m.record_request(_lookup(K1), 5.0)
    m.record_request(_lookup(K1), 5.0)
    m.record_steps(K1, [4.0])
    queue.clear()
    ex.push()
    assert b["bcg_requests"].calls[-1] == (2, {"bucket": str(K1), "shape": "i256_t256"})  # the increase only
    assert b["bcg_requests"].total(bucket=str(K1)) == 3 == m.counters(K1).requests
    assert [v for v, _ in b["bcg_step_latency_ms"].calls] == [3.0, 40.0, 4.0]
    assert b["bcg_queue_length"].total(shape="i256_t256") == 0  # an emptied queue reads 0, not its last length
    assert ex.status()["pushes"] == 3 and ex.status()["errors"] == 0


def test_exporter_never_decreases_a_counter_and_survives_errors(caplog):
    m = BucketMetrics([K1])
    backend = FakeBackend()
    state = {"requests": 5, "fail": False}

    def stats():
        if state["fail"]:
            raise RuntimeError("stats unavailable")
        return {"buckets": [{"key": str(K1), "requests": state["requests"]}], "misses": {}}

    ex = BucketExporter(stats, m, backend=backend)
    ex.push()
    state["requests"] = 3  # cannot happen in one replica; must not turn into a negative increment
    ex.push()
    state["requests"] = 4
    ex.push()
    assert [v for v, _ in backend.m["bcg_requests"].calls] == [5, 1]
    state["fail"] = True
    assert ex.push_logged() is False and ex.status()["errors"] == 1 and "stats unavailable" in ex.status()["last_error"]

    async def run_a_while():
        task = asyncio.get_running_loop().create_task(ex.run(period_s=0.01))
        await asyncio.sleep(0.1)
        state["fail"] = False
        await asyncio.sleep(0.1)
        assert not task.done()  # errors never end the loop
        task.cancel()

    asyncio.run(run_a_while())
    assert ex.status()["errors"] >= 2 and ex.status()["pushes"] >= 4 and ex.status()["period_s"] == 0.01


def test_exporter_counts_background_compile_swaps_and_the_buckets_pending():
    """``bcg_compile_swaps`` follows the step scheduler's ``background_compiles.swapped`` by increments, and
    ``bcg_compiles_pending`` its ``pending`` (bcg_core/runners/background.py)."""
    m = BucketMetrics([K1])
    compiles = {"pending": 2, "swapped": 0}
    backend = FakeBackend()
    ex = BucketExporter(_stats_of(m), m, dict, ["i256_t256"], backend,
                        scheduler_stats=lambda: {"shapes": {}, "background_compiles": dict(compiles)})
    ex.push()
    b = backend.m
    assert b["bcg_compiles_pending"].total() == 2 and b["bcg_compile_swaps"].total() == 0
    compiles.update(pending=0, swapped=2)
    ex.push()
    ex.push()
    assert b["bcg_compiles_pending"].total() == 0 and b["bcg_compile_swaps"].total() == 2
    assert b["bcg_compile_swaps"].calls == [(2, {})]


def test_readme_lists_every_exported_metric():
    readme = (ROOT / "docs" / "OPERATIONS.md").read_text()
    section = readme.split("## Metrics (Prometheus)", 1)[1].split("\n## ", 1)[0]
    for spec in METRICS:
        assert f"`{spec.exported}`" in section, spec.exported
