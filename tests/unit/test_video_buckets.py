"""Video buckets: latent frames in the key beside the grid (``_g<f>x<h>x<w>``), the table's frame tiers, and the
request rules of ``num_frames`` (1 + 4k, video models only), on shape rules alone (no checkpoint)."""

import pytest
from pydantic import ValidationError

from bcg_core import BucketConfig, BucketKey, BucketTable, Dim, EngineConfig, ShapeQuery, ShapeRules
from bcg_core.errors import RequestError
from bcg_core.families import ModelSpec
from bcg_core.keys import BucketShape
from bcg_core.request import GenerationRequest
from bcg_core.validation import RequestValidator

VIDEO = ShapeRules(pixels_per_token=16, grid_keyed=True, native_text_tokens=512, frame_stride=4)
IMAGE = ShapeRules(pixels_per_token=16, grid_keyed=True, native_text_tokens=None)


def _table(**kw) -> BucketTable:
    base = dict(batch_sizes=[1, 2, 4], resolutions=["832x480", "480x832"], text_lengths=[512], frames=[33, 81])
    return BucketTable(BucketConfig(**{**base, **kw}), VIDEO)


@pytest.mark.parametrize("text", ["b2_i32760_t512_g21x30x52", "b1_i1024_m_t256_g32x32", "b8_i1024_t256",
                                  "b4_i90_t32_g9x10"])
def test_keys_with_and_without_frames_round_trip_through_their_string(text):
    key = BucketKey.parse(text)
    assert str(key) == text and BucketKey.parse(str(key)) == key
    assert BucketShape.parse(str(key.shape)).key(key.batch) == key


def test_a_video_key_holds_its_latent_frames_beside_the_grid():
    key = BucketKey.parse("b2_i32760_t512_g21x30x52")
    assert (key.frames, key.latent_hw, key.grid, key.image_tokens) == (21, (30, 52), (21, 30, 52), 21 * 30 * 52)
    shape = key.shape
    assert (shape.frames, shape.latent_hw, shape.grid) == (21, (30, 52), (21, 30, 52))
    assert BucketShape.of(32760, 512, (30, 52), frames=21) == "i32760_t512_g21x30x52"
    image = BucketKey.parse("b4_i90_t32_g9x10")  # image keys are unchanged: no frames, a 2D grid
    assert (image.frames, image.grid, image.shape.frames) == (None, (9, 10), None)
    assert BucketKey.parse("b1_i1024_t256").grid is None


@pytest.mark.parametrize("text,needle", [
    ("i32761_t512_g21x30x52", "frames x h x w = 32760, not 32761"),
    ("i100_t512_g1x2x3x4", "i32760_t512_g21x30x52"),  # four sides: not a shape; the format is named
])
def test_a_bad_video_shape_is_refused_naming_the_rule(text, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        BucketShape.parse(text)


def test_the_table_keys_each_resolution_at_each_frame_count_exactly():
    t = _table()
    assert t.frames == (9, 21)  # 33 and 81 frames: (n - 1) / 4 + 1 latent frames
    assert t.grids == ((9, 30, 52), (9, 52, 30), (21, 30, 52), (21, 52, 30))
    assert {str(k) for k in t.keys if k.batch == 1} == {
        "b1_i14040_t512_g9x30x52", "b1_i14040_t512_g9x52x30", "b1_i32760_t512_g21x30x52", "b1_i32760_t512_g21x52x30"}
    lk = t.lookup(ShapeQuery(3, 32760, 512, (30, 52), 21))
    assert lk.hit and str(lk.key) == "b4_i32760_t512_g21x30x52"  # only the batch rounds up
    for frames in (8, 10, 20):  # frames between the tiers or beside them never round: an image miss
        miss = t.lookup(ShapeQuery(1, frames * 30 * 52, 512, (30, 52), frames))
        assert not miss.hit and miss.missed == (Dim.IMAGE,)
    assert str(t.split_home(t.lookup(ShapeQuery(6, 14040, 512, (30, 52), 9)))) == "b4_i14040_t512_g9x30x52"
    assert t.describe_limits()["frames"] == [33, 81]


@pytest.mark.parametrize("rules,frames,needle", [
    (VIDEO, [80], "num_frames 80 is not 1 plus a multiple of 4 (1, 5, 9, ...); use 77 or 81"),
    (VIDEO, [], "buckets.frames is empty: this model generates videos"),
    (IMAGE, [81], "this model generates images, not videos; leave frames empty"),
])
def test_frame_tiers_a_model_cannot_serve_are_refused_naming_the_fix(rules, frames, needle):
    cfg = BucketConfig(batch_sizes=[1], resolutions=["832x480"], text_lengths=[512], frames=frames)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        BucketTable(cfg, rules)


def test_frames_must_ascend():
    with pytest.raises(ValidationError, match="frames"):
        BucketConfig(frames=[81, 33])


def _validator(rules: ShapeRules, **buckets) -> RequestValidator:
    spec = ModelSpec("wan-test", "wan", "WanPipeline", rules, default_frames=81 if rules.video else None,
                     default_size=(832, 480), default_guidance_scale=5.0, default_steps=50,
                     default_buckets=dict(batch_sizes=[1, 2], resolutions=["832x480"], text_lengths=[512], frames=[81])
                     if rules.video else None)
    cfg = EngineConfig(buckets=BucketConfig(**buckets)) if buckets else EngineConfig()
    return RequestValidator(cfg, spec, lambda prompt, negative=False: len(prompt.split()) + 1)


def test_a_video_request_gets_the_default_frames_and_a_three_sided_grid():
    v = _validator(VIDEO)  # no buckets section: the family's default table
    assert [str(k) for k in v.table.keys] == ["b1_i32760_t512_g21x30x52", "b2_i32760_t512_g21x30x52"]
    ok = v.validate(GenerationRequest(prompt="a cat", seed=1))
    assert ok.request.num_frames == 81 and (ok.request.width, ok.request.height) == (832, 480)
    assert ok.grid == (21, 30, 52) and str(ok.key) == "b2_i32760_t512_g21x30x52" and ok.rows == 2
    short = v.validate(GenerationRequest(prompt="a cat", num_frames=33, guidance_scale=1.0, seed=1))
    assert short.grid == (9, 30, 52) and not short.lookup.hit and short.lookup.missed == (Dim.IMAGE,)


@pytest.mark.parametrize("frames,needle", [
    (80, "invalid 'num_frames' (got 80): is not 1 plus a multiple of 4 (1, 5, 9, ...); use 77 or 81; allowed: an "
         "integer 1 plus a multiple of 4 from 1 to 129"),
    (133, "invalid 'num_frames' (got 133): out of range"),
    (0, "invalid 'num_frames' (got 0): out of range"),
    ("81", "invalid 'num_frames' (got '81'): out of range"),
])
def test_a_frame_count_the_pipeline_cannot_generate_is_refused_naming_the_allowed_values(frames, needle):
    with pytest.raises(RequestError) as e:
        _validator(VIDEO).validate(GenerationRequest(prompt="a cat", num_frames=frames))
    assert e.value.field == "num_frames" and e.value.status == 422 and needle in str(e.value)


def test_frames_on_an_image_model_and_previews_of_a_video_are_refused():
    with pytest.raises(RequestError) as e:
        _validator(IMAGE, resolutions=["512x512"]).validate(GenerationRequest(prompt="a cat", num_frames=81))
    assert e.value.field == "num_frames" and "generates images, not videos; leave num_frames unset" in str(e.value)
    with pytest.raises(RequestError) as e:
        _validator(VIDEO).validate(GenerationRequest(prompt="a cat", partial_images=2))
    assert e.value.field == "partial_images" and "previews are not served for videos" in str(e.value)


def test_asking_a_model_for_the_other_kind_of_output_is_refused():
    video, image = _validator(VIDEO).spec, _validator(IMAGE, resolutions=["512x512"]).spec
    video.check_output(video=True)
    image.check_output(video=False)
    with pytest.raises(RequestError, match=r"generates videos, not images; ask for videos \(POST /v1/videos\)"):
        video.check_output(video=False)
    with pytest.raises(RequestError, match="generates images, not videos") as e:
        image.check_output(video=True)
    assert e.value.field == "model"


def test_a_videos_work_counts_its_latent_frames():
    v = _validator(VIDEO)
    with pytest.raises(RequestError, match=r"832x480 x 21 latent frames x 3 videos x 50 steps = 1258"):
        v.validate(GenerationRequest(prompt="a cat", n=3))  # 3 videos: 3 x 419 megapixel-steps
    assert v.validate(GenerationRequest(prompt="a cat", n=2)).rows == 4


def test_frames_and_sides_beyond_the_models_position_table_are_refused():
    """Wan's RoPE table holds ``rope_max_seq_len`` positions per axis (frames, h, w): a grid beyond it is refused."""
    spec = ModelSpec("wan-test", "wan", "WanPipeline", VIDEO, default_frames=81, default_size=(128, 128),
                     max_grid_side=8, default_steps=4)
    cfg = EngineConfig(buckets=BucketConfig(resolutions=["128x128"], text_lengths=[512], frames=[29]),
                       limits={"min_side_px": 64})
    v = RequestValidator(cfg, spec, lambda prompt, negative=False: 2)
    assert v.validate(GenerationRequest(prompt="a cat", num_frames=29)).grid == (8, 8, 8)
    with pytest.raises(RequestError) as e:
        v.validate(GenerationRequest(prompt="a cat", num_frames=33))
    assert e.value.field == "num_frames" and "its 9 latent frames exceed this model's position table (8 a side): " \
                                             "at most 29 frames" in str(e.value)
    with pytest.raises(RequestError) as e:
        v.validate(GenerationRequest(prompt="a cat", num_frames=29, width=144, height=128))
    assert e.value.field == "size" and "position table (8 tokens a side)" in str(e.value)
