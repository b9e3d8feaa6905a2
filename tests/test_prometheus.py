"""Per-bucket metrics: the engine's counters, the exporter's delta logic (fake backend, no Ray), and the real
thing: Ray's Prometheus endpoint showing the ``ray_bcg_*`` series of a served application (own Ray instance, in a
subprocess: ``tests/prometheus_scenario.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

from bcg_core import BucketConfig, DiTPipeline, GenerationRequest, ServeConfig, build_tiny
from bcg_core.buckets import BucketKey
from bcg_core.metrics import STEP_MS_BOUNDS, BucketMetrics, histogram_quantile
from bcg_core.models import TINY_TEXT_TOKENS
from deployments.metrics import METRICS, BucketExporter

ROOT = Path(__file__).resolve().parents[1]
T = TINY_TEXT_TOKENS
K1, K2 = BucketKey(1, 256, T), BucketKey(2, 256, T)


class FakeMetric:
    """Records what the exporter does to one metric; checks the ``ray.util.metrics`` rules it must follow."""

    def __init__(self, kind: str, name: str, tag_keys: tuple[str, ...], boundaries=None):
        self.kind, self.name, self.tag_keys, self.boundaries = kind, name, tag_keys, boundaries
        self.calls: list[tuple[float, dict]] = []

    def _check(self, value, tags):
        assert isinstance(value, (int, float)) and set(tags) == set(self.tag_keys), (self.name, tags)
        assert all(isinstance(v, str) for v in tags.values())
        self.calls.append((value, dict(tags)))

    def inc(self, value=1.0, tags=None):
        assert self.kind == "counter" and value > 0, (self.name, value)  # Ray refuses value <= 0
        self._check(value, tags)

    def set(self, value, tags=None):
        assert self.kind == "gauge"
        self._check(value, tags)

    def observe(self, value, tags=None):
        assert self.kind == "histogram"
        self._check(value, tags)

    def total(self, **tags) -> float:
        """Sum of increments (or last gauge value) at tags matching ``tags``."""
        hits = [v for v, t in self.calls if all(t.get(k) == w for k, w in tags.items())]
        return (hits[-1] if hits else None) if self.kind == "gauge" else sum(hits)


class FakeBackend:
    def __init__(self):
        self.m: dict[str, FakeMetric] = {}

    def counter(self, name, description, tag_keys):
        return self.m.setdefault(name, FakeMetric("counter", name, tag_keys))

    def gauge(self, name, description, tag_keys):
        return self.m.setdefault(name, FakeMetric("gauge", name, tag_keys))

    def histogram(self, name, description, boundaries, tag_keys):
        return self.m.setdefault(name, FakeMetric("histogram", name, tag_keys, boundaries))

    def calls(self) -> int:
        return sum(len(m.calls) for m in self.m.values() if m.kind != "gauge")


def _lookup(key: BucketKey | None, rows: int = 1):
    from bcg_core.buckets import BucketLookup, Dim, ShapeQuery

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


# -- the pipeline records what /v1/buckets and the exporter show ------------------------------------------


def test_pipeline_records_one_step_latency_per_forward_and_the_exporter_matches_its_stats():
    # request-level batching: the 6-row request below is a miss (the step scheduler would split it)
    cfg = ServeConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "512x512"],
                                           text_lengths=[T]), runner={"scheduler": "request"})
    pipe = DiTPipeline(cfg, build_tiny())
    backend = FakeBackend()
    ex = BucketExporter(pipe.stats, pipe.metrics, lambda: {}, {k.shape for k in pipe.table.keys}, backend)
    pipe.generate(GenerationRequest("a", n=1, width=256, height=256, num_inference_steps=2, seed=0))
    pipe.generate(GenerationRequest("a", n=3, width=256, height=256, num_inference_steps=1, seed=0))  # 6 rows: miss
    ex.push()
    stats = pipe.stats()
    b = {x["key"]: x for x in stats["buckets"]}["b2_i256_t256"]
    assert b["forwards"] == 2 and b["step_latency_ms"]["count"] == 2 and b["step_latency_ms"]["p50"] > 0
    assert b["forwards_by_mode"] == {"graph": 0, "static_eager": 2, "eager": 0} and b["replays"] == 0
    assert b["padded_token_ratio"] == 1.0 and b["captures"] == 0 and b["mode"] == "static_eager"
    assert stats["misses"]["step_latency_ms"]["count"] == 1 == stats["misses"]["forwards_by_mode"]["eager"]
    m = backend.m
    assert m["bcg_requests"].total(bucket="b2_i256_t256") == b["requests"] == 1
    assert m["bcg_forwards"].total(bucket="b2_i256_t256") == b["forwards"]
    assert m["bcg_step_time_ms"].total(bucket="b2_i256_t256") == pytest.approx(b["step_latency_ms"]["sum"])
    assert len(m["bcg_step_latency_ms"].calls) == 3
    assert m["bcg_misses"].total(dim="batch") == stats["misses"]["by_dim"]["batch"] == 1
    assert m["bcg_real_tokens"].total(bucket="miss") == stats["misses"]["real_tokens"]


def test_the_step_scheduler_metrics_follow_its_stats():
    """``bcg_sched_*`` from a replica's step scheduler: forwards by kind, decisions, rows in flight, fill,
    waste and admission waits match ``StepScheduler.stats()`` after real requests; a second push adds nothing."""
    from bcg_core.step_scheduler import StepScheduler

    cfg = ServeConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "512x512"],
                                           text_lengths=[T]))
    pipe = DiTPipeline(cfg, build_tiny())
    sched = StepScheduler(pipe)
    backend = FakeBackend()
    ex = BucketExporter.for_replica(pipe, sched, backend)

    async def serve():
        # n=3 with guidance is 6 rows, above the largest bucket (4): split across buckets, in the shape's group
        reqs = [GenerationRequest("a", n=n, width=256, height=256, num_inference_steps=2, seed=n) for n in (1, 3)]
        return await asyncio.gather(*[sched.submit(r) for r in reqs])

    try:
        asyncio.run(asyncio.wait_for(serve(), 120))
        ex.push()
        stats = sched.stats()
    finally:
        sched.close()
    shape = stats["shapes"]["i256_t256"]
    m = backend.m
    for kind, n in shape["forwards"].items():
        assert m["bcg_sched_forwards"].total(shape="i256_t256", kind=kind) == n
    assert sum(shape["forwards"].values()) > 0
    for decision, n in shape["decisions"].items():
        assert m["bcg_sched_decisions"].total(shape="i256_t256", decision=decision) == n
    assert m["bcg_sched_admitted"].total(shape="i256_t256") == shape["admitted"] == 2
    assert m["bcg_sched_queue_wait_ms"].total(shape="i256_t256") == pytest.approx(shape["queue_wait_ms"]["sum"])
    assert m["bcg_sched_rows_in_flight"].total(shape="i256_t256") == 0
    assert m["bcg_sched_rows_in_flight"].total(shape="i1024_t256") == 0  # every shape of the table gets its gauge
    assert m["bcg_sched_padded_token_waste"].total(shape="i256_t256") == shape["padded_token_waste"]
    before = backend.calls()
    ex.push()
    assert backend.calls() == before  # nothing new: no counter moves


def test_on_cuda_replays_captures_pool_bytes_and_step_times_are_exported():
    """The graph runner's counters and the CUDA-event step timer (skipped without CUDA)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from diffusers import FluxTransformer2DModel

    from bcg_core import BucketTable, FluxAdapter
    from bcg_core.graphs import CudaGraphRunner
    from bcg_core.pipeline import _StepTimer
    from bcg_core.verify import BoundaryCase, random_inputs

    cuda, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                   attention_head_dim=64, num_attention_heads=4, joint_attention_dim=128,
                                   pooled_projection_dim=96, axes_dims_rope=(16, 24, 24))
    adapter = FluxAdapter(model.to(cuda, dtype).eval(), native_text_tokens=64)
    table = BucketTable(BucketConfig(batch_sizes=[1, 2], resolutions=["256x256"], text_lengths=[64]),
                        adapter.rules, min_image_tokens=256)
    metrics = BucketMetrics(table.keys)
    runner = CudaGraphRunner(adapter, table.keys, metrics, cuda, dtype)
    runner.prepare()
    key = BucketKey(2, 256, 64)
    case = BoundaryCase(key, 1, (16, 16), 64)
    timer = _StepTimer(cuda)
    for seed in range(3):
        timer.start()
        runner.run(key, random_inputs(adapter, case, cuda, dtype, seed=seed))
        timer.stop()
    runner.run(None, random_inputs(adapter, case, cuda, dtype))
    step_ms = timer.step_ms()
    assert len(step_ms) == 3 and all(0 < ms < 10_000 for ms in step_ms), step_ms
    metrics.record_steps(key, step_ms)
    c = metrics.counters(key)
    assert c.forwards_by_mode == {"graph": 3, "static_eager": 0, "eager": 0} and c.replays == 3
    assert sum(metrics.counters(k).captures for k in table.keys) == runner.stats.captured == len(table.keys)
    assert metrics.counters(None).forwards_by_mode["eager"] == 1

    def stats():
        snap = metrics.snapshot()
        state = {d["key"]: d for d in runner.describe()}
        for b in snap["buckets"]:
            b.update({"pool_bytes": state[b["key"]]["pool_bytes"], "capture_s": state[b["key"]]["capture_s"]})
        return snap

    backend = FakeBackend()
    BucketExporter(stats, metrics, backend=backend).push()
    m = backend.m
    assert m["bcg_forwards"].total(bucket=str(key), mode="graph") == 3
    assert m["bcg_captures"].total() == len(table.keys) and m["bcg_capture_seconds"].total() > 0
    assert sum(v for v, t in m["bcg_graph_pool_bytes"].calls) == runner.stats.pool_bytes > 0
    assert [v for v, _ in m["bcg_step_latency_ms"].calls] == pytest.approx(step_ms)


def test_readme_lists_every_exported_metric():
    readme = (ROOT / "docs" / "OPERATIONS.md").read_text()
    section = readme.split("## Metrics (Prometheus)", 1)[1].split("\n## ", 1)[0]
    for spec in METRICS:
        assert f"`{spec.exported}`" in section, spec.exported


# -- Ray's Prometheus endpoint ----------------------------------------------------------------------------

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
        assert _sum(series, "ray_bcg_forwards_total", mode="static_eager", **tags) == b["forwards"] > 0
        assert _sum(series, "ray_bcg_real_tokens_total", **tags) == b["real_tokens"]
        assert _sum(series, "ray_bcg_padded_tokens_total", **tags) == b["padded_tokens"]
        assert _sum(series, "ray_bcg_step_latency_ms_count", **tags) == b["step_latency_ms"]["count"] > 0
        for le, n in b["step_latency_ms"]["buckets"].items():  # every bin, same le labels
            assert _sum(series, "ray_bcg_step_latency_ms_bucket", le=le, **tags) == n, le
        assert _sum(series, "ray_bcg_step_time_ms_total", **tags) == pytest.approx(b["step_latency_ms"]["sum"])
        assert _sum(series, "ray_bcg_padded_token_ratio", **tags) == pytest.approx(b["padded_token_ratio"])
    assert _sum(series, "ray_bcg_padded_token_ratio", bucket="b2_i1024_m_t256") > 1  # 272 image tokens padded
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
