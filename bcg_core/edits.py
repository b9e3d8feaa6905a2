"""Input images of edit requests (image-to-image and inpainting): read, bounded and checked before any model work.

An edit request carries the bytes of one image file (PNG, JPEG or WebP) and, for inpainting, a mask file. OpenAI's
mask convention holds: the mask is an image of the same size with an alpha channel, and its fully transparent
pixels mark where to edit. diffusers' inpainting pipelines take the opposite kind of mask, white where to repaint
(``VaeImageProcessor``'s ``mask_processor``), so :func:`read_mask` turns alpha 0 into white and every other
alpha into black.

A file's pixel count is read from its header and bounded (``limits.max_input_pixels``) before it is decoded, so a
small file that decodes to gigapixels (a decompression bomb) is refused without being decoded.

An image whose EXIF orientation says it is shown turned (a phone's portrait photo: 4032x3024 pixels tagged
"rotate 90") is turned upright once decoded (``PIL.ImageOps.exif_transpose``, as diffusers' ``load_image`` does),
so the edit, its default size and the mask it must match are those of the picture as every viewer shows it.
"""

from __future__ import annotations

import io
import struct

from bcg_core.errors import RequestError

__all__ = ["EDIT_FORMATS", "MASK_FORMATS", "read_image", "read_mask"]

EDIT_FORMATS = ("PNG", "JPEG", "WEBP")
"""Pillow formats an input image may have."""

MASK_FORMATS = ("PNG", "WEBP")
"""Pillow formats a mask may have: those with an alpha channel (OpenAI: "a PNG ... with an alpha channel")."""


def _open(data: bytes, field: str, max_pixels: int, formats: tuple[str, ...] = EDIT_FORMATS):
    """The Pillow image of ``data``, decoded after the header's size was checked, and turned upright by its EXIF
    orientation (module docstring). ``formats``: the Pillow formats allowed (a mask needs alpha: no JPEG).

    Raises:
        RequestError: (field ``field``) not bytes, empty, not a file of ``formats``, a zero-size image, more
            than ``max_pixels`` pixels, or a truncated or corrupt file.
    """
    from PIL import Image, UnidentifiedImageError

    names = [{"WEBP": "WebP"}.get(f, f) for f in formats]
    allowed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]  # "PNG, JPEG or WebP"
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise RequestError(field, f"'{field}' must be a non-empty {allowed} file")
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # Pillow's own bound (twice Image.MAX_IMAGE_PIXELS), read from the header
        raise RequestError(field, f"'{field}' claims more pixels than Pillow opens, above limits.max_input_pixels "
                                  f"{max_pixels}; send a smaller image") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise RequestError(field, f"'{field}' is not an image file; allowed: {allowed}") from None
    if im.format not in formats:
        raise RequestError(field, f"'{field}' is a {im.format} file; allowed: {allowed}"
                           + (" with an alpha channel" if field == "mask" else ""))
    w, h = im.size
    if w < 1 or h < 1:
        raise RequestError(field, f"'{field}' has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise RequestError(field, f"'{field}' is {w}x{h} = {w * h} pixels, above limits.max_input_pixels "
                                  f"{max_pixels}; send a smaller image")
    try:
        im.load()
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError):  # corrupt data
        raise RequestError(field, f"'{field}' is truncated or corrupt: it does not decode") from None
    from PIL import ImageOps

    ImageOps.exif_transpose(im, in_place=True)  # upright as shown (module docstring); no copy without an orientation
    return im


def read_image(data: bytes, max_pixels: int):
    """The input image of an edit: a decoded RGB ``PIL.Image.Image``.

    Raises:
        RequestError: field ``image``: see :func:`_open`.
    """
    return _open(data, "image", max_pixels).convert("RGB")


def read_mask(data: bytes, size: tuple[int, int], max_pixels: int):
    """The mask of an inpainting request as diffusers takes it: an ``"L"`` image, 255 where the mask's alpha is 0
    (OpenAI: fully transparent = edit here), 0 elsewhere.

    Args:
        data: the mask file.
        size: ``(width, height)`` of the input image; the mask must have the same.

    Raises:
        RequestError: field ``mask``: as :func:`_open`, another size than the image, no alpha channel, or no fully
            transparent pixel (nothing to edit).
    """
    im = _open(data, "mask", max_pixels, MASK_FORMATS)
    if im.size != tuple(size):
        raise RequestError("mask", f"'mask' is {im.size[0]}x{im.size[1]}, the image {size[0]}x{size[1]}; they must "
                                   f"have the same size")
    if im.mode not in ("RGBA", "LA", "PA") and not (im.mode in ("P", "L", "RGB") and "transparency" in im.info):
        raise RequestError("mask", f"'mask' has no alpha channel (mode {im.mode}); allowed: a PNG or WebP with "
                                   f"alpha whose fully transparent pixels mark where to edit")
    alpha = im.convert("RGBA").getchannel("A")
    edit = alpha.point(lambda a: 255 if a == 0 else 0)
    if edit.getextrema()[1] == 0:
        raise RequestError("mask", "'mask' has no fully transparent pixel, so there is nothing to edit")
    return edit
