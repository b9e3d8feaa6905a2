"""deployments/videos/encode.py: frames -> H.264 MP4 (decoded back with PyAV), thumbnail, spritesheet, bad input.

The clip is synthetic: smooth moving sinusoids and a gradient, with a sharp-edged moving yellow square; 17 frames of
64x96 encode in about 20 ms. The pixel bound: PSNR of the decoded clip against the frames at least 34 dB at the
default CRF 18, and of each frame at least 31 dB (measured 35.5 dB, frames 32.4 to 37.1 dB; without the square 37.5
dB; even CRF 0 gives 39 dB there, the floor of yuv420p: 8-bit limited range and chroma at half resolution, which
blurs the square's coloured edges).
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest

av = pytest.importorskip("av")

from deployments.videos.encode import (  # noqa: E402 - after the importorskip
    EncodedVideo,
    encode_mp4,
    encode_video,
    float_frames_to_uint8,
    spritesheet,
    spritesheet_indices,
    thumbnail,
)
from deployments.videos.files import media_type  # noqa: E402

F, H, W = 17, 64, 96


def _clip(frames: int = F, height: int = H, width: int = W, square: bool = True) -> np.ndarray:
    t = np.arange(frames)[:, None, None]
    y = np.arange(height)[None, :, None]
    x = np.arange(width)[None, None, :]
    r = 128 + 100 * np.sin(2 * np.pi * (x / width + t / frames))
    g = 128 + 100 * np.cos(2 * np.pi * (y / height - t / (2 * frames)))
    b = np.broadcast_to(255 * x / (width - 1) * (y / (height - 1)), (frames, height, width))
    clip = np.stack(np.broadcast_arrays(r, g, b), -1)
    for i in range(frames if square else 0):
        clip[i, 10:26, 2 + 3 * i:18 + 3 * i] = (250, 240, 30)
    return np.clip(np.rint(clip), 0, 255).astype(np.uint8)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / np.mean((a.astype(np.float64) - b) ** 2)))


def _decode(data: bytes):
    """(stream facts, (F, H, W, 3) uint8 RGB) of an MP4, converted with the colour space its frames are tagged with."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        codec = stream.codec_context
        facts = dict(codec=codec.name, rate=stream.average_rate, frames=stream.frames, width=stream.width,
                     height=stream.height, pix_fmt=codec.pix_fmt, colorspace=codec.colorspace,
                     color_range=codec.color_range, duration_s=float(stream.duration * stream.time_base))
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    return facts, frames


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return _clip()


@pytest.fixture(scope="module")
def encoded(clip) -> EncodedVideo:
    return encode_video(clip, 16)


def test_the_mp4_is_h264_at_the_frame_rate_and_decodes_back_to_the_frames(clip, encoded):
    facts, frames = _decode(encoded.video)
    assert facts == dict(codec="h264", rate=16, frames=F, width=W, height=H, pix_fmt="yuv420p", colorspace=1,
                         color_range=1, duration_s=pytest.approx(F / 16, abs=1e-3))  # BT.709, limited range
    assert frames.shape == clip.shape
    assert _psnr(frames, clip) >= 34.0
    assert min(_psnr(a, b) for a, b in zip(frames, clip, strict=True)) >= 31.0
    # the frames are converted with BT.709 as tagged: read as BT.601 they are far off
    with av.open(io.BytesIO(encoded.video)) as container:
        as_601 = np.stack([f.reformat(format="rgb24", src_colorspace="itu601").to_ndarray()
                           for f in container.decode(video=0)])
    assert _psnr(as_601, clip) < 30.0
    # faststart: the index (moov) before the data (mdat)
    assert 0 < encoded.video.find(b"moov") < encoded.video.find(b"mdat")


def test_fractional_frame_rates_are_kept_as_fractions(clip):
    short = clip[:5]
    assert _decode(encode_mp4(short, Fraction(24000, 1001)))[0]["rate"] == Fraction(24000, 1001)
    assert _decode(encode_mp4(short, 23.976))[0]["rate"] == Fraction(2997, 125)


def test_an_odd_size_is_padded_by_repeating_the_last_row_and_column():
    clip = _clip(3, 31, 45, square=False)
    facts, frames = _decode(encode_mp4(clip, 8))
    assert (facts["width"], facts["height"], facts["frames"]) == (46, 32, 3)
    assert _psnr(frames[:, :31, :45], clip) >= 31.0
    assert _psnr(frames[:, 31, :45], clip[:, 30]) >= 30.0  # the added row repeats the last one
    assert _psnr(frames[:, :31, 45], clip[:, :, 44]) >= 30.0


def test_the_thumbnail_is_the_first_frame_as_webp_by_default(clip, encoded):
    from PIL import Image

    image = Image.open(io.BytesIO(encoded.thumbnail))
    assert (image.format, image.size, image.mode) == ("WEBP", (W, H), "RGB")
    assert _psnr(np.asarray(image), clip[0]) >= 30.0
    assert _psnr(np.asarray(image), clip[-1]) < 20.0  # the first frame, not another
    assert Image.open(io.BytesIO(thumbnail(clip, "png"))).format == "PNG"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(thumbnail(clip, "png")))), clip[0])  # lossless
    assert Image.open(io.BytesIO(thumbnail(clip, "jpeg"))).format == "JPEG"


def test_the_spritesheet_is_a_jpeg_grid_of_evenly_spaced_frames(clip, encoded):
    from PIL import Image

    assert spritesheet_indices(17, 16) == [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16]
    assert spritesheet_indices(81, 5) == [0, 20, 40, 60, 80]
    assert spritesheet_indices(3, 16) == [0, 1, 2] and spritesheet_indices(1, 16) == [0]
    sheet = Image.open(io.BytesIO(encoded.spritesheet))
    assert (sheet.format, sheet.size) == ("JPEG", (4 * W, 4 * H))  # 16 tiles: 4 x 4 at full size (96 < 256)
    grid = np.asarray(sheet)
    for k, i in enumerate(spritesheet_indices(F, 16)):
        r, c = divmod(k, 4)
        assert _psnr(grid[r * H:(r + 1) * H, c * W:(c + 1) * W], clip[i]) >= 25.0, (k, i)
    small = Image.open(io.BytesIO(spritesheet(clip[:3], tile_width=48)))
    assert small.size == (2 * 48, 2 * 32)  # 3 tiles: 2 x 2, the fourth cell black
    assert np.asarray(small)[32:, 48:].max() < 30


def test_encode_video_names_its_files_as_the_store_keeps_them(encoded):
    files = encoded.files()
    assert {v: name for v, (name, _) in files.items()} == {
        "video": "video.mp4", "thumbnail": "thumbnail.webp", "spritesheet": "spritesheet.jpg"}
    assert [media_type(name) for name, _ in files.values()] == ["video/mp4", "image/webp", "image/jpeg"]
    assert files["video"][1] == encoded.video


@pytest.mark.parametrize("call, needle", [
    (lambda c: encode_mp4(c.astype(np.float32) / 255, 16), "float_frames_to_uint8"),
    (lambda c: encode_mp4(c[..., :2], 16), "(frames, height, width, 3)"),
    (lambda c: encode_mp4(c[0], 16), "(frames, height, width, 3)"),
    (lambda c: encode_mp4(c[:0], 16), "each at least 1"),
    (lambda c: encode_mp4(c.tolist(), 16), "numpy array"),
    (lambda c: encode_mp4(c, 0), "fps 0"),
    (lambda c: encode_mp4(c, float("nan")), "fps nan"),
    (lambda c: encode_mp4(c, True), "fps True"),
    (lambda c: encode_mp4(c, 241), "at most 240"),
    (lambda c: encode_mp4(c, 16, crf=52), "crf 52"),
    (lambda c: encode_mp4(c, 16, preset="fastest"), "allowed: ultrafast"),
    (lambda c: thumbnail(c, "gif"), "allowed: webp, jpeg, png"),
    (lambda c: thumbnail(c, "webp", quality=101), "quality 101"),
    (lambda c: spritesheet(c, tiles=0), "tiles 0"),
    (lambda c: spritesheet(c, tile_width=4), "tile_width 4"),
    (lambda c: encode_video(c, 16, thumbnail_format="bmp"), "thumbnail format 'bmp'"),
])
def test_bad_input_is_refused_naming_the_field(clip, call, needle):
    with pytest.raises(ValueError) as e:
        call(clip[:2])
    assert needle in str(e.value)


def test_float_frames_are_rounded_and_clipped_to_uint8():
    frames = np.array([[[[-0.1, 0.0, 0.5], [1 / 255 * 0.6, 1.0, 1.7]]]], np.float32)
    assert float_frames_to_uint8(frames).tolist() == [[[[0, 0, 128], [1, 255, 255]]]]
    with pytest.raises(ValueError, match="not finite"):
        float_frames_to_uint8(np.full((1, 2, 2, 3), np.nan, np.float32))
    with pytest.raises(ValueError, match="floating-point"):
        float_frames_to_uint8(np.zeros((1, 2, 2, 3), np.uint8))
