"""A DiT replica whose caller goes away stops the work within one denoising step (no Ray needed); its start logs
its progress shape by shape."""

import asyncio
import logging
import time

from bcg_core import BucketConfig, GenerationRequest, RequestValidator
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
    request = RequestValidator.from_config(CONFIG).validate(
        GenerationRequest("a lighthouse", n=1, width=512, height=512, num_inference_steps=50, seed=1))
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

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines, serve_log = Lines(), logging.getLogger("ray.serve")  # the replica's logger, printed by `bcg serve`
    level = serve_log.level
    serve_log.addHandler(lines)
    serve_log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        asyncio.run(cancel_soon())  # asyncio.run waits for the worker thread of to_thread to end
    finally:
        serve_log.removeHandler(lines)
        serve_log.setLevel(level)
    elapsed = time.perf_counter() - t0
    progress = [ln for ln in lines.lines if " ready (2 buckets, " in ln]
    assert [p.rsplit(", ", 1)[1] for p in progress] == [f"{i} of 3 shapes" for i in (1, 2, 3)], lines.lines
    stats = replica.stats()
    forwards = sum(b["forwards"] for b in stats["buckets"])
    assert stats["totals"]["requests"] == 0  # never finished
    assert 0 < forwards < 50, forwards  # started, then stopped well before its 50 steps
    assert elapsed < 40
