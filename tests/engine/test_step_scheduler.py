"""The step scheduler (bcg_core/scheduler/: step_scheduler.py, loop.py, admission.py, flight.py) and its cost model
(bcg_core/costs/), on the CPU.

Tiny default model, fp32. Closeness: rows that share a forward differ from the same rows run alone only in the
reduction order of batched kernels (``tests/closeness.py``: latents within RTOL 1e-5); after the VAE and the
uint8 rounding that flips at most one level on a few pixels, so images are compared at one level on at most
:data:`COMPANY_PIXEL_SHARE` of the pixel values, and the tests check that this tolerance does discriminate.

Deterministic arrivals: :func:`submit_together` holds the scheduler's lock (a re-entrant condition) while the
event loop submits, so the denoising thread admits every request of the call at the same step boundary.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from bcg_core import BucketConfig, BucketKey, DiTPipeline, GenerationRequest, RequestCancelled, build_tiny
from bcg_core.costs import Chunk, CostModel, StepForwards, eager_row_counts
from bcg_core.costs.miss_memory import MARGIN_BYTES
from bcg_core.families.tiny import TINY_TEXT_TOKENS
from bcg_core.scheduler.stats import FORWARD_KINDS
from bcg_core.scheduler.step_scheduler import StepScheduler
from closeness import assert_close
from deployments.settings import ServeConfig, backpressure_limits
from reference_gate import pixels
from scheduling import ValidatingScheduler

T = TINY_TEXT_TOKENS
CONFIG = ServeConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4, 8], resolutions=["256x256", "256x512"],
                                          text_lengths=[T]))
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.fixture
def pipe(tiny):
    return DiTPipeline(CONFIG, tiny)


@pytest.fixture
def make_sched(pipe):
    made: list[StepScheduler] = []

    def make(**kw) -> StepScheduler:
        s = ValidatingScheduler(pipe, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _req(prompt="a red cube", n=1, width=256, height=256, steps=2, guidance=1.0, seed=0, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, n=n, width=width, height=height, num_inference_steps=steps,
                             guidance_scale=guidance, seed=seed, **kw)


COMPANY_PIXEL_SHARE = 1.8e-3
"""Most share of pixel values that a request's image may move (by one level) beside others: the largest of
``benchmarks/pixel_moves.py``'s company sweep, 0.178% (tiny default at 512x512, its image decoded in one VAE call
with other images; sharing forwards alone moved at most 0.004%; docs/BENCHMARKS.md, 2026-12-06)."""


def same_image(a: bytes, b: bytes) -> bool:
    """At most one level apart, on at most :data:`COMPANY_PIXEL_SHARE` of the pixel values."""
    d = np.abs(pixels(a) - pixels(b))
    return int(d.max()) <= 1 and float((d > 0).mean()) <= COMPANY_PIXEL_SHARE


class StepLog:
    """Wraps ``pipe.step`` to record, per forward step: ``[(request seed, step index, rows)]`` and the plan."""

    def __init__(self, pipe: DiTPipeline):
        self.steps: list[tuple[list[tuple[int, int, int]], StepForwards | None]] = []
        self.step_ms: list[float] = []
        self._step = pipe.step
        self.lock = threading.Lock()
        pipe.step = self  # instance attribute: this test's pipeline only

    def __call__(self, states, plan=None):
        with self.lock:
            self.steps.append(([(s.request.seed, s.step_index, s.rows) for s in states], plan))
        t0 = time.perf_counter()
        try:
            return self._step(states, plan)
        finally:
            self.step_ms.append((time.perf_counter() - t0) * 1e3)

    def rows_per_step(self) -> list[int]:
        return [sum(r for _, _, r in states) for states, _ in self.steps]


async def submit_together(sched: StepScheduler, requests: list[GenerationRequest]) -> list[asyncio.Task]:
    """Submit ``requests`` so that they reach the queue before the denoising thread admits any of them."""
    with sched.flight.cv:
        tasks = [asyncio.ensure_future(sched.submit(r)) for r in requests]
        await asyncio.sleep(0)  # every submit runs up to its await while the lock is held
    return tasks


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


# -- the cost model ---------------------------------------------------------------------------------

SHAPE = "i256_t256"
KEYS = [BucketKey(b, 256, 256) for b in (1, 2, 4, 8, 16)]


def _scripted(bucket: dict[int, float], eager: dict[int, float] | None = None) -> CostModel:
    return CostModel({BucketKey(b, 256, 256): ms for b, ms in bucket.items()}, {SHAPE: eager or {}})


def test_cost_model_splits_instead_of_padding():
    # launch-bound graphs: 9 rows as 8 + 1 (2.0 + 1.0) beats padding to 16 (3.5) and eager (5.5)
    costs = _scripted({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 16: 3.5}, {1: 2.0, 2: 2.5, 4: 3.0, 8: 5.0, 16: 9.0})
    plan = costs.choose(SHAPE, 9, KEYS)
    assert plan.decision == "split"
    assert [(c.key.batch, c.rows) for c in plan.chunks] == [(8, 8), (1, 1)]
    assert plan.ms == pytest.approx(3.0) and plan.padded_rows == 0
    assert plan.ms_per_row == pytest.approx(3.0 / 9)


def test_cost_model_pads_when_padding_is_cheaper():
    costs = _scripted({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 16: 3.5}, {1: 2.0, 16: 9.0})
    plan = costs.choose(SHAPE, 15, KEYS)  # 8 + 4 + 2 + 1 = 5.4 ms; b16 = 3.5 ms
    assert plan.decision == "pad"
    assert [(c.key.batch, c.rows) for c in plan.chunks] == [(16, 15)]
    assert plan.padded_rows == 1
    full = costs.choose(SHAPE, 16, KEYS)
    assert full.decision == "fill" and full.padded_rows == 0


def test_cost_model_runs_eager_where_no_graph_pays():
    # compute-bound: a bucket costs its padded rows; eager costs only the real rows
    costs = _scripted({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0, 16: 160.0}, {1: 9.0, 8: 72.0, 16: 144.0})
    plan = costs.choose(SHAPE, 9, KEYS)
    assert plan.decision == "eager"
    assert all(c.key is None for c in plan.chunks) and plan.rows == 9
    assert plan.ms == pytest.approx(81.0)
    no_eager = CostModel(costs.bucket_ms, costs.eager_ms, eager=False).choose(SHAPE, 9, KEYS)
    assert no_eager.decision == "split" and no_eager.ms == pytest.approx(90.0)  # 8 + 1 rather than 16


def test_cost_model_chunks_never_exceed_the_largest_bucket_and_ties_take_fewer_forwards():
    costs = _scripted({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0})
    plan = costs.choose(SHAPE, 40, KEYS)
    assert max(c.rows for c in plan.chunks) <= 16 and plan.rows == 40
    assert [c.rows for c in plan.chunks] == [16, 16, 8]  # every split costs 40 ms: the fewest forwards win
    assert plan.home == KEYS[-1]


def test_cost_model_errors_and_interpolation():
    costs = _scripted({1: 1.0}, {1: 2.0, 4: 5.0})
    with pytest.raises(ValueError, match="at least 1 row"):
        costs.choose(SHAPE, 0, KEYS)
    with pytest.raises(ValueError, match="no cost is known"):
        CostModel({}, {}).choose(SHAPE, 3, KEYS)
    with pytest.raises(ValueError, match="row counts >= 1"):
        CostModel({}, {SHAPE: {0: 1.0}})
    assert costs.eager_cost(SHAPE, 2) == pytest.approx(3.0)  # between 1 and 4 rows
    assert costs.eager_cost(SHAPE, 8) == pytest.approx(9.0)  # extrapolated from the last two points
    assert costs.eager_cost("other", 2) is None
    assert eager_row_counts([1, 2, 4, 8, 18, 20]) == [1, 2, 4, 8, 16, 18, 20]


def test_token_model_prefers_the_fewest_padded_tokens_and_says_so(pipe):
    graphs = CostModel.token_model(pipe.table.keys, graphs=True)
    assert graphs.source == "token-count"
    keys = [k for k in pipe.table.keys if k.shape == SHAPE]
    assert graphs.choose(SHAPE, 5, keys).decision in ("split", "pad")
    eager = CostModel.token_model(pipe.table.keys, graphs=False)  # bucket == eager cost at equal rows
    plan = eager.choose(SHAPE, 5, keys)
    assert plan.padded_rows == 0  # no padded token is ever worth it when a bucket forward is not cheaper


def test_eager_time_scales_with_the_real_tokens_above_its_fixed_part():
    costs = _scripted({1: 10.0}, {1: 5.0, 2: 7.0, 4: 11.0})  # 3 ms fixed + 2 ms a row
    assert costs.fixed_ms(SHAPE) == pytest.approx(3.0) and costs.fixed_ms("other") == 0.0
    assert costs.eager_cost(SHAPE, 2, share=0.5) == pytest.approx(3.0 + 4.0 * 0.5)
    assert costs.eager_cost(SHAPE, 2, share=1.0) == costs.eager_cost(SHAPE, 2) == pytest.approx(7.0)


def test_a_request_padded_into_a_masked_tier_runs_eager_where_padding_does_not_pay(pipe, make_sched):
    """Without graphs (a CPU) a padded token is pure extra work: a 320x256 request in the 512-token masked tier
    runs its 320 real image tokens unpadded and eager, with no padded token, and gives the same image. The eager
    times were measured (or modelled) at the tier's size, so the decider scales them to the real tokens; priced at
    the tier's size, eager tied with the padded bucket and the bucket won."""
    req = _req(seed=140, width=320, height=256)
    validated = pipe.validator.validate(req)
    q = validated.lookup.query
    assert validated.shape.image_mask and q.image_tokens == 320 and validated.shape.image_tokens == 512
    costs = CostModel.token_model(pipe.table.keys, graphs=False)
    keys = [k for k in pipe.table.keys if k.shape == validated.shape]
    assert costs.choose(validated.shape, 1, keys).decision == "fill"  # at the tier's size: a tie, to the bucket

    async def main():
        sched = make_sched(costs=costs)
        log = StepLog(pipe)
        return sched, log, await sched.submit(req)

    sched, log, result = run(main())
    assert [[c.key for c in p.chunks] for _, p in log.steps] == [[None]] * 2
    shape = sched.stats()["shapes"][str(validated.shape)]
    assert shape["decisions"]["eager"] == 2 and shape["padded_token_waste"] == 0
    assert same_image(result.image_bytes[0], pipe.generate(pipe.validator.validate(req)).image_bytes[0])


# -- per-row timesteps and splits, at the pipeline level ----------------------------------------------

@torch.inference_mode()
def test_mixed_step_forward_equals_rows_run_one_request_at_a_time(pipe, monkeypatch):
    from reference_gate import bucket_costs

    monkeypatch.setattr(pipe.decider, "costs", bucket_costs(pipe))  # padded bucket forwards, as the table places them
    a, b = _req(seed=1, steps=4, n=2), _req(prompt="a blue sphere", seed=2, steps=3, guidance=3.0)
    together = [pipe.start(pipe.validator.validate(r)) for r in (a, b)]
    alone = [pipe.start(pipe.validator.validate(r)) for r in (a, b)]
    # a is one step ahead: every later forward mixes steps 1.. and 0..
    pipe.step([together[0]], pipe.decider.for_states([together[0]]))
    pipe.step([alone[0]], pipe.decider.for_states([alone[0]]))
    mixed = 0
    while not all(s.done for s in together):
        live = [s for s in together if not s.done]
        mixed += len({s.step_index for s in live}) > 1
        pipe.step(live, pipe.decider.for_states(live))
    for s in alone:
        while not s.done:
            pipe.step([s], pipe.decider.for_states([s]))
    assert mixed >= 2
    for t, s in zip(together, alone, strict=True):
        assert_close(t.latents, s.latents)


@torch.inference_mode()
def test_split_plan_equals_one_forward(pipe):
    reqs = [_req(seed=3, n=3), _req(seed=4, n=2, guidance=2.0)]  # 3 + 4 rows
    key8 = pipe.table.lookup(pipe.validator.validate(_req(n=8)).lookup.query).key
    key4 = BucketKey(4, key8.image_tokens, key8.text_tokens)
    split = StepForwards((Chunk(key4, 4, 0.0), Chunk(None, 3, 0.0)), home=key8)
    one = [pipe.start(pipe.validator.validate(r)) for r in reqs]
    two = [pipe.start(pipe.validator.validate(r)) for r in reqs]
    while not all(s.done for s in one):
        pipe.step(one, pipe.decider.for_states(one))
        pipe.step(two, split)
    for x, y in zip(one, two, strict=True):
        assert_close(x.latents, y.latents)
    with pytest.raises(ValueError, match="the forwards run 4 rows"):
        pipe.step([pipe.start(pipe.validator.validate(reqs[0]))], StepForwards((Chunk(key4, 4, 0.0),)))
    modes = {b["key"]: b["forwards_by_mode"] for b in pipe.metrics.snapshot()["buckets"]}
    assert modes[str(key4)]["static_eager"] >= 2 and modes[str(key8)]["eager"] >= 2  # eager chunks counted


# -- the scheduler ----------------------------------------------------------------------------------

def test_image_does_not_depend_on_company(pipe, make_sched):
    """Alone, or joining three others mid-flight (other steps, step counts, seeds, guidance): the same image."""
    probe = _req(prompt="a green pyramid", seed=11, steps=3, n=2)
    others = [_req(seed=20, steps=6), _req(prompt="a lamp", seed=21, steps=5, guidance=2.5),
              _req(seed=22, steps=4, n=3)]

    async def main():
        sched = make_sched()
        log = StepLog(pipe)
        alone = await sched.submit(probe)
        first = await submit_together(sched, others)
        while len(log.steps) < 4:  # the others are two or more steps in
            await asyncio.sleep(0.01)
        joined = await sched.submit(probe)
        await asyncio.gather(*first)
        return alone, joined, log

    alone, joined, log = run(main())
    probe_steps = [states for states, _ in log.steps if any(seed == 11 for seed, _, _ in states)]
    shared = [states for states in probe_steps[3:] if len(states) > 1]  # the joined run's steps
    assert shared and any(len({i for _, i, _ in states}) > 1 for states in shared)  # at different steps
    assert joined.batch_size > 1 and alone.batch_size == 1
    for a, b in zip(alone.image_bytes, joined.image_bytes, strict=True):
        assert same_image(a, b)
    reference = pipe.generate(pipe.validator.validate(probe))  # the request-level path agrees too
    for a, b in zip(alone.image_bytes, reference.image_bytes, strict=True):
        assert same_image(a, b)
    assert not same_image(alone.image_bytes[0], alone.image_bytes[1])  # the tolerance discriminates (seed + 1)


def test_cancel_mid_flight_frees_the_rows_at_the_next_step(pipe, make_sched):
    long, short = _req(seed=5, steps=40, n=2), _req(prompt="a small boat", seed=6, steps=4)

    async def main():
        sched = make_sched()
        log = StepLog(pipe)
        long_task, short_task = await submit_together(sched, [long, short])
        while len(log.steps) < 2:
            await asyncio.sleep(0.01)
        long_task.cancel()
        cancelled_at = len(log.steps)
        with pytest.raises(asyncio.CancelledError):
            await long_task
        result = await short_task
        for _ in range(200):  # the scheduler retires the cancelled request at its next step boundary
            if sched.stats()["rows_in_flight"] == 0:
                break
            await asyncio.sleep(0.02)
        return sched, log, cancelled_at, result

    sched, log, cancelled_at, result = run(main())
    with_long = [i for i, (states, _) in enumerate(log.steps) if any(seed == 5 for seed, _, _ in states)]
    assert max(with_long) <= cancelled_at  # at most the step already under way when it was cancelled
    assert len(with_long) < 40
    st = sched.stats()
    assert st["rows_in_flight"] == 0 and st["running"] == 0 and st["bytes_in_flight"] == 0
    assert st["shapes"][SHAPE]["cancelled"] == 1 and st["shapes"][SHAPE]["completed"] == 1
    for a, b in zip(result.image_bytes, pipe.generate(pipe.validator.validate(short)).image_bytes, strict=True):
        assert same_image(a, b)


def test_a_cancelled_waiting_request_never_starts(pipe, make_sched):
    async def main():
        sched = make_sched(max_rows=2)
        log = StepLog(pipe)
        first, second = await submit_together(sched, [_req(seed=7, steps=4, n=2), _req(seed=8, steps=2, n=2)])
        await asyncio.sleep(0.05)
        second.cancel()  # still waiting: the first holds every row
        await first
        with pytest.raises(asyncio.CancelledError):
            await second
        return sched, log

    sched, log = run(main())
    assert all(seed != 8 for states, _ in log.steps for seed, _, _ in states)
    assert sched.stats()["waiting"] == 0


def test_admission_bounds_rows_and_lets_a_larger_request_run_alone(pipe, make_sched):
    reqs = [_req(seed=30 + i, steps=2, n=2) for i in range(3)] + [_req(seed=40, steps=1, n=3, guidance=2.0)]

    async def main():
        sched = make_sched(max_rows=4)
        log = StepLog(pipe)
        results = await asyncio.gather(*await submit_together(sched, reqs))
        return sched, log, results

    sched, log, results = run(main())
    assert len(results) == 4 and all(len(r.image_bytes) == r_.n for r, r_ in zip(results, reqs, strict=True))
    rows = log.rows_per_step()
    six = [i for i, (states, _) in enumerate(log.steps) if any(seed == 40 for seed, _, _ in states)]
    assert all(r <= 4 for i, r in enumerate(rows) if i not in six)
    assert [rows[i] for i in six] == [6]  # above the row budget: admitted alone, when nothing else ran
    assert len(log.steps[six[0]][0]) == 1


def test_an_incompatible_head_does_not_block_other_shapes(pipe, make_sched):
    """The head request (4 rows) does not fit beside a running 2-row request; a later 1-row request of
    another shape is admitted past it, and the head gets in once the rows are free (FIFO within its shape)."""
    running, head = _req(seed=50, steps=6, n=2), _req(seed=51, steps=1, n=4)
    other = _req(seed=52, steps=2, width=256, height=512)

    async def main():
        sched = make_sched(max_rows=5, fair_wait_s=60.0)
        log = StepLog(pipe)
        tasks = await submit_together(sched, [running, head, other])
        results = await asyncio.gather(*tasks)
        return log, results

    log, results = run(main())
    first_step = {}
    for i, (states, _) in enumerate(log.steps):
        for seed, _, _ in states:
            first_step.setdefault(seed, i)
    assert first_step[52] < first_step[51]  # the other shape went past the blocked head
    assert first_step[50] == 0


def _hot_and_rare(pipe, make_sched, fair_s: float):
    """Scripted arrivals: hot 256x256 requests of 2 rows, staggered (2 steps each, the second 3), so that one
    finishes at every step boundary and at most 2 of the 4 rows are ever free; a rare 256x512 request of 4 rows arrives
    third. Returns the step log and the rare request's result."""
    hot = [_req(seed=60 + i, steps=3 if i == 1 else 2, n=2) for i in range(10)]  # one finishes every step
    rare = _req(seed=99, steps=2, width=256, height=512, n=4)

    async def main():
        sched = make_sched(max_rows=4, fair_wait_s=fair_s)
        log = StepLog(pipe)
        tasks = await submit_together(sched, [hot[0], hot[1], rare, *hot[2:]])
        results = await asyncio.gather(*tasks)
        return sched, log, results[2]

    return run(main())


def _first_steps(log: StepLog) -> dict[int, int]:
    first: dict[int, int] = {}
    for i, (states, _) in enumerate(log.steps):
        for seed, _, _ in states:
            first.setdefault(seed, i)
    return first


def test_a_rare_shape_is_admitted_within_its_bound_under_a_hot_shape(pipe, make_sched):
    fair_s = 0.3
    sched, log, rare = _hot_and_rare(pipe, make_sched, fair_s)
    first = _first_steps(log)
    # the bound: past fair_s no later request is admitted, so it waits at most fair_s plus the time the
    # requests already running take to finish (at most 3 steps of 2 requests here)
    longest_hot_ms = 3 * max(ms for ms in log.step_ms) * 2
    assert rare.timings_ms["queue"] <= fair_s * 1e3 + longest_hot_ms + 500
    assert first[99] < max(first[s] for s in range(60, 70))  # admitted before the hot stream ran out
    assert sched.stats()["shapes"]["i512_t256"]["queue_wait_ms"]["max"] == pytest.approx(rare.timings_ms["queue"],
                                                                                            abs=1.0)


def test_without_the_bound_the_rare_request_would_wait_for_the_whole_hot_stream(pipe, make_sched):
    """The control for the test above: with an unbounded wait, every hot request is admitted past it."""
    _, log, _ = _hot_and_rare(pipe, make_sched, fair_s=1e4)
    first = _first_steps(log)
    assert first[99] > max(first[s] for s in range(60, 70))


def test_decode_batches_finished_requests_of_one_size(pipe, make_sched, monkeypatch):
    calls = []
    decode = pipe.model.decode

    def counting(state):
        calls.append(state.n)
        return decode(state)

    monkeypatch.setattr(pipe.model, "decode", counting)
    reqs = [_req(seed=80, steps=2, n=2), _req(seed=81, steps=2, n=1),
            _req(seed=82, steps=2, n=1, width=256, height=512)]

    async def main():
        sched = make_sched(decode_batch_images=8)
        return await asyncio.gather(*await submit_together(sched, reqs))

    results = run(main())
    assert sorted(calls) == [1, 3]  # the two 256x256 requests in one decode call, the 256x512 one apart
    monkeypatch.setattr(pipe.model, "decode", decode)
    for r, req in zip(results, reqs, strict=True):
        for a, b in zip(r.image_bytes, pipe.generate(pipe.validator.validate(req)).image_bytes, strict=True):
            assert same_image(a, b)
        assert set(r.timings_ms) == {"queue", "encode", "denoise", "decode", "image_encode", "total"}


def test_a_failing_forward_fails_its_step_only_and_serving_goes_on(pipe, make_sched, monkeypatch):
    real_run = pipe.runner.run
    armed = threading.Event()
    armed.set()

    def flaky(key, inputs, eager=False):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return real_run(key, inputs, eager=eager)

    monkeypatch.setattr(pipe.runner, "run", flaky)

    async def main():
        sched = make_sched()
        first = await asyncio.gather(*await submit_together(sched, [_req(seed=90), _req(seed=91)]),
                                     return_exceptions=True)
        after = await sched.submit(_req(seed=92))
        return sched, first, after

    sched, first, after = run(main())
    assert all(isinstance(r, RuntimeError) and "simulated" in str(r) for r in first)
    assert len(after.image_bytes) == 1
    st = sched.stats()
    assert st["shapes"][SHAPE]["failed"] == 2 and st["rows_in_flight"] == 0 and st["running"] == 0


def test_nan_latents_fail_their_request_loudly_and_serving_goes_on(pipe, make_sched, monkeypatch):
    """A forward that returns NaN (a broken kernel, adapter or checkpoint) never becomes an image: decoded, NaN
    turns quietly into a black picture. Its request fails with ``NonFiniteOutput``, the request decoded beside it
    is answered, later requests are served, and ``DiTPipeline.generate`` refuses it the same way."""
    from bcg_core.errors import NonFiniteOutput

    real_run = pipe.runner.run
    poisoned = threading.Event()
    poisoned.set()

    def nan_rows(key, inputs, eager=False):
        out = real_run(key, inputs, eager=eager)
        return out.clone().fill_(float("nan")) if poisoned.is_set() else out

    monkeypatch.setattr(pipe.runner, "run", nan_rows)

    async def main():
        sched = make_sched()
        bad = await asyncio.gather(sched.submit(_req(seed=93)), return_exceptions=True)
        poisoned.clear()
        after = await sched.submit(_req(seed=94))
        return sched, bad[0], after

    sched, bad, after = run(main())
    assert isinstance(bad, NonFiniteOutput) and "NaN or inf values (100.0% of them)" in str(bad)
    assert len(after.image_bytes) == 1
    st = sched.stats()
    assert st["shapes"][SHAPE]["failed"] == 1 and st["rows_in_flight"] == 0 and st["running"] == 0
    poisoned.set()
    with pytest.raises(NonFiniteOutput):
        pipe.generate(pipe.validator.validate(_req(seed=95)))


def test_a_nan_request_fails_alone_in_a_batched_decode(pipe):
    """In one decode batch (two requests of one size, one VAE call) only the request with inf latents fails; its
    company's images go on to their encode."""
    from types import SimpleNamespace

    from bcg_core.errors import NonFiniteOutput
    from bcg_core.scheduler.finish import Finisher

    failed, encoded, released = [], [], []
    fin = Finisher(pipe, decode_batch_images=8, encode_threads=1, release=released.append,
                   fail=lambda item, e, **kw: failed.append((item, e, kw)), done=None)
    fin._encode = lambda item, images: encoded.append((item, len(images)))
    validated_requests = [pipe.validator.validate(_req(seed=s)) for s in (96, 97)]
    items = [SimpleNamespace(cancel=threading.Event(), validated=p, state=pipe.start(p), done_event=None, decoded=0.0)
             for p in validated_requests]
    with torch.inference_mode():
        items[1].state.latents[0, 0].fill_(float("inf"))
    fin._decode(items)
    (item, error, kw), = failed
    assert item is items[1] and isinstance(error, NonFiniteOutput) and kw == {"failed": True}
    assert encoded == [(items[0], 1)] and released == [items[0], items[1]]
    with pytest.raises(NonFiniteOutput, match="NaN or inf"):
        pipe.finish(items[1].state)
    fin.close(1.0)


def test_memory_budget_bounds_admission(pipe, make_sched):
    async def main():
        sched = make_sched(memory_budget_bytes=1)  # below one request's tensors: one at a time once measured
        log = StepLog(pipe)
        await sched.submit(_req(seed=100, steps=1))  # measures the group's bytes per row
        results = await asyncio.gather(*await submit_together(sched, [_req(seed=101 + i, steps=2) for i in range(3)]))
        return log, results

    log, results = run(main())
    assert len(results) == 3
    assert all(len(states) == 1 for states, _ in log.steps)  # never two requests in flight


def test_burst_of_real_size_requests_all_answered_same_seed_same_image(tiny, make_sched):
    """The first krea requests at their own sizes and image counts, all at once on the default table, with a
    row budget below the burst: every one is answered (none lost, none hung), and two of them again alone
    give the same images."""
    from deployments.cli.demo import load_requests

    pipe = DiTPipeline(ServeConfig(), tiny)
    demo = load_requests(8)
    reqs = [GenerationRequest(d.prompt, n=d.n, width=d.width, height=d.height, num_inference_steps=1,
                              guidance_scale=1.0, seed=d.seed) for d in demo]

    async def main():
        sched = ValidatingScheduler(pipe, max_rows=12)
        try:
            results = await asyncio.gather(*[sched.submit(r) for r in reqs])
            again = [await sched.submit(reqs[i]) for i in (0, len(reqs) - 1)]
            return sched.stats(), results, again
        finally:
            sched.close()

    stats, results, again = run(main())
    assert [len(r.image_bytes) for r in results] == [r.n for r in reqs]
    assert stats["waiting"] == 0 and stats["running"] == 0 and stats["rows_in_flight"] == 0
    assert sum(s["completed"] for s in stats["shapes"].values()) == len(reqs) + 2
    for r, i in zip(again, (0, len(reqs) - 1), strict=True):
        for a, b in zip(r.image_bytes, results[i].image_bytes, strict=True):
            assert same_image(a, b)


def test_stats_show_forwards_fill_waste_and_queue_wait(pipe, make_sched):
    costs = CostModel.token_model(pipe.table.keys, graphs=True)  # graphs: padding is worth it here

    async def main():
        sched = make_sched(costs=costs)
        await asyncio.gather(*await submit_together(sched, [_req(seed=110, n=3), _req(seed=111, n=2)]))
        return sched.stats()

    st = run(main())
    shape = st["shapes"][SHAPE]
    assert set(shape["forwards"]) == set(FORWARD_KINDS)
    assert sum(shape["forwards"].values()) >= 2 and shape["steps"] == 2
    assert 0 < shape["fill"] <= 1 and 0 <= shape["padded_token_waste"] < 1
    assert shape["queue_wait_ms"]["p50"] is not None and shape["admitted"] == 2
    assert st["costs"]["source"] == "token-count" and st["kind"] == "step"
    assert st["padded_token_waste"] == pytest.approx(1 - st["real_tokens"] / st["computed_tokens"], abs=1e-4)


def test_measured_costs_on_the_cpu(pipe, monkeypatch):
    """Bucket and eager times on the CPU; each eager forward runs under the runner's gate, which a capture on the
    denoising thread holds (a replica measures after ready, in a worker thread, while captures go on: the eager
    measurement's device-wide synchronizations would invalidate one, ``bcg_core/costs/measure.py``)."""
    keys = [k for k in pipe.table.keys if k.shape == SHAPE]
    gate_held, inner = [], pipe.model.adapter.forward_eager

    def forward_eager(inputs):
        def try_gate():  # from another thread, as the denoising thread would ask for it
            got = pipe.runner.gate.acquire(blocking=False)
            if got:
                pipe.runner.gate.release()
            gate_held.append(not got)

        t = threading.Thread(target=try_gate)
        t.start()
        t.join()
        return inner(inputs)

    monkeypatch.setattr(pipe.model.adapter, "forward_eager", forward_eager)
    costs = pipe.measure_costs(keys, iters=1)
    assert gate_held and all(gate_held), gate_held
    assert costs.source == "measured"
    assert set(costs.bucket_ms) == set(keys) and all(v > 0 for v in costs.bucket_ms.values())
    assert sorted(costs.eager_ms[SHAPE]) == [1, 2, 4, 8]
    assert costs.choose(SHAPE, 3, keys).rows == 3


def test_the_scheduler_measures_costs_where_runner_measure_costs_asks(tiny):
    """``StepScheduler.measure_costs`` (a replica calls it after each capture): ``auto`` measures only with CUDA
    graphs, so not on a CPU, ``never`` never, ``always`` here too, and the times are then the decider's."""
    keys = [k for k in DiTPipeline(CONFIG, tiny).table.keys if k.shape == SHAPE][:1]
    for how, measured in (("auto", False), ("never", False), ("always", True)):
        config = CONFIG.model_copy(update={"scheduler": CONFIG.scheduler.model_copy(update={"measure_costs": how})})
        sched = StepScheduler.from_pipeline(DiTPipeline(config, tiny))
        try:
            assert sched.measure_costs(keys) is measured
            assert (sched.costs.source == "measured") is measured, sched.costs.source
        finally:
            sched.close()


def test_backpressure_follows_the_scheduler_capacity():
    step = backpressure_limits(ServeConfig())
    assert (step.batch_capacity, step.dit_max_ongoing) == (32, 64)  # 64 rows / 2 rows per default request
    one_row_table = ServeConfig.model_validate({"buckets": {"batch_sizes": [1]}})
    assert backpressure_limits(one_row_table).dit_max_ongoing == 64  # no longer 2: the table does not bound it
    set_requests = ServeConfig.model_validate({"scheduler": {"max_requests": 10}})
    assert backpressure_limits(set_requests).dit_max_ongoing == 10
    with pytest.raises(ValueError, match="scheduler"):  # the request-level scheduler is gone: a clear config error
        ServeConfig.model_validate({"runner": {"scheduler": "request"}})


def test_close_answers_whatever_is_left(pipe):
    async def main():
        sched = ValidatingScheduler(pipe, max_rows=2)
        tasks = await submit_together(sched, [_req(seed=120, steps=30, n=2), _req(seed=121, steps=1, n=2)])
        await asyncio.sleep(0.1)
        await asyncio.to_thread(sched.close)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, RequestCancelled) for r in results)


def test_a_request_above_the_largest_bucket_is_split_across_buckets(pipe, make_sched):
    """10 rows (5 images with guidance) on a table whose largest bucket is 8 (a miss in the batch dimension only):
    the step scheduler runs it in its shape's buckets, split."""
    big = _req(seed=130, n=5, guidance=2.0, steps=2)
    validated = pipe.validator.validate(big)
    assert not validated.lookup.hit and [d.value for d in validated.lookup.missed] == ["batch"]
    assert validated.shape == BucketKey(8, 256, T).shape

    async def main():
        sched = make_sched(costs=_scripted({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0}, {1: 5.0, 8: 40.0}))
        log = StepLog(pipe)
        return sched, log, await sched.submit(big)

    sched, log, result = run(main())
    assert result.hit and str(result.bucket) == "b8_i256_t256" and result.missed == []
    assert [[(c.key.batch, c.rows) for c in p.chunks] for _, p in log.steps] == [[(8, 8), (2, 2)]] * 2
    assert sched.stats()["shapes"][SHAPE]["decisions"]["split"] == 2
    for a, b in zip(result.image_bytes, pipe.generate(pipe.validator.validate(big)).image_bytes, strict=True):
        assert same_image(a, b)


ONE_ROW = ServeConfig(buckets=BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[T]))
"""A table of one 1-row bucket (256 + T tokens), as a replica that owns only small buckets, or the naive server."""


@pytest.fixture
def one_row(tiny):
    return DiTPipeline(ONE_ROW, tiny)


def _served_miss(pipe: DiTPipeline, request: GenerationRequest):
    """``request`` through a step scheduler on ``pipe``: its steps' forwards as ``[(key, rows)]``, its result, and
    the forwards it added to the metrics' ``misses.forwards``."""
    before = pipe.metrics.snapshot()["misses"]["forwards"]

    async def main():
        sched = ValidatingScheduler(pipe)
        try:
            log = StepLog(pipe)
            return log, await sched.submit(request)
        finally:
            sched.close()

    log, result = run(main())
    plans = [[(c.key, c.rows) for c in p.chunks] for _, p in log.steps]
    return plans, result, pipe.metrics.snapshot()["misses"]["forwards"] - before


def test_a_one_row_replica_serves_an_18_row_miss_in_one_forward_a_step(one_row):
    """9 images at 384x256 with guidance: 18 rows of 384 + T tokens beside a largest forward of 1 x (256 + T). Cut
    to fit the largest bucket forward, it ran as 18 forwards a step; on a CPU nothing bounds a miss's memory, so
    each step is one unpadded eager forward of all 18 rows."""
    big = _req(seed=132, n=9, width=384, height=256, guidance=2.0, steps=2)
    validated = one_row.validator.validate(big)
    assert validated.shape is None and validated.rows == 18 and validated.lookup.query.tokens_per_row == 384 + T
    assert one_row.decider.miss.spare_bytes is None and one_row.decider.miss.bytes_per_row_token is None
    plans, result, forwards = _served_miss(one_row, big)
    assert plans == [[(None, 18)]] * 2 and forwards == 2
    assert len(result.image_bytes) == 9


def test_a_miss_too_large_for_the_spare_memory_is_chunked_and_its_images_are_unchanged(one_row):
    """The same 18-row miss with a scripted memory bound: 1,000 bytes per row-token and room for 6.5 rows beyond
    the margin (1 GiB of spare memory is the margin: :data:`~bcg_core.costs.miss_memory.MARGIN_BYTES`) runs as
    3 even chunks of 6 rows a step, and its images equal the one-forward run's."""
    big = _req(seed=132, n=9, width=384, height=256, guidance=2.0, steps=2)
    whole_plans, whole, _ = _served_miss(one_row, big)
    assert whole_plans == [[(None, 18)]] * 2
    per_row = 1000 * (384 + T)
    one_row.decider.miss.set_bytes_per_row_token(1000)
    one_row.decider.miss.spare_bytes = lambda: MARGIN_BYTES + int(6.5 * per_row)
    assert one_row.decider.miss.usable_bytes() == int(6.5 * per_row)
    plans, chunked, forwards = _served_miss(one_row, big)
    assert plans == [[(None, 6), (None, 6), (None, 6)]] * 2 and forwards == 6
    for a, b in zip(chunked.image_bytes, whole.image_bytes, strict=True):
        assert same_image(a, b)
    one_row.decider.miss.spare_bytes = lambda: MARGIN_BYTES + 18 * per_row  # room for all 18: one forward again
    assert [c.rows for c in one_row.decider.decide(None, 18, 384 + T).chunks] == [18]


def _slow_decode(pipe, monkeypatch, seconds: float) -> threading.Event:
    decode, entered = pipe.model.decode, threading.Event()

    def slow(state):
        entered.set()
        time.sleep(seconds)
        return decode(state)

    monkeypatch.setattr(pipe.model, "decode", slow)
    return entered


def test_close_during_decode_answers_every_caller(pipe, monkeypatch):
    sched = ValidatingScheduler(pipe, encode_threads=1)
    entered = _slow_decode(pipe, monkeypatch, 1.0)

    async def main():
        tasks = [asyncio.ensure_future(sched.submit(_req(seed=140 + i, steps=1, n=3))) for i in range(2)]
        while not entered.is_set():
            await asyncio.sleep(0.01)
        await asyncio.to_thread(sched.close, 5.0)
        done, pending = await asyncio.wait(tasks, timeout=10)
        return [t.exception() for t in done], pending

    errors, pending = run(main())
    assert not pending and all(isinstance(e, RequestCancelled) for e in errors)
    assert sched.stats()["rows_in_flight"] == 0 and sched.stats()["bytes_in_flight"] == 0


def test_queue_lengths_count_requests_being_decoded(pipe, make_sched, monkeypatch):
    sched = make_sched()
    entered = _slow_decode(pipe, monkeypatch, 1.0)

    async def main():
        task = asyncio.ensure_future(sched.submit(_req(seed=150, steps=1, n=2)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        during = sched.queue_lengths()
        await task
        return during, sched.queue_lengths()

    during, after = run(main())
    assert during == {SHAPE: 1} and after == {}


@pytest.mark.parametrize("size", [256, 512], ids=["bucket", "miss"])
def test_the_memory_budget_holds_for_the_first_burst_of_a_group(pipe, make_sched, monkeypatch, size):
    """A burst of one bucket group, and a burst of misses (512x512: each miss a group of its own, their bytes
    remembered per row-token under one key, so the budget holds for them too and the estimates stay one)."""
    from bcg_core.scheduler.admission import MISS_KEY, tensor_bytes as _tensor_bytes

    first = _req(width=size, height=size, seed=0)
    assert pipe.validator.validate(first).lookup.hit == (size == 256)
    with torch.inference_mode():
        one = _tensor_bytes(pipe.start(pipe.validator.validate(first)))
    sched = make_sched(memory_budget_bytes=int(1.5 * one))
    _slow_decode(pipe, monkeypatch, 0.2)  # decoded requests still hold their tensors for a while
    peak = [0]
    step = pipe.step

    def watched(states, plan=None):
        peak[0] = max(peak[0], sched.flight.bytes)
        return step(states, plan)

    monkeypatch.setattr(pipe, "step", watched)

    async def main():
        reqs = [_req(width=size, height=size, seed=160 + i, steps=2) for i in range(6)]
        return await asyncio.gather(*await submit_together(sched, reqs))

    assert len(run(main())) == 6
    assert 0 < peak[0] <= 1.5 * one
    if size == 512:
        assert list(sched.flight.admission._bytes_per_unit) == [MISS_KEY]


def test_a_burst_of_arrivals_does_not_stall_the_requests_in_flight(pipe, make_sched, monkeypatch):
    """Starts (text encoding, noise) of a burst are spread over step boundaries: a request in flight waits
    about one iteration per boundary, not for every start at once."""
    sched = make_sched()
    stamps = []
    step = pipe.step

    def watched(states, plan=None):
        if any(s.request.seed == 999 for s in states):
            stamps.append(time.perf_counter())
        return step(states, plan)

    monkeypatch.setattr(pipe, "step", watched)

    async def main():
        long = asyncio.ensure_future(sched.submit(_req(seed=999, steps=10, width=256, height=512)))
        while len(stamps) < 3:
            await asyncio.sleep(0.01)
        burst = [asyncio.ensure_future(sched.submit(_req(prompt=f"b{i}", seed=i, steps=1))) for i in range(40)]
        await asyncio.gather(long, *burst)

    run(main())
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    assert gaps[-1] < 10 * gaps[len(gaps) // 2], (f"largest gap {gaps[-1] * 1e3:.0f} ms, "
                                                  f"median {gaps[len(gaps) // 2] * 1e3:.0f} ms")


def test_counters_stay_consistent_with_cancellations_everywhere(pipe, make_sched):
    async def main():
        sched = make_sched(max_rows=4)
        tasks = await submit_together(sched, [_req(seed=170 + i, steps=3, n=2) for i in range(6)])
        await asyncio.sleep(0.15)
        for t in tasks[1::2]:
            t.cancel()  # some running, some waiting
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return sched.stats(), results

    stats, results = run(main())
    shape = stats["shapes"][SHAPE]
    served = sum(1 for r in results if not isinstance(r, BaseException))
    assert shape["completed"] == served and served >= 3
    assert shape["admitted"] == shape["completed"] + shape["cancelled"] + shape["failed"]
    assert shape["cancelled"] + shape["cancelled_waiting"] == 6 - served
    assert "batch_totals" not in pipe.stats()  # the request-level batcher's counters are gone


def test_the_validator_routes_and_accepts_rows_above_the_largest_bucket(tiny):
    """Under ``miss_policy: reject`` a request above the largest batch bucket is validated with its shape (the step
    scheduler splits its rows), which routes it to its shape's owners; an image miss is refused."""
    from bcg_core.errors import BucketMissError
    from bcg_core.validation import RequestValidator
    from deployments.routing import bucket_shape

    buckets = {"batch_sizes": [1, 2, 4, 8], "resolutions": ["256x256"], "text_lengths": [T], "miss_policy": "reject"}
    big = _req(n=5, guidance=2.0)  # 10 rows
    step = RequestValidator(ServeConfig.model_validate({"buckets": buckets}), tiny.spec, tiny.count_tokens)
    validated = step.validate(big)
    assert not validated.lookup.hit and validated.shape == BucketKey(8, 256, T).shape
    assert bucket_shape(validated) == SHAPE
    wide = _req(width=512, height=512)  # an image miss is refused by both
    with pytest.raises(BucketMissError):
        step.validate(wide)


def test_the_scheduler_trims_the_heap_once_idle(make_sched):
    """Once its last request is answered the scheduler hands the C heap's free memory back
    (bcg_core/scheduler/memtrim.py: without it a CPU replica's memory at rest follows its largest requests); None turns
    it off."""
    async def main(sched):
        await sched.submit(_req(seed=3, steps=1))

    sched = make_sched(trim_idle_s=0.05)
    run(main(sched))
    for _ in range(200):
        if sched.stats()["memory_trim"]["trims"] >= 1:
            break
        time.sleep(0.02)
    assert sched.stats()["memory_trim"]["trims"] == 1
    off = make_sched(trim_idle_s=None)
    run(main(off))
    assert off.stats()["memory_trim"] is None


def test_a_request_cancelled_between_admission_and_start_does_not_hold_back_its_group(pipe, make_sched, monkeypatch):
    """The first request of a new group is admitted alone (its tensors give the group's estimate); cancelled after
    admission, before its start, it must free the group as a failed start does, else every later request of the
    shape waits until ``max_queue_wait_s`` (then 503) under a memory budget."""
    from bcg_core.errors import ServiceUnavailable
    from bcg_core.scheduler.admission import Admission

    sched = make_sched(memory_budget_bytes=1 << 40, max_queue_wait_s=3.0)
    admit = Admission.admit
    cancelled = []

    def admit_then_cancel(self, rows, nbytes, now):
        out = admit(self, rows, nbytes, now)
        for item in out.start:
            if item.validated.request.seed == 71 and not cancelled:
                item.cancel.set()  # its caller goes away right after admission
                cancelled.append(item)
        return out

    monkeypatch.setattr(Admission, "admit", admit_then_cancel)

    async def main():
        first = await asyncio.gather(sched.submit(pipe.validator.validate(_req(seed=71, width=512, height=256))),
                                     return_exceptions=True)
        t0 = time.perf_counter()
        second = await sched.submit(pipe.validator.validate(_req(seed=72, width=512, height=256)))
        return first, second, time.perf_counter() - t0

    first, second, waited = run(main())
    assert cancelled and isinstance(first[0], RequestCancelled)
    assert not isinstance(second, ServiceUnavailable) and len(second.image_bytes) == 1 and waited < 2.5
