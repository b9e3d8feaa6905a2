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
from bcg_core.runners.fp8 import FP8_RTOL
from bcg_core.runners.kernels import CompiledKernels, KernelTier, repeated_blocks
from bcg_core.runners.precompiled import available as precompiled_available
from bcg_core.verify import RTOL, verify_runner
from bcg_core.verify_inputs import boundary_cases

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
    # one graph per block class and bucket shape: FLUX's first single block gets its successors' input layout
    assert stats["kernels"]["cache_hits"] + stats["kernels"]["cache_misses"] == 2 * len(compiled.table.keys), stats
    # the replica's start: weights, then every bucket prepared (its compiles among it)
    assert stats["model"]["load_s"] > 0 and stats["kernels"]["prepare_s"] >= stats["kernels"]["compile_s"]


def test_buckets_of_one_token_shape_and_several_rows_share_one_compile():
    """``runner.compile_batch_dynamic`` (off by default: it failed inside CUDA graph capture on an H100): the 2- and
    4-row buckets of one size compile once per block
    class (their batch dimension dynamic), the 1-row bucket once more; every bucket still matches its unpadded eager
    forward."""
    table = BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256"], text_lengths=[256])
    pipe = DiTPipeline.from_config(EngineConfig(buckets=table, runner=RunnerConfig(kernels="compiled",
                                                                                   compile_batch_dynamic=True)))
    stats = pipe.stats()["kernels"]
    assert stats["batch_dynamic"] is True and stats["compile_failed"] == 0
    # two block classes (FLUX's double- and single-stream blocks) x (1 row, 2 and 4 rows): 4 compiles, not 6
    assert stats["cache_hits"] + stats["cache_misses"] == 4, stats
    model = pipe.model
    pre = pipe.runner.kernels.precompiled
    before = pre is not None and (pre.loads, pre.saves, pre.unsaved)
    verdicts = verify_runner(model.adapter, pipe.runner, boundary_cases(pipe.table, pipe.config.limits),
                             model.device, model.dtype, rtol=RTOL[model.dtype])
    assert verdicts and all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts]
    # the buckets' forwards find the functions their compiles kept, under their SDPA backend: nothing is loaded or
    # compiled again (on a GPU such a compile would run inside the bucket's capture, and fail there)
    assert pre is None or (pre.loads, pre.saves, pre.unsaved) == before


@pytest.mark.long  # outside the default run (README, Tests)
def test_a_masked_tier_shares_its_batch_compile_too(tmp_path):
    """FLUX.1's masked tier passes its key-padding mask inside ``joint_attention_kwargs``: its batch dimension is
    left dynamic with the other inputs (``shared_batch``), or the shared compile specializes to the batch it was
    traced at and its next batch fails (``expected size 2==4``: found on an H100, reproduced here)."""
    table = BucketConfig(batch_sizes=[2, 4], resolutions=["256x256", "512x512"], text_lengths=[256])
    pipe = DiTPipeline.from_config(EngineConfig(buckets=table, runner=RunnerConfig(
        kernels="compiled", compile_batch_dynamic=True, compile_cache_dir=str(tmp_path))))
    stats = pipe.stats()["kernels"]
    assert any(k.image_mask for k in pipe.table.keys)
    assert stats["compile_failed"] == 0 and {d["kernels"] for d in pipe.runner.describe()} == {"compiled"}
    # three image tiers (256, 1024, 1024 masked) x two block classes, each shared by its 2 and 4 rows
    assert stats["cache_hits"] + stats["cache_misses"] == 6, stats
    model = pipe.model
    verdicts = verify_runner(model.adapter, pipe.runner, boundary_cases(pipe.table, pipe.config.limits),
                             model.device, model.dtype, rtol=RTOL[model.dtype])
    assert verdicts and all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts]


def test_a_generated_image_with_compiled_kernels_is_close_to_the_eager_one(compiled):
    eager = DiTPipeline.from_config(_config(kernels="eager"))
    request = GenerationRequest("a red fox in snow", n=2, width=256, height=256, num_inference_steps=2, seed=5)
    ours = compiled.generate(compiled.validator.validate(request))
    ref = eager.generate(eager.validator.validate(request))
    assert ours.bucket == ref.bucket and len(ours.image_bytes) == len(ref.image_bytes) == 2
    for a, b in zip(ours.image_bytes, ref.image_bytes, strict=True):
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
    from bcg_core.runners.fp8 import fp8_layers

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
from bcg_core.verify import RTOL, verify_runner
from bcg_core.verify_inputs import boundary_cases
config = EngineConfig(buckets=BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[256]),
                      runner=RunnerConfig(kernels="compiled", compile_cache_dir=sys.argv[1]))
pipe = DiTPipeline.from_config(config)
case = boundary_cases(pipe.table, pipe.config.limits)[0]
verdict, = verify_runner(pipe.model.adapter, pipe.runner, [case], pipe.model.device, pipe.model.dtype,
                         rtol=RTOL[pipe.model.dtype])
stats = pipe.stats()
print(json.dumps({**stats["kernels"], "passed": verdict.passed,
                  "attention": [b["attention"] for b in stats["buckets"]]}))
"""


@pytest.mark.long  # outside the default run (README, Tests)
def test_a_restart_reads_its_compiled_kernels_back_from_the_cache_dir(tmp_path):
    """``runner.compile_cache_dir``: the first start (a process of its own) compiles, missing the caches and
    writing them there (inductor's and the precompiled blocks of :mod:`bcg_core.runners.precompiled`); a second
    start with the same model and table reads every block back without tracing it: hits, no misses, and its buckets
    still pass. A third start over a corrupted cache compiles again and passes."""
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
    assert (cold["start"], warm["start"]) == ("cold", "warm") and warm["compile_failed"] == 0
    assert [a["source"] for a in cold["attention"]] == ["measured"]
    assert cold["attention"][0]["backend"] in {"flash", "math"}
    assert set(cold["attention"][0]["times_ms"]) == {"flash", "math"}, cold["attention"]
    assert [(a["backend"], a["source"]) for a in warm["attention"]] == [(cold["attention"][0]["backend"], "cached")]
    if precompiled_available(torch.compile):  # torch 2.10+: each block shape is one file, loaded without a trace
        assert cold["precompiled"]["saves"] == warm["precompiled"]["loads"] > 0, (cold, warm)
        assert warm["precompiled"]["saves"] == 0 and len(list((cache / "bcg-precompiled").glob("*.aot"))) == \
            cold["precompiled"]["saves"]

    # a corrupt cache (every entry cut in half) is never loaded: the entries miss, are compiled again and pass
    entries = [p for p in cache.rglob("*") if p.is_file() and "triton" not in p.parts]
    for p in entries:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    rebuilt = start()
    assert rebuilt["cache_misses"] > 0 and rebuilt["compile_failed"] == 0 and rebuilt["passed"], rebuilt
    assert [a["source"] for a in rebuilt["attention"]] == ["measured"]  # its torn choice file was not trusted
    if precompiled_available(torch.compile):  # a torn precompiled block is deleted and compiled again, never called
        assert rebuilt["precompiled"]["rebuilt"] == cold["precompiled"]["saves"], rebuilt


def _runner(pipe: DiTPipeline, kernels: CompiledKernels):
    from bcg_core.runners.eager import EagerBucketRunner

    return EagerBucketRunner(pipe.model.adapter, pipe.table.keys, pipe.metrics, pipe.model.device, pipe.model.dtype,
                             kernels=kernels)


def _outputs(result, scale: float):
    if isinstance(result, torch.Tensor):
        return result * scale
    return tuple(_outputs(r, scale) if r is not None else None for r in result)


def test_compiled_kernels_that_deviate_from_eager_are_caught_at_prepare_and_the_bucket_runs_eager():
    """Each compiled bucket's forward is checked against its eager forward when it is prepared: kernels off by 1%
    (a stand-in for a wrong compile or a cache entry that loads but computes something else) fail the check and the
    bucket keeps eager kernels; kernels that agree pass, with their deviation recorded."""
    pipe = DiTPipeline(_config(kernels="eager"), DiTPipeline.from_config(_config()).model, prepare=False)

    def off_by_one_percent(fn, **options):
        return lambda *a, **k: _outputs(fn(*a, **k), 1.01)

    bad = CompiledKernels(pipe.model.adapter.model, compile_fn=off_by_one_percent, rtol=1e-3)
    runner = _runner(pipe, bad)
    runner.prepare()
    described = runner.describe()
    assert {d["kernels"] for d in described} == {"eager"} and runner.compile_failed == len(pipe.table.keys)
    assert all(d["note"].startswith("compile_check_failed: the compiled forward deviates") and
               d["compile_rel_err"] > 1e-3 for d in described), described
    case = boundary_cases(pipe.table, pipe.config.limits)[0]
    verdict, = verify_runner(pipe.model.adapter, runner, [case], pipe.model.device, pipe.model.dtype, rtol=0.0)
    assert verdict.passed  # the eager kernels serve: exact

    fresh = DiTPipeline(_config(kernels="eager"), DiTPipeline.from_config(_config()).model, prepare=False)
    good = CompiledKernels(fresh.model.adapter.model, compile_fn=lambda fn, **o: fn, rtol=1e-3)
    runner = _runner(fresh, good)
    runner.prepare()
    assert {(d["kernels"], d["compile_rel_err"]) for d in runner.describe()} == {("compiled", 0.0)}


def test_a_compile_past_compile_timeout_s_is_stopped_and_its_bucket_runs_eager():
    """``runner.compile_timeout_s``: a compile still running at the deadline is stopped inside (the exception
    unwinds it) and its bucket keeps eager kernels, counted; start-up goes on at once."""
    import time

    def endless(fn, **options):
        def compiled(*a, **k):
            for _ in range(6000):  # 60 s of "compiling", in short waits the deadline can interrupt
                time.sleep(0.01)
            return fn(*a, **k)
        return compiled

    pipe = DiTPipeline(_config(kernels="eager"), DiTPipeline.from_config(_config()).model, prepare=False)
    kernels = CompiledKernels(pipe.model.adapter.model, compile_fn=endless, timeout_s=0.3)
    runner = _runner(pipe, kernels)
    t0 = time.perf_counter()
    runner.prepare()
    assert time.perf_counter() - t0 < 10
    assert kernels.timeouts == len(pipe.table.keys) and runner.compile_failed == len(pipe.table.keys)
    assert all(d["note"] == "compile_timeout: the compile passed runner.compile_timeout_s (0.3 s)"
               for d in runner.describe())
    time.sleep(0.5)  # no stray exception lands after the deadline was withdrawn
    case = boundary_cases(pipe.table, pipe.config.limits)[0]
    verdict, = verify_runner(pipe.model.adapter, runner, [case], pipe.model.device, pipe.model.dtype, rtol=0.0)
    assert verdict.passed


def test_a_real_compile_stopped_at_its_deadline_leaves_torch_compile_usable(tmp_path, monkeypatch):
    """The deadline stops a real inductor compile part-way (dynamo's compile lock is released as it unwinds); the
    bucket serves eager kernels, and a later compile of the same shape in the same process works and passes the
    check. A shape no other test compiles (3 rows; dynamo would reuse another model's compile of the same shape)
    and an empty cache folder make the first compile a cold one (seconds)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # restored after the test (use_cache_dir sets both)
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    one = BucketConfig(batch_sizes=[3], resolutions=["256x256"], text_lengths=[256])
    stopped = DiTPipeline.from_config(EngineConfig(buckets=one, runner=RunnerConfig(
        kernels="compiled", compile_timeout_s=0.2, compile_cache_dir=str(tmp_path / "cold"))))
    k = stopped.stats()["kernels"]
    assert (k["compile_timeouts"], k["compile_failed"]) == (1, 1), {n: k.get(n) for n in (
        "compile_timeouts", "compile_failed", "compile_s", "precompiled", "cache_hits", "cache_misses")}
    later = DiTPipeline.from_config(EngineConfig(buckets=one, runner=RunnerConfig(kernels="compiled")))
    k = later.stats()["kernels"]
    assert k["compile_failed"] == 0 and k["compile_timeouts"] == 0, k
    assert later.stats()["buckets"][0]["compile_rel_err"] <= k["rtol"]


def test_the_rounding_measure_widens_one_repeated_block_at_a_time(monkeypatch):
    """The own tensors stay alive while their wide copies exist (they are given back after), so the wide forward
    widens the transformer's repeated blocks one at a time, each for its own forward: while a block runs, it is the
    only block in float32 (the full FLUX.1-dev widened at once needs 47.6 GB beside its own 23.8 GB: an H100 ran
    out of memory). Where even that does not fit the device's free memory, the measure is skipped (None)."""
    from bcg_core.runners.kernels import repeated_blocks
    from bcg_core.verify import precision_deviation

    model = DiTPipeline.from_config(_config()).model
    model.adapter.model.to(torch.bfloat16)
    blocks = repeated_blocks(model.adapter.model)
    assert len(blocks) > 1
    seen = []

    def probe(module, args, output):  # runs before the measure's own hook gives the block back
        seen.append([i for i, b in enumerate(blocks) if next(b.parameters()).dtype == torch.float32])

    hooks = [b.register_forward_hook(probe) for b in blocks]
    key = min(DiTPipeline(_config(), model, prepare=False).table.keys, key=lambda k: k.tokens)
    try:
        assert 1e-4 < precision_deviation(model.adapter, key, model.device, torch.bfloat16) < 5e-2
    finally:
        for h in hooks:
            h.remove()
    n = len(blocks)
    assert seen == [[]] * n + [[i] for i in range(n)]  # the narrow forward, then each block alone in float32
    assert {p.dtype for p in model.adapter.model.parameters()} == {torch.bfloat16}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 1 << 30))  # 1 MiB free
    assert precision_deviation(model.adapter, key, "cuda", torch.bfloat16) is None


def test_the_compiled_tolerance_comes_from_the_eager_forwards_own_rounding():
    """``runner.compile_rtol`` None: the check's tolerance is max(dtype tolerance, 2 x the eager forward's rounding
    error against a wider dtype), measured with the model's own tensors widened and then given back untouched."""
    from bcg_core.verify import COMPILED_CAP, COMPILED_FACTOR, kernel_tolerance, precision_deviation

    model = DiTPipeline.from_config(_config()).model
    model.adapter.model.to(torch.bfloat16)
    tensors = [t for t in (*model.adapter.model.parameters(), *model.adapter.model.buffers())]
    before = [(t.data_ptr(), t.dtype, t.detach().clone()) for t in tensors]
    key = min(DiTPipeline(_config(), model, prepare=False).table.keys, key=lambda k: k.tokens)
    deviation = precision_deviation(model.adapter, key, model.device, torch.bfloat16)
    assert 1e-4 < deviation < 5e-2  # bf16 rounding against float32
    assert [(t.data_ptr(), t.dtype) for t in tensors] == [(p, d) for p, d, _ in before]
    assert all(torch.equal(t, v) for t, (_, _, v) in zip(tensors, before, strict=True))
    rtol, note = kernel_tolerance("compiled", torch.bfloat16, deviation)
    assert rtol == max(RTOL[torch.bfloat16], min(COMPILED_FACTOR * deviation, COMPILED_CAP))
    assert "eager rounding" in note
    # a model whose bf16 forward is far from its float32 one (the full FLUX.1-dev with random weights: 0.50) still
    # gets a check that catches a broken compile
    assert kernel_tolerance("compiled", torch.bfloat16, 0.496)[0] == COMPILED_CAP == 0.1
    assert kernel_tolerance("fp8", torch.bfloat16, deviation)[0] == FP8_RTOL == 0.25
    assert kernel_tolerance("compiled", torch.bfloat16, None) == (RTOL[torch.bfloat16], note.replace(
        note, "eager rounding not measured (no memory for a wide copy): 0.02"))


def test_the_eager_rounding_is_measured_once_per_weights_and_kept_beside_the_compile_cache(tmp_path, monkeypatch):
    """``derived_tolerance``: the first start measures the deviation and keeps it in ``bcg-deviation.json``; a start
    with the same weights reads it (no widened forward), other weights (another ``weights_stamp``) measure again,
    ``fp8`` never measures, and a file with a value that is not a deviation is not trusted."""
    import json
    import os

    import bcg_core.verify as verify
    from bcg_core.models import save_pipeline, weights_stamp

    pipe = DiTPipeline.from_config(_config())
    model, keys = pipe.model, pipe.table.keys
    measured: list = []
    real = verify.precision_deviation
    monkeypatch.setattr(verify, "precision_deviation", lambda *a, **k: measured.append(a[1]) or real(*a, **k))

    def tolerance(tier="compiled", weights="w1"):
        return verify.derived_tolerance(tier, model.adapter, keys, model.device, model.dtype, str(tmp_path), weights)

    first = tolerance()
    assert len(measured) == 1 and measured[0] == min(keys, key=lambda k: (k.tokens, k.batch))
    assert (tmp_path / "bcg-deviation.json").exists() and "kept" not in first[1]
    again = tolerance()
    assert len(measured) == 1 and again[0] == first[0] and again[1] == first[1] + " (kept from an earlier start)"
    assert tolerance(weights="w2")[0] == first[0] and len(measured) == 2  # other weights: measured again
    assert tolerance(weights=None) == first and len(measured) == 3  # no stamp (the tiny default): never kept
    assert tolerance("fp8") == (FP8_RTOL, f"fp8 stated bound {FP8_RTOL:g}") and len(measured) == 3
    kept = json.loads((tmp_path / "bcg-deviation.json").read_text())
    (tmp_path / "bcg-deviation.json").write_text(json.dumps({k: -v for k, v in kept.items()}))  # not deviations
    assert "kept" not in tolerance()[1] and len(measured) == 4
    # a cache folder not made yet (a first start: CompiledKernels makes it later) is made; two stores writing
    # (replicas starting together) keep each other's entries; a folder that cannot be written does not stop a start
    fresh = tmp_path / "new" / "cache"
    assert verify.derived_tolerance("compiled", model.adapter, keys, model.device, model.dtype, str(fresh), "w1")[0] \
        == first[0] and (fresh / "bcg-deviation.json").exists()
    from bcg_core.runners.attention import KeptValues

    one, two = (KeptValues(str(fresh), "kept.json", lambda v: isinstance(v, int)) for _ in range(2))
    one.put("a", 1)
    two.put("b", 2)
    assert KeptValues(str(fresh), "kept.json", lambda v: isinstance(v, int)).get("a") == 1 == 3 - two.get("b")
    (tmp_path / "file").write_text("")
    KeptValues(str(tmp_path / "file" / "under"), "kept.json", lambda v: True).put("a", 1)  # logged, in memory
    # the stamp: a checkpoint's transformer files, by path, size and modification time
    folder = save_pipeline(model, tmp_path / "ckpt")
    stamp = weights_stamp(folder)
    assert stamp is not None and weights_stamp(folder) == stamp and weights_stamp(None) is None
    weights = next((folder / "transformer").glob("*.safetensors"))
    os.utime(weights, ns=(1, 1))  # rewritten in place (another modification time)
    assert weights_stamp(folder) != stamp


def test_a_checkpoints_first_start_keeps_its_deviation_in_a_new_cache_folder_and_the_next_reads_it(tmp_path):
    """``compiled_kernels`` of a saved checkpoint with a ``compile_cache_dir`` that does not exist yet (a first
    start; nothing is compiled here): the deviation is measured and kept there; a second start of the same
    checkpoint reads it (its note says so)."""
    from bcg_core.config import ModelConfig
    from bcg_core.models import load_model, save_pipeline
    from bcg_core.pipeline import compiled_kernels

    tiny = DiTPipeline(_config(), load_model(ModelConfig()), prepare=False)  # the same table; eager: nothing kept
    folder, keys = save_pipeline(tiny.model, tmp_path / "ckpt"), tiny.table.keys
    config = EngineConfig.model_validate({"model": {"path": str(folder)}, "buckets": TABLE.model_dump(), "runner": {
        "kernels": "compiled", "compile_cache_dir": str(tmp_path / "new" / "cache")}})
    notes = [compiled_kernels(config, load_model(config.model), keys).rtol_note for _ in range(2)]
    assert (tmp_path / "new" / "cache" / "bcg-deviation.json").exists()
    assert "kept" not in notes[0] and notes[1] == notes[0] + " (kept from an earlier start)"


def test_kernels_auto_is_eager_on_a_cpu():
    from bcg_core.pipeline import kernel_tier

    assert kernel_tier(_config(), torch.device("cpu")) is KernelTier.EAGER
    assert kernel_tier(_config(), torch.device("cuda")) is KernelTier.COMPILED
    assert kernel_tier(_config(kernels="eager"), torch.device("cuda")) is KernelTier.EAGER


def test_the_first_flux_single_block_gets_the_layout_its_successors_get():
    """Single blocks pass their output on as two slices of one tensor; the first one gets the double blocks' two
    tensors. ``_joint_views`` hands it the same slices (values unchanged), and leaves slices as they are."""
    from bcg_core.runners.kernels import INPUT_LAYOUTS

    joint_views = INPUT_LAYOUTS["FluxSingleTransformerBlock"]
    text, image = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    out = joint_views({"hidden_states": image, "encoder_hidden_states": text, "temb": None})
    assert torch.equal(out["hidden_states"], image) and torch.equal(out["encoder_hidden_states"], text)
    assert out["hidden_states"].stride() == out["encoder_hidden_states"].stride() == (32, 4, 1)
    assert out["temb"] is None
    again = joint_views(out)  # what every later single block receives: passed through, no copy
    assert again is out
    swapped = joint_views({"hidden_states": out["encoder_hidden_states"],
                           "encoder_hidden_states": out["hidden_states"]})
    assert torch.equal(swapped["hidden_states"], text)  # not text-first slices: put in that layout


def test_bcg_warm_compiles_the_table_into_the_cache_dir_and_refuses_an_eager_config(tmp_path, monkeypatch, capsys):
    """``bcg warm``: on an eager config (``auto`` on a CPU) it compiles nothing and names the flag (exit 2); with
    ``--kernels compiled`` it prepares every bucket into ``--cache-dir``, prints what each got, exits 0."""
    import yaml

    from deployments.cli.main import main

    cache = tmp_path / "cache"
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # bcg warm sets them; restored after the test
        monkeypatch.setenv(var, str(tmp_path / "before"))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"buckets": {"batch_sizes": [1], "resolutions": ["256x256"],
                                                  "text_lengths": [256]}}))
    assert main(["warm", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "runner.kernels is 'auto', which means eager kernels on this device" in err and "--kernels compiled" in err
    # a mistyped --cache-dir is refused before anything loads, not made with all its parents
    with pytest.raises(SystemExit) as exit_:
        main(["warm", "--config", str(config), "--kernels", "compiled", "--cache-dir", str(tmp_path / "no" / "c")])
    assert exit_.value.code == 2 and "does not exist" in capsys.readouterr().err and not (tmp_path / "no").exists()
    assert main(["warm", "--config", str(config), "--kernels", "compiled", "--cache-dir", str(cache)]) == 0
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())  # rich wraps long lines
    assert "b1_i256_t256" in out and "compiled" in out and "0 buckets on eager kernels" in out, out
    assert "bcg warm: loading the model" in captured.err and "1/1" in captured.err, captured.err  # its progress
    # the attention choice is kept there (the kernels too, unless this process already compiled the shape)
    assert (cache / "bcg-attention.json").exists()


def test_the_compile_check_covers_text_padding_where_the_family_pads_text(tmp_path):
    """PixArt-Sigma buckets its text lengths with masked zero pads, so each bucket's compile check also runs inputs
    that leave a quarter of its text tokens to the padding. Blocks that go wrong only on padded text (NaN once the
    key-padding mask holds a pad: what the fp8 tier's zero-row quantization did) fail that check and the bucket keeps
    eager kernels; the full-text inputs alone would have passed them."""
    from bcg_core.runners.eager import EagerBucketRunner
    from bcg_core.verify_inputs import text_pad_of
    from reference_gate import bcg_pipeline
    from tiny.pixart import build

    pipe = bcg_pipeline(build(tmp_path / "pixart"), {"batch_sizes": [2], "resolutions": ["256x256"],
                                                      "text_lengths": [16]})
    adapter = pipe.model.adapter
    key, = pipe.table.keys
    flux = DiTPipeline.from_config(_config()).model.adapter  # FLUX.1: a fixed text length, never padded
    assert text_pad_of(adapter, key) == 4 and text_pad_of(flux, key) == 0

    def nan_on_padded_text(fn, **options):
        def block(*a, **k):
            out = fn(*a, **k)
            mask = k.get("encoder_attention_mask")
            return out * float("nan") if mask is not None and bool((mask < 0).any()) else out
        return block

    runs = {}
    for name, compile_fn in (("poisoned", nan_on_padded_text), ("faithful", lambda fn, **o: fn)):
        kernels = CompiledKernels(adapter.model, compile_fn=compile_fn, rtol=1e-3)
        runner = EagerBucketRunner(adapter, pipe.table.keys, pipe.metrics, pipe.model.device, pipe.model.dtype,
                                   kernels=kernels)
        runner.prepare()
        runs[name] = runner.describe()[0]
    assert runs["poisoned"]["kernels"] == "eager" and runs["poisoned"]["note"].startswith("compile_check_failed")
    assert "nan" in runs["poisoned"]["note"]
    assert runs["faithful"]["kernels"] == "compiled" and runs["faithful"]["compile_rel_err"] == 0.0
