"""The SDPA backend of each compiled bucket, chosen by measurement (``bcg_core/runners/attention.py``), on the CPU:
the recording of a forward's attention calls, the choice, the store kept beside the compile cache, and the
compile-cache key that keeps kernels traced for different backends apart."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bcg_core.runners.attention import (
    AttentionChoice,
    ChoiceStore,
    choose,
    choose_backend,
    compiling_under,
    record_sdpa_calls,
)
from bcg_core.runners.kernels import CompiledKernels

CPU = torch.device("cpu")


def _attention_forward():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 96, 16, generator=g)
    mask = torch.ones(2, 1, 96, 96, dtype=torch.bool)
    mask[:, :, :, 80:] = False  # padded keys, as a masked bucket has them

    def forward():
        return [F.scaled_dot_product_attention(q, q, q), F.scaled_dot_product_attention(q, q, q),
                F.scaled_dot_product_attention(q, q, q, attn_mask=mask)]
    return forward, mask


def test_a_forwards_attention_calls_are_recorded_and_the_fastest_backend_that_runs_them_is_chosen():
    forward, mask = _attention_forward()
    calls = record_sdpa_calls(forward)
    assert sorted(calls.counts.values()) == [1, 2]  # two distinct calls, one of them twice
    masked, = [c for c in calls.counts if c.mask is not None]
    assert masked.mask == (2, 1, 96, 96) and torch.equal(calls.masks[masked], mask)
    choice = choose_backend(calls, CPU, candidates=("efficient", "flash", "math"), iters=2)
    assert choice.times_ms["efficient"] is None  # no memory-efficient kernel on a CPU: skipped, not chosen
    assert choice.times_ms["flash"] > 0 and choice.times_ms["math"] > 0
    assert choice.backend == min(("flash", "math"), key=choice.times_ms.get) and choice.source == "measured"
    assert choose_backend(record_sdpa_calls(lambda: torch.ones(3) * 2), CPU).backend == "default"  # no attention


def test_choices_are_kept_beside_the_compile_cache_and_a_torn_file_is_not_trusted(tmp_path):
    forward, _ = _attention_forward()
    calls = record_sdpa_calls(forward)
    first = choose(calls, CPU, "auto", ChoiceStore(str(tmp_path)))
    assert first.source == "measured" and (tmp_path / ChoiceStore.FILE).exists()
    again = choose(calls, CPU, "auto", ChoiceStore(str(tmp_path)))  # a restart: read back, not measured
    assert (again.backend, again.source, again.times_ms) == (first.backend, "cached", {})
    assert choose(calls, CPU, "math", ChoiceStore(str(tmp_path))) == AttentionChoice("math", source="configured")
    (tmp_path / ChoiceStore.FILE).write_text('{"x": "flash", "y": ')  # torn
    assert choose(calls, CPU, "auto", ChoiceStore(str(tmp_path))).source == "measured"
    (tmp_path / ChoiceStore.FILE).write_text(json.dumps({"x": "rm -rf"}))  # not a backend
    assert ChoiceStore(str(tmp_path)).get(calls) is None


def test_kernels_traced_for_one_backend_are_never_loaded_for_another(tmp_path, monkeypatch):
    """Inductor's cache keys leave the SDPA backend out (pytorch/pytorch 185449): ``compiling_under`` puts it in,
    so the same graph compiled for flash after math misses the cache (and lowers to flash), and math again hits."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    q = torch.randn(1, 2, 64, 16)

    def attention(q):
        return F.scaled_dot_product_attention(q, q, q) * 2

    def compile_under(backend: str) -> tuple[int, int]:
        torch._dynamo.reset()
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        with compiling_under(backend):
            out = torch.compile(attention, dynamic=False, fullgraph=True)(q)
        torch.testing.assert_close(out, attention(q))
        return (counters["inductor"]["fxgraph_cache_hit"] - hits, counters["inductor"]["fxgraph_cache_miss"] - misses)

    assert compile_under("math") == (0, 1)
    assert compile_under("flash") == (0, 1)  # without the backend in the key this was a hit on math's kernels
    assert compile_under("math") == (1, 0)
    torch._dynamo.reset()


def test_a_configured_backend_is_used_where_it_runs_and_an_unknown_one_is_refused():
    forward, _ = _attention_forward()
    kernels = CompiledKernels(torch.nn.Linear(4, 4), compile_fn=lambda fn, **options: fn, attention="math")
    assert kernels.attention_for("b1", forward, CPU) == AttentionChoice("math", source="configured")
    # cuDNN has no CPU kernel: the bucket says PyTorch's default runs it, never that cuDNN does
    cudnn = CompiledKernels(torch.nn.Linear(4, 4), compile_fn=lambda fn, **options: fn, attention="cudnn")
    choice = cudnn.attention_for("b1", forward, CPU)
    assert (choice.backend, choice.times_ms, choice.source) == ("default", {"cudnn": None},
                                                                "configured cudnn cannot run here")
    with pytest.raises(ValueError, match="runner.attention 'fa9'.*cudnn, flash, efficient, math"):
        CompiledKernels(torch.nn.Linear(4, 4), compile_fn=lambda fn, **options: fn, attention="fa9")


def test_a_restart_reads_a_buckets_choice_without_running_its_forward(tmp_path):
    """With ``runner.attention: auto`` a bucket's choice is also kept under the model and bucket key, so a restart
    takes it without the eager forward that records the calls; another model (config) records and measures."""
    forward, _ = _attention_forward()
    runs = []

    def counted():
        runs.append(1)
        return forward()

    def kernels(width: int) -> CompiledKernels:
        model = torch.nn.Sequential(torch.nn.Linear(width, width))
        model.config = {"width": width}  # a diffusers model's config: part of the bucket entry's key
        return CompiledKernels(model, compile_fn=lambda f, **_: f, cache_dir=str(tmp_path))

    first = kernels(8).attention_for("b2_i96_t0", counted, CPU)
    assert first.source == "measured" and len(runs) == 1
    again = kernels(8).attention_for("b2_i96_t0", counted, CPU)  # a restart
    assert (again.backend, again.source, len(runs)) == (first.backend, "cached", 1)
    # another bucket records its calls; these are the same calls, so the calls' entry answers
    assert kernels(8).attention_for("b4_i96_t0", counted, CPU).source == "cached" and len(runs) == 2
    other = kernels(16).attention_for("b2_i96_t0", counted, CPU)  # another model: its calls are recorded
    assert other.source == "cached" and len(runs) == 3  # same calls, so the calls' entry answers


def test_bench_masked_attention_layouts_compute_the_masked_attention_on_the_cpu(tmp_path):
    """``benchmarks/bench_masked_attention.py --small``: every layout that hides the pad keys (the boolean and float
    masks, the bias head dimensions) matches the float32 masked reference; the unmasked call does not."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_masked_attention as bench

    out = tmp_path / "masked.json"
    assert bench.main(["--small", "--iters", "1", "--rounds", "1", "--out", str(out)]) == 0
    for case in json.loads(out.read_text())["cases"].values():
        layouts = case["layouts"]
        assert set(layouts) == {"dense", "masked", "masked-float", "bias-dim-8", "bias-dim-16", "bias-dim-64"}
        assert layouts["dense"]["max_err"] > 0.1  # the pads change an unmasked row: the check can fail
        for name in layouts.keys() - {"dense"}:
            assert layouts[name]["max_err"] < 1e-2, name  # bf16 against a float32 reference
