"""Video files: decoded frames as an H.264 MP4, its thumbnail and its spritesheet (the three ``variant`` values of
OpenAI's ``GET /v1/videos/{id}/content``).

A video family's decode gives (frames, height, width, 3) RGB arrays; :func:`encode_video` turns them into the three
files a finished job keeps. Every function here is a plain blocking function that holds no state: the caller runs it
off the event loop and off the GPU thread (``asyncio.to_thread`` or an executor), as the image encoders run on the
scheduler's encoder threads (:mod:`bcg_core.images`).

**Why PyAV** (the ``av`` package) rather than imageio-ffmpeg: PyAV binds FFmpeg's libraries in-process. Frames go
from a numpy array to libx264 without a subprocess, a pipe or a per-video ``ffmpeg`` process start; a bad argument
or an encoder failure is a Python exception (``av.error.FFmpegError``), not an exit code and a stderr to parse; and the
same package decodes, which the tests use to check what was written. Its wheels bundle FFmpeg with libx264 (``av``
18.1.0, cp311 manylinux_2_28: 35.8 MB; imageio-ffmpeg 0.6.0's manylinux2014 wheel, which ships an ``ffmpeg`` binary
and drives it through a pipe, is 29.5 MB), so wheel size is no reason either way: the in-process API is.

**Pixels.** The MP4 holds H.264 in yuv420p (what every browser and player decodes), converted from RGB with BT.709
coefficients in limited ("MPEG", 16-235) range and tagged so (colour space, primaries, transfer and range in the
stream), so players show the colours the model made. 4:2:0 halves the chroma resolution, so width and height must be
even: a clip with an odd width or height is padded by one column or row repeating its last one (the MP4 is then one
pixel wider or taller than the frames; Wan's sizes are multiples of 16, so its clips are never padded). The thumbnail
and the spritesheet are made from the frames as given, unpadded.

**Container.** ``movflags=+faststart`` puts the MP4's index before its data, so a browser can start playing while it
downloads. FFmpeg writes that index by reopening the output file, which an in-memory buffer does not allow, so
:func:`encode_mp4` writes to a temporary file and returns its bytes.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from bcg_core.images import encode_image

__all__ = [
    "THUMBNAIL_FORMATS", "EncodedVideo", "check_frames", "encode_mp4", "encode_video", "even_frames",
    "float_frames_to_uint8", "spritesheet", "spritesheet_indices", "thumbnail",
]

THUMBNAIL_FORMATS = {"webp": "image/webp", "jpeg": "image/jpeg", "png": "image/png"}
"""Thumbnail formats and their media types. ``webp`` is the default: OpenAI serves its ``thumbnail`` variant as
WebP (its spritesheet as JPEG); the client takes any bytes (it asks ``Accept: application/binary``)."""

_THUMBNAIL_SUFFIX = {"webp": "webp", "jpeg": "jpg", "png": "png"}
_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")
MAX_FPS = 240.0


def check_frames(frames: object, name: str = "frames") -> np.ndarray:
    """``frames`` checked: a (F, H, W, 3) uint8 RGB numpy array with F, H and W at least 1.

    Returns:
        The same array, C-contiguous.

    Raises:
        ValueError: not a numpy array, another dtype (saying how to convert floats in 0..1), another shape.
    """
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"{name} must be a numpy array of shape (frames, height, width, 3), got "
                         f"{type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise ValueError(f"{name} must be uint8 RGB, got dtype {frames.dtype}; float frames in 0..1 convert with "
                         f"float_frames_to_uint8")
    if frames.ndim != 4 or frames.shape[-1] != 3 or min(frames.shape[:3]) < 1:
        raise ValueError(f"{name} must have shape (frames, height, width, 3) with each at least 1, got "
                         f"{tuple(frames.shape)}")
    return np.ascontiguousarray(frames)


def float_frames_to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float frames in 0..1 (diffusers' ``output_type="np"`` video, one clip: (F, H, W, 3)) as uint8, rounded to
    the nearest level and clipped (diffusers' ``export_to_video`` truncates instead).

    Raises:
        ValueError: not a floating-point numpy array, or a value that is not finite.
    """
    if not isinstance(frames, np.ndarray) or not np.issubdtype(frames.dtype, np.floating):
        raise ValueError(f"frames must be a floating-point numpy array, got "
                         f"{getattr(frames, 'dtype', type(frames).__name__)}")
    if not np.isfinite(frames).all():
        raise ValueError("frames hold a value that is not finite (NaN or infinity): the decode went wrong")
    return np.clip(np.rint(frames * 255.0), 0, 255).astype(np.uint8)


def even_frames(frames: np.ndarray) -> np.ndarray:
    """``frames`` (F, H, W, 3) with an odd H or W padded to even by repeating the last row or column (yuv420p
    needs even sizes); returned as given when both are even."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not pad_h and not pad_w:
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def _rate(fps: object) -> Fraction:
    if isinstance(fps, bool) or not isinstance(fps, (int, float, Fraction)) or not 0 < float(fps) <= MAX_FPS \
            or not math.isfinite(float(fps)):
        raise ValueError(f"fps {fps!r} must be a number above 0 and at most {MAX_FPS:g} frames per second")
    return Fraction(fps).limit_denominator(1001)  # 23.976 -> 2997/125; Fraction(24000, 1001) is kept as given


def encode_mp4(frames: np.ndarray, fps: float, *, crf: int = 18, preset: str = "medium") -> bytes:
    """The frames as an H.264 (libx264) MP4 at ``fps`` frames per second, yuv420p, BT.709 limited range, faststart.

    Args:
        frames: (F, H, W, 3) uint8 RGB; an odd H or W is padded by one (module docstring).
        fps: frames per second, above 0 and at most 240 (Wan: 16): an int, float or ``Fraction`` (NTSC's
            ``Fraction(24000, 1001)``), kept as the nearest fraction with a denominator of at most 1001.
        crf: libx264's constant rate factor, 0 (lossless luma) to 51; 18 is visually near-lossless.
        preset: libx264's speed preset, ``ultrafast`` .. ``veryslow``.

    Returns:
        The MP4 file's bytes: F frames of H.264, duration F / fps seconds.

    Raises:
        ValueError: bad frames, fps, crf or preset (naming the field and what it takes).
        av.error.FFmpegError: the encoder or muxer failed.
    """
    import av
    from av.video.reformatter import ColorRange, Colorspace

    frames = even_frames(check_frames(frames))
    rate = _rate(fps)
    if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= 51:
        raise ValueError(f"crf {crf!r} must be an integer from 0 to 51")
    if preset not in _PRESETS:
        raise ValueError(f"preset {preset!r} is not a libx264 preset; allowed: {', '.join(_PRESETS)}")
    height, width = frames.shape[1:3]
    with tempfile.TemporaryDirectory(prefix="bcg-video-") as folder:
        path = os.path.join(folder, "video.mp4")
        with av.open(path, mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"crf": str(crf), "preset": preset}
            codec = stream.codec_context
            codec.colorspace = codec.color_primaries = codec.color_trc = 1  # AVCOL_*_BT709
            codec.color_range = int(ColorRange.MPEG)
            for i, rgb in enumerate(frames):
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(
                    format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG)
                frame.pts = i
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))  # flush the encoder's delayed frames
        with open(path, "rb") as f:
            return f.read()


def thumbnail(frames: np.ndarray, fmt: str = "webp", quality: int = 90) -> bytes:
    """The first frame as an image file: OpenAI's ``thumbnail`` variant.

    Args:
        frames: (F, H, W, 3) uint8 RGB.
        fmt: ``webp`` (OpenAI's), ``jpeg`` or ``png`` (:data:`THUMBNAIL_FORMATS`).
        quality: Pillow's quality for WebP and JPEG, 0..100 (ignored for PNG, which is lossless).

    Raises:
        ValueError: bad frames, an unknown format, a quality out of range.
    """
    frames = check_frames(frames)
    if fmt not in THUMBNAIL_FORMATS:
        raise ValueError(f"thumbnail format {fmt!r} is not served; allowed: {', '.join(THUMBNAIL_FORMATS)}")
    if fmt != "png" and (isinstance(quality, bool) or not isinstance(quality, int) or not 0 <= quality <= 100):
        raise ValueError(f"thumbnail quality {quality!r} must be an integer from 0 to 100")
    return encode_image(frames[0], fmt, None if fmt == "png" else quality)


def spritesheet_indices(count: int, tiles: int) -> list[int]:
    """The frame indices a spritesheet of at most ``tiles`` tiles shows: evenly spaced from the first frame to the
    last, each once (all of them when there are no more than ``tiles``)."""
    n = min(count, tiles)
    if n == 1:
        return [0]
    return sorted({round(i * (count - 1) / (n - 1)) for i in range(n)})


def spritesheet(frames: np.ndarray, tiles: int = 16, tile_width: int = 256, quality: int = 85) -> bytes:
    """A JPEG grid of evenly spaced frames (OpenAI's ``spritesheet`` variant), for scrubbing previews.

    The grid has ``ceil(sqrt(n))`` columns and as many rows as ``n`` tiles need, filled row by row in time order;
    unused cells are black. Each tile is its frame resized (Lanczos) to ``min(tile_width, W)`` pixels wide, keeping
    the aspect ratio (height rounded, at least 1).

    Args:
        frames: (F, H, W, 3) uint8 RGB.
        tiles: most frames shown, 1..100 (n = min(F, tiles), :func:`spritesheet_indices`).
        tile_width: width of one tile in pixels, 8..4096.
        quality: JPEG quality, 1..100.

    Returns:
        The JPEG's bytes, ``columns x tile width`` by ``rows x tile height`` pixels.

    Raises:
        ValueError: bad frames, or a tiles, tile_width or quality out of range.
    """
    from PIL import Image

    frames = check_frames(frames)
    for name, value, low, high in (("tiles", tiles, 1, 100), ("tile_width", tile_width, 8, 4096),
                                   ("quality", quality, 1, 100)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"spritesheet {name} {value!r} must be an integer from {low} to {high}")
    count, height, width = frames.shape[:3]
    indices = spritesheet_indices(count, tiles)
    tw = min(tile_width, width)
    th = max(1, round(height * tw / width))
    columns = math.ceil(math.sqrt(len(indices)))
    rows = math.ceil(len(indices) / columns)
    sheet = np.zeros((rows * th, columns * tw, 3), np.uint8)
    for k, i in enumerate(indices):
        tile = np.asarray(Image.fromarray(frames[i]).resize((tw, th), Image.Resampling.LANCZOS))
        r, c = divmod(k, columns)
        sheet[r * th:(r + 1) * th, c * tw:(c + 1) * tw] = tile
    return encode_image(sheet, "jpeg", quality)


@dataclass(frozen=True)
class EncodedVideo:
    """The three files of a finished video job (OpenAI's download variants).

    Attributes:
        video: the MP4's bytes (:func:`encode_mp4`).
        thumbnail: the first frame's image bytes (:func:`thumbnail`).
        spritesheet: the JPEG grid's bytes (:func:`spritesheet`).
        thumbnail_format: ``webp``, ``jpeg`` or ``png``.
    """

    video: bytes
    thumbnail: bytes
    spritesheet: bytes
    thumbnail_format: str = "webp"

    def files(self) -> dict[str, tuple[str, bytes]]:
        """``{variant: (file name, bytes)}`` for ``video``, ``thumbnail`` and ``spritesheet``: the names
        :class:`~deployments.videos.store.VideoStore` keeps them under (``video.mp4``, ``thumbnail.webp`` or
        ``.jpg`` / ``.png``, ``spritesheet.jpg``)."""
        return {
            "video": ("video.mp4", self.video),
            "thumbnail": (f"thumbnail.{_THUMBNAIL_SUFFIX[self.thumbnail_format]}", self.thumbnail),
            "spritesheet": ("spritesheet.jpg", self.spritesheet),
        }


def encode_video(frames: np.ndarray, fps: float, *, thumbnail_format: str = "webp", crf: int = 18,
                 preset: str = "medium", sprite_tiles: int = 16, sprite_tile_width: int = 256) -> EncodedVideo:
    """The MP4, thumbnail and spritesheet of one clip (blocking: run it in a thread, not on an event loop).

    Args:
        frames: (F, H, W, 3) uint8 RGB (:func:`float_frames_to_uint8` converts a decode's floats in 0..1).
        fps: frames per second of the MP4 (the model's frame rate; Wan: 16).
        thumbnail_format: ``webp`` (OpenAI's), ``jpeg`` or ``png``.
        crf, preset: libx264's quality and speed (:func:`encode_mp4`).
        sprite_tiles, sprite_tile_width: the spritesheet's most tiles and tile width in pixels (:func:`spritesheet`).

    Raises:
        ValueError: a bad argument, naming it and what it takes.
        av.error.FFmpegError: the encoder or muxer failed.
    """
    frames = check_frames(frames)
    thumb = thumbnail(frames, thumbnail_format)  # checks the format before the slow part
    sheet = spritesheet(frames, sprite_tiles, sprite_tile_width)
    return EncodedVideo(encode_mp4(frames, fps, crf=crf, preset=preset), thumb, sheet, thumbnail_format)
