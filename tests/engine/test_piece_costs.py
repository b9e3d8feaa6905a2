"""The cost model of cached steps (bcg_core/costs/model.py ``piece_shares``, bcg_core/costs/decider.py
``observe_pieces``): a step-cache half's forward is priced at its bucket's whole forward times the half's measured
share, with scripted times and shares. The shares' measurement (CUDA events at the halves' capture) is tested on a
GPU in tests/gpu/test_step_cache_gpu.py."""

from __future__ import annotations

import pytest

from bcg_core import BucketKey
from bcg_core.costs import CostModel, StepDecider
from bcg_core.runners.base import CaptureStats

T = 64
K1, K2, K4 = (BucketKey(b, 256, T) for b in (1, 2, 4))
SHAPE = K1.shape


def _costs(**kw) -> CostModel:
    return CostModel({K1: 10.0, K2: 12.0, K4: 20.0}, {SHAPE: {1: 30.0, 2: 40.0, 4: 60.0}}, **kw)


def test_a_half_is_priced_at_its_buckets_measured_share_of_the_whole_forward():
    costs = _costs(piece_shares={K1: (0.25, 0.8), K2: (0.3, 0.75)})
    head = costs.choose(SHAPE, 1, [K1, K2, K4], phase="head")
    assert [(c.key, c.rows) for c in head.chunks] == [(K1, 1)] and head.ms == pytest.approx(2.5)
    assert costs.choose(SHAPE, 2, [K1, K2, K4], phase="tail").ms == pytest.approx(12.0 * 0.75)
    # K4 unmeasured: the mean share of its shape's measured buckets, as is an eager chunk
    assert costs.phase_share(K4, "head") == pytest.approx(0.275)
    assert costs.choose(SHAPE, 4, [K4], phase="head").ms == pytest.approx(20.0 * 0.275)
    assert costs.choose(SHAPE, 3, [], phase="tail").ms == pytest.approx(
        costs.eager_cost(SHAPE, 3) * (0.8 + 0.75) / 2)
    # no phase, or nothing measured: the whole forward's time
    assert costs.choose(SHAPE, 1, [K1]).ms == 10.0
    assert _costs().choose(SHAPE, 1, [K1], phase="head").ms == 10.0


def test_the_shares_can_change_the_chunks_a_half_runs_in():
    """Two 1-row forwards against one 2-row forward: whole forwards favour the 2-row bucket (12 < 20), but a tail
    half that costs a tenth on the 1-row bucket and nearly all on the 2-row one runs as two 1-row forwards."""
    costs = _costs(piece_shares={K1: (0.5, 0.1), K2: (0.5, 1.0)})
    assert [c.key for c in costs.choose(SHAPE, 2, [K1, K2]).chunks] == [K2]
    assert [c.key for c in costs.choose(SHAPE, 2, [K1, K2], phase="tail").chunks] == [K1, K1]


def test_shares_are_described_merged_and_checked():
    costs = _costs(piece_shares={K1: (0.25, 0.8)})
    assert costs.describe()["step_cache_shares"] == {str(K1): {"head": 0.25, "tail": 0.8}}
    assert "step_cache_shares" not in _costs().describe()
    merged = costs.merged(CostModel({K2: 11.0}, piece_shares={K2: (0.3, 0.7)}))
    assert merged.piece_shares == {K1: (0.25, 0.8), K2: (0.3, 0.7)} and merged.bucket_ms[K2] == 11.0
    with pytest.raises(ValueError, match="0..2"):
        _costs(piece_shares={K1: (-0.1, 0.8)})
    with pytest.raises(ValueError, match="allowed: head, tail"):
        costs.choose(SHAPE, 1, [K1], phase="middle")


class _Runner:
    """What the decider reads of a runner: its capture counters and its measured halves."""

    def __init__(self):
        self.stats, self.piece_shares = CaptureStats(), {}

    def capture(self, key, shares):
        self.stats.piece_captures += 1
        self.piece_shares = {**self.piece_shares, key: shares}


def test_the_decider_takes_a_runners_measured_halves_once_they_are_captured():
    keys = [K1, K2, K4]
    decider = StepDecider(keys, prepared=lambda: set(keys), graphs=True)
    decider.set_costs(_costs(source="measured"), merge=False)
    runner = _Runner()
    decider.observe_pieces(runner)  # nothing captured: nothing learnt
    assert decider.costs.piece_shares == {}
    runner.capture(K1, (0.25, 0.8))
    decider.observe_pieces(runner)
    assert decider.costs.piece_shares == {K1: (0.25, 0.8)} and decider.costs.source == "measured"
    assert decider.decide(SHAPE, 1, phase="head").ms == pytest.approx(2.5)
    assert decider.decide(SHAPE, 1).ms == 10.0
    # the token-count stand-in (nothing measured) learns them too
    stand_in = StepDecider(keys, prepared=lambda: set(keys), graphs=True)
    stand_in.observe_pieces(runner)
    assert stand_in.costs.piece_shares == {K1: (0.25, 0.8)} and stand_in.costs.source == "token-count"
    whole = stand_in.decide(SHAPE, 1).ms
    assert stand_in.decide(SHAPE, 1, phase="tail").ms == pytest.approx(whole * 0.8)
