"""A DiT replica whose caller goes away stops the work within one denoising step (no Ray needed)."""

import asyncio
import time

from bcg_core import BucketConfig, GenerationRequest, Planner
from bcg_core.config import EngineConfig
from deployments.dit import DiTReplica

CONFIG = EngineConfig(buckets=BucketConfig(batch_sizes=[1, 2], resolutions=["256x256", "512x512"]))


async def make_replica(config: dict):
    """The replica class outside Serve: its constructor is async."""
    cls = DiTReplica.func_or_class
    replica = cls.__new__(cls)
    await replica.__init__(config)
    return replica


def test_cancelling_a_generate_call_stops_its_worker_thread_early():
    request = Planner.from_config(CONFIG).plan(GenerationRequest("a lighthouse", n=1, width=512, height=512,
                                                                 num_inference_steps=50, seed=1))
    replica = None

    async def cancel_soon():
        nonlocal replica
        replica = await make_replica(CONFIG.model_dump(mode="json"))
        task = asyncio.create_task(replica.generate(request))
        for _ in range(400):  # cancel once the denoising loop has started (first import of diffusers is slow)
            await asyncio.sleep(0.05)
            if sum(b["forwards"] for b in replica.stats()["buckets"]) > 0:
                break
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    t0 = time.perf_counter()
    asyncio.run(cancel_soon())  # asyncio.run waits for the worker thread of to_thread to end
    elapsed = time.perf_counter() - t0
    stats = replica.stats()
    forwards = sum(b["forwards"] for b in stats["buckets"])
    assert stats["totals"]["requests"] == 0  # never finished
    assert 0 < forwards < 50, forwards  # started, then stopped well before its 50 steps
    assert elapsed < 40
