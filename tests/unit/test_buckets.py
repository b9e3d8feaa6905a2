"""Bucket table: round-up at and around every boundary, misses that name the dimension, bad configs."""

import pytest
from pydantic import ValidationError

from bcg_core import BucketConfig, BucketKey, BucketTable, Dim, MissPolicy, ShapeQuery, ShapeRules, parse_size

FLUX_RULES = ShapeRules(pixels_per_token=16, grid_keyed=False, native_text_tokens=None)
GRID_RULES = ShapeRules(pixels_per_token=16, grid_keyed=True, native_text_tokens=None)


def _table(rules=FLUX_RULES, **kw):
    base = dict(batch_sizes=[1, 2, 4, 8], resolutions=["256x256", "512x512", "512x768"], text_lengths=[32, 64, 128])
    base.update(kw)
    return BucketTable(BucketConfig(**base), rules)


def _brute_up(values, v):
    ups = [b for b in values if b >= v]
    return min(ups) if ups else None


def test_every_value_rounds_up_to_the_smallest_bucket_that_holds_it():
    t = _table()
    assert t.image_tiers == (256, 1024, 1536)
    for b in range(1, 10):
        for s in range(1, 1540, 7):
            for text in (1, 31, 32, 33, 64, 65, 127, 128, 129):
                lk = t.lookup(ShapeQuery(b, s, text))
                want = (_brute_up(t.batch_sizes, b), _brute_up(t.image_tiers, s), _brute_up(t.text_lengths, text))
                if None in want:
                    assert not lk.hit and lk.key is None
                else:
                    masked = s not in t.image_tiers
                    assert lk.hit and lk.key == BucketKey(*want, image_mask=masked), (b, s, text)


@pytest.mark.parametrize("dim,values", [("batch", [1, 2, 4, 8]), ("text", [32, 64, 128])])
def test_boundaries_at_one_below_and_one_above(dim, values):
    t = _table()
    prev = 0
    for v in values:
        for probe, expect in ((v, v), (v - 1, v if v - 1 > prev else prev), (prev + 1, v)):
            if probe <= 0:
                continue
            q = ShapeQuery(probe, 256, 32) if dim == "batch" else ShapeQuery(1, 256, probe)
            key = t.lookup(q).key
            assert (key.batch if dim == "batch" else key.text_tokens) == expect
        prev = v


def test_image_token_boundaries():
    t = _table()
    assert t.lookup(ShapeQuery(1, 256, 32)).key.image_tokens == 256
    assert t.lookup(ShapeQuery(1, 257, 32)).key.image_tokens == 1024
    assert t.lookup(ShapeQuery(1, 1023, 32)).key.image_tokens == 1024
    assert t.lookup(ShapeQuery(1, 1025, 32)).key.image_tokens == 1536
    assert t.lookup(ShapeQuery(1, 1536, 32)).key.image_tokens == 1536


def test_misses_name_every_dimension_that_missed():
    t = _table()
    assert t.lookup(ShapeQuery(9, 256, 32)).missed == (Dim.BATCH,)
    assert t.lookup(ShapeQuery(1, 1537, 32)).missed == (Dim.IMAGE,)
    assert t.lookup(ShapeQuery(1, 256, 129)).missed == (Dim.TEXT,)
    lk = t.lookup(ShapeQuery(9, 5000, 500))
    assert set(lk.missed) == {Dim.BATCH, Dim.IMAGE, Dim.TEXT}
    assert lk.padded_tokens == lk.query.tokens  # a miss runs unpadded


def test_grid_keyed_family_keys_on_the_exact_grid():
    t = _table(rules=GRID_RULES, resolutions=["512x512", "512x768", "768x512"])
    assert t.lookup(ShapeQuery(1, 32 * 48, 32, (48, 32))).key.latent_hw == (48, 32)
    assert t.lookup(ShapeQuery(1, 32 * 48, 32, (32, 48))).key.latent_hw == (32, 48)
    miss = t.lookup(ShapeQuery(1, 30 * 30, 32, (30, 30)))
    assert miss.missed == (Dim.IMAGE,)
    assert len(t.keys) == len(t) == 4 * 3 * 3
    assert not any(k.image_mask for k in t.keys)


def test_keys_are_unique_and_cover_the_product():
    t = _table()
    assert len(set(t.keys)) == len(t.keys) == len(t) == 4 * (3 + 3) * 3  # every tier exact and masked
    assert str(BucketKey(2, 1024, 64)) == "b2_i1024_t64"
    assert str(BucketKey(2, 1024, 64, image_mask=True)) == "b2_i1024_m_t64"


def test_exact_fits_run_unmasked_and_sizes_between_tiers_masked():
    t = _table()
    assert t.lookup(ShapeQuery(1, 1024, 32)).key.image_mask is False
    assert t.lookup(ShapeQuery(1, 1000, 32)).key == BucketKey(1, 1024, 32, image_mask=True)
    exact = _table(image_padding="exact")
    assert len(exact) == 4 * 3 * 3
    assert exact.lookup(ShapeQuery(1, 1000, 32)).missed == (Dim.IMAGE,)
    assert exact.lookup(ShapeQuery(1, 1024, 32)).key == BucketKey(1, 1024, 32)


def test_a_tier_that_no_valid_request_can_pad_into_gets_no_masked_variant():
    t = BucketTable(BucketConfig(batch_sizes=[1], resolutions=["256x256", "512x512"], text_lengths=[32]),
                    FLUX_RULES, min_image_tokens=256)
    assert [str(k) for k in t.keys] == ["b1_i256_t32", "b1_i1024_t32", "b1_i1024_m_t32"]
    assert BucketKey(2, 1024, 64).tokens == 2 * (1024 + 64)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(batch_sizes=[4, 2]), "strictly ascending"),
        (dict(batch_sizes=[1, 1, 2]), "strictly ascending"),
        (dict(batch_sizes=[0, 2]), "must be positive"),
        (dict(batch_sizes=[]), "at least one"),
        (dict(text_lengths=[-3]), "must be positive"),
        (dict(resolutions=["big"]), "not of the form 'WxH'"),
        (dict(resolutions=["512x512", "512x512"]), "listed twice"),
        (dict(resolutions=[]), "at least one"),
        (dict(miss_policy="sometimes"), "miss_policy"),
        (dict(unknown_field=1), "unknown_field"),
    ],
)
def test_bad_configs_are_rejected_with_a_message_naming_the_value(kw, needle):
    with pytest.raises(ValidationError) as e:
        BucketConfig(**kw)
    assert needle in str(e.value)


def test_resolution_not_a_multiple_of_the_token_size_suggests_the_fix():
    with pytest.raises(ValueError, match="width 500 is not a multiple of 16; use 496 or 512"):
        _table(resolutions=["500x512"])


def test_fixed_length_text_model_rejects_text_buckets():
    rules = ShapeRules(pixels_per_token=16, grid_keyed=False, native_text_tokens=256)
    with pytest.raises(ValueError, match=r"use text_lengths: \[256\]"):
        _table(rules=rules, text_lengths=[64, 256])
    assert _table(rules=rules, text_lengths=[256]).text_lengths == (256,)


def test_resolutions_with_equal_token_counts_are_rejected_for_count_keyed_models():
    with pytest.raises(ValueError, match="same number of image tokens"):
        _table(resolutions=["512x768", "768x512"])


def test_parse_size_and_policy_defaults():
    assert parse_size("512x768") == (512, 768)
    with pytest.raises(ValueError):
        parse_size("512")
    assert BucketConfig().miss_policy is MissPolicy.EAGER


def test_a_tier_with_its_own_text_buckets_rounds_its_text_among_them():
    """``text_lengths_by_resolution``: 512x512 has fine text buckets, the other tiers the coarse ``text_lengths``;
    every lookup agrees with a brute-force round-up among its tier's own buckets."""
    t = _table(text_lengths=[128], text_lengths_by_resolution={"512x512": [32, 64, 128]}, image_padding="exact")
    assert t.text_lengths == (32, 64, 128)
    assert t.texts_for(1024) == (32, 64, 128) and t.texts_for(1536) == (128,) and t.texts_for(256) == (128,)
    assert len(t) == 4 * (1 + 3 + 1) and len(set(t.keys)) == len(t)
    for tokens, texts in ((256, (128,)), (1024, (32, 64, 128)), (1536, (128,))):
        for text in (1, 31, 32, 33, 64, 65, 128, 129):
            lk = t.lookup(ShapeQuery(2, tokens, text))
            want = _brute_up(texts, text)
            if want is None:
                assert lk.missed == (Dim.TEXT,)
            else:
                assert lk.key == BucketKey(2, tokens, want), (tokens, text)
    # a masked size between tiers takes the text buckets of the tier it pads into
    m = _table(text_lengths=[128], text_lengths_by_resolution={"512x512": [32, 128]})
    assert m.lookup(ShapeQuery(1, 900, 20)).key == BucketKey(1, 1024, 32, image_mask=True)
    assert m.lookup(ShapeQuery(1, 1100, 20)).key == BucketKey(1, 1536, 128, image_mask=True)
    assert m.describe_limits()["text_tokens_by_resolution"] == {"512x512": [32, 128]}
    g = _table(GRID_RULES, text_lengths=[128], text_lengths_by_resolution={"512x768": [64, 128]})
    assert g.lookup(ShapeQuery(1, 1536, 50, (48, 32))).key == BucketKey(1, 1536, 64, (48, 32))
    assert g.lookup(ShapeQuery(1, 1024, 50, (32, 32))).key == BucketKey(1, 1024, 128, (32, 32))


@pytest.mark.parametrize("by_res,needle", [
    ({"640x640": [32]}, "not in resolutions"),
    ({"512x512": [64, 32]}, "strictly ascending"),
    ({"512x512": []}, "at least one value"),
    ({"big": [32]}, "big"),
])
def test_bad_per_tier_text_buckets_are_rejected_naming_the_fix(by_res, needle):
    with pytest.raises(ValidationError, match=needle):
        BucketConfig(resolutions=["256x256", "512x512"], text_lengths=[128], text_lengths_by_resolution=by_res)


def test_fixed_length_text_model_rejects_per_tier_text_buckets():
    native = ShapeRules(pixels_per_token=16, grid_keyed=False, native_text_tokens=256)
    with pytest.raises(ValueError, match=r"use text_lengths: \[256\] and no text_lengths_by_resolution"):
        _table(native, text_lengths=[256], text_lengths_by_resolution={"512x512": [64, 256]})
