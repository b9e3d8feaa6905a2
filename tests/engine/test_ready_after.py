"""A replica reports ready once ``runner.ready_after_s`` of capture has passed, with its largest shapes captured, and
captures the rest in the background; a request of a shape not captured yet is served at once (unpadded), with the
image it gets once its shape is captured (``deployments/dit.py``, ``deployments/replica/model.py``, no Ray)."""

import asyncio
import io

import numpy as np
from PIL import Image

from bcg_core import BucketConfig, GenerationRequest, RequestValidator
from bcg_core.config import EngineConfig, RunnerConfig
from tests.engine.test_replica_cancel import make_replica

TABLE = BucketConfig(batch_sizes=[1, 2], resolutions=["256x256", "512x512"])
SMALL = GenerationRequest("a lighthouse at dusk", n=2, width=256, height=256, num_inference_steps=2, seed=5)


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def test_a_replica_past_ready_after_s_is_ready_with_its_largest_shape_and_serves_the_others_meanwhile():
    config = EngineConfig(buckets=TABLE, runner=RunnerConfig(ready_after_s=0.0))
    request = RequestValidator.from_config(config).validate(SMALL)

    async def scenario():
        replica = await make_replica(config.model_dump(mode="json"))
        model = replica._model  # its ReplicaModel: the shapes, the capture lock and task
        order = sorted(model.shapes, key=lambda s: -max(k.tokens for k in model.by_shape[s]))
        large, every = order[0], sorted(order)
        assert len(order) > 1 and str(request.shape) in order[1:]
        view = await replica.record_routing_stats()
        # one shape captured (the largest), the others left to the background task, which has not run yet
        assert view["owned"] == every and view["ready"] == [large] and view["capturing"]
        model.capture_lock.acquire()  # hold the background capture until the request below is served
        try:
            before = await replica.generate(request)
            assert (await replica.record_routing_stats())["ready"] == [large]  # served before its shape was captured
            # on the CPU its bucket's static buffers were allocated on the spot: /v1/buckets counts it
            assert replica.stats()["capture"]["lazy_prepares"] >= 1
        finally:
            model.capture_lock.release()
        await model.capture_task
        assert (await replica.record_routing_stats())["ready"] == every
        assert not (await replica.record_routing_stats())["capturing"]
        after = await replica.generate(request)
        return before, after

    before, after = asyncio.run(scenario())
    assert len(before.image_bytes) == len(after.image_bytes) == 2
    for a, b in zip(before.image_bytes, after.image_bytes, strict=True):  # fp32 on the CPU: unpadded and bucketed agree
        assert np.abs(_pixels(a) - _pixels(b)).max() <= 1


def test_without_ready_after_s_every_shape_is_captured_before_ready():
    config = EngineConfig(buckets=TABLE, runner=RunnerConfig(ready_after_s=None))

    async def scenario():
        replica = await make_replica(config.model_dump(mode="json"))
        return (await replica.record_routing_stats()), replica._model.capture_task

    view, task = asyncio.run(scenario())
    assert view["ready"] == view["owned"] and len(view["owned"]) > 1 and task is None


def test_costs_of_the_shapes_captured_before_ready_are_timed_after_it():
    from bcg_core.config import SchedulerConfig

    config = EngineConfig(buckets=TABLE, runner=RunnerConfig(ready_after_s=0.0),
                          scheduler=SchedulerConfig(measure_costs="always"))

    async def scenario():
        replica = await make_replica(config.model_dump(mode="json"))
        model = replica._model
        order = sorted(model.shapes, key=lambda s: -max(k.tokens for k in model.by_shape[s]))
        at_ready = (list(model.unmeasured), model.costs_s, replica.stats()["start"]["costs_s"])
        await model.capture_task
        measured = set(model.scheduler.costs.bucket_ms)
        return order, at_ready, model.unmeasured, model.costs_s, measured, model.by_shape[order[0]]

    order, (unmeasured, costs_s, reported), left, costs_after, measured, large = asyncio.run(scenario())
    assert unmeasured == [order[0]] and costs_s == 0.0 == reported  # nothing timed before ready
    assert left == [] and costs_after > 0.0  # timed by the background task, before it captured the rest
    assert set(large) <= measured
