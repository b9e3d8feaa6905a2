"""Precompiled blocks (bcg_core/runners/precompiled.py): which blocks and inputs share one ahead-of-time compiled
function, that it reads each call's own block weights, and that a file on disk is loaded, rebuilt when torn and
deleted when its bucket fails its check."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

from bcg_core.runners.precompiled import PrecompiledBlocks, available, block_signature, inputs_signature

pytestmark = pytest.mark.skipif(not available(torch.compile), reason="torch without ahead-of-time compile")

OPTIONS = dict(fullgraph=True, dynamic=False, backend="inductor")


def _flux_block(seed: int) -> FluxTransformerBlock:
    torch.manual_seed(seed)
    return FluxTransformerBlock(dim=64, num_attention_heads=2, attention_head_dim=32).eval()


def _inputs(tokens: int = 16, rows: int = 2) -> dict:
    g = torch.Generator().manual_seed(tokens)
    return dict(hidden_states=torch.randn(rows, tokens, 64, generator=g),
                encoder_hidden_states=torch.randn(rows, 8, 64, generator=g), temb=torch.randn(rows, 64, generator=g),
                image_rotary_emb=(torch.randn(tokens + 8, 32, generator=g), torch.randn(tokens + 8, 32, generator=g)))


def test_blocks_of_one_structure_share_a_signature_and_other_flags_or_dtypes_do_not():
    assert block_signature(_flux_block(0)) == block_signature(_flux_block(1))  # weights are inputs, not the key
    last = JointTransformerBlock(dim=64, num_attention_heads=2, attention_head_dim=32, context_pre_only=True)
    other = JointTransformerBlock(dim=64, num_attention_heads=2, attention_head_dim=32, context_pre_only=False)
    assert block_signature(last) != block_signature(other)  # SD3's last joint block takes another path
    assert block_signature(_flux_block(0)) != block_signature(_flux_block(0).to(torch.bfloat16))


def test_a_change_to_a_submodule_or_processor_class_is_another_key(tmp_path, monkeypatch):
    """The key hashes the source of every class the block runs (its submodules' and their processors'), so code
    changed under the same class names never loads a file compiled from the old code."""
    from bcg_core.runners import precompiled

    block = _flux_block(0)
    store = PrecompiledBlocks(tmp_path, OPTIONS, torch.device("cpu"))
    before = store._file_name(repr(store._block(block)), block, "math")
    processor = type(block.attn.processor)
    monkeypatch.setattr(precompiled, "_class_code",
                        lambda cls: "changed" if cls is processor else precompiled.inspect.getsource(cls))
    fresh = PrecompiledBlocks(tmp_path, OPTIONS, torch.device("cpu"))
    assert fresh._file_name(repr(fresh._block(block)), block, "math") != before


def test_inputs_differing_in_shape_stride_or_aliasing_get_their_own_signature():
    x = _inputs()
    assert inputs_signature((), x) == inputs_signature((), _inputs())
    assert inputs_signature((), x) != inputs_signature((), _inputs(20))
    strided = dict(x, hidden_states=torch.randn(2, 64, 16).transpose(1, 2))
    assert inputs_signature((), x) != inputs_signature((), strided)
    joint = torch.randn(2, 24, 64)
    views = dict(x, encoder_hidden_states=joint[:, :8], hidden_states=joint[:, 8:])
    copies = dict(x, encoder_hidden_states=joint[:, :8].clone(), hidden_states=joint[:, 8:].clone())
    assert inputs_signature((), views) != inputs_signature((), copies)
    outside = inputs_signature((), x)
    with torch.inference_mode():
        assert inputs_signature((), x) != outside


def test_a_dynamic_batch_dimension_gives_every_batch_of_one_token_shape_one_signature():
    two, four = _inputs(rows=2), _inputs(rows=4)
    assert inputs_signature((), two) != inputs_signature((), four)  # static shapes: one signature per batch
    assert inputs_signature((), two, batch=2) == inputs_signature((), four, batch=4)
    assert inputs_signature((), two, batch=2) != inputs_signature((), _inputs(20, rows=4), batch=4)  # tokens differ
    # the rotary tables (tokens x channels) keep their sizes: only a first size equal to the batch reads B
    assert "(24, 32)" in inputs_signature((), four, batch=4) and "('B', 16, 64)" in inputs_signature((), four, batch=4)


def test_one_function_serves_every_batch_size_above_one_with_a_dynamic_batch_dimension(tmp_path):
    from bcg_core.runners.kernels import shared_batch

    block = _flux_block(0)
    store = PrecompiledBlocks(tmp_path, OPTIONS, torch.device("cpu"))
    with torch.no_grad():
        x2, x4 = _inputs(rows=2), _inputs(rows=4)
        fn = store.function(block, (), x2, "math", batch=shared_batch((), x2))
        assert store.function(block, (), x4, "math", batch=shared_batch((), x4)) is fn and store.saves == 1
        for got, ref in zip(fn(block, **x4), block(**x4), strict=True):  # traced at 2 rows, run at 4
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        restart = PrecompiledBlocks(tmp_path, OPTIONS, torch.device("cpu"))
        x3 = _inputs(rows=3)
        again = restart.function(block, (), x3, "math", load_only=True, batch=shared_batch((), x3))
        assert (restart.loads, restart.saves) == (1, 0)
        for got, ref in zip(again(block, **x3), block(**x3), strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        # another SDPA backend at the same shapes is another function, in memory as on disk
        store.function(block, (), x4, "flash", batch=4)
        assert store.saves == 2


def test_one_row_and_inputs_too_large_for_32_bit_indexing_compile_per_shape(monkeypatch):
    from bcg_core.runners import kernels

    assert kernels.shared_batch((), _inputs(rows=1)) is None
    assert kernels.shared_batch((), _inputs(rows=3)) == 3
    monkeypatch.setattr(kernels, "INDEX_MARGIN", 2**31 // (3 * 16 * 64) + 1)  # hidden_states now too large
    assert kernels.shared_batch((), _inputs(rows=3)) is None


def test_one_function_serves_every_block_loads_from_disk_and_rebuilds_a_torn_file(tmp_path):
    a, b = _flux_block(0), _flux_block(1)
    x = _inputs()
    with torch.no_grad():
        expect = b(**x)
        store = PrecompiledBlocks(tmp_path, OPTIONS, torch.device("cpu"))
        fn = store.function(a, (), x, "math")
        assert store.function(b, (), x, "math") is fn and store.saves == 1
        for got, ref in zip(fn(b, **x), expect, strict=True):  # b's own weights, not a's
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        (path,) = tmp_path.glob("FluxTransformerBlock-*.aot")

        restart = PrecompiledBlocks(tmp_path, OPTIONS, torch.device("cpu"))
        again = restart.function(b, (), x, "math")
        assert (restart.loads, restart.saves) == (1, 0)
        for got, ref in zip(again(b, **x), expect, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        flash = PrecompiledBlocks(tmp_path, OPTIONS, torch.device("cpu"))
        flash.function(b, (), x, "flash")
        assert (flash.loads, flash.saves, len(list(tmp_path.glob("*.aot")))) == (0, 1, 2)  # another backend: a file
        assert oct(path.stat().st_mode & 0o777) == oct(0o644)  # readable by replicas of another user

        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        torn = PrecompiledBlocks(tmp_path, OPTIONS, torch.device("cpu"))
        rebuilt = torn.function(b, (), x, "math")
        assert (torn.loads, torn.rebuilt, torn.saves) == (0, 1, 1)
        for got, ref in zip(rebuilt(b, **x), expect, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)

        # a bucket whose check failed: what its compile used is forgotten and its file deleted, never loaded again
        torn.begin()
        assert torn.function(b, (), x, "math") is rebuilt  # from memory, recorded as used
        assert torn.discard_used() == 1 and not path.exists() and torn.discarded == 1
        assert torn.function(b, (), x, "math") is not rebuilt and torn.saves == 2 and path.exists()


def test_a_block_class_whose_ahead_of_time_compile_raises_is_traced_once_for_all_its_blocks(tmp_path, monkeypatch):
    from bcg_core.runners.kernels import CompiledKernels

    class Model(torch.nn.Module):
        _repeated_blocks = ("FluxTransformerBlock",)

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(_flux_block(i) for i in range(3))

    attempts = []

    def unserializable(self, block, args, kwargs, attention, load_only=False, batch=None):
        attempts.append(block)
        raise RuntimeError("cannot serialize this tensor subclass")

    monkeypatch.setattr(PrecompiledBlocks, "function", unserializable)
    model, x = Model(), _inputs()
    kernels = CompiledKernels(model, cache_dir=str(tmp_path))
    with torch.no_grad():
        expect = [blk(**x) for blk in model.blocks]
        with kernels.compiling(None):
            got = [blk(**x) for blk in model.blocks]
    assert len(attempts) == 1  # one attempt for the class, then every block is traced by dynamo
    for g, e in zip(got, expect, strict=True):
        torch.testing.assert_close(g[1], e[1], rtol=1e-4, atol=1e-5)


def test_a_mode_other_than_default_compiles_ahead_of_time_as_its_inductor_options(tmp_path):
    """``runner.compile_mode: max-autotune-no-cudagraphs``: ``torch.compile`` refuses ``mode`` beside ``options``, so
    the ahead-of-time compile once raised and every block fell back to a plain compile, with nothing saved to disk."""
    from bcg_core.runners.precompiled import compile_options

    autotune = {**OPTIONS, "mode": "max-autotune-no-cudagraphs"}
    options = compile_options(autotune)
    assert "mode" not in options and options["options"]["max_autotune"] is True
    assert options["options"]["guard_filter_fn"] is torch.compiler.skip_all_guards_unsafe
    assert "mode" in autotune and "options" not in autotune  # the caller's dict is left as it was
    assert compile_options({**OPTIONS, "mode": "default"})["options"] == {
        "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    torch.manual_seed(0)
    block, x = _Linear(), {"hidden_states": torch.randn(4, 16)}  # a block of one matmul: autotuning it is quick
    with torch.no_grad():
        store = PrecompiledBlocks(tmp_path, autotune, torch.device("cpu"))
        fn = store.function(block, (), x, "math")
        assert store.saves == 1 and len(list(tmp_path.glob("_Linear-*.aot"))) == 1
        torch.testing.assert_close(fn(block, **x), block(**x), rtol=1e-4, atol=1e-5)


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, hidden_states):
        return torch.nn.functional.gelu(self.proj(hidden_states))
