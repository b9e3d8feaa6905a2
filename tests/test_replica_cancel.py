"""A DiT replica whose caller goes away stops the work within one denoising step (no Ray needed)."""

import asyncio
import time

from bcg_core import BucketConfig, ServeConfig
from deployments.dit import DiTReplica

CONFIG = ServeConfig(buckets=BucketConfig(batch_sizes=[1, 2], resolutions=["256x256", "512x512"]))


def test_cancelling_a_generate_call_stops_its_worker_thread_early():
    replica = DiTReplica.func_or_class(CONFIG.model_dump(mode="json"))
    request = {"prompt": "a lighthouse", "n": 1, "width": 512, "height": 512, "num_inference_steps": 50, "seed": 1}

    async def cancel_soon():
        task = asyncio.create_task(replica.generate(request))
        await asyncio.sleep(1.0)
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
    assert elapsed < 30
