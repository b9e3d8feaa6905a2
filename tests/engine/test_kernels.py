"""Compiled kernels (``runner.kernels: compiled``, ``bcg_core/runners/kernels.py``) on the CPU: the same code path
as on a GPU but for the capture (inductor's C++ backend compiles the tiny default's repeated blocks).

A two-bucket table keeps the compiles to two shapes (seconds each on 2 cores)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from bcg_core import BucketConfig, EngineConfig, GenerationRequest
from bcg_core.config import RunnerConfig
from bcg_core.pipeline import DiTPipeline
from bcg_core.runners.kernels import CompiledKernels, KernelTier, repeated_blocks
from bcg_core.verify import RTOL, boundary_cases, verify_runner

TABLE = BucketConfig(batch_sizes=[1, 2], resolutions=["256x256"], text_lengths=[256])


def _config(**runner) -> EngineConfig:
    return EngineConfig(buckets=TABLE, runner=RunnerConfig(**runner))


@pytest.fixture(scope="module")
def compiled() -> DiTPipeline:
    return DiTPipeline.from_config(_config(kernels="compiled"))


def test_every_bucket_compiles_and_matches_the_unpadded_eager_forward(compiled):
    model = compiled.model
    kernels = compiled.runner.kernels
    assert kernels is not None and kernels.regional  # FLUX names its repeated blocks: regional compilation
    assert {d["kernels"] for d in compiled.runner.describe()} == {"compiled"}
    cases = boundary_cases(compiled.table, compiled.config.limits)
    verdicts = verify_runner(model.adapter, compiled.runner, cases, model.device, model.dtype,
                             rtol=RTOL[model.dtype])
    assert verdicts and all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts]
    # compiled kernels round differently: close to eager, not necessarily equal
    assert 0.0 <= max(v.max_rel_err for v in verdicts) < 1e-5
    stats = compiled.stats()
    assert stats["kernels"]["tier"] == "compiled" and stats["kernels"]["compile_failed"] == 0
    assert stats["kernels"]["compile_s"] > 0 and {b["kernels"] for b in stats["buckets"]} == {"compiled"}


def test_a_generated_image_with_compiled_kernels_is_close_to_the_eager_one(compiled):
    eager = DiTPipeline.from_config(_config(kernels="eager"))
    request = GenerationRequest("a red fox in snow", n=2, width=256, height=256, num_inference_steps=2, seed=5)
    ours, ref = compiled.generate(request), eager.generate(request)
    assert ours.bucket == ref.bucket and len(ours.images_png) == len(ref.images_png) == 2
    for a, b in zip(ours.images_png, ref.images_png):
        diff = np.abs(_pixels(a) - _pixels(b))
        # fp32: the blocks' rounding differs by ~1e-7 relative, so at most one level on a few pixel values
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())
    assert compiled.runner.kernels.on is False  # switched off again outside the bucket forwards


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def test_a_bucket_whose_compile_fails_keeps_eager_kernels_and_serves():
    """A compile error (dynamo or inductor raising, here a stand-in ``torch.compile``) leaves the bucket on
    eager kernels, noted in ``/v1/buckets`` and counted; its forwards are the eager ones, exactly."""
    def broken_compile(fn, **options):
        def compiled(*args, **kwargs):
            raise RuntimeError("inductor: C++ compile failed (simulated)\nmore lines")
        return compiled

    pipe = DiTPipeline(_config(kernels="eager"), DiTPipeline.from_config(_config()).model, prepare=False)
    kernels = CompiledKernels(pipe.model.adapter.model, compile_fn=broken_compile)
    from bcg_core.runners.eager import EagerBucketRunner

    runner = EagerBucketRunner(pipe.model.adapter, pipe.table.keys, pipe.metrics, pipe.model.device, pipe.model.dtype,
                               kernels=kernels)
    runner.prepare()
    described = runner.describe()
    assert {d["kernels"] for d in described} == {"eager"} and runner.compile_failed == len(pipe.table.keys)
    assert all(d["note"] == "compile_failed: RuntimeError: inductor: C++ compile failed (simulated)"
               for d in described)
    case = boundary_cases(pipe.table, pipe.config.limits)[0]
    verdict, = verify_runner(pipe.model.adapter, runner, [case], pipe.model.device, pipe.model.dtype, rtol=0.0)
    assert verdict.passed and verdict.max_rel_err == 0.0  # eager kernels: the padded forward is exact


def test_fp8_is_refused_at_start_where_float8_cannot_run_and_names_its_layers():
    """On a CPU (CI) the fp8 tier is a start-up error naming the requirement, before any model loads; the layers it
    would turn to float8 are the repeated blocks' linear layers without the adaptive norms' modulation."""
    from bcg_core.pipeline import runner_mode
    from bcg_core.runners.kernels import fp8_layers

    with pytest.raises(ValueError, match=r"runner.kernels 'fp8' needs a CUDA GPU with float8 matmuls \(compute "
                                         r"capability 8.9 or newer: Ada, Hopper\); the model runs on cpu"):
        runner_mode(_config(kernels="fp8"), torch.device("cpu"))
    from bcg_core.config import ModelConfig
    from bcg_core.models import load_model

    transformer = load_model(ModelConfig()).adapter.model
    names = fp8_layers(transformer)
    assert "transformer_blocks.0.attn.to_q" in names and "single_transformer_blocks.0.proj_mlp" in names
    assert not [n for n in names if "norm" in n or n.startswith(("x_embedder", "context_embedder", "proj_out",
                                                                 "time_text_embed"))]


def test_inductor_modes_that_capture_their_own_graphs_are_refused():
    with pytest.raises(ValueError, match="bcg-serve owns the graphs"):
        CompiledKernels(torch.nn.Linear(2, 2), compile_fn=lambda fn, **o: fn, mode="reduce-overhead")
    # a module without repeated blocks is compiled whole
    whole = CompiledKernels(torch.nn.Linear(2, 2), compile_fn=lambda fn, **o: fn)
    assert not whole.regional and repeated_blocks(torch.nn.Linear(2, 2)) == []
    assert KernelTier("compiled") is KernelTier.COMPILED


_START = """
import json, sys
from bcg_core import BucketConfig, EngineConfig
from bcg_core.config import RunnerConfig
from bcg_core.pipeline import DiTPipeline
from bcg_core.verify import RTOL, boundary_cases, verify_runner
config = EngineConfig(buckets=BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[256]),
                      runner=RunnerConfig(kernels="compiled", compile_cache_dir=sys.argv[1]))
pipe = DiTPipeline.from_config(config)
case = boundary_cases(pipe.table, pipe.config.limits)[0]
verdict, = verify_runner(pipe.model.adapter, pipe.runner, [case], pipe.model.device, pipe.model.dtype,
                         rtol=RTOL[pipe.model.dtype])
print(json.dumps({**pipe.stats()["kernels"], "passed": verdict.passed}))
"""


def test_a_restart_reads_its_compiled_kernels_back_from_the_cache_dir(tmp_path):
    """``runner.compile_cache_dir``: the first start (a process of its own) compiles, missing inductor's FX graph
    cache and writing it there; a second start with the same model and table reads every kernel back: hits, no
    misses, and its buckets still pass."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cache = tmp_path / "cache"

    def start() -> dict:
        proc = subprocess.run([sys.executable, "-c", _START, str(cache)], cwd=root, capture_output=True, text=True,
                              timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold = start()
    assert cold["cache_dir"] == str(cache) and cold["cache_misses"] > 0 and cold["cache_hits"] == 0, cold
    assert cold["passed"] and any(cache.iterdir())
    warm = start()
    assert warm["cache_hits"] >= cold["cache_misses"] and warm["cache_misses"] == 0 and warm["passed"], (cold, warm)
