"""The article's central warning: a padded bucket run must equal the unpadded eager run.

For every bucket of a small test table, at the bucket size, one below it and the smallest request size
that maps to it (in each dimension), the padded forward (static buffers, pad rows copied from row 0,
masked pad image tokens) equals the unpadded, unmasked reference forward in fp32. Also: a row alone
equals the same row among other prompts, and garbage in pad slots changes nothing.
"""

import itertools

import pytest
import torch
from diffusers import FluxTransformer2DModel

from bcg_core import (
    BucketConfig, BucketMetrics, BucketTable, DenoiseInputs, EagerBucketRunner, FluxAdapter, LimitsConfig,
    ShapeQuery,
)

TEXT = 12
RTOL = 1e-5


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
    return BucketTable(cfg, adapter.rules)


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


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert not torch.isnan(a).any()
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err < RTOL, f"relative error {err:.2e}"


def _valid_grids(limits: LimitsConfig, step: int) -> list[tuple[int, int]]:
    sides = range(limits.min_side_px // step, limits.max_side_px // step + 1)
    return [(h, w) for h in sides for w in sides]


def _boundary_cases(table: BucketTable, limits: LimitsConfig):
    """(bucket, rows, grid) at each bucket's size, one below it, and the smallest request that maps to it.

    The bucket is the one the table picks: "one below" a bucket's size may fall into the next smaller bucket.
    """
    grids = _valid_grids(limits, table.rules.pixels_per_token)
    for key in table.keys:
        prev_b = max([b for b in table.batch_sizes if b < key.batch], default=0)
        rows = sorted({key.batch, key.batch - 1, prev_b + 1} - {0})
        prev_t = max([t for t in table.image_tiers if t < key.image_tokens], default=0)
        mapped = [g for g in grids if prev_t < g[0] * g[1] <= key.image_tokens]
        exact = [g for g in mapped if g[0] * g[1] == key.image_tokens][:1]
        below = [max(mapped, key=lambda g: (g[0] * g[1] < key.image_tokens, g[0] * g[1]))] if len(mapped) > 1 else []
        below = [g for g in below if g[0] * g[1] < key.image_tokens]
        smallest = [min(mapped, key=lambda g: g[0] * g[1])]
        for r, g in itertools.product(rows, {*exact, *below, *smallest}):
            yield table.lookup(ShapeQuery(r, g[0] * g[1], TEXT)).key, r, g


def test_boundary_cases_cover_every_bucket_and_round_up(table):
    cases = list(_boundary_cases(table, LimitsConfig()))
    assert {k for k, _, _ in cases} == set(table.keys)
    for key, rows, grid in cases:
        assert rows <= key.batch and grid[0] * grid[1] <= key.image_tokens
    exact = {k for k, r, g in cases if r == k.batch and g[0] * g[1] == k.image_tokens}
    assert exact == set(table.keys)
    # Some case of each non-smallest bucket really pads in each dimension.
    assert any(r < k.batch for k, r, _ in cases)
    assert any(g[0] * g[1] < k.image_tokens for k, _, g in cases)


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(adapter, table, runner):
    n = 0
    for key, rows, grid in _boundary_cases(table, LimitsConfig()):
        x = _inputs(rows, grid, seed=n)
        with torch.inference_mode():
            ref = adapter.forward_eager(x)
        out = runner.run(key, x)
        assert out.shape == ref.shape == (rows, grid[0] * grid[1], 16)
        _close(out, ref)
        n += 1
    assert n >= 3 * len(table.keys)


def test_a_prompt_alone_equals_the_same_prompt_inside_a_batch(table, runner):
    grid = (20, 18)
    key = table.lookup(ShapeQuery(4, 360, TEXT)).key
    batch = _inputs(3, grid, seed=7)  # three different prompts (text, pooled) and noises
    together = runner.run(key, batch)
    for i in range(3):
        alone = runner.run(table.lookup(ShapeQuery(1, 360, TEXT)).key, batch.select([i]))
        _close(together[i : i + 1], alone)
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
    _close(dirty, clean)


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
    key = table.lookup(ShapeQuery(4, 576, TEXT)).key
    big = _inputs(4, (24, 24), seed=11)
    small = _inputs(1, (16, 17), seed=12)
    runner.run(key, big)
    after_big = runner.run(key, small)
    fresh = EagerBucketRunner(runner.adapter, [key], runner.metrics, torch.device("cpu"), torch.float32)
    fresh.prepare()
    _close(after_big, fresh.run(key, small))


def test_inputs_that_do_not_fit_the_bucket_are_refused(adapter, table, runner):
    key = table.lookup(ShapeQuery(1, 256, TEXT)).key
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(2, (16, 16)))
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(1, (16, 17)))
