"""SD3 and PixArt-Sigma under CUDA graphs: replay equals eager at every boundary, exact fits bit for bit.

FLUX.2 [dev], [klein] and Z-Image: their tiny checkpoints (tests/tiny) loaded through ``model.path`` with every bucket
of ``benchmarks/bench_families.py``'s ``VERIFY`` table captured as a CUDA graph, in fp32 and bf16; each bucket's
boundary cases replayed against the unpadded eager forward within ``bcg_core.verify.RTOL`` (fp32 1e-5, bf16 2e-2), as
``bench_families.py verify`` checks every family.
"""

import importlib

import pytest
import torch

from bcg_core import BucketConfig, BucketMetrics, BucketTable, LimitsConfig
from bcg_core.runners.cuda_graph import CudaGraphRunner
from bcg_core.verify import RTOL, verify_runner
from bcg_core.verify_inputs import BoundaryCase, boundary_cases, random_inputs
from benchmark_scripts import load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

bench = load("bench_graphs")
families = load("bench_families")

CUDA, BF16 = torch.device("cuda"), torch.bfloat16
CHECKPOINT_FAMILIES = ("flux2-dev", "flux2-klein", "zimage")
"""Families of ``bench_families.VERIFY`` whose buckets are checked here from their tiny checkpoints."""

FAMILIES = {
    # name: (resolutions, text buckets); SD3 text is fixed at the model's native length.
    "sd3-small": (["256x256", "512x512", "512x768", "768x512"], None),
    "pixart-small": (["256x256", "512x512", "512x768"], [64, 128]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    name = request.param
    _, adapter = bench.build(name, CUDA, BF16)
    resolutions, texts = FAMILIES[name]
    texts = texts or [adapter.rules.native_text_tokens]
    table = BucketTable(BucketConfig(batch_sizes=[1, 2, 4], resolutions=resolutions, text_lengths=texts),
                        adapter.rules, min_image_tokens=256)
    runner = CudaGraphRunner(adapter, table.keys, BucketMetrics(table.keys), CUDA, BF16)
    runner.prepare()
    return name, adapter, table, runner


def test_every_bucket_is_captured(family):
    _, _, table, runner = family
    assert runner.graph_count == len(table.keys) and runner.stats.failed == 0


def test_graph_replay_equals_eager_at_every_boundary(family):
    _, adapter, table, runner = family
    cases = boundary_cases(table, LimitsConfig())
    verdicts = verify_runner(adapter, runner, cases, CUDA, BF16, rtol=2e-2)
    assert {v.key for v in verdicts} == set(table.keys)
    assert all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_exact_fit_replay_equals_eager_bit_for_bit(family):
    _, adapter, table, runner = family
    for key in table.keys:
        case = BoundaryCase(key, key.batch, key.latent_hw, key.text_tokens)
        x = random_inputs(adapter, case, CUDA, BF16, seed=3)
        with torch.inference_mode():
            ref = adapter.forward_eager(x)
        assert torch.equal(runner.run(key, x), ref), str(key)


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", CHECKPOINT_FAMILIES)
def test_checkpoint_family_buckets_replayed_as_graphs_equal_unpadded_eager(name, dtype, tmp_path):
    module, kwargs, table = families.VERIFY[name]
    folder = importlib.import_module(f"tiny.{module}").build(tmp_path / name, **kwargs)
    r = families._verify_one(name, folder, dtype, table, LimitsConfig(**families.VERIFY_LIMITS), CUDA)
    assert r["modes"] == {"graph": r["buckets"]}, r["modes"]  # every bucket captured, none left eager
    assert r["buckets"] == r["checked"] == r["passed"] > 0 and not r["unreached"], r
    assert r["failed"] == [] and r["max_rel_err"] <= r["rtol"] == RTOL[getattr(torch, dtype)], r
