"""SD3 buckets: keyed on the latent grid, native-length unmasked text, pad rows copied from row 0.

A tiny ``SD3Transformer2DModel`` (two joint blocks, two heads, fp32 on CPU), as diffusers' own
``tests/models/transformers/test_models_transformer_sd3.py``. Every bucket's padded forward must equal the
unpadded eager forward at its boundary shapes; a row alone must equal the same row in a batch; garbage in
pad rows changes nothing. The family facts behind the key are checked too: the forward depends on the
grid (so 512x768 and 768x512 are two buckets and a grid not in the table is a miss), and padding the text
changes the output (so text stays at its native length).
"""

import pytest
import torch
from diffusers import SD3Transformer2DModel

from bcg_core import (
    BucketConfig, BucketMetrics, BucketTable, DenoiseInputs, Dim, EagerBucketRunner, LimitsConfig, SD3Adapter,
    ShapeQuery,
)
from bcg_core.verify import boundary_cases, verify_runner
from closeness import RTOL, assert_close, rel_err

TEXT = 12
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def adapter():
    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=20,
        out_channels=4, pos_embed_max_size=64,
    ).eval()
    return SD3Adapter(model, native_text_tokens=TEXT)


@pytest.fixture(scope="module")
def table(adapter):
    sizes = ["256x256", "512x768", "768x512"]
    cfg = BucketConfig(batch_sizes=[1, 2, 4], resolutions=sizes, text_lengths=[TEXT])
    return BucketTable(cfg, adapter.rules)


@pytest.fixture(scope="module")
def runner(adapter, table):
    r = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    r.prepare()
    return r


def _inputs(adapter: SD3Adapter, rows: int, grid: tuple[int, int], seed: int = 0,
            text: int = TEXT) -> DenoiseInputs:
    g = torch.Generator().manual_seed(seed)
    return DenoiseInputs(
        latents=adapter.example_latents(rows, grid, g),
        text=torch.randn(rows, text, adapter.seq_dim, generator=g),
        pooled=torch.randn(rows, adapter.pooled_dim, generator=g),
        timestep=1000 * torch.rand(rows, generator=g),
        grid=grid,
    )


def _query(rows: int, grid: tuple[int, int]) -> ShapeQuery:
    return ShapeQuery(rows, grid[0] * grid[1], TEXT, grid)


def test_portrait_and_landscape_are_different_buckets_and_an_unlisted_grid_misses(adapter, table):
    portrait, landscape = adapter.rules.grid(512, 768), adapter.rules.grid(768, 512)
    assert portrait == (48, 32) and landscape == (32, 48)
    a, b = table.lookup(_query(1, portrait)).key, table.lookup(_query(1, landscape)).key
    assert a.image_tokens == b.image_tokens == 1536
    assert a != b and a.latent_hw == portrait and b.latent_hw == landscape
    square = adapter.rules.grid(512, 512)  # 32 x 32: fewer tokens than both tiers, but not a listed grid
    miss = table.lookup(_query(1, square))
    assert not miss.hit and miss.missed == (Dim.IMAGE,)
    assert len(table) == 9 and all(k.latent_hw is not None and not k.image_mask for k in table.keys)


def test_text_buckets_other_than_the_native_length_are_a_start_up_error(adapter):
    cfg = BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[8, TEXT])
    with pytest.raises(ValueError, match=f"text_lengths: \\[{TEXT}\\]"):
        BucketTable(cfg, adapter.rules)


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(adapter, table, runner):
    cases = boundary_cases(table, LimitsConfig())
    assert {c.key for c in cases} == set(table.keys)
    assert {c.key for c in cases if c.rows < c.key.batch} == {k for k in table.keys if k.batch == 4}  # 3 -> 4
    verdicts = verify_runner(adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert [v.key for v in verdicts] == table.keys
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_a_prompt_alone_equals_the_same_prompt_inside_a_batch(adapter, table, runner):
    grid = (48, 32)
    batch = _inputs(adapter, 3, grid, seed=7)  # three different prompts, noises and timesteps
    together = runner.run(table.lookup(_query(3, grid)).key, batch)
    assert together.shape == (3, 4, 96, 64)
    for i in range(3):
        alone = runner.run(table.lookup(_query(1, grid)).key, batch.select([i]))
        assert_close(together[i : i + 1], alone)
    assert not torch.allclose(together[0], together[1])


def test_garbage_in_pad_rows_changes_nothing(adapter, table):
    grid = (32, 48)
    x = _inputs(adapter, 3, grid, seed=3)
    key = table.lookup(_query(3, grid)).key
    assert key.batch == 4
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        clean = adapter.unpad(adapter.forward(buf), x).clone()
        g = torch.Generator().manual_seed(99)
        for name, scale in (("latents", 1e3), ("text", 1e3), ("pooled", 50.0), ("timestep", 1e3)):
            buf[name][3:] = scale * torch.randn(buf[name][3:].shape, generator=g)
        dirty = adapter.unpad(adapter.forward(buf), x)
    assert_close(dirty, clean)


def test_the_forward_depends_on_the_grid_so_the_key_must_carry_it(adapter):
    """The same latent transposed is not the transposed output: positions are cropped per axis."""
    x = _inputs(adapter, 1, (32, 48), seed=5)
    xt = DenoiseInputs(x.latents.transpose(-1, -2).contiguous(), x.text, x.pooled, x.timestep, (48, 32))
    with torch.inference_mode():
        out, out_t = adapter.forward_eager(x), adapter.forward_eager(xt)
    assert rel_err(out_t.transpose(-1, -2), out) > 1e-3


def test_padding_the_text_changes_the_output_so_text_keeps_its_native_length(adapter):
    short = _inputs(adapter, 1, (16, 16), seed=6, text=TEXT - 4)
    padded = DenoiseInputs(short.latents, torch.cat([short.text, torch.zeros(1, 4, adapter.seq_dim)], dim=1),
                           short.pooled, short.timestep, short.grid)
    with torch.inference_mode():
        assert rel_err(adapter.forward_eager(padded), adapter.forward_eager(short)) > 1e-3


def test_stale_data_from_a_larger_request_does_not_leak(adapter, table, runner):
    grid = (16, 16)
    key = table.lookup(_query(4, grid)).key
    runner.run(key, _inputs(adapter, 4, grid, seed=11))
    small = _inputs(adapter, 3, grid, seed=12)
    after_big = runner.run(key, small)
    fresh = EagerBucketRunner(adapter, [key], runner.metrics, CPU, torch.float32)
    fresh.prepare()
    assert_close(after_big, fresh.run(key, small))


def test_inputs_that_do_not_fit_the_bucket_are_refused(adapter, table, runner):
    key = table.lookup(_query(1, (48, 32))).key
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 2, (48, 32)))
    with pytest.raises(ValueError, match="do not fit"):  # same token count, other grid
        runner.run(key, _inputs(adapter, 1, (32, 48)))
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 1, (48, 32), text=TEXT - 1))
    x = _inputs(adapter, 1, (48, 32))
    x.text_mask = torch.ones(1, TEXT, dtype=torch.bool)
    with pytest.raises(ValueError, match="unmasked"):
        runner.run(key, x)


def test_a_grid_beyond_the_position_table_is_a_start_up_error(adapter):
    cfg = BucketConfig(batch_sizes=[1], resolutions=["1280x256"], text_lengths=[TEXT])  # 80 tokens wide > 64
    key = BucketTable(cfg, adapter.rules).keys[0]
    with pytest.raises(ValueError, match="pos_embed_max_size 64"):
        adapter.allocate(key, CPU, torch.float32)
