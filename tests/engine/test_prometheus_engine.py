"""Per-bucket metrics of a real pipeline and step scheduler on the tiny default model (CPU), and of the CUDA graph
runner (skipped without CUDA), through the exporter with a fake backend (no Ray). The exporter's own logic is
``tests/unit/test_prometheus.py``; Ray's Prometheus endpoint ``tests/serve/test_prometheus_serve.py``."""

from __future__ import annotations

import asyncio

import pytest

from bcg_core import BucketConfig, DiTPipeline, GenerationRequest, build_tiny
from bcg_core.config import EngineConfig
from bcg_core.families.tiny import TINY_TEXT_TOKENS
from bcg_core.keys import BucketKey
from bcg_core.metrics import BucketMetrics
from deployments.metrics import BucketExporter
from fake_metrics import FakeBackend

T = TINY_TEXT_TOKENS


def test_pipeline_records_one_step_latency_per_forward_and_the_exporter_matches_its_stats():
    cfg = EngineConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "512x512"],
                                           text_lengths=[T]))
    pipe = DiTPipeline(cfg, build_tiny())
    backend = FakeBackend()
    ex = BucketExporter(pipe.stats, pipe.metrics, lambda: {}, {k.shape for k in pipe.table.keys}, backend)
    pipe.generate(pipe.validator.validate(GenerationRequest("a", n=1, width=256, height=256, num_inference_steps=2,
                                                            seed=0)))
    miss = GenerationRequest("a", n=1, width=768, height=768, num_inference_steps=1, seed=0)  # no tier: a miss
    pipe.generate(pipe.validator.validate(miss))
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
    assert m["bcg_misses"].total(dim="image_tokens") == stats["misses"]["by_dim"]["image_tokens"] == 1
    assert m["bcg_real_tokens"].total(bucket="miss") == stats["misses"]["real_tokens"]


def test_the_step_scheduler_metrics_follow_its_stats():
    """``bcg_sched_*`` from a replica's step scheduler: forwards by kind, decisions, rows in flight, fill,
    waste and admission waits match ``StepScheduler.stats()`` after real requests; a second push adds nothing."""
    from scheduling import ValidatingScheduler

    cfg = EngineConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "512x512"],
                                           text_lengths=[T]))
    pipe = DiTPipeline(cfg, build_tiny())
    sched = ValidatingScheduler(pipe)
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
    from bcg_core.pipeline import _StepTimer
    from bcg_core.runners.cuda_graph import CudaGraphRunner
    from bcg_core.verify_inputs import BoundaryCase, random_inputs

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
