"""The batched LoRA operator (``bcg_core/lora/layers.py``) on its own: each row's deltas as peft's formula gives
them, four kernels a layer, and no copy of a layer's output in a compiled block.

The images against diffusers' pipeline with ``load_lora_weights`` are ``tests/engine/test_lora_engine.py`` and
``tests/families/test_lora_families.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bcg_core.lora.files import AdapterWeights, LayerDelta
from bcg_core.lora.layers import LoRALayers, lora_add_

SLOTS = torch.tensor([[1, 0], [2, 3], [0, 0]])  # row 0: one adapter; row 1: two; row 2: none (slot 0)
SCALES = torch.tensor([[0.8, 0.0], [1.0, -0.5], [0.0, 0.0]])


class Block(torch.nn.Module):
    """Two linear layers with a nonlinearity and a residual between them, as a DiT block's MLP."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 24), torch.nn.Linear(24, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _adapters(layers: LoRALayers) -> list[AdapterWeights]:
    """Three adapters of ranks 2, 3, 2 (max_rank 4: zero-padded) with scalings 0.5, 1.5, 2.5, written to slots
    1..3; the third changes only ``up``."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(3):
        deltas = {}
        for name, (fi, fo) in layers.shapes().items():
            if i == 2 and name == "down":
                continue
            r = 2 + i % 2
            deltas[name] = LayerDelta(torch.randn(r, fi, generator=g), torch.randn(fo, r, generator=g), 0.5 + i)
        out.append(AdapterWeights(f"a{i}", Path(f"a{i}.safetensors"), deltas))
        layers.write(i + 1, out[-1])
    return out


@pytest.fixture()
def block():
    torch.manual_seed(0)
    m = Block()
    plain = Block()
    plain.load_state_dict(m.state_dict())
    layers = LoRALayers(m, slots=3, max_rank=4, max_per_request=2)
    return m, plain, layers, _adapters(layers)


def _peft(plain: Block, adapters: list[AdapterWeights], x: torch.Tensor) -> torch.Tensor:
    """Row by row, peft's ``base_layer(x) + lora_B(lora_A(x)) * scaling`` with ``set_adapters``' weights."""

    def linear(layer, name, v, row):
        y = layer(v)
        for s, w in zip(SLOTS[row].tolist(), SCALES[row].tolist(), strict=True):
            d = adapters[s - 1].layers.get(name) if s else None
            if d is not None:
                y = y + (v @ d.A.t() @ d.B.t()) * d.scaling * w
        return y

    rows = []
    for row in range(x.shape[0]):
        h = torch.nn.functional.gelu(linear(plain.up, "up", x[row], row))
        rows.append(x[row] + linear(plain.down, "down", h, row))
    return torch.stack(rows)


def test_each_row_gets_its_own_adapters_deltas_as_peft_computes_them(block):
    m, plain, layers, adapters = block
    x = torch.randn(3, 5, 16)
    with torch.no_grad(), layers.rows(SLOTS, SCALES):
        got = m(x)
    want = _peft(plain, adapters, x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6
    with torch.no_grad():
        base = plain(x)
        assert torch.equal(got[2], base[2])  # slot 0 adds exact zeros
        assert torch.equal(m(x), base)  # no rows: the base layers alone


def test_the_operator_is_registered_as_mutating_only_the_base_output(block):
    """torch's own check of a custom operator (schema, fake tensor, autograd registration), with rows and
    without: what dynamo and inductor rely on to trace it opaque inside a compiled block."""
    _, _, layers, _ = block
    AB = layers.layers["up"].AB
    x = torch.randn(3, 5, 16)
    torch.library.opcheck(lora_add_, (torch.randn(3, 5, 24), x, AB))
    with layers.rows(SLOTS, SCALES):
        torch.library.opcheck(lora_add_, (torch.randn(3, 5, 24), x, AB))


def test_a_layer_with_adapter_rows_runs_four_kernels_beyond_its_base(block):
    """A gather of both halves of the rows' slots, the scaled ``B`` half, ``x A^T`` and the in-place
    ``y += h B``; views launch nothing (each kernel in a CUDA graph costs microseconds, times every wrapped
    layer of the transformer)."""
    _, _, layers, _ = block
    x, y = torch.randn(3, 5, 16), torch.randn(3, 5, 24)
    views = {"slice", "view", "flatten", "transpose", "unsqueeze", "reshape", "as_strided", "_reshape_alias",
             "t", "expand", "detach", "alias", "resolve_conj", "empty"}
    with torch.no_grad(), layers.rows(SLOTS, SCALES), torch.profiler.profile() as prof:
        lora_add_(y, x, layers.layers["up"].AB)
    ops = [e.name.removeprefix("aten::") for e in prof.events()
           if e.cpu_parent is not None and e.cpu_parent.name == "bcg::lora_add_"]
    assert [op for op in ops if op not in views] == ["index", "mul", "bmm", "baddbmm_"], ops


def test_a_compiled_block_updates_each_base_output_in_place_without_a_copy(block):
    """Inductor writes the operator's in-place update into the base layer's output buffer (no clone), so a
    compiled forward of rows without adapters pays nothing per wrapped layer; with rows it equals eager."""
    from torch._inductor.utils import run_and_get_code

    m, plain, layers, adapters = block
    x = torch.randn(3, 5, 16)
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    with torch.no_grad():
        out, code = run_and_get_code(compiled, x)
        assert torch.allclose(out, plain(x), rtol=1e-5, atol=1e-5)
        with layers.rows(SLOTS, SCALES):
            with_rows = compiled(x)
            eager = m(x)
    assert torch.allclose(with_rows, eager, rtol=1e-5, atol=1e-5)
    src = "\n".join(code)
    calls = [line for line in src.splitlines() if "torch.ops.bcg.lora_add_" in line]
    assert len(calls) == 2, src
    assert "clone" not in src and "copy_" not in src, src


def test_the_deltas_share_of_the_wrapped_layers_work_is_reported_and_warned_about_at_start(block, tmp_path, caplog):
    """``delta_share``: per token, ``(in + out) x K x max_rank`` against ``in x out``, summed over the wrapped
    layers; a start above :data:`~bcg_core.lora.slots.DELTA_SHARE_WARN` logs the settings to lower, and
    ``/v1/buckets``' ``lora`` section carries the share."""
    import logging
    from types import SimpleNamespace

    from bcg_core.config import EngineConfig
    from bcg_core.lora.slots import DELTA_SHARE_WARN, install

    _, _, layers, _ = block
    assert layers.delta_share == pytest.approx((16 + 24 + 24 + 16) * 2 * 4 / (16 * 24 + 24 * 16))
    model = SimpleNamespace(lora_loader="FluxPipeline", adapter=SimpleNamespace(model=Block()))
    config = EngineConfig(lora={"dir": str(tmp_path), "slots": 2, "max_rank": 4, "max_per_request": 2})
    with caplog.at_level(logging.INFO, logger="bcg_core.lora.slots"):
        slots = install(config, model)
    try:
        share = slots.describe()["delta_share"]
        assert share == round(layers.delta_share, 4) > DELTA_SHARE_WARN
        (record,) = [r for r in caplog.records if "matmul work" in r.getMessage()]
        assert record.levelno == logging.WARNING and "lower lora.max_rank" in record.getMessage()
        assert f"{100 * share:.1f}%" in record.getMessage()
    finally:
        slots.close()
