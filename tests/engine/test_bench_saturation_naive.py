"""The naive server of ``benchmarks/bench_saturation.py`` runs as a user's own server does: each request step is ONE
unpadded eager forward holding all of that request's rows (its uncond rows with classifier-free guidance included),
and no forward holds rows of two requests.

Its config is built as the benchmark builds it (``base_config`` + ``server_overrides("naive", ...)``: the eager
runner and a one-row, one-tier table every request misses), then served by the step scheduler on the CPU with the
tiny default model, with requests of several image counts in flight together. The benchmark's ratios over naive
(``images_per_s_vs_naive``) are only honest while this holds: when a miss was cut into chunks no larger than the
largest prepared bucket forward, every row of a naive request ran as a forward of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from bcg_core import build_tiny
from benchmark_scripts import load
from scheduling import ValidatingScheduler

bench = load("bench_saturation")

STEPS = 2
SIZES_AND_COUNTS = [(256, 256, 1), (384, 256, 2), (256, 384, 4), (320, 256, 3)]
"""(width, height, n) of the requests: small sizes (a 2-core CPU), several image counts."""
GUIDANCE = 2.0
"""Above 1: classifier-free guidance, an uncond row beside each image's cond row (the tiny default's rule)."""


@pytest.fixture(scope="module")
def naive():
    """``(config, requests)``: the naive server's config for the first krea requests at the sizes and counts above
    (their prompts and seeds), and the engine requests the ingress would make of them, with guidance."""
    from bcg_core.config import ModelConfig
    from bcg_core.models import describe_model, load_tokenizer_counter
    from deployments.settings import ServeConfig

    mc = ModelConfig(device="cpu")
    spec, counter = describe_model(mc), load_tokenizer_counter(mc)
    rows = [dataclasses.replace(r, width=w, height=h, n=n)
            for r, (w, h, n) in zip(bench.replay_requests(len(SIZES_AND_COUNTS)), SIZES_AND_COUNTS, strict=True)]
    base = bench.base_config(mc.model_dump(mode="json"), spec, counter, rows, STEPS)
    config = ServeConfig.model_validate(bench.merge(base, bench.server_overrides("naive", base, spec, rows, 4)))
    reqs = [dataclasses.replace(bench.generation_request(r, STEPS), guidance_scale=GUIDANCE) for r in rows]
    return config, reqs


class ForwardsPerStep:
    """Wraps ``pipe.step`` and ``pipe.runner.run``: per step call, the requests (seeds) whose rows it held, their
    rows, and the rows and keys of each transformer forward it ran."""

    def __init__(self, pipe):
        self.steps: list[dict] = []
        self._local = threading.local()
        step, run = pipe.step, pipe.runner.run

        def counted_step(states, plan=None):
            self._local.forwards = forwards = []
            out = step(states, plan)
            self.steps.append({"seeds": sorted({s.request.seed for s in states}),
                               "rows": sum(s.rows for s in states), "forwards": forwards})
            return out

        def counted_run(key, inputs, *args, **kw):
            forwards = getattr(self._local, "forwards", None)
            if forwards is not None:
                forwards.append((key, inputs.rows))
            return run(key, inputs, *args, **kw)

        pipe.step = counted_step  # instance attributes: this test's pipeline only
        pipe.runner.run = counted_run


def test_a_naive_request_step_runs_one_unpadded_forward_of_all_its_rows(naive):
    from bcg_core import DiTPipeline

    config, reqs = naive
    assert config.runner.mode == "eager" and config.buckets.batch_sizes == [1]
    pipe = DiTPipeline(config, build_tiny())
    validated_requests = [pipe.validator.validate(r) for r in reqs]
    assert all(p.shape is None for p in validated_requests)  # every request misses the naive table
    assert [p.rows for p in validated_requests] == [2 * n for _, _, n in SIZES_AND_COUNTS]  # cond and uncond rows
    counter = ForwardsPerStep(pipe)

    async def main():
        sched = ValidatingScheduler(pipe)
        try:
            with sched.flight.cv:  # every request reaches the queue before the denoising thread admits any
                tasks = [asyncio.ensure_future(sched.submit(p)) for p in validated_requests]
                await asyncio.sleep(0)
            return await asyncio.wait_for(asyncio.gather(*tasks), 300)
        finally:
            sched.close()

    results = asyncio.run(main())
    assert [len(r.image_bytes) for r in results] == [n for _, _, n in SIZES_AND_COUNTS]
    by_seed = {r.seed: p.rows for r, p in zip(reqs, validated_requests, strict=True)}
    assert len(counter.steps) == STEPS * len(reqs)
    for step in counter.steps:
        assert len(step["seeds"]) == 1, f"a naive forward held rows of several requests: {step}"
        assert step["forwards"] == [(None, by_seed[step["seeds"][0]])], f"not one forward of all its rows: {step}"
    assert pipe.metrics.snapshot()["misses"]["forwards"] == STEPS * len(reqs)
