"""Bucket keys and shapes: frozen values with ``parse`` and ``str``, and no torch import (the router uses them).

A :class:`BucketKey` is the padded shape one captured graph is bound to; its :class:`BucketShape` is the key
without the batch dimension, the unit of ownership, routing and step-level batching (every batch bucket of one
resolution tier and text bucket). Each has one canonical string, ``b8_i1024_m_t256_g32x32`` and
``i1024_m_t256_g32x32`` (a video bucket's grid has three sides, latent frames first: ``b2_i32760_t512_g21x30x52``),
and :meth:`BucketKey.parse` / :meth:`BucketShape.parse` are its only readers.

Dimensions (docs/DESIGN.md section 2):

- ``batch``: transformer rows (images x 2 when classifier-free guidance puts cond and uncond rows in one
  forward). Pad rows are copies of a real row.
- ``image_tokens``: tokens of the image stream; ``image_mask`` when the tier's graph masks padded image tokens;
  ``latent_hw`` for families whose forward crops a position table by the latent grid (SD3); ``frames``, the
  latent frames of a video family (Wan: its 3D RoPE spans frames x h x w, so a bucket holds one exact
  frames x h x w grid and ``image_tokens`` is their product).
- ``text_tokens``: tokens of the text stream.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

__all__ = ["BucketKey", "BucketShape", "Dim", "ShapeQuery"]

_SHAPE = re.compile(r"^i(\d+)(_m)?_t(\d+)(?:_g(?:(\d+)x)?(\d+)x(\d+))?$")


class Dim(str, enum.Enum):
    """A dimension of a bucket key."""

    BATCH = "batch"
    IMAGE = "image_tokens"
    TEXT = "text_tokens"


class BucketShape(str):
    """A bucket key without its batch dimension, e.g. ``"i1024_m_t256"``.

    It *is* its canonical string (a ``str`` subclass), so JSON bodies, Ray's routing and autoscaling stats and
    Prometheus labels carry it unchanged and it compares equal to the plain string; its fields are parsed once,
    here.

    Attributes:
        image_tokens: image-stream tokens of the tier.
        text_tokens: text-stream tokens of the text bucket.
        image_mask: the tier's graph masks padded image tokens.
        latent_hw: ``(h, w)`` of the token grid for grid-keyed families, else None.
        frames: latent frames of a video family's grid (the first of the three sides of ``_g<f>x<h>x<w>``), else
            None.

    Raises:
        ValueError: (from :meth:`parse` or the constructor) a string that is not a shape, naming the format.
    """

    __slots__ = ("image_tokens", "text_tokens", "image_mask", "latent_hw", "frames")

    def __new__(cls, text: str) -> BucketShape:
        m = _SHAPE.match(str(text))
        if m is None:
            raise ValueError(f"{text!r} is not a bucket shape: expected i<image tokens>[_m]_t<text tokens>"
                             f"[_g[<frames>x]<h>x<w>], e.g. i1024_t256, i1024_m_t256_g32x32 or i32760_t512_g21x30x52")
        self = super().__new__(cls, text)
        self.image_tokens, self.text_tokens = int(m.group(1)), int(m.group(3))
        self.image_mask = m.group(2) is not None
        self.latent_hw = (int(m.group(5)), int(m.group(6))) if m.group(5) else None
        self.frames = int(m.group(4)) if m.group(4) else None
        if self.frames is not None and self.frames * self.latent_hw[0] * self.latent_hw[1] != self.image_tokens:
            raise ValueError(f"{text!r}: a video shape's image tokens are frames x h x w = "
                             f"{self.frames * self.latent_hw[0] * self.latent_hw[1]}, not {self.image_tokens}")
        return self

    @classmethod
    def parse(cls, text: str) -> BucketShape:
        """The shape of ``text`` (``"i1024_m_t256"``); raises ValueError naming the format if it is none."""
        return text if isinstance(text, BucketShape) else cls(text)

    @classmethod
    def of(cls, image_tokens: int, text_tokens: int, latent_hw: tuple[int, int] | None = None,
           image_mask: bool = False, frames: int | None = None) -> BucketShape:
        """The shape with these fields (``frames`` needs ``latent_hw``)."""
        grid = f"_g{latent_hw[0]}x{latent_hw[1]}" if latent_hw else ""
        if frames is not None:
            grid = f"_g{frames}x{grid[2:]}"
        return cls(f"i{image_tokens}{'_m' if image_mask else ''}_t{text_tokens}{grid}")

    @property
    def grid(self) -> tuple[int, ...] | None:
        """The token grid a bucket of this shape holds: ``(frames, h, w)`` for a video family, ``latent_hw`` for a
        grid-keyed image family, else None."""
        return _grid(self.latent_hw, self.frames)

    @property
    def tokens_per_row(self) -> int:
        """Image plus text tokens of one row."""
        return self.image_tokens + self.text_tokens

    def key(self, batch: int) -> BucketKey:
        """The bucket of ``batch`` rows of this shape."""
        return BucketKey(batch, self.image_tokens, self.text_tokens, self.latent_hw, self.image_mask, self.frames)

    def __reduce__(self):  # pickled (Ray) as its string, parsed again on the other side
        return (BucketShape, (str(self),))


@dataclass(frozen=True, slots=True, order=True)
class BucketKey:
    """The padded shape a captured graph (or a static-buffer eager run) is bound to.

    Attributes:
        batch: transformer rows of the bucket (real rows + pad rows).
        image_tokens: image-stream tokens of the bucket (real tokens + masked pad tokens).
        text_tokens: text-stream tokens of the bucket.
        latent_hw: ``(h, w)`` of the token grid for families whose forward depends on it, else None.
        image_mask: the forward masks padded image tokens (requests with fewer tokens than the tier).
        frames: latent frames of a video family's bucket (its grid is ``frames x h x w`` and ``image_tokens`` their
            product), else None.
    """

    batch: int
    image_tokens: int
    text_tokens: int
    latent_hw: tuple[int, int] | None = None
    image_mask: bool = False
    frames: int | None = None

    def __str__(self) -> str:
        return f"b{self.batch}_{self.shape}"

    @classmethod
    def parse(cls, text: str) -> BucketKey:
        """The key of ``text`` (``"b8_i1024_m_t256_g32x32"``).

        Raises:
            ValueError: not a key, naming the format.
        """
        head, _, rest = str(text).partition("_")
        if not head.startswith("b") or not head[1:].isdigit() or not rest:
            raise ValueError(f"{text!r} is not a bucket key: expected b<rows>_<shape>, e.g. b8_i1024_t256")
        return BucketShape.parse(rest).key(int(head[1:]))

    @property
    def tokens(self) -> int:
        """Padded tokens in one forward: ``batch * (image_tokens + text_tokens)``."""
        return self.batch * (self.image_tokens + self.text_tokens)

    @property
    def shape(self) -> BucketShape:
        """The bucket's shape without its batch dimension (:class:`BucketShape`)."""
        return _shape_of(self.image_tokens, self.text_tokens, self.latent_hw, self.image_mask, self.frames)

    @property
    def grid(self) -> tuple[int, ...] | None:
        """The token grid the bucket holds: ``(frames, h, w)`` for a video family, ``latent_hw`` for a grid-keyed
        image family, else None."""
        return _grid(self.latent_hw, self.frames)


def _grid(latent_hw: tuple[int, int] | None, frames: int | None) -> tuple[int, ...] | None:
    return latent_hw if frames is None or latent_hw is None else (frames, *latent_hw)


@functools.lru_cache(maxsize=4096)
def _shape_of(image_tokens: int, text_tokens: int, latent_hw: tuple[int, int] | None, image_mask: bool,
              frames: int | None = None) -> BucketShape:
    """:attr:`BucketKey.shape`, parsed once per distinct shape (the step loop asks every step)."""
    return BucketShape.of(image_tokens, text_tokens, latent_hw, image_mask, frames)


@dataclass(frozen=True, slots=True)
class ShapeQuery:
    """A request's exact (unpadded) shape, in the same units as :class:`BucketKey`."""

    batch: int
    image_tokens: int
    text_tokens: int
    latent_hw: tuple[int, int] | None = None
    frames: int | None = None
    """Latent frames of a video request (``image_tokens`` = frames x h x w), else None."""

    @property
    def grid(self) -> tuple[int, ...] | None:
        """Its token grid: ``(frames, h, w)`` for a video, ``latent_hw`` for a grid-keyed image family, else None."""
        return _grid(self.latent_hw, self.frames)

    @property
    def tokens_per_row(self) -> int:
        """Real image plus text tokens of one row."""
        return self.image_tokens + self.text_tokens

    @property
    def tokens(self) -> int:
        """Real tokens in one forward: ``batch * (image_tokens + text_tokens)``."""
        return self.batch * self.tokens_per_row
