"""The CUDA graph runner's decisions that need no GPU: budget arithmetic and capture order."""

import pytest
import torch

from bcg_core import BucketConfig, BucketKey, BucketTable, ShapeRules
from bcg_core.runners.cuda_graph import CudaGraphRunner, budget_allows, capture_order

MiB = 1 << 20


def test_shared_pool_budget_counts_only_growth_beyond_the_pool():
    # An empty pool: the bucket's peak must fit.
    assert budget_allows(0, 100 * MiB, 100 * MiB)
    assert not budget_allows(0, 101 * MiB, 100 * MiB)
    # A pool that already holds a larger graph: a smaller bucket reuses it and adds nothing.
    assert budget_allows(90 * MiB, 50 * MiB, 100 * MiB)
    # A larger bucket grows the shared pool to its own peak.
    assert not budget_allows(90 * MiB, 120 * MiB, 100 * MiB)
    assert budget_allows(90 * MiB, 10**12, None)


def test_capture_order_is_largest_first_and_deterministic():
    rules = ShapeRules(pixels_per_token=16, grid_keyed=False, native_text_tokens=64)
    table = BucketTable(BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "512x512"], text_lengths=[64]),
                        rules, min_image_tokens=1)
    order = capture_order(table.keys)
    assert order[0] == BucketKey(4, 1024, 64) and order[1] == BucketKey(4, 1024, 64, image_mask=True)
    assert order[-1].batch == 1 and order[-1].image_tokens == 256
    tokens = [k.tokens for k in order]
    assert tokens == sorted(tokens, reverse=True)
    assert capture_order(list(reversed(table.keys))) == order


def test_graph_runner_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CudaGraphRunner(adapter=None, keys=[], metrics=None, device=torch.device("cpu"), dtype=torch.float32)
