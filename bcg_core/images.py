"""Image files: encoding decoded images as PNG, JPEG or WebP (Pillow), the answer's ``output_format``.

A family's decode gives (height, width, 3) uint8 RGB arrays (RGBA, (height, width, 4), where its pipeline's images
carry alpha: ``ModelSpec.output_alpha``, whose requests cannot ask for JPEG); :func:`encode_image` turns one into the
bytes of an image file. The replica's encoder threads call it (never the denoising thread, never an event loop): the
step scheduler's ``scheduler.encode_threads`` pool (:mod:`bcg_core.scheduler.finish`), or the calling thread of
:meth:`~bcg_core.pipeline.DiTPipeline.generate`.

``compression`` follows OpenAI's ``output_compression``: 0 to 100, 100 (the default) keeps the most detail.
It is Pillow's ``quality`` of the JPEG and WebP encoders (lossy WebP; 100 is its best quality, not lossless).
PNG is lossless and takes no compression (OpenAI refuses one below 100 for PNG; so does the validator).
Measured sizes and times per format: ``benchmarks/bench_image_formats.py`` (figures in docs/API.md).
"""

from __future__ import annotations

import io

import numpy as np

__all__ = ["DEFAULT_COMPRESSION", "IMAGE_FORMATS", "encode_image", "resize_image"]

IMAGE_FORMATS = ("png", "jpeg", "webp")
"""The ``output_format`` values served (OpenAI's, less ``gif`` and ``svg``)."""

DEFAULT_COMPRESSION = 100
"""``output_compression`` when a request omits it (OpenAI's default)."""

_PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def encode_image(image: np.ndarray, fmt: str = "png", compression: int | None = None, fast: bool = False) -> bytes:
    """The bytes of ``image`` as a ``fmt`` file.

    Args:
        image: (height, width, 3) uint8 RGB, or (height, width, 4) RGBA for PNG and WebP (they keep the alpha).
        fmt: ``"png"`` (PIL's default settings, lossless), ``"jpeg"`` or ``"webp"``.
        compression: 0..100 for JPEG and WebP (Pillow ``quality``; None: :data:`DEFAULT_COMPRESSION`); must be
            None or 100 for PNG.
        fast: the encoders' quickest settings (PNG ``compress_level=1``, WebP ``method=0``; JPEG unchanged), for
            streamed previews: 2.5-5x faster for PNG and about 3x for WebP at 512 and 1024 pixels, files 15-50%
            larger.

    Raises:
        ValueError: an unknown format, a compression out of 0..100, or one below 100 for PNG.
    """
    from PIL import Image

    if fmt not in _PIL_FORMAT:
        raise ValueError(f"output_format {fmt!r} is not served; allowed: {', '.join(IMAGE_FORMATS)}")
    q = DEFAULT_COMPRESSION if compression is None else int(compression)
    if not 0 <= q <= 100:
        raise ValueError(f"output_compression {q} is out of range; allowed: an integer from 0 to 100")
    buf = io.BytesIO()
    pil = Image.fromarray(image)
    if fmt == "png":
        if q != 100:
            raise ValueError("output_compression applies to jpeg and webp only; omit it (or send 100) for png")
        pil.save(buf, format="PNG", **({"compress_level": 1} if fast else {}))
    elif fmt == "webp":
        pil.save(buf, format="WEBP", quality=q, **({"method": 0} if fast else {}))
    else:
        pil.save(buf, format="JPEG", quality=q)
    return buf.getvalue()


def resize_image(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """``image`` (h, w, 3) uint8 resized to (height, width, 3) with Pillow's bilinear filter (previews drawn at
    latent resolution are brought to the requested size this way)."""
    from PIL import Image

    if image.shape[0] == height and image.shape[1] == width:
        return image
    return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.BILINEAR))
