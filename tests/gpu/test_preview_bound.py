"""The streamed-preview bound on a GPU (docs/API.md, "Streaming"): a request whose steps are shared with a request
streaming 3 previews of each of its 2 images answers at most :data:`SLOWDOWN_BOUND` times later than beside the
same request without previews.

Runs ``benchmarks/bench_previews.py``'s measurement (B's ``timings_ms["total"]``, submitted to answered, median of
3 interleaved trials; 512x512, 8 steps) on random-weight checkpoints at published widths, built as
``benchmarks/bench_saturation.py`` builds them (bf16). Measured on one H200 (2026-12-02): 1.02 for FLUX.1-dev
width, 1.03 for PixArt-Sigma 512 (``docs/bench/2026-12-02_previews_gpu_h200.json``).
"""

import shutil
import sys

import pytest
import torch

from benchmark_scripts import BENCHMARKS, load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SLOWDOWN_BOUND = 1.25
"""The bound of docs/API.md, the same as tests/engine/test_previews.py's on the CPU."""


@pytest.mark.parametrize("model", ["flux-dev-width", "pixart-512"])
def test_previews_slow_the_request_sharing_their_steps_at_most_the_bound(model, tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    saturation, previews = load("bench_saturation"), load("bench_previews")
    config, folder, _ = saturation.build_model(model, False, str(tmp_path), "cuda")
    try:
        row = previews.run_size(512, steps=8, trials=3, previews=3, n=2, device="cuda", model=config)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stats = row["previews"]
    assert stats["sent"] == 12 and stats["dropped"] == stats["failed"] == 0, stats
    assert row["ratio"] <= SLOWDOWN_BOUND, row
