"""No dead ends in the ``bcg`` command line (issue 23, point 3): ``bcg verify`` shows progress, an estimate and
the ``--bucket`` quick check; ``bcg demo --url`` sends an API key; ``bcg plan`` prints whole request counts and
says (and does not write without ``--force``) when the current table is already better.

Fast and without Ray: verify runs the tiny model on a 6-bucket table (the pipeline built once per module), the
demo talks to a fake server on 127.0.0.1, the plan uses the token-count cost model on the packaged krea sample.
"""

from __future__ import annotations

import pytest

from deployments import commands
from deployments.cli import main

# -- bcg verify ----------------------------------------------------------------------------------------------

SMALL_TABLE = 'buckets:\n  batch_sizes: [1, 2]\n  resolutions: ["256x256", "320x256"]\n'
SMALL_KEYS = ("b1_i256_t256", "b1_i320_t256", "b1_i320_m_t256", "b2_i256_t256", "b2_i320_t256", "b2_i320_m_t256")


@pytest.fixture(scope="module")
def _small_pipeline(tmp_path_factory):
    from deployments.settings import load_config

    path = tmp_path_factory.mktemp("verify") / "small.yaml"
    path.write_text(SMALL_TABLE)
    return str(path), commands._pipeline(load_config(config_path=str(path)))


@pytest.fixture()
def small_config(_small_pipeline, monkeypatch):
    """The small table's config file; ``bcg verify`` gets the pipeline built once (the model loads in seconds)."""
    path, pipe = _small_pipeline
    monkeypatch.setattr(commands, "_pipeline", lambda config: pipe)
    return path


def test_verify_of_the_whole_table_shows_the_bucket_hint_progress_per_bucket_and_an_estimate(small_config, capsys):
    assert main(["verify", "--config", small_config]) == 0
    captured = capsys.readouterr()
    err = captured.err.replace("\r", "\n")
    assert "checking all 6 buckets (8 cases); for a quick check give one or more: bcg verify --bucket b1_i256_t256" \
        in err
    for i, key in enumerate(SMALL_KEYS, start=1):
        assert f"bucket {i}/6: {key}" in err  # the bar names each bucket as it runs
    assert "6 buckets checked" in err and "checked 6 buckets (8 cases) in " in err
    estimate = [line for line in err.splitlines() if line.startswith("estimate: ~")]
    assert len(estimate) == 1 and "us per token over the 3 cases run after the first" in estimate[0]
    # the estimate comes before the last buckets run
    assert err.index("estimate: ~") < err.index("bucket 4/6: b2_i256_t256")
    assert "6 of 6 buckets passed" in captured.out  # the table stays on stdout


def test_verify_of_chosen_buckets_has_no_hint_and_keeps_the_exit_status(small_config, capsys):
    assert main(["verify", "--config", small_config, "--bucket", "b1_i320_m_t256", "--bucket", "b2_i256_t256"]) == 0
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "for a quick check" not in err
    assert "bucket 1/2: b1_i320_m_t256" in err and "bucket 2/2: b2_i256_t256" in err
    # a tolerance no masked bucket meets still fails with exit status 1
    assert main(["verify", "--config", small_config, "--rtol", "1e-30", "--bucket", "b2_i320_m_t256"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["verify", "--config", small_config, "--bucket", "b9_i1_t1"]) == 2
    assert "is not in the table; buckets: b1_i256_t256" in capsys.readouterr().err


def test_verify_estimate_waits_for_enough_cases_then_adds_the_rate_per_token_times_the_tokens_left():
    tokens = [100, 1000, 1000, 2000, 4000, 12000]  # 20,100 tokens in all
    # the first case warms up (its seconds count as spent, its rate not); one case after it is too few
    assert commands.verify_estimate([(100, 5.0), (1000, 1.0)], tokens) is None
    seconds, text = commands.verify_estimate([(100, 5.0), (1000, 1.0), (1000, 1.0)], tokens)
    # 2000 tokens in 2 s after the first: 1 ms per token; spent 7 s; left 18,000 tokens -> 18 s
    assert seconds == pytest.approx(25.0)
    assert text.startswith("estimate: ~25 s for all 6 cases, ~18 s left (measured: 1000.0 us per token over the 2 "
                           "cases run after the first")
    # under 5% of the tokens and under 30 s measured: not yet
    few = [2] * 3 + [10_000]
    assert commands.verify_estimate([(2, 0.1), (2, 0.1), (2, 0.1)], few) is None
    assert commands.verify_estimate([(2, 0.1), (2, 20.0), (2, 20.0)], few) is not None  # 40 s measured
    slow = commands.verify_estimate([(1, 0.0), (10, 20.0), (10, 20.0)], [1, 10, 10, 2700])
    assert "~1.5 h for all 4 cases" in slow[1]
