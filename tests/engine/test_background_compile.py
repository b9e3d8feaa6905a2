"""Ready first, compiled later (``bcg_core/runners/background.py``): with compiled kernels and a cold compile cache a
replica's buckets serve eager kernels at once, compile on a background thread while requests are served, and are
swapped in between forwards; a warm cache is compiled from the start; a compile that fails leaves eager kernels.

On the CPU (inductor's C++ backend) with the tiny default and a two-bucket table: seconds per compile on 2 cores."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from bcg_core import BucketConfig, EngineConfig, GenerationRequest
from bcg_core.config import RunnerConfig
from bcg_core.models import load_model
from bcg_core.pipeline import DiTPipeline, installed_kernels
from bcg_core.runners.background import BackgroundCompiles, compile_pending, reserved_cpus
from bcg_core.runners.kernels import CompiledKernels
from bcg_core.runners.precompiled import available as precompiled_available
from bcg_core.scheduler.step_scheduler import StepScheduler

TABLE = BucketConfig(batch_sizes=[1, 2], resolutions=["256x256"], text_lengths=[256])
REQUEST = GenerationRequest("a lighthouse at dusk", n=2, width=256, height=256, num_inference_steps=2, seed=3)


def _config(cache: str, **runner) -> EngineConfig:
    return EngineConfig(buckets=TABLE, runner=RunnerConfig(kernels="compiled", compile_cache_dir=cache, **runner))


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def _deferred(config: EngineConfig) -> DiTPipeline:
    pipe = DiTPipeline(config, load_model(config.model), prepare=False)
    pipe.prepare(defer_compiles=True)
    return pipe


@pytest.fixture(scope="module")
def eager_images() -> list[bytes]:
    pipe = DiTPipeline.from_config(EngineConfig(buckets=TABLE))
    return pipe.generate(pipe.validator.validate(REQUEST)).image_bytes


@pytest.mark.skipif(not precompiled_available(torch.compile), reason="torch without ahead-of-time compile")
def test_a_cold_cache_serves_eager_kernels_at_once_then_swaps_compiled_ones_in_and_a_warm_cache_starts_compiled(
        tmp_path, eager_images):
    pipe = _deferred(_config(str(tmp_path / "cache")))
    described = pipe.runner.describe()
    assert {(d["kernels"], d["pending"]) for d in described} == {("eager", True)}, described
    assert {b["pending"] for b in pipe.stats()["buckets"]} == {True}  # /v1/buckets shows it per bucket
    assert pipe.stats()["kernels"]["start"] == "cold"  # not warm while its compiles are still to come
    assert pipe.runner.kernels.compile_s < 5 * 60 and pipe.stats()["kernels"]["pending"] == 2
    assert pipe.stats()["kernels"]["compile_failed"] == 0  # pending is not failed
    # before any compile: eager kernels in the bucket, so diffusers' bits, equal to an eager-tier pipeline's
    assert pipe.generate(pipe.validator.validate(REQUEST)).image_bytes == eager_images

    # requests are served all through the compiles: torch.fx's tracing patches stay on the compile thread
    # (bcg_core/runners/fx_threads.py; without it a request raised NameError in one run of three here)
    compiles = BackgroundCompiles(pipe.runner, pin=False)
    served, errors = [], []

    def serve():
        try:
            while compiles.describe()["running"] or not served:
                served.append(pipe.generate(pipe.validator.validate(REQUEST)).image_bytes)
        except Exception as e:  # noqa: BLE001 - recorded for the assertion below
            errors.append(e)

    assert compiles.start()
    client = threading.Thread(target=serve)
    client.start()
    assert compiles.wait(timeout_s=600)
    client.join(120)
    assert not errors and served, errors
    state = compiles.describe()
    assert (state["pending"], state["swapped"], state["failed"], state["done"]) == (0, 2, 0, True), state
    described = pipe.runner.describe()
    assert {(d["kernels"], d["pending"]) for d in described} == {("compiled", False)}, described
    assert all("compiled in the background" in d["note"] for d in described)
    assert all(d["compile_rel_err"] is not None for d in described)  # checked against eager before the swap
    # every image served while compiling was whole, and after the swap within a level of the eager kernels' image
    after = pipe.generate(pipe.validator.validate(REQUEST)).image_bytes
    for images in [*served, after]:
        for a, b in zip(images, eager_images, strict=True):
            diff = np.abs(_pixels(a) - _pixels(b))
            assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())
    assert not compiles.start()  # nothing pending: no thread

    # a restart on the same cache folder (a fresh model, fresh compiled kernels): compiled at once, nothing pending
    warm = _deferred(_config(str(tmp_path / "cache")))
    assert {(d["kernels"], d["pending"]) for d in warm.runner.describe()} == {("compiled", False)}
    assert warm.stats()["kernels"]["start"] == "warm" and not BackgroundCompiles(warm.runner, pin=False).start()
    assert BackgroundCompiles(warm.runner, pin=False).describe()["done"]  # nothing was ever pending: done


def test_a_background_compile_that_fails_leaves_eager_kernels_and_every_request_served(tmp_path, eager_images):
    """A compile that raises (a stand-in ``torch.compile``) in the background: the bucket keeps its eager kernels for
    good (noted, counted as failed, not pending), and the images stay the eager tier's, bit for bit."""
    def broken_compile(fn, **options):
        def compiled(*args, **kwargs):
            raise RuntimeError("inductor: C++ compile failed (simulated)")
        return compiled

    config = _config(str(tmp_path / "cache"))
    model = load_model(config.model)
    installed_kernels(model.adapter.model).compiled = CompiledKernels(
        model.adapter.model, compile_fn=broken_compile, rtol=1e-3, cache_dir=str(tmp_path / "cache"))
    pipe = DiTPipeline(config, model, prepare=False)
    pipe.prepare(defer_compiles=True)  # no ahead-of-time compile with a stand-in: nothing can load, all pending
    assert pipe.runner.pending_compiles() == pipe.runner.keys
    key = pipe.runner.keys[0]
    assert compile_pending(pipe.runner, key) == ("failed", None)
    entry = pipe.runner.entries[key]
    assert not entry.pending and entry.note.startswith("compile_failed: RuntimeError: inductor: C++ compile failed")
    assert compile_pending(pipe.runner, key) == ("gone", None)  # no longer pending: nothing to do
    compiles = BackgroundCompiles(pipe.runner, pin=False)
    assert compiles.start() and compiles.wait(timeout_s=120)
    assert compiles.describe()["failed"] == 1 and pipe.stats()["kernels"]["compile_failed"] == 2
    assert pipe.generate(pipe.validator.validate(REQUEST)).image_bytes == eager_images


def test_a_torch_whose_fx_patches_cannot_be_isolated_keeps_eager_kernels_instead_of_compiling_beside_serving(
        tmp_path, eager_images, monkeypatch):
    """Where ``torch.fx``'s tracing patches cannot be bound to the compile thread (a torch whose internals moved), no
    compile runs beside serving: the pending buckets keep eager kernels, each noted why, and the images stay eager."""
    import bcg_core.runners.background as background

    calls = []
    config = _config(str(tmp_path / "cache"))
    model = load_model(config.model)
    installed_kernels(model.adapter.model).compiled = CompiledKernels(
        model.adapter.model, compile_fn=lambda fn, **o: calls.append(fn) or fn, rtol=1e-3,
        cache_dir=str(tmp_path / "cache"))
    pipe = DiTPipeline(config, model, prepare=False)
    pipe.prepare(defer_compiles=True)
    assert pipe.runner.pending_compiles() == pipe.runner.keys
    monkeypatch.setattr(background, "isolate_fx_patches", lambda: False)
    compiles = BackgroundCompiles(pipe.runner, pin=False)
    assert not compiles.start() and not pipe.runner.pending_compiles()
    assert {d["note"] for d in pipe.runner.describe()} == {
        "compile_failed: no background compile on this torch (torch.fx patches could not be isolated)"}
    assert pipe.stats()["kernels"]["compile_failed"] == 2
    assert pipe.generate(pipe.validator.validate(REQUEST)).image_bytes == eager_images


def test_the_step_scheduler_starts_background_compiles_and_rescales_a_swapped_buckets_time(tmp_path):
    """The scheduler owns the background compile of its pipeline (a replica starts it once its shapes are ready),
    shows it in its stats and, after a swap, scales the cost model's time of that bucket by the measured ratio. (A
    stand-in compile that returns the eager forward: nothing to load from a cache, so every bucket is pending, and
    its check passes at once.)"""
    from bcg_core.costs import CostModel

    config = _config(str(tmp_path / "cache"))
    model = load_model(config.model)
    installed_kernels(model.adapter.model).compiled = CompiledKernels(
        model.adapter.model, compile_fn=lambda fn, **options: fn, rtol=1e-3, cache_dir=str(tmp_path / "cache"))
    pipe = DiTPipeline(config, model, prepare=False)
    pipe.prepare(defer_compiles=True)
    sched = StepScheduler(pipe)
    try:
        key = pipe.runner.keys[0]
        sched.set_costs(CostModel({k: 10.0 for k in pipe.runner.keys}, {key.shape: {1: 12.0, 2: 20.0}},
                                  source="measured"))
        sched._compiled(key, 0.5)  # what a CUDA graph swap reports: its replay takes half the eager graph's
        assert sched.costs.bucket_ms[key] == 5.0 and sched.costs.bucket_ms[pipe.runner.keys[1]] == 10.0
        sched._compiled(key, None)  # unmeasured (no graph): unchanged
        assert sched.costs.bucket_ms[key] == 5.0 and sched.costs.source == "measured"
        assert sched.stats()["background_compiles"]["pending"] == 2
        assert sched.compile_in_background() and sched.compiles.wait(timeout_s=600)
        stats = sched.stats()["background_compiles"]
        assert (stats["pending"], stats["swapped"], stats["done"]) == (0, 2, True) and stats["elapsed_s"] > 0
    finally:
        sched.close()


def test_serving_keeps_a_quarter_of_the_cpus_while_compiling():
    assert [reserved_cpus(n) for n in (1, 2, 4, 8, 16, 64)] == [0, 1, 1, 2, 4, 4]


def test_an_eager_forward_waits_while_a_compile_holds_sdpa_s_priority_order():
    """A bucket's compile sets SDPA's process-wide priority order to its measured backend; an eager forward on CUDA on
    another thread (a miss, a bucket on eager kernels) waits until it is restored, so it never runs that backend
    instead of PyTorch's default (bcg_core/runners/attention.py ``ORDER_LOCK``). On a CPU, whose SDPA ignores the
    order, nothing waits. (A stand-in adapter: no CUDA is needed to see who waits.)"""
    import time

    from bcg_core.runners.attention import attention_backend
    from bcg_core.runners.base import eager_forward

    class Adapter:
        def forward_eager(self, inputs):
            order.append(torch._C._get_sdp_priority_order())
            return torch.zeros(1)

    order = []
    default = torch._C._get_sdp_priority_order()
    entered, release = threading.Event(), threading.Event()

    def compile_like():
        with attention_backend("math"):
            entered.set()
            release.wait(10)

    t = threading.Thread(target=compile_like)
    t.start()
    assert entered.wait(10)
    eager_forward(Adapter(), None, torch.device("cpu"))  # a CPU forward does not wait
    assert len(order) == 1 and order.pop()[0] == 0 != default[0]  # the compile's order (math, 0, first) meanwhile
    waiter = threading.Thread(target=lambda: eager_forward(Adapter(), None, torch.device("cuda")))
    waiter.start()
    time.sleep(0.2)
    assert order == [] and waiter.is_alive()  # it waits while the order is the compile's
    release.set()
    t.join(10)
    waiter.join(10)
    assert order == [default]
