"""Micro-batching on the tiny default model (CPU, fp32): DiTPipeline.generate_batch and MicroBatcher.

Closeness of a batched image to the same request run alone: in fp32 the two differ only in the reduction
order of the batched kernels (matmuls, attention and norms over more rows pick other blockings), about
1e-6 relative in the latents (``tests/closeness.py``: RTOL 1e-5). After the VAE an image is rounded to
uint8 (``(x + 1) * 127.5``), so such a difference can flip a pixel only where it sits on a rounding
boundary: at most one level. The tests check the latents at RTOL and the PNGs at one level, and check that
the one-level tolerance does discriminate (a wrong guidance scale or another request's image differs by far
more).
"""

import asyncio
import dataclasses
import io
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from bcg_core import (
    BucketConfig, BucketKey, DiTPipeline, GenerationRequest, Plan, Planner, RequestCancelled, RequestError, ServeConfig,
    build_tiny,
)
from bcg_core.batching import MicroBatcher
from bcg_core.metrics import token_shares
from bcg_core.models import TINY_TEXT_TOKENS
from closeness import assert_close
from plan_counting import PlanCounter

T = TINY_TEXT_TOKENS
CONFIG = ServeConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4, 8], resolutions=["256x256", "256x512"],
                                          text_lengths=[T]))
WAIT_MS = 500.0  # a window long enough for every submit of a test to arrive within it, even on a loaded machine


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.fixture
def pipe(tiny):
    return DiTPipeline(CONFIG, tiny)  # fresh counters per test


def _req(prompt="a red cube", n=1, width=256, height=256, steps=1, guidance=1.0, seed=0, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, n=n, width=width, height=height, num_inference_steps=steps,
                             guidance_scale=guidance, seed=seed, **kw)


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)


def _max_diff(a: bytes, b: bytes) -> int:
    return int(np.abs(_pixels(a) - _pixels(b)).max())


@torch.inference_mode()
def _reference_images(pipe: DiTPipeline, request: GenerationRequest) -> list[bytes]:
    """The single-request path written out from the family's step hooks (start, model_rows, the runner on the
    request's own bucket, advance, decode), without DiTPipeline.step's batching: one request, its own bucket."""
    plan = pipe.planner.plan(request)
    state = pipe.model.start(plan)
    while not state.done:
        pipe.model.advance(state, pipe.runner.run(plan.lookup.key, pipe.model.model_rows(state)))
    return pipe.finish(state)


def _latents(pipe: DiTPipeline, requests: list[GenerationRequest]) -> list[torch.Tensor]:
    """Final latents of ``requests`` stepped together through DiTPipeline.step (one forward per step)."""
    states = [pipe.start(pipe.planner.plan(r)) for r in requests]
    while not all(s.done for s in states):
        pipe.step([s for s in states if not s.done])
    return [s.latents for s in states]


class Recorder:
    """A ``run_batch`` that records each batch of plans as ``[(width, height, steps, rows), ...]`` and runs it.

    With ``gate``, a batch waits for the gate before it computes, so that batches dispatched early do not
    slow the event loop (through the GIL) while later requests are still being submitted.
    """

    def __init__(self, pipe: DiTPipeline, gate: threading.Event | None = None):
        self.pipe = pipe
        self.gate = gate
        self.calls: list[list[tuple[int, int, int, int]]] = []

    def __call__(self, plans, cancels):
        assert all(isinstance(p, Plan) for p in plans)
        self.calls.append([(p.request.width, p.request.height, p.request.num_inference_steps, p.lookup.query.batch)
                           for p in plans])
        if self.gate is not None:
            assert self.gate.wait(60)
        return self.pipe.generate_batch(plans, cancels)


def _submit_all(batcher: MicroBatcher, requests: list[GenerationRequest], gate: threading.Event | None = None) -> list:
    """Submit every request at once; with ``gate``, open it once all of them are queued."""

    async def main():
        tasks = [asyncio.create_task(batcher.submit(r)) for r in requests]
        if gate is not None:
            while batcher.stats()["waiting"] + batcher.stats()["running"] < len(requests):
                await asyncio.sleep(0.005)
            gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(main())


# -- DiTPipeline.generate_batch -----------------------------------------------------------------------


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_a_batch_of_one_is_the_single_request_path_bit_for_bit(pipe, guidance):
    req = _req("a corgi astronaut", n=2, steps=2, guidance=guidance, seed=5, negative_prompt="blurry")
    reference = _reference_images(pipe, req)
    (batched,) = pipe.generate_batch([req])
    single = pipe.generate(req)
    assert batched.images_png == reference and single.images_png == reference
    key = BucketKey(4 if guidance > 1 else 2, 256, T)
    for r in (batched, single):
        assert r.batch_size == 1 and r.bucket == str(key) and r.hit and r.seed == 5 and r.steps == 2
        assert r.real_tokens == r.padded_tokens == key.tokens
    assert pipe.metrics.counters(key).batches == 0 and pipe.metrics.counters(key).batched_requests == 0


def test_a_batch_of_three_gives_each_request_the_images_it_gets_alone(pipe):
    reqs = [
        _req("a lighthouse at dusk", n=1, steps=2, guidance=2.0, seed=11),
        _req("a bowl of ramen", n=2, steps=2, guidance=7.5, seed=22, negative_prompt="text, watermark"),
        _req("p. cubensis", n=1, steps=2, guidance=4.0, seed=33),
    ]  # 2 + 4 + 2 = 8 transformer rows: b8
    together = pipe.generate_batch(reqs)
    alone = [pipe.generate(r) for r in reqs]
    for t, a, r in zip(together, alone, reqs):
        assert t.batch_size == 3 and t.bucket == "b8_i256_t256" and a.batch_size == 1
        assert t.seed == r.seed and len(t.images_png) == len(a.images_png) == r.n
        for x, y in zip(t.images_png, a.images_png):
            assert _max_diff(x, y) <= 1
    assert sum(t.padded_tokens for t in together) == BucketKey(8, 256, T).tokens
    # The tolerance discriminates: another request's image, or this one under another guidance scale.
    assert _max_diff(together[0].images_png[0], together[2].images_png[0]) > 10
    other_guidance = pipe.generate(dataclasses.replace(reqs[0], guidance_scale=7.5))
    assert _max_diff(together[0].images_png[0], other_guidance.images_png[0]) > 1
    # The latents themselves agree to fp32 reduction order (RTOL 1e-5).
    for batched, r in zip(_latents(pipe, reqs), reqs):
        assert_close(batched, _latents(pipe, [r])[0])


def test_requests_of_different_steps_and_guidance_share_forwards_and_each_gets_its_own_images(pipe):
    reqs = [
        _req("a lighthouse at dusk", n=1, steps=3, guidance=4.0, seed=11),  # 2 rows
        _req("a bowl of ramen", n=2, steps=1, guidance=1.0, seed=22),  # 2 rows, no CFG, leaves after step 1
        _req("p. cubensis", n=1, steps=2, guidance=7.5, seed=33),  # 2 rows
    ]
    assert len({pipe.batch_group(pipe.planner.plan(r)) for r in reqs}) == 1
    together = pipe.generate_batch(reqs)
    for t, r in zip(together, reqs):
        assert t.batch_size == 3 and t.bucket == "b8_i256_t256" and t.steps == r.num_inference_steps
        for x, y in zip(t.images_png, pipe.generate(r).images_png):
            assert _max_diff(x, y) <= 1
    # 3 forwards: 6 rows (b8), then 4 rows (b4) once the 1-step request left, then 2 rows (b2)
    assert [pipe.metrics.counters(BucketKey(b, 256, T)).steps for b in (8, 4, 2)] == [1, 1, 1 + 3 + 1 + 2]
    for batched, r in zip(_latents(pipe, reqs), reqs):
        assert_close(batched, _latents(pipe, [r])[0])


def test_generate_batch_refuses_mixed_groups_misses_and_too_many_rows(pipe):
    base = _req(guidance=4.0)  # 2 rows
    assert pipe.batch_group(pipe.planner.plan(base)) == ("i256_t256", (16, 16))
    with pytest.raises(ValueError, match="different batch groups"):
        pipe.generate_batch([base, dataclasses.replace(base, width=256, height=512)])  # another shape
    tall, wide = dataclasses.replace(base, width=256, height=512), dataclasses.replace(base, width=512, height=256)
    assert pipe.planner.plan(tall).lookup.key == pipe.planner.plan(wide).lookup.key  # one bucket, two grids
    with pytest.raises(ValueError, match="different batch groups"):
        pipe.generate_batch([tall, wide])
    miss = dataclasses.replace(base, n=5)  # 10 rows, above the largest batch bucket: a miss
    assert pipe.batch_group(pipe.planner.plan(miss)) is None
    with pytest.raises(ValueError, match="miss runs alone"):
        pipe.generate_batch([base, miss])
    two = dataclasses.replace(base, n=2)  # 4 rows
    with pytest.raises(ValueError, match="10 transformer rows, above the largest batch bucket 8"):
        pipe.generate_batch([two, two, base])
    assert pipe.stats()["totals"]["requests"] == 0
    assert sum(b["forwards"] for b in pipe.stats()["buckets"]) == 0  # refused before any forward
    bad, ok = pipe.generate_batch([dataclasses.replace(base, n=0), base])  # a planning error is its own result
    assert isinstance(bad, RequestError) and bad.field == "n"
    assert ok.batch_size == 1 and ok.bucket == "b2_i256_t256"


def test_a_cancelled_request_of_a_batch_is_not_decoded_and_the_others_are_served(pipe):
    reqs = [_req(f"prompt {i}", steps=2, seed=i) for i in range(3)]  # 1 row each: b4
    cancels = [None, threading.Event(), threading.Event()]
    cancels[1].set()
    out = pipe.generate_batch(reqs, cancels)
    assert isinstance(out[1], RequestCancelled)
    assert [r.batch_size for r in (out[0], out[2])] == [3, 3] and len(out[2].images_png) == 1
    # the cancelled request left at the first step boundary: the two others ran 2 rows (b2) per step
    assert pipe.metrics.counters(BucketKey(4, 256, T)).forwards == 0
    c = pipe.metrics.counters(BucketKey(2, 256, T))
    assert (c.forwards, c.requests, c.batches, c.batched_requests) == (2, 2, 1, 2)  # the loop ran on
    every = [threading.Event() for _ in reqs]
    for e in every:
        e.set()
    assert all(isinstance(r, RequestCancelled) for r in pipe.generate_batch(reqs, every))
    c = pipe.metrics.counters(BucketKey(2, 256, T))
    assert (c.forwards, c.requests, c.batches) == (2, 2, 1)  # all cancelled: no step ran, nothing counted


def test_token_shares_split_by_rows_and_sum_exactly():
    assert token_shares(4096, [2, 4]) == [1365, 2731]
    assert token_shares(10, [1, 1, 1]) == [4, 3, 3]
    assert token_shares(7, [3]) == [7]
    assert sum(token_shares(8 * 512, [2, 2, 2])) == 8 * 512
    with pytest.raises(ValueError):
        token_shares(5, [])
    with pytest.raises(ValueError):
        token_shares(5, [2, 0])


def test_generate_batch_trusts_plans_and_plans_each_raw_request_once(pipe, monkeypatch):
    ingress = Planner(CONFIG, pipe.model.spec, pipe.model.count_tokens)  # the ingress's own planner
    plans = [ingress.plan(_req("a lighthouse", seed=None)), ingress.plan(_req("a bowl of ramen", seed=None))]
    raw = _req("p. cubensis", seed=7)
    counter = PlanCounter(monkeypatch)
    out = pipe.generate_batch([plans[0], raw, plans[1]])
    assert counter.by(pipe.planner) == 1 and len(counter.calls) == 1  # the raw request only, once
    assert [r.seed for r in out] == [plans[0].request.seed, 7, plans[1].request.seed]  # the plans' drawn seeds
    assert all(r.batch_size == 3 and r.bucket == "b4_i256_t256" for r in out)
    (again,) = pipe.generate_batch([plans[0]])  # the same plan again (a resend): the same seed, the same image
    assert again.images_png == pipe.generate(plans[0]).images_png
    assert len(counter.calls) == 1
    pipe.generate(raw)  # a raw request through generate: planned there, once
    (bad,) = pipe.generate_batch([dataclasses.replace(raw, n=0)])  # bad raw input is still refused, naming n
    assert isinstance(bad, RequestError) and bad.field == "n" and len(counter.calls) == 3


# -- MicroBatcher ---------------------------------------------------------------------------------------


def test_the_batcher_does_not_plan_a_planned_request_again(pipe, monkeypatch):
    ingress = Planner(CONFIG, pipe.model.spec, pipe.model.count_tokens)
    plans = [ingress.plan(_req(f"prompt {i}", seed=None)) for i in range(2)]
    rec = Recorder(pipe)
    batcher = MicroBatcher(pipe, wait_ms=WAIT_MS, run_batch=rec)
    counter = PlanCounter(monkeypatch)
    results = _submit_all(batcher, [*plans, _req("raw", seed=3)])
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert counter.by(pipe.planner) == 1 and len(counter.calls) == 1  # only the raw request, at submit
    assert [r.seed for r in results] == [plans[0].request.seed, plans[1].request.seed, 3]
    assert rec.calls == [[(256, 256, 1, 1)] * 3]  # one batch: the plans and the raw request's plan


def test_concurrent_same_shape_submits_share_one_forward_per_step(pipe):
    rec = Recorder(pipe)
    batcher = MicroBatcher(pipe, wait_ms=WAIT_MS, run_batch=rec)
    assert batcher.max_rows == 8
    reqs = [_req(f"prompt {i}", steps=2, seed=i) for i in range(3)]  # 1 row each: 3 rows -> b4

    async def main():
        tasks = []
        for r in reqs:  # arriving 30 ms apart, within the first one's window
            tasks.append(asyncio.create_task(batcher.submit(r)))
            await asyncio.sleep(0.03)
        waiting = batcher.queue_lengths(), batcher.stats()["waiting"]
        return waiting, await asyncio.gather(*tasks)

    waiting, results = asyncio.run(main())
    assert waiting == ({"i256_t256": 3}, 3)
    assert [len(c) for c in rec.calls] == [3]
    assert [r.seed for r in results] == [0, 1, 2] and all(r.batch_size == 3 for r in results)
    assert all(r.bucket == "b4_i256_t256" and r.timings_ms["queue"] >= 0 for r in results)
    c = pipe.metrics.counters(BucketKey(4, 256, T))
    assert (c.forwards, c.requests, c.batches, c.batched_requests) == (2, 3, 1, 3)  # 2 steps, not 3 x 2
    assert pipe.stats()["batch_totals"] == {"batches": 1, "batched_requests": 3}
    stats = batcher.stats()
    assert (stats["runs"], stats["requests"], stats["batches"], stats["batched_requests"]) == (1, 3, 1, 3)
    assert stats["mean_batch_size"] == 3.0 and stats["waiting"] == stats["running"] == 0
    assert batcher.queue_lengths() == {}


def test_requests_of_different_grids_never_share_a_batch_and_steps_or_guidance_do(pipe):
    rec = Recorder(pipe)
    batcher = MicroBatcher(pipe, wait_ms=WAIT_MS, run_batch=rec)
    base = _req()
    reqs = [
        base, dataclasses.replace(base, seed=1),  # one group: bucket shape i256_t256, grid 16x16 ...
        dataclasses.replace(base, num_inference_steps=2), dataclasses.replace(base, num_inference_steps=2, seed=1),
        dataclasses.replace(base, guidance_scale=3.0),  # ... whatever the steps and CFG rows
        dataclasses.replace(base, width=256, height=512),  # bucket shape i512_t256, grid 32x16
        dataclasses.replace(base, width=512, height=256),  # the same bucket shape, grid 16x32
    ]
    results = _submit_all(batcher, reqs)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert sorted(rec.calls) == sorted([
        [(256, 256, 1, 1), (256, 256, 1, 1), (256, 256, 2, 1), (256, 256, 2, 1), (256, 256, 1, 2)],
        [(256, 512, 1, 1)], [(512, 256, 1, 1)],
    ])
    assert [r.batch_size for r in results] == [5, 5, 5, 5, 5, 1, 1]
    assert [r.steps for r in results[:5]] == [1, 1, 2, 2, 1]
    assert [Image.open(io.BytesIO(r.images_png[0])).size for r in results[5:7]] == [(256, 512), (512, 256)]


def test_a_batch_never_exceeds_max_rows(pipe):
    gate = threading.Event()
    rec = Recorder(pipe, gate)
    batcher = MicroBatcher(pipe, max_rows=4, wait_ms=WAIT_MS, run_batch=rec)
    reqs = [_req(f"p{i}", guidance=4.0, seed=i) for i in range(3)]  # 2 rows each (CFG)
    reqs.append(_req("big", n=2, guidance=4.0, seed=9))  # 4 rows: a full batch by itself
    reqs += [_req("three", n=3), _req("two", n=2), _req("one")]  # no CFG: 3, 2 and 1 rows
    results = _submit_all(batcher, reqs, gate)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert max(sum(r[3] for r in call) for call in rec.calls) <= 4
    assert sorted(rec.calls) == sorted([
        [(256, 256, 1, 2)] * 2,  # p0 + p1 filled the batch
        [(256, 256, 1, 2)],  # p2: "three" (CFG or not, one group) would have overflowed it, so it ran
        [(256, 256, 1, 4)],  # big
        [(256, 256, 1, 3)],  # three: "two" would have overflowed it, so it ran and "two" opened the next
        [(256, 256, 1, 2), (256, 256, 1, 1)],  # two + one
    ])
    assert [r.batch_size for r in results] == [2, 2, 1, 1, 1, 2, 2]
    assert results[0].bucket == results[1].bucket == "b4_i256_t256"
    # Full batches and overflowed ones run at once instead of waiting out the window; the others wait it.
    assert max(results[i].timings_ms["queue"] for i in (0, 1, 2, 3, 4)) < WAIT_MS / 2
    assert min(results[i].timings_ms["queue"] for i in (5, 6)) >= WAIT_MS * 0.9


def test_misses_and_disabled_batching_run_each_request_alone(pipe):
    gate = threading.Event()
    rec = Recorder(pipe, gate)
    batcher = MicroBatcher(pipe, wait_ms=WAIT_MS, run_batch=rec)
    miss = _req("a miss", width=256, height=768)  # 768 image tokens: above the largest tier (512)
    results = _submit_all(batcher, [miss, dataclasses.replace(miss, seed=1)], gate)
    assert [len(c) for c in rec.calls] == [1, 1]
    assert all(not r.hit and r.missed == ["image_tokens"] and r.batch_size == 1 for r in results)
    snap = pipe.stats()
    assert snap["misses"]["requests"] == 2 and snap["misses"]["forwards"] == 2
    assert snap["batch_totals"]["batches"] == 0
    assert all(r.timings_ms["queue"] < WAIT_MS / 2 for r in results)  # no window for a miss

    gate = threading.Event()
    rec = Recorder(pipe, gate)
    off = MicroBatcher(pipe, wait_ms=WAIT_MS, enabled=False, run_batch=rec)
    results = _submit_all(off, [_req(f"p{i}", seed=i) for i in range(3)], gate)
    assert [len(c) for c in rec.calls] == [1, 1, 1]
    assert all(r.batch_size == 1 and r.timings_ms["queue"] < WAIT_MS / 2 for r in results)
    assert pipe.metrics.counters(BucketKey(1, 256, T)).forwards == 3
    assert off.stats()["batches"] == 0 and off.stats()["runs"] == 3


def test_a_submit_cancelled_in_its_window_leaves_the_batch_to_the_others(pipe):
    rec = Recorder(pipe)
    batcher = MicroBatcher(pipe, max_rows=4, wait_ms=WAIT_MS, run_batch=rec)
    first, gone, late = _req("first", n=2, seed=0), _req("gone", seed=1), _req("late", n=2, seed=2)

    async def main():
        tasks = [asyncio.create_task(batcher.submit(first)), asyncio.create_task(batcher.submit(gone))]
        await asyncio.sleep(0.05)
        tasks[1].cancel()  # leaves the batch: 2 of its 4 rows are free again
        await asyncio.sleep(0.02)
        tasks.append(asyncio.create_task(batcher.submit(late)))  # fits (2 + 2 rows) and fills the batch
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[1], asyncio.CancelledError)
    assert [r.seed for r in (results[0], results[2])] == [0, 2] and results[0].batch_size == 2
    assert rec.calls == [[(256, 256, 1, 2)] * 2]  # the cancelled request never ran
    assert results[0].timings_ms["queue"] < WAIT_MS  # the late request filled the batch: no full window
    assert pipe.stats()["totals"]["requests"] == 2 and batcher.queue_lengths() == {}


def test_a_submit_cancelled_while_its_batch_runs_does_not_break_the_others(pipe):
    started, go = threading.Event(), threading.Event()
    seen: list[list[threading.Event]] = []

    def gated(plans, cancels):
        seen.append(list(cancels))
        started.set()
        assert go.wait(30)
        return pipe.generate_batch(plans, cancels)

    batcher = MicroBatcher(pipe, wait_ms=20, run_batch=gated)
    reqs = [_req(f"prompt {i}", steps=2, seed=i) for i in range(3)]

    async def main():
        tasks = [asyncio.create_task(batcher.submit(r)) for r in reqs]
        assert await asyncio.to_thread(started.wait, 30)
        running = batcher.queue_lengths()
        tasks[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        go.set()
        return running, await asyncio.gather(tasks[0], tasks[2])

    running, results = asyncio.run(main())
    assert running == {"i256_t256": 3} and batcher.stats()["running"] == 0
    assert [c.is_set() for c in seen[0]] == [False, True, False]
    assert [r.seed for r in results] == [0, 2] and all(r.batch_size == 3 for r in results)
    c = pipe.metrics.counters(BucketKey(2, 256, T))  # the cancelled one left before the first step: 2 rows
    assert (c.forwards, c.requests) == (2, 2)  # the loop ran for the others; the cancelled one is not counted


def test_cancelling_every_submit_of_a_running_batch_stops_it_before_its_steps(pipe):
    started, go = threading.Event(), threading.Event()

    def gated(plans, cancels):
        started.set()
        assert go.wait(30)
        return pipe.generate_batch(plans, cancels)

    batcher = MicroBatcher(pipe, wait_ms=0, run_batch=gated)

    async def main():
        task = asyncio.create_task(batcher.submit(_req(steps=50)))
        assert await asyncio.to_thread(started.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()

    asyncio.run(main())  # waits for the worker thread
    assert sum(b["forwards"] for b in pipe.stats()["buckets"]) == 0 and pipe.stats()["totals"]["requests"] == 0


def test_padded_tokens_of_a_batch_are_shared_by_rows_and_sum_to_the_forward(pipe):
    batcher = MicroBatcher(pipe, wait_ms=WAIT_MS)
    reqs = [_req("two rows", guidance=4.0), _req("four rows", n=2, guidance=4.0, seed=3)]  # 6 rows: b8
    results = _submit_all(batcher, reqs)
    key = BucketKey(8, 256, T)
    assert [r.bucket for r in results] == [str(key)] * 2
    assert [r.real_tokens for r in results] == [2 * (256 + T), 4 * (256 + T)]
    assert [r.padded_tokens for r in results] == [1365, 2731] and sum(r.padded_tokens for r in results) == key.tokens
    c = pipe.metrics.counters(key)
    assert (c.real_tokens, c.padded_tokens, c.forwards) == (6 * (256 + T), key.tokens, 1)
    assert c.padding_waste_pct == 25.0


def test_a_bad_request_is_refused_at_submit_and_nothing_is_queued(pipe):
    batcher = MicroBatcher.from_pipeline(pipe)
    assert (batcher.enabled, batcher.wait_ms) == (True, 10.0)

    async def main():
        with pytest.raises(RequestError) as info:
            await batcher.submit(_req(width=250))
        return info.value

    assert asyncio.run(main()).field == "size"
    assert batcher.queue_lengths() == {} and batcher.stats()["runs"] == 0


def test_planning_while_batches_encode_in_other_threads_does_not_break_the_tokenizer(pipe):
    """A fast tokenizer's padding and truncation are mutable state: counting tokens (the planner, on the
    event loop) while another thread encodes (padding to the text length) made one of them fail."""
    stop, errors = threading.Event(), []

    def plan():
        while not stop.is_set():
            try:
                assert pipe.planner.plan(_req("a lighthouse at dusk, oil on canvas")).prompt_tokens == 10
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    def encode():
        try:
            for _ in range(20):
                rows = pipe.model.encode("a lighthouse")
                assert rows.text.shape[:2] == (1, T)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    planners = [threading.Thread(target=plan)]
    encoders = [threading.Thread(target=encode) for _ in range(2)]  # two batches encoding at once
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the spinning planner hands the GIL back at once after each torch op
    try:
        for t in encoders + planners:
            t.start()
        for t in encoders:
            t.join()
    finally:
        stop.set()
        for t in planners:
            t.join()
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
