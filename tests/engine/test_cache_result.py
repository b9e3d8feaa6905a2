"""A finished request reports its step cache (``GenerationResult.cache``, the answer's ``bcg.cache``), on the tiny
default model on the CPU: through the step scheduler (its finish path, :mod:`bcg_core.scheduler.finish`), with the
config's default, a request's own threshold and ``NoCache`` side by side; and through the synchronous
:meth:`~bcg_core.DiTPipeline.generate`. Whether the steps reused are diffusers' own:
``tests/families/test_step_cache.py``."""

from __future__ import annotations

import asyncio

import pytest

from bcg_core import BucketConfig, DiTPipeline, GenerationRequest, build_tiny
from bcg_core.families.tiny import TINY_TEXT_TOKENS
from bcg_core.step_cache import FirstBlockCache, NoCache
from deployments.settings import ServeConfig
from scheduling import ValidatingScheduler

STEPS = 4
CONFIG = ServeConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256"],
                                          text_lengths=[TINY_TEXT_TOKENS]),
                     cache={"default": {"method": "first_block", "threshold": 10.0}})


@pytest.fixture(scope="module")
def pipe():
    return DiTPipeline(CONFIG, build_tiny())


def _req(seed: int, cache=None) -> GenerationRequest:
    return GenerationRequest("a red cube", width=256, height=256, num_inference_steps=STEPS, guidance_scale=1.0,
                             seed=seed, cache=cache)


def test_the_step_schedulers_results_report_each_requests_cache(pipe):
    sched = ValidatingScheduler(pipe)
    try:
        async def together():
            return await asyncio.wait_for(asyncio.gather(
                sched.submit(_req(0)), sched.submit(_req(1, FirstBlockCache(threshold=0.0))),
                sched.submit(_req(2, NoCache()))), 180)

        default, never, plain = asyncio.run(together())
    finally:
        sched.close()
    # threshold 10 (the config's default): every step after the first reuses; 0: every step computes
    assert default.cache == {"method": "first_block", "threshold": 10.0,
                             "steps": {"cond": {"computed": 1, "reused": STEPS - 1}}}
    assert never.cache == {"method": "first_block", "threshold": 0.0,
                           "steps": {"cond": {"computed": STEPS, "reused": 0}}}
    assert plain.cache is None
    assert default.to_dict()["cache"] == default.cache


def test_the_synchronous_generate_reports_the_cache_too(pipe):
    result = pipe.generate(pipe.validator.validate(_req(3)))
    assert result.cache == {"method": "first_block", "threshold": 10.0,
                            "steps": {"cond": {"computed": 1, "reused": STEPS - 1}}}


def test_a_cache_default_leaves_the_fused_steps_start_up_check_on(pipe):
    """The fused step's start-up check runs its own requests without a cache (a cached step never runs fused), so a
    server-wide ``cache.default`` does not turn the fused step off for the requests that run without one."""
    from bcg_core.config import EngineConfig

    config = EngineConfig(buckets=CONFIG.buckets, runner={"fused_step": "always"}, cache=CONFIG.cache)
    fused = DiTPipeline(config, pipe.model)
    info = fused.stats()["fused_step"]
    assert info["enabled"], info["note"]
