"""PixArt buckets: keyed on the latent grid, text rounded up to a bucket and masked, pad rows from row 0.

A tiny ``PixArtTransformer2DModel`` (two blocks, two heads, fp32 on CPU), as diffusers' own
``tests/models/transformers/test_models_transformer_pixart.py``. Every bucket's padded forward (text padded
with masked zeros) must equal the unpadded eager forward at its boundary shapes; a row alone must equal
the same row in a batch; garbage in pad rows and pad text tokens changes nothing. The mask is what makes
text buckets valid: 77 tokens padded to 128 with it equal the unpadded run, without it they do not.
"""

import pytest
import torch
from diffusers import PixArtTransformer2DModel

from bcg_core import (
    BucketConfig, BucketMetrics, BucketTable, DenoiseInputs, Dim, EagerBucketRunner, LimitsConfig,
    PixArtAdapter, ShapeQuery,
)
from bcg_core.verify import boundary_cases, verify_runner
from closeness import RTOL, assert_close, rel_err

CPU = torch.device("cpu")
TEXTS = [32, 128]


def _model(**overrides) -> PixArtTransformer2DModel:
    cfg = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
               cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=24,
               use_additional_conditions=False)
    return PixArtTransformer2DModel(**{**cfg, **overrides}).eval()


@pytest.fixture(scope="module")
def adapter():
    torch.manual_seed(0)
    return PixArtAdapter(_model())


@pytest.fixture(scope="module")
def table(adapter):
    cfg = BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "512x768"], text_lengths=TEXTS)
    return BucketTable(cfg, adapter.rules)


@pytest.fixture(scope="module")
def runner(adapter, table):
    r = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    r.prepare()
    return r


def _inputs(adapter: PixArtAdapter, rows: int, grid: tuple[int, int], text: int,
            seed: int = 0) -> DenoiseInputs:
    g = torch.Generator().manual_seed(seed)
    return DenoiseInputs(
        latents=adapter.example_latents(rows, grid, g),
        text=torch.randn(rows, text, adapter.seq_dim, generator=g),
        pooled=torch.zeros(rows, 0),
        timestep=torch.randint(0, 1000, (rows,), generator=g).float(),
        grid=grid,
    )


def _key(table: BucketTable, rows: int, grid: tuple[int, int], text: int):
    return table.lookup(ShapeQuery(rows, grid[0] * grid[1], text, grid)).key


def test_text_rounds_up_to_a_bucket_and_the_grid_is_keyed(adapter, table):
    assert adapter.rules.native_text_tokens is None and adapter.rules.grid_keyed
    assert _key(table, 1, (16, 16), 77).text_tokens == 128
    assert _key(table, 1, (16, 16), 32).text_tokens == 32
    assert _key(table, 1, (48, 32), 1).latent_hw == (48, 32)
    over = table.lookup(ShapeQuery(1, 256, 129, (16, 16)))
    assert over.missed == (Dim.TEXT,)
    landscape = table.lookup(ShapeQuery(1, 1536, 32, (32, 48)))  # same tokens as 512x768, other grid
    assert landscape.missed == (Dim.IMAGE,)


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(adapter, table, runner):
    cases = boundary_cases(table, LimitsConfig())
    assert {c.key for c in cases} == set(table.keys)
    # Every text bucket is checked with requests that pad text: one below it and the smallest that maps to it.
    assert {c.text_tokens for c in cases} == {1, 31, 32, 33, 127, 128}
    verdicts = verify_runner(adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert [v.key for v in verdicts] == table.keys
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_text_padded_77_to_128_with_the_mask_equals_unpadded_and_without_it_does_not(adapter, table):
    x = _inputs(adapter, 1, (16, 16), text=77, seed=4)
    key = _key(table, 1, (16, 16), 77)
    assert key.text_tokens == 128
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        ref = adapter.forward_eager(x)
        adapter.fill(buf, x)
        assert buf["text_mask"].sum().item() == 77
        assert_close(adapter.unpad(adapter.forward(buf), x), ref)
        buf["text"][:, 77:] = torch.randn(1, 51, adapter.seq_dim, generator=torch.Generator().manual_seed(1))
        buf["text_mask"].fill_(True)
        assert rel_err(adapter.unpad(adapter.forward(buf), x), ref) > 1e-3


def test_no_mask_and_an_all_true_mask_are_the_same_forward_on_cpu(adapter):
    x = _inputs(adapter, 2, (16, 16), text=20, seed=8)
    with torch.inference_mode():
        masked = adapter.forward_eager(x)
        unmasked = adapter.model(x.latents, encoder_hidden_states=x.text, timestep=x.timestep,
                                 added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                                 return_dict=False)[0]
    assert torch.equal(masked, unmasked)


def test_a_prompt_alone_equals_the_same_prompt_inside_a_batch(adapter, table, runner):
    grid = (48, 32)
    batch = _inputs(adapter, 3, grid, text=77, seed=7)  # three prompts of 77 tokens, other noises and times
    together = runner.run(_key(table, 3, grid, 77), batch)
    assert together.shape == (3, 8, 96, 64)
    for i in range(3):
        alone = runner.run(_key(table, 1, grid, 77), batch.select([i]))
        assert_close(together[i : i + 1], alone)
    assert not torch.allclose(together[0], together[1])


def test_prompts_of_different_lengths_in_one_batch_equal_each_prompt_alone_unpadded(adapter, table, runner):
    """Rows carry their own text masks (as the pipeline's tokenizer mask): each row sees only its tokens."""
    grid, lengths = (16, 16), [20, 77, 50]
    batch = _inputs(adapter, 3, grid, text=77, seed=9)
    batch.text_mask = torch.arange(77)[None, :] < torch.tensor(lengths)[:, None]
    together = runner.run(_key(table, 3, grid, 77), batch)
    for i, n in enumerate(lengths):
        row = batch.select([i])
        alone = DenoiseInputs(row.latents, row.text[:, :n], row.pooled, row.timestep, grid)
        with torch.inference_mode():
            assert_close(together[i : i + 1], adapter.forward_eager(alone))


def test_garbage_in_pad_rows_and_pad_text_tokens_changes_nothing(adapter, table):
    grid = (16, 16)
    x = _inputs(adapter, 3, grid, text=40, seed=3)
    key = _key(table, 3, grid, 40)
    assert (key.batch, key.text_tokens) == (4, 128)
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        clean = adapter.unpad(adapter.forward(buf), x).clone()
        g = torch.Generator().manual_seed(99)
        buf["text"][:, 40:] = 1e4 * torch.randn(buf["text"][:, 40:].shape, generator=g)
        for name, scale in (("latents", 1e3), ("text", 1e3), ("timestep", 1e3)):
            buf[name][3:] = scale * torch.randn(buf[name][3:].shape, generator=g)
        dirty = adapter.unpad(adapter.forward(buf), x)
    assert_close(dirty, clean)


def test_stale_data_from_a_larger_request_does_not_leak(adapter, table, runner):
    grid = (16, 16)
    key = _key(table, 4, grid, 128)
    runner.run(key, _inputs(adapter, 4, grid, text=128, seed=11))
    small = _inputs(adapter, 3, grid, text=40, seed=12)
    after_big = runner.run(key, small)
    fresh = EagerBucketRunner(adapter, [key], runner.metrics, CPU, torch.float32)
    fresh.prepare()
    assert_close(after_big, fresh.run(key, small))


def test_inputs_that_do_not_fit_the_bucket_are_refused(adapter, table, runner):
    key = _key(table, 1, (48, 32), 32)
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 2, (48, 32), text=32))
    with pytest.raises(ValueError, match="do not fit"):  # same token count, other grid
        runner.run(key, _inputs(adapter, 1, (32, 48), text=32))
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 1, (48, 32), text=33))


def test_text_buckets_beyond_the_trained_length_and_micro_conditioned_models_are_refused(adapter):
    cfg = BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[512])
    key = BucketTable(cfg, adapter.rules).keys[0]
    with pytest.raises(ValueError, match="300"):
        adapter.allocate(key, CPU, torch.float32)
    with pytest.raises(ValueError, match="use_additional_conditions"):
        PixArtAdapter(_model(use_additional_conditions=True))
