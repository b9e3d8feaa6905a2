"""Input images of edit requests (image-to-image, inpainting and reference edits): read, bounded and checked before any
model work.

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

A reference edit (a family whose pipeline takes ``image`` as reference images: FLUX.2) sends one or several images and
neither a mask nor a strength; :func:`read_references` reads each and checks it against the pipeline's own rules
(:class:`~bcg_core.families.references.ReferenceImages`).
"""

from __future__ import annotations

import io
import struct

from bcg_core.errors import RequestError

__all__ = ["EDIT_FORMATS", "MASK_FORMATS", "read_image", "read_mask", "read_references"]

EDIT_FORMATS = ("PNG", "JPEG", "WEBP")
"""Pillow formats an input image may have."""

MASK_FORMATS = ("PNG", "WEBP")
"""Pillow formats a mask may have: those with an alpha channel (OpenAI: "a PNG ... with an alpha channel")."""


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_INFLATED_CHUNKS = {b"zTXt": "compressed text", b"iTXt": "international text", b"iCCP": "ICC colour profile"}


def _png_chunk_too_large(data: bytes) -> str | None:
    """Why Pillow refused the PNG ``data`` for its ancillary chunks' inflated size, or None when that is not why.

    Pillow inflates a PNG's ``zTXt``, compressed ``iTXt`` and ``iCCP`` chunks when it reads them, each to at most
    ``PngImagePlugin.MAX_TEXT_CHUNK`` bytes (1 MiB in Pillow 13.0), and its text chunks to at most
    ``PngImagePlugin.MAX_TEXT_MEMORY`` bytes together (64 MiB), raising ``ValueError`` beyond either: a chunk of
    200 KB can inflate to 200 MB. Called once Pillow has refused a file: this walks the chunks again (each inflated
    to one byte past the limit, no further) to name the one at fault, in the limits of the Pillow in use.

    Returns:
        The rest of a sentence that starts with the field's name, e.g. ``a PNG whose zTXt chunk (compressed text)
        inflates to more than 1048576 bytes, ...``; None for a file that is no PNG or whose chunks are within both
        limits (then it was refused for something else).
    """
    import zlib

    from PIL import PngImagePlugin

    if not data.startswith(_PNG_SIGNATURE):
        return None
    chunk_limit, text_limit = PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY
    text_bytes, pos = 0, len(_PNG_SIGNATURE)
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body, pos = data[pos + 8:pos + 8 + length], pos + 12 + length
        packed: bytes | None = None
        if kind == b"tEXt":
            text_bytes += len(body)
        elif kind in (b"zTXt", b"iCCP") and b"\0" in body:  # keyword or profile name, NUL, method, data
            packed = body[body.index(b"\0") + 2:]
        elif kind == b"iTXt" and b"\0" in body:  # keyword, NUL, compressed?, method, language NUL, key NUL, text
            head = body.index(b"\0")
            rest = body[head + 3:].split(b"\0", 2)
            if len(rest) == 3:
                if body[head + 1:head + 2] == b"\1":
                    packed = rest[2]
                else:
                    text_bytes += len(rest[2])
        if packed is not None:
            try:
                inflated = len(zlib.decompressobj().decompress(packed, chunk_limit + 1))
            except zlib.error:
                inflated = 0
            if inflated > chunk_limit:
                return (f"a PNG whose {kind.decode()} chunk ({_INFLATED_CHUNKS[kind]}, an ancillary chunk) inflates "
                        f"to more than {chunk_limit} bytes, the most one such chunk may (Pillow's "
                        f"PngImagePlugin.MAX_TEXT_CHUNK); send the image without that metadata")
            if kind != b"iCCP":
                text_bytes += inflated
        if text_bytes > text_limit:
            return (f"a PNG whose text chunks (tEXt, zTXt, iTXt: ancillary chunks) inflate to more than {text_limit} "
                    f"bytes together, the most they may (Pillow's PngImagePlugin.MAX_TEXT_MEMORY); send the image "
                    f"without that metadata")
    return None


def _open(data: bytes, field: str, max_pixels: int, formats: tuple[str, ...] = EDIT_FORMATS):
    """The Pillow image of ``data``, decoded after the header's size was checked, and turned upright by its EXIF
    orientation (module docstring). ``formats``: the Pillow formats allowed (a mask needs alpha: no JPEG).

    Raises:
        RequestError: (field ``field``) not bytes, empty, not a file of ``formats``, a PNG with an ancillary chunk
            that inflates beyond Pillow's limits (named, with the limit: :func:`_png_chunk_too_large`), a zero-size
            image, more than ``max_pixels`` pixels, or a truncated or corrupt file.
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
        why = _png_chunk_too_large(data) if "PNG" in formats else None
        raise RequestError(field, f"'{field}' is {why}" if why else
                           f"'{field}' is not an image file; allowed: {allowed}") from None
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
        why = _png_chunk_too_large(data) if im.format == "PNG" else None  # a text chunk after the pixel data
        raise RequestError(field, f"'{field}' is {why}" if why else
                           f"'{field}' is truncated or corrupt: it does not decode") from None
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


def read_references(request, rules, max_pixels: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, int]]:
    """A reference edit's images read and checked, as the validator takes them.

    Args:
        request: the :class:`~bcg_core.request.GenerationRequest` (its ``image`` set: one file or a tuple of them).
        rules: the model's :class:`~bcg_core.families.references.ReferenceImages`.
        max_pixels: ``limits.max_input_pixels``, the most pixels of each file (read from its header first).

    Returns:
        ``(grids, size)``: each reference's token grid ``(h, w)`` as the pipeline encodes it
        (:meth:`~bcg_core.families.references.ReferenceImages.grid`), and ``(width, height)`` of the first as the
        pipeline resizes it: the size of an edit that names none (``Flux2Pipeline.__call__``: ``height = height or
        image_height``).

    Raises:
        RequestError: ``mask`` sent (a reference edit has none), ``strength`` sent (its target starts from pure noise),
            more than ``rules.max_images`` images, or an image that is not served (:func:`read_image`) or that the
            pipeline refuses (a side below ``rules.min_side``, an aspect ratio above ``rules.max_aspect``; field
            ``image``, naming which image of several).
    """
    pipe = rules.pipeline
    if request.mask is not None:
        raise RequestError("mask", f"'mask': edits of {pipe} are reference edits (the images condition a new image, "
                                   f"nothing is masked or inpainted); send no mask")
    if request.strength is not None:
        raise RequestError("strength", f"'strength': edits of {pipe} are reference edits, whose image starts from pure "
                                       f"noise (no image-to-image strength); send no strength")
    files = request.images
    if len(files) > rules.max_images:
        raise RequestError("image", f"'image': {len(files)} reference images were sent; {pipe} takes at most "
                                    f"{rules.max_images} (limits of the model, GET /v1/models: bcg.edits)")
    grids, first = [], None
    for i, data in enumerate(files):
        which = f"image {i + 1} of {len(files)}" if len(files) > 1 else "the image"
        try:
            im = read_image(data, max_pixels)
        except RequestError as e:
            if len(files) == 1:
                raise
            raise RequestError("image", e.message.replace("'image'", f"'image' ({which})", 1)) from None
        why = rules.refusal(*im.size)
        if why is not None:
            raise RequestError("image", f"'image': {which} {why}")
        grids.append(rules.grid(*im.size))
        first = first or rules.size(*im.size)
    return tuple(grids), first
