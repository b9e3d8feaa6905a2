"""What ``POST /v1/videos`` takes for the served video model: OpenAI's ``size`` and ``seconds`` mapped onto the video
buckets (docs/API.md "Videos").

Video buckets are exact (a Wan bucket holds one frames x height x width grid; docs/DESIGN.md "Video buckets"), so a
job is served at one of the table's tiers: ``size`` is one of ``buckets.resolutions`` and ``seconds`` one of the
durations of ``buckets.frames`` at the model's frame rate. A clip of ``F`` frames at ``fps`` lasts ``(F - 1) / fps``
seconds after its first frame: Wan 2.1's 81 frames at 16 fps are its 5 seconds, so ``seconds: "5"`` asks for 81
frames (the MP4 then plays ``F / fps`` seconds, 5.06). A tier of one frame (a still) is no duration and is not
offered. The frame rate is the model's published one (:func:`bcg_core.families.defaults.frame_rate`: Wan 2.1's 16)
unless ``videos.fps`` sets it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bcg_core.config import parse_size
from bcg_core.errors import RequestError, shown
from bcg_core.families.defaults import frame_rate

from .config import VideosConfig

__all__ = ["VideoOptions", "VideoShape"]


@dataclass(frozen=True)
class VideoShape:
    """A job's shape as the model generates it.

    Attributes:
        width, height: pixels; num_frames: frames of the clip (``1 + k x`` the VAE's temporal factor).
        seconds: its duration as the job shows it (``"5"``: ``(num_frames - 1) / fps``); size: ``"WxH"``.
        fps: frames per second of its MP4.
    """

    width: int
    height: int
    num_frames: int
    seconds: str
    size: str
    fps: float


def _seconds_text(frames: int, fps: float) -> str:
    """``(frames - 1) / fps`` as a decimal string of at most three decimals (``"5"``, ``"2.5"``)."""
    return f"{round((frames - 1) / fps, 3):g}"


@dataclass(frozen=True)
class VideoOptions:
    """The sizes and durations a video job may ask for, and the defaults of one that omits them.

    Attributes:
        model: the served model's name; pipeline: its diffusers pipeline class.
        sizes: ``"WxH"`` of the video tiers (``buckets.resolutions``), in the table's order.
        frames: frame counts of the tiers offered as durations (``buckets.frames`` above 1), ascending.
        fps: frames per second.
        default_size: the model's default size where it is a tier (Wan: 832x480), else the first tier's.
        default_frames: the model's default frames where they are a tier (Wan: 81), else the fewest.
    """

    model: str
    pipeline: str
    sizes: tuple[str, ...]
    frames: tuple[int, ...]
    fps: float
    default_size: str
    default_frames: int

    @classmethod
    def for_model(cls, validator, videos: VideosConfig) -> VideoOptions:
        """The options of the model ``validator`` serves (its spec and its table's config, the family's default table
        where the config sets none) under the ``videos`` section.

        Raises:
            ValueError: the model generates images, no frame rate is known for it and ``videos.fps`` is unset, or no
                frame tier above one frame.
        """
        spec, buckets = validator.spec, validator.config.buckets
        if not spec.video:
            raise ValueError(f"model {spec.name!r} ({spec.pipeline_class}) generates images, not videos")
        fps = videos.fps if videos.fps is not None else frame_rate(spec.pipeline_class)
        if fps is None:
            raise ValueError(f"no frame rate is known for {spec.pipeline_class}; set videos.fps")
        frames = tuple(sorted(f for f in buckets.frames if f > 1))
        if not frames:
            raise ValueError(f"buckets.frames {list(buckets.frames)} holds no clip longer than one frame; /v1/videos "
                             f"needs one (e.g. [{spec.default_frames}])")
        sizes = tuple("{}x{}".format(*parse_size(r)) for r in buckets.resolutions)
        default = "{}x{}".format(*spec.default_size)
        return cls(model=spec.name, pipeline=spec.pipeline_class, sizes=sizes, frames=frames, fps=float(fps),
                   default_size=default if default in sizes else sizes[0],
                   default_frames=spec.default_frames if spec.default_frames in frames else frames[0])

    @property
    def seconds(self) -> tuple[str, ...]:
        """The durations offered, as ``seconds`` texts, one per frame tier (``("1", "2")``)."""
        return tuple(_seconds_text(f, self.fps) for f in self.frames)

    def seconds_phrase(self) -> str:
        """What ``seconds`` takes: ``'1', '2' (1 + seconds x 16 fps frames: 17, 33; omitted: '1')``."""
        return (", ".join(repr(s) for s in self.seconds) + f" (1 + seconds x {self.fps:g} fps frames: "
                f"{', '.join(map(str, self.frames))}; omitted: {_seconds_text(self.default_frames, self.fps)!r})")

    def size_phrase(self) -> str:
        """What ``size`` takes: ``'832x480' (the video buckets' sizes; omitted: '832x480')``."""
        return ", ".join(repr(s) for s in self.sizes) + f" (the video buckets' sizes; omitted: {self.default_size!r})"

    def shape(self, seconds: object = None, size: object = None) -> VideoShape:
        """The shape a job of ``seconds`` (a decimal string or a number; None: the default) and ``size`` (``"WxH"``;
        None: the default) is generated at.

        Raises:
            RequestError: HTTP 422 on ``seconds`` or ``size``, naming the value sent and the values allowed.
        """
        frames = self.default_frames if seconds is None else self._frames(seconds)
        if size is None:
            size = self.default_size
        try:
            width, height = parse_size(size) if isinstance(size, str) else (None, None)
        except ValueError:
            width = height = None
        text = f"{width}x{height}"
        if width is None or text not in self.sizes:
            raise RequestError("size", f"invalid 'size' (got {shown(size, 40)}): not a served size for {self.model}; "
                                       f"allowed: {self.size_phrase()}")
        return VideoShape(width, height, frames, _seconds_text(frames, self.fps), text, self.fps)

    def _frames(self, seconds: object) -> int:
        """The frame tier of ``seconds`` (within half a millisecond); RequestError naming the durations otherwise."""
        value = None
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
            value = float(seconds)
        elif isinstance(seconds, str):
            try:
                value = float(seconds.strip())
            except ValueError:
                value = None
        if value is not None and math.isfinite(value):
            for f in self.frames:
                if abs(value - (f - 1) / self.fps) <= 5e-4:
                    return f
        raise RequestError("seconds", f"invalid 'seconds' (got {shown(seconds, 40)}): not a served duration for "
                                      f"{self.model}; allowed: {self.seconds_phrase()}")

    def card(self) -> dict:
        """``bcg.videos`` of ``GET /v1/models``: sizes, seconds, their frames, fps and the defaults."""
        return {"sizes": list(self.sizes), "seconds": list(self.seconds), "frames": list(self.frames),
                "fps": self.fps, "default_size": self.default_size,
                "default_seconds": _seconds_text(self.default_frames, self.fps)}
