"""Faults at run time (issue: reliability), on the CPU: a bucket whose padded forward raises (a CUDA error
mid-replay, simulated through the runner) falls back to unpadded eager, logged and counted, and its request is
served; a step that runs out of device memory answers its requests 503 with Retry-After and the replica goes on.

The CUDA graph runner shares the code paths tested here (:func:`bcg_core.runners.base.demote`); ``tests/gpu`` replays.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from test_step_scheduler import same_image

from bcg_core import BucketConfig, DiTPipeline, GenerationRequest, build_tiny
from bcg_core.config import EngineConfig
from bcg_core.errors import ServiceUnavailable
from bcg_core.families.tiny import TINY_TEXT_TOKENS
from bcg_core.runners import eager as runner_mod
from scheduling import ValidatingScheduler

T = TINY_TEXT_TOKENS
BUCKETS = BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256"], text_lengths=[T])
SIMULATED = "CUDA error: an illegal memory access was encountered (simulated)"


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


def _req(n=1, steps=2, seed=0) -> GenerationRequest:
    return GenerationRequest("a red cube", n=n, width=256, height=256, num_inference_steps=steps, seed=seed)


def _fail_once(monkeypatch, name: str):
    """Make ``<name>`` as the eager runner calls it (``bcg_core.runners.eager``) raise :data:`SIMULATED` on its first
    call; returns the call counter."""
    real = getattr(runner_mod, name)
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(SIMULATED)
        return real(*a, **kw)

    monkeypatch.setattr(runner_mod, name, flaky)
    return calls


def test_a_runtime_error_in_a_padded_forward_demotes_the_bucket_to_eager_and_the_request_is_served(
        tiny, monkeypatch, caplog):
    clean = DiTPipeline(EngineConfig(buckets=BUCKETS), tiny)
    clean = clean.generate(clean.validator.validate(_req(seed=5)))
    pipe = DiTPipeline(EngineConfig(buckets=BUCKETS), tiny)
    pipe.runner.prepare()
    _fail_once(monkeypatch, "static_forward")
    with caplog.at_level(logging.ERROR, logger="bcg_core.runners.base"):
        got = pipe.generate(pipe.validator.validate(_req(seed=5)))
    assert same_image(got.image_bytes[0], clean.image_bytes[0])  # the faulted step ran unpadded: same image
    assert any(str(got.bucket) in r.getMessage() and "unpadded and eager" in r.getMessage() for r in caplog.records)
    row = next(b for b in pipe.metrics.snapshot()["buckets"] if b["key"] == str(got.bucket))
    assert row["faults"] == 1 and row["forwards_by_mode"]["eager"] == 2  # both steps: the fault, then demoted
    note = next(d["note"] for d in pipe.runner.describe() if d["key"] == str(got.bucket))
    assert note.startswith("runs unpadded and eager after a runtime error: RuntimeError: CUDA error")
    # no new fault: the bucket stays eager, serving goes on
    again = pipe.generate(pipe.validator.validate(_req(seed=6)))
    row = next(b for b in pipe.metrics.snapshot()["buckets"] if b["key"] == str(got.bucket))
    assert len(again.image_bytes) == 1 and row["faults"] == 1 and row["forwards_by_mode"]["eager"] == 4


def test_an_out_of_memory_error_is_not_swallowed_by_the_fallback(tiny, monkeypatch):
    pipe = DiTPipeline(EngineConfig(buckets=BUCKETS), tiny)

    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    monkeypatch.setattr(runner_mod, "static_forward", oom)
    with pytest.raises(torch.OutOfMemoryError):
        pipe.generate(pipe.validator.validate(_req()))
    assert all(b["faults"] == 0 for b in pipe.metrics.snapshot()["buckets"])


def test_a_fused_replay_that_raises_runs_its_step_on_the_host_with_the_same_image(tiny, monkeypatch):
    config = EngineConfig(buckets=BUCKETS, runner={"fused_step": "always"})
    clean = DiTPipeline(config, tiny)
    clean.prepare()
    want = clean.generate(clean.validator.validate(_req(steps=3, seed=8)))
    pipe = DiTPipeline(config, tiny)
    pipe.prepare()
    assert pipe.fused.on
    real = pipe.model.adapter.forward
    calls = {"n": 0}

    def flaky(buffers):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(SIMULATED)
        return real(buffers)

    monkeypatch.setattr(pipe.model.adapter, "forward", flaky)
    got = pipe.generate(pipe.validator.validate(_req(steps=3, seed=8)))
    assert got.image_bytes == want.image_bytes  # fused and host steps are bitwise equal
    assert pipe.fused.host_steps == {"bucket_fault": 1, "no_fused_graph": 2}  # then the bucket runs eager
    assert sum(b["faults"] for b in pipe.metrics.snapshot()["buckets"]) == 1


def test_a_step_that_runs_out_of_memory_is_answered_503_and_the_replica_keeps_serving(tiny, monkeypatch):
    pipe = DiTPipeline(EngineConfig(buckets=BUCKETS), tiny)
    real = pipe.step
    calls = {"n": 0}

    def oom_once(states, plan=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return real(states, plan)

    pipe.step = oom_once

    async def main():
        sched = ValidatingScheduler(pipe)
        try:
            first = await asyncio.gather(sched.submit(_req(seed=1)), return_exceptions=True)
            after = await sched.submit(_req(seed=2))
            return first[0], after, sched.stats()
        finally:
            sched.close()

    first, after, stats = asyncio.run(asyncio.wait_for(main(), 120))
    assert isinstance(first, ServiceUnavailable) and first.status == 503 and first.retry_after_s > 0
    assert "ran out of memory" in first.message and first.field == "request"
    assert len(after.image_bytes) == 1
    assert stats["oom_steps"] == 1 and stats["rows_in_flight"] == 0 and stats["running"] == 0


def test_a_request_that_waits_past_its_deadline_is_answered_503_not_left_hanging(tiny):
    """``scheduler.max_queue_wait_s``: with one row in flight allowed and a slow first request, the second waits in
    the replica's queue past the deadline and is answered 503 with Retry-After; the first is served."""
    pipe = DiTPipeline(EngineConfig(buckets=BUCKETS), tiny)
    real = pipe.step

    def slow(states, plan=None):
        import time

        time.sleep(0.4)
        return real(states, plan)

    pipe.step = slow

    async def main():
        sched = ValidatingScheduler(pipe, max_rows=2, max_queue_wait_s=0.2)
        try:
            first = asyncio.ensure_future(sched.submit(_req(n=1, steps=2, seed=1)))
            await asyncio.sleep(0.1)  # the first is admitted and holds the rows
            second = await asyncio.gather(sched.submit(_req(n=1, steps=2, seed=2)), return_exceptions=True)
            return await first, second[0], sched.stats()
        finally:
            sched.close()

    first, second, stats = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(first.image_bytes) == 1
    assert isinstance(second, ServiceUnavailable) and second.status == 503 and second.retry_after_s > 0
    assert "past scheduler.max_queue_wait_s 0.2" in second.message
    assert sum(s["expired"] for s in stats["shapes"].values()) == 1 and stats["waiting"] == 0


def test_work_per_request_is_bounded_with_an_error_naming_the_limit():
    from bcg_core import LimitsConfig, RequestError
    from bcg_core.validation import RequestValidator

    validator = RequestValidator.from_config(EngineConfig(limits=LimitsConfig(max_megapixel_steps=10.0)))
    validator.validate(GenerationRequest("x", n=2, width=512, height=512, num_inference_steps=19))  # 9.96: allowed
    with pytest.raises(RequestError) as e:
        validator.validate(GenerationRequest("x", n=2, width=512, height=512, num_inference_steps=20))
    assert e.value.field == "n" and e.value.status == 422
    assert "= 10 megapixel-steps, above limits.max_megapixel_steps 10" in e.value.message
    with pytest.raises(RequestError) as e:
        validator.validate(GenerationRequest("x", n=1, width=1024, height=1024, num_inference_steps=20))
    assert e.value.field == "num_inference_steps"
    unbounded = RequestValidator.from_config(EngineConfig(limits=LimitsConfig(max_megapixel_steps=None)))
    big = GenerationRequest("x", n=10, width=2048, height=2048, num_inference_steps=50)
    assert unbounded.validate(big).request.n == 10
