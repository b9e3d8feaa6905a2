"""The GPU benchmark's model table and construction path, checked on the CPU (no timing, no capture)."""


import diffusers
import pytest
import torch

from bcg_core import FluxAdapter, PixArtAdapter, SD3Adapter
from benchmark_scripts import load

bench = load("bench_graphs")


@pytest.mark.parametrize("name, adapter_cls, params_b, text", [
    ("flux-dev", FluxAdapter, 11.90, 512),  # docs/DESIGN.md section 1: FLUX.1-dev 11.9B
    ("sd3-medium", SD3Adapter, 2.03, 333),  # SD3-medium 2.0B
    ("pixart-sigma", PixArtAdapter, 0.61, 128),  # PixArt-Sigma 0.6B
])
def test_published_configs_have_the_published_sizes_and_their_familys_adapter(name, adapter_cls, params_b,
                                                                               text):
    spec = bench.MODELS[name]
    with torch.device("meta"):
        model = getattr(diffusers, spec.cls)(**spec.config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == params_b
    adapter = spec.adapter(model, spec.text_tokens)
    assert isinstance(adapter, adapter_cls) and spec.text_tokens == text
    assert adapter.rules.pixels_per_token == 16
    assert adapter.rules.grid_keyed == (adapter_cls is not FluxAdapter)


@pytest.mark.parametrize("name", ["sd3-small", "pixart-small"])
def test_build_computes_the_position_tables_that_meta_construction_would_leave_empty(name):
    spec = bench.MODELS[name]
    model, adapter = bench.build(name, torch.device("cpu"), torch.float32)
    reference = getattr(diffusers, spec.cls)(**spec.config)
    assert torch.equal(model.pos_embed.pos_embed, reference.pos_embed.pos_embed)
    assert adapter.rules.grid_keyed


def test_dry_run_checks_padded_against_eager_on_the_cpu():
    rows = bench.dry_run("sd3-small", ["512x768"], [2])
    assert len(rows) == 1 and rows[0]["key"] == "b2_i1536_t333_g48x32" and rows[0]["shape"] == [2, 16, 96, 64]
    assert rows[0]["rel_err"] < 1e-5
