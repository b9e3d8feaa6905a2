"""The article's central warning: a padded bucket run must equal the unpadded eager run.

For every bucket of a small test table, at the bucket size, one below it and the smallest request size
that maps to it (in each dimension), the padded forward (static buffers, pad rows copied from row 0,
masked pad image tokens) equals the unpadded, unmasked reference forward in fp32. Also: a row alone
equals the same row among other prompts, and garbage in pad slots changes nothing.
"""

import pytest
import torch
from diffusers import FluxTransformer2DModel

from bcg_core import (
    BucketConfig,
    BucketMetrics,
    BucketTable,
    DenoiseInputs,
    EagerBucketRunner,
    FluxAdapter,
    LimitsConfig,
    ShapeQuery,
)
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases
from closeness import RTOL, assert_close

TEXT = 12


@pytest.fixture(scope="module")
def adapter():
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=24, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    return FluxAdapter(model, native_text_tokens=TEXT)


@pytest.fixture(scope="module")
def table(adapter):
    cfg = BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "384x384", "512x512"], text_lengths=[TEXT])
    return BucketTable(cfg, adapter.rules, min_image_tokens=256)


@pytest.fixture(scope="module")
def runner(adapter, table):
    r = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), torch.device("cpu"), torch.float32)
    r.prepare()
    return r


def _inputs(rows: int, grid: tuple[int, int], seed: int = 0) -> DenoiseInputs:
    g = torch.Generator().manual_seed(seed)
    tokens = grid[0] * grid[1]
    return DenoiseInputs(
        latents=torch.randn(rows, tokens, 16, generator=g),
        text=torch.randn(rows, TEXT, 24, generator=g),
        pooled=torch.randn(rows, 24, generator=g),
        timestep=torch.rand(rows, generator=g),
        grid=grid,
    )


def test_boundary_cases_cover_every_bucket_and_round_up(table):
    cases = boundary_cases(table, LimitsConfig())
    assert {c.key for c in cases} == set(table.keys)
    for c in cases:
        assert table.lookup(ShapeQuery(c.rows, c.grid[0] * c.grid[1], TEXT)).key == c.key
    exact = {c.key for c in cases if c.rows == c.key.batch and c.grid[0] * c.grid[1] == c.key.image_tokens}
    assert exact == {k for k in table.keys if not k.image_mask}
    assert {c.key for c in cases if c.key.image_mask} == {k for k in table.keys if k.image_mask}
    # Every bucket above the smallest in a dimension is checked with a request that pads that dimension.
    assert {c.key for c in cases if c.rows < c.key.batch} == {k for k in table.keys if k.batch == 4}  # 3 -> 4
    assert {c.key for c in cases if c.grid[0] * c.grid[1] < c.key.image_tokens} == {
        k for k in table.keys if k.image_mask}


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(adapter, table, runner):
    cases = boundary_cases(table, LimitsConfig())
    verdicts = verify_runner(adapter, runner, cases, torch.device("cpu"), torch.float32, rtol=RTOL)
    assert [v.key for v in verdicts] == table.keys
    failed = [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]
    assert not failed
    assert sum(v.cases for v in verdicts) > len(table.keys)


def test_a_prompt_alone_equals_the_same_prompt_inside_a_batch(table, runner):
    grid = (20, 18)
    key = table.lookup(ShapeQuery(4, 360, TEXT)).key
    batch = _inputs(3, grid, seed=7)  # three different prompts (text, pooled) and noises
    together = runner.run(key, batch)
    for i in range(3):
        alone = runner.run(table.lookup(ShapeQuery(1, 360, TEXT)).key, batch.select([i]))
        assert_close(together[i : i + 1], alone)
    assert not torch.allclose(together[0], together[1])


def test_garbage_in_pad_slots_changes_nothing(adapter, table):
    grid = (17, 16)
    x = _inputs(3, grid, seed=3)
    key = table.lookup(ShapeQuery(3, 272, TEXT)).key
    assert key.batch == 4 and key.image_tokens == 576
    buf = adapter.allocate(key, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        clean = adapter.unpad(adapter.forward(buf), x).clone()
        g = torch.Generator().manual_seed(99)
        buf["latents"][:, 272:] = 1e4 * torch.randn(buf["latents"][:, 272:].shape, generator=g)
        buf["latents"][3:] = torch.randn(buf["latents"][3:].shape, generator=g)
        buf["text"][3:] = torch.randn(buf["text"][3:].shape, generator=g)
        buf["pooled"][3:] = 50 * torch.randn(buf["pooled"][3:].shape, generator=g)
        buf["img_ids"][272:] = 1e3 * torch.randn(buf["img_ids"][272:].shape, generator=g)
        dirty = adapter.unpad(adapter.forward(buf), x)
    assert_close(dirty, clean)


def test_without_the_mask_padding_would_change_the_output(adapter, table):
    """Guards the test above: the mask, not luck, keeps pad tokens out."""
    grid = (17, 16)
    x = _inputs(1, grid, seed=4)
    key = table.lookup(ShapeQuery(1, 272, TEXT)).key
    buf = adapter.allocate(key, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        buf["attn_mask"].fill_(True)
        unmasked = adapter.unpad(adapter.forward(buf), x)
        ref = adapter.forward_eager(x)
    assert ((unmasked - ref).abs().max() / ref.abs().max()).item() > 1e-3


def test_stale_data_from_a_larger_request_does_not_leak(table, runner):
    key = table.lookup(ShapeQuery(4, 500, TEXT)).key
    assert key.image_mask and key.image_tokens == 576
    big = _inputs(4, (20, 25), seed=11)
    small = _inputs(1, (16, 17), seed=12)
    runner.run(key, big)
    after_big = runner.run(key, small)
    fresh = EagerBucketRunner(runner.adapter, [key], runner.metrics, torch.device("cpu"), torch.float32)
    fresh.prepare()
    assert_close(after_big, fresh.run(key, small))


def test_inputs_that_do_not_fit_the_bucket_are_refused(adapter, table, runner):
    key = table.lookup(ShapeQuery(1, 256, TEXT)).key
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(2, (16, 16)))
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(1, (16, 17)))
    exact = table.lookup(ShapeQuery(1, 576, TEXT)).key
    with pytest.raises(ValueError, match="do not fit"):  # an unmasked bucket cannot hold fewer tokens
        runner.run(exact, _inputs(1, (16, 17)))
