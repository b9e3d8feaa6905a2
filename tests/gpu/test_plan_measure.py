"""``bcg plan --measure`` on CUDA: the planner profiles the sample's buckets itself and plans with the fitted costs.

The model is the tests/tiny FLUX checkpoint (the embedded default's text encoder package is not on the GPU
machine's path)."""

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_bcg_plan_measures_its_own_costs_on_the_gpu(tmp_path, capsys):
    from deployments.cli.main import main
    from tiny.flux import build

    folder = build(tmp_path / "tiny-flux")
    config = tmp_path / "config.yaml"
    config.write_text(f"model: {{path: {folder}, device: cuda}}\nbuckets: {{text_lengths: [32]}}\n")
    report = tmp_path / "plan.json"
    assert main(["plan", "--config", str(config), "--measure", "--steps", "20", "--max-graphs", "8",
                 "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    costs = data["costs"]
    assert costs["source"].startswith("profile (measured by bcg plan --measure on ")
    assert costs["ms_per_token"] > 0 and costs["bytes_per_token"] > 0
    assert data["chosen"]["graphs"] <= 8 and data["buckets"]["plan"]["costs"] == costs["source"]
    assert "bcg profile:" in capsys.readouterr().out  # the profiled buckets are shown
