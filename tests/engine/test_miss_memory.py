"""A miss's memory bound (bcg_core/costs/miss_memory.py) and the decider that asks it, with scripted spare
memory and bytes per row-token: one forward while the miss fits, else the fewest, most even chunks that fit.

The replica-level tests (a one-row table serving an 18-row miss in one forward; a scripted memory chunking it with
unchanged images) are in tests/engine/test_step_scheduler.py.
"""

from __future__ import annotations

import pytest

from bcg_core import BucketKey
from bcg_core.costs import CostModel, StepDecider
from bcg_core.costs.miss_memory import MARGIN_BYTES, MARGIN_FRACTION, ActivationPeaks, MissMemory

GIB = 1 << 30
FLUX_2048_ROW = 16_384 + 512
"""Real tokens of one row of a 2048x2048 FLUX miss: 128 x 128 image tokens and 512 text tokens."""


def test_the_margin_keeps_one_gib_or_a_fifth_of_the_spare_memory_whichever_is_more():
    assert (MARGIN_BYTES, MARGIN_FRACTION) == (GIB, 0.2)
    assert MissMemory(lambda: 2 * GIB).usable_bytes() == GIB  # a fifth is 0.4 GiB: the 1 GiB floor
    assert MissMemory(lambda: 100 * GIB).usable_bytes() == 80 * GIB
    assert MissMemory(lambda: GIB // 2).usable_bytes() == 0  # never negative
    assert MissMemory().usable_bytes() is None and MissMemory(lambda: None).usable_bytes() is None


def test_a_miss_runs_in_one_forward_while_it_fits_and_in_the_fewest_even_chunks_beyond():
    mem = MissMemory(lambda: 2 * GIB)  # 1 GiB usable
    mem.set_bytes_per_row_token(10_000)  # a FLUX 2048x2048 row: 168,960,000 bytes, 6 rows fit in 1 GiB
    assert mem.chunk_rows(6, FLUX_2048_ROW) == [6]
    assert mem.chunk_rows(20, FLUX_2048_ROW) == [5, 5, 5, 5]  # ceil(20 / 6) = 4 chunks, as even as they go
    assert mem.chunk_rows(7, FLUX_2048_ROW) == [4, 3]
    mem.set_bytes_per_row_token(1_000)  # 63 rows fit: the whole miss in one forward
    assert mem.chunk_rows(20, FLUX_2048_ROW) == [20]
    exact = MissMemory(lambda: 2 * GIB)
    exact.set_bytes_per_row_token(GIB / (8 * 1024))  # 8 rows of 1,024 tokens fill the usable bytes exactly
    assert exact.chunk_rows(8, 1024) == [8] and exact.chunk_rows(9, 1024) == [5, 4]
    mem.set_bytes_per_row_token(GIB)  # not even one row fits: one row a chunk (a row cannot be split)
    assert mem.chunk_rows(3, FLUX_2048_ROW) == [1, 1, 1]


def test_without_a_figure_a_source_or_the_rows_tokens_a_miss_runs_in_one_forward():
    unmeasured = MissMemory(lambda: 0)  # CUDA before any measurement: no bound, however little is free
    assert unmeasured.chunk_rows(18, 640) == [18]
    cpu = MissMemory(None)  # a CPU: no spare-memory source
    cpu.set_bytes_per_row_token(1e12)
    assert cpu.chunk_rows(18, 640) == [18]
    scripted = MissMemory(lambda: 0)
    scripted.set_bytes_per_row_token(1.0)
    assert scripted.chunk_rows(3, None) == [3] and scripted.chunk_rows(3, 640) == [1, 1, 1]


def test_measurements_keep_the_largest_figure_and_bad_values_name_the_field():
    mem = MissMemory()
    mem.observe(None)
    assert mem.bytes_per_row_token is None
    mem.observe(300.0)
    mem.observe(120.0)  # a smaller figure never lowers the bound's estimate
    assert mem.bytes_per_row_token == 300.0
    mem.set_bytes_per_row_token(50)  # the setter replaces (tests, an operator's figure)
    assert mem.bytes_per_row_token == 50.0
    with pytest.raises(ValueError, match="bytes_per_row_token"):
        mem.observe(-1)
    with pytest.raises(ValueError, match="bytes_per_row_token"):
        mem.set_bytes_per_row_token(-0.5)
    with pytest.raises(ValueError, match="at least 1 row"):
        mem.chunk_rows(0, 640)
    with pytest.raises(ValueError, match="tokens_per_row"):
        mem.chunk_rows(2, 0)


def test_the_decider_splits_a_miss_by_memory_not_by_its_largest_bucket():
    """A one-row table of 256 tokens: a 20-row miss of 2048x2048 rows ran as 20 forwards when chunks were bounded
    by the largest bucket forward; with room for it, it runs as one, and a scripted shortage chunks it."""
    keys = [BucketKey(1, 256, 256)]
    spare = {"bytes": 2 * GIB}
    decider = StepDecider(keys, prepared=lambda: set(keys), graphs=True, spare_bytes=lambda: spare["bytes"])
    assert [c.rows for c in decider.decide(None, 20, FLUX_2048_ROW).chunks] == [20]  # nothing measured yet
    decider.set_costs(CostModel({}, source="measured", eager_bytes_per_row_token=1_000.0))
    forwards = decider.decide(None, 20, FLUX_2048_ROW)
    assert [(c.key, c.rows) for c in forwards.chunks] == [(None, 20)] and forwards.home is None
    decider.set_costs(CostModel({}, source="measured", eager_bytes_per_row_token=10_000.0))
    assert [c.rows for c in decider.decide(None, 20, FLUX_2048_ROW).chunks] == [5, 5, 5, 5]
    decider.set_costs(CostModel({}, eager_bytes_per_row_token=None), merge=False)  # scripted costs keep the figure
    assert decider.miss.bytes_per_row_token == 10_000.0
    spare["bytes"] = 100 * GIB  # memory freed since: the same miss fits again, asked at each step
    assert [c.rows for c in decider.decide(None, 20, FLUX_2048_ROW).chunks] == [20]
    with pytest.raises(ValueError, match="at least 1 row"):
        decider.decide(None, 0, FLUX_2048_ROW)


def test_merged_costs_keep_the_largest_bytes_per_row_token():
    a = CostModel({}, source="measured", eager_bytes_per_row_token=200.0)
    b = CostModel({}, source="measured", eager_bytes_per_row_token=150.0)
    assert a.merged(b).eager_bytes_per_row_token == 200.0 == b.merged(a).eager_bytes_per_row_token
    assert CostModel({}).merged(b).eager_bytes_per_row_token == 150.0
    assert CostModel({}).merged(CostModel({})).eager_bytes_per_row_token is None


def test_nothing_is_measured_off_cuda():
    peaks = ActivationPeaks("cpu")
    assert peaks.measure(None, lambda: 7) == 7
    assert peaks.per_row_token == [] and peaks.most is None
