"""Request bodies read within their bound, and the multipart form of ``POST /v1/images/edits`` mapped onto the fields
of :class:`~deployments.schemas.ImageEditRequest`.

Every body is read as a stream and refused (:class:`BodyTooLarge`, HTTP 413) as soon as its ``Content-Length`` or
the bytes received pass the bound, so a huge upload is never held whole: ``limits.max_body_bytes`` (64 KiB) for
JSON generations, :func:`upload_limit` (64 MiB) for an edit's files. The validator bounds an image's pixel count from
its header before anything decodes it (:mod:`bcg_core.edits`); it then decodes it once to check it, on the ingress's
validation thread.

The official ``openai`` client sends ``images.edit`` as ``multipart/form-data``: the image as the file part
``image`` (a list of images: one ``image[]`` part each), ``mask`` as a file part, every other argument as a text
field (``"2"``, ``"true"``, ``"0.5"``), and ``extra_body`` too, where a list of objects becomes bracketed fields
grouped by key (``lora[][name]`` for every entry, then ``lora[][scale]``; see :func:`_lora_entries`) and an object
one field per key (``cache[method]``, ``cache[threshold]``). :func:`edit_fields` reads those, ``lora`` and ``cache``
also as one JSON text field (``-F 'lora=[{"name": "watercolor", "scale": 0.8}]'``, ``-F 'cache={"method":
"first_block"}'``), and refuses with :class:`FormError` (naming the field) what no field of the request can be: several
masks, a file where text belongs and text where a file belongs, a field sent twice. Several images are read in the order
sent (FLUX.2's reference images; the validator refuses them for a model that edits one image). :func:`edits_card` is
``bcg.edits`` of ``GET /v1/models``: the edits the model serves and these bounds.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

__all__ = ["BodyTooLarge", "FormError", "MULTIPART", "edit_fields", "edits_card", "form_not_json", "json_body_refusal",
           "media_type", "read_body", "read_form", "repeated_json_key", "upload_limit"]

MULTIPART = "multipart/form-data"

MAX_FORM_FILES = 32
"""Most file parts read (OpenAI takes up to 16 images; the validator bounds them by the model: one, or FLUX.2's
reference images)."""

MAX_FORM_FIELDS = 128
"""Most text fields read (the ``openai`` client sends at most ~20, plus two per ``lora`` entry)."""

MAX_TEXT_FIELD_BYTES = 2**20
"""Largest text field (a prompt is at most ``limits.max_prompt_chars`` characters)."""

_IMAGE = re.compile(r"image(\[\d*\])?")
_LORA = re.compile(r"lora\[(\d*)\](?:\[([^\[\]]*)\])?")
_CACHE = re.compile(r"cache\[([^\[\]]+)\]")
_BOOLEANS = ("stream",)
"""The form's true/false fields: only ``true`` or ``false`` (any case) is read, as the ``openai`` client sends them,
not the other spellings pydantic's lax mode takes (``yes``, ``on``, ``1``, ...)."""


class BodyTooLarge(Exception):
    """A body over its bound: ``size``, its declared length, or with ``read`` the bytes received when it passed the
    bound (a body sent without a ``Content-Length``, or longer than declared, read no further)."""

    def __init__(self, size: int, read: bool = False):
        super().__init__(size, read)
        self.size, self.read = size, read


class FormError(Exception):
    """A body or form that no request can be made of: ``status`` (400 unreadable multipart, 415 not multipart, 422
    a field), ``field`` (or None) and the ``message`` answered."""

    def __init__(self, status: int, field: str | None, message: str):
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


def edits_card(spec, limits) -> dict | None:
    """``bcg.edits`` of ``GET /v1/models`` for the model ``spec`` under ``limits``: the edit modes served, their
    diffusers pipelines and request defaults (the validator's: the spec's own where it has them, else the pipeline's,
    the config's limits first), the mask convention and the upload bounds; for reference edits (FLUX.2) the mode
    ``reference``, its pipeline, ``max_reference_images`` and the reference rules instead of a mask; None for a family
    without edits."""
    from bcg_core.families.defaults import edit_defaults

    refs = spec.references
    if refs is not None:
        steps = limits.default_steps if limits.default_steps is not None else min(spec.default_steps,
                                                                                  limits.max_steps)
        guidance = limits.default_guidance_scale if limits.default_guidance_scale is not None \
            else spec.default_guidance_scale
        return {"modes": ["reference"], "pipelines": {"reference": refs.pipeline},
                "defaults": {"reference": {"num_inference_steps": steps, "guidance_scale": guidance,
                                           "strength": None}},
                "max_reference_images": refs.max_images,
                "reference": f"1 to {refs.max_images} images (image[] parts, in order) condition a new image that "
                             f"starts from noise; no mask, no strength; each side at least {refs.min_side} pixels, "
                             f"aspect ratio up to {refs.max_aspect:g}:1; resized to {refs.max_area} pixels of area "
                             f"where larger, sides cut down to multiples of {refs.multiple}; size 'auto' is the first "
                             f"image's",
                "max_input_pixels": limits.max_input_pixels, "max_upload_bytes": upload_limit(limits)}
    if spec.edit_pipelines is None:
        return None
    pipes = dict(zip(("image-to-image", "inpainting"), spec.edit_pipelines, strict=True))
    defaults = {}
    for mode in pipes:
        d = edit_defaults(spec, limits, mode == "inpainting")
        defaults[mode] = {"num_inference_steps": d["steps"], "guidance_scale": d["guidance"],
                          "strength": d["strength"]}
    return {"modes": list(pipes), "pipelines": pipes, "defaults": defaults,
            "mask": "inpainting: a PNG or WebP with alpha of the image's size; fully transparent pixels are edited",
            "max_input_pixels": limits.max_input_pixels, "max_upload_bytes": upload_limit(limits)}


def upload_limit(limits) -> int:
    """The bound of an edit's body: ``limits.max_upload_bytes`` (default 64 MiB: room for an image at
    ``limits.max_input_pixels``, 4096 x 4096, as a PNG (a photo's is 20-35 MB, noise's up to 50 MB) and its
    mask)."""
    return int(limits.max_upload_bytes)


async def _bounded(request: Request, max_bytes: int) -> AsyncIterator[bytes]:
    """The body's chunks, raising :class:`BodyTooLarge` before any when ``Content-Length`` is over ``max_bytes``,
    and as soon as the bytes received pass it (a chunked or lying upload)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(int(declared))
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(size, read=True)
        yield chunk


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, read within ``max_bytes`` (raises :class:`BodyTooLarge`)."""
    return b"".join([chunk async for chunk in _bounded(request, max_bytes)])


def media_type(request: Request) -> str:
    """The request's media type, lowercase, without parameters (``""`` when absent)."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def form_not_json(request: Request, body: bytes) -> str | None:
    """Why the body of a JSON route (``POST /v1/images/generations``) is refused with 415, or None: a
    ``multipart/form-data`` body (an edit's), or a urlencoded one that is not JSON (``curl -d '{...}'`` sends JSON as
    ``application/x-www-form-urlencoded``: that is read as JSON)."""
    got = media_type(request)
    if got == MULTIPART or (got == "application/x-www-form-urlencoded" and not body.lstrip().startswith(b"{")):
        return (f"POST {request.url.path} takes a JSON body, not {got}; an edit of an uploaded image is "
                f"POST /v1/images/edits (multipart/form-data)")
    return None


class _Pairs(dict):
    """A JSON object as :func:`repeated_json_key` reads it: its keys, with those sent more than once."""

    repeated: list[str]


def repeated_json_key(body: bytes) -> str | None:
    """Where a JSON ``body`` holds a key twice in one object (at any depth), as a path from the top
    (``"n"``, ``"cache.method"``, ``"lora[0].name"``: the first such object in document order), or None: none, or
    not JSON (the model's parser then names what is wrong). A JSON parser keeps the last of two, so
    ``{"n": 11, "n": 1}`` would be served as ``n=1`` while ``{"n": 1, "n": 11}`` is refused; the body is refused
    instead, as an edit form's field sent twice is."""

    def pairs(items: list[tuple[str, Any]]) -> dict:
        obj = _Pairs(items)
        keys = [k for k, _ in items]
        obj.repeated = [k for k in dict.fromkeys(keys) if keys.count(k) > 1]
        return obj

    def find(value: Any, path: str) -> str | None:
        if isinstance(value, _Pairs):
            if value.repeated:
                return f"{path}.{value.repeated[0]}" if path else value.repeated[0]
            items = ((f"{path}.{k}" if path else k, v) for k, v in value.items())
        elif isinstance(value, list):
            items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
        else:
            return None
        return next((hit for p, v in items if (hit := find(v, p)) is not None), None)

    try:
        return find(json.loads(body, object_pairs_hook=pairs), "")
    except (ValueError, RecursionError):
        return None


def json_body_refusal(request: Request, body: bytes) -> tuple[int, str, str | None] | None:
    """Why a JSON route refuses ``body`` before its model reads it, as ``(status, message, param)``, or None:
    415 for a form body (:func:`form_not_json`), 422 for a key sent twice (:func:`repeated_json_key`)."""
    if (why := form_not_json(request, body)) is not None:
        return 415, why, None
    if (key := repeated_json_key(body)) is not None:  # the param is the request's field that holds it
        return 422, f"'{key}' is sent more than once in the JSON body; send each field once", \
            key.split(".")[0].split("[")[0]
    return None


async def read_form(request: Request, max_bytes: int) -> FormData:
    """The ``multipart/form-data`` body of ``request``, parsed while it streams in, within ``max_bytes``.

    Raises:
        FormError: 415 for another content type (naming the one expected), 400 for a body that is not readable
            multipart (no boundary, malformed, a text field over 1 MiB, more than :data:`MAX_FORM_FILES` files or
            :data:`MAX_FORM_FIELDS` fields).
        BodyTooLarge: over ``max_bytes``.
    """
    got = media_type(request) or "a body without a Content-Type"
    if got != MULTIPART:
        raise FormError(415, None, f"POST {request.url.path} takes a multipart/form-data body (the image as the file "
                                   f"field 'image', the other fields as form fields: the openai client's images.edit, "
                                   f"or curl -F image=@photo.png -F prompt=...), not {got}")
    parser = MultiPartParser(request.headers, _bounded(request, max_bytes), max_files=MAX_FORM_FILES,
                             max_fields=MAX_FORM_FIELDS, max_part_size=MAX_TEXT_FIELD_BYTES)
    parser.spool_max_size = max_bytes  # files stay in memory: the body is bounded already, and read whole next
    try:
        return await parser.parse()
    except MultiPartException as exc:
        raise FormError(400, None, f"the multipart/form-data body could not be read ({exc.message}); send the image "
                                   f"as the file field 'image' and each other field once as a text field") from None


def _scale(value: str) -> Any:
    """A ``lora[][scale]`` text as a number where it is one (else as sent: the schema refuses it, naming it)."""
    try:
        return float(value)
    except ValueError:
        return value


def _lora_entries(parts: list[tuple[str, str, str]]) -> list:
    """``lora`` of its bracketed fields ``(index, key, value)``: in the order sent, or by index where indexed.

    The ``openai`` client sends ``extra_body={"lora": [...]}`` as ``lora[][name]`` and ``lora[][scale]`` fields
    grouped by key (every name, then every scale), so entry ``i`` is the ``i``-th value of each key; an entry that
    omits a key another gives cannot be placed, and is refused. ``lora[0][name]`` (indices from 0, without gaps)
    places each value;
    ``lora[]`` alone gives list items as sent (the schema refuses them).

    Raises:
        FormError: 422 on ``lora``: the forms mixed, keys given by some entries only, indices that skip one, or a
            key sent twice at one index.
    """
    styles = {"items" if not key else "indices" if index else "brackets" for index, key, _ in parts}
    if len(styles) > 1:
        raise FormError(422, "lora", "'lora' is sent in more than one form (lora[], lora[][key], lora[0][key]); "
                                     "send one, or a JSON list in one 'lora' field")
    if styles == {"items"}:
        return [value for _, _, value in parts]
    if styles == {"indices"}:
        by_index: dict[str, dict] = {}
        for index, key, value in parts:
            entry = by_index.setdefault(index, {})
            if key in entry:
                raise FormError(422, "lora", f"'lora[{index}][{key}]' is sent more than once; send each once")
            entry[key] = _scale(value) if key == "scale" else value
        sent = sorted(by_index, key=lambda i: (len(i), i))  # digits: by length, then as text, is by value
        if [i.lstrip("0") or "0" for i in sent] != [str(n) for n in range(len(sent))]:
            raise FormError(422, "lora", f"'lora' indices must count from 0 without gaps or repeats (got "
                                         f"{', '.join(sent)[:80]}); e.g. lora[0][name], lora[1][name]")
        return [by_index[i] for i in sent]
    columns: dict[str, list] = {}
    for _, key, value in parts:
        columns.setdefault(key, []).append(_scale(value) if key == "scale" else value)
    counts = {key: len(values) for key, values in columns.items()}
    if len(set(counts.values())) > 1:
        raise FormError(422, "lora", f"'lora' entries give their keys unevenly ({counts}): the openai client sends "
                                     f"each key's values together, so an entry without a scale cannot be matched to "
                                     f"its name; give every entry a scale (1.0 is the default), or send lora as a JSON "
                                     f"string: extra_body={{\"lora\": json.dumps([...])}}")
    return [{key: values[i] for key, values in columns.items()} for i in range(max(counts.values()))]


def _form_json(field: str, text: str, example: str, fields: str) -> Any:
    """A form field sent as a JSON text (``lora``, ``cache``), parsed; a 422 naming ``field``, a JSON ``example`` and
    the bracketed ``fields`` the openai client's ``extra_body`` sends instead, where it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise FormError(422, field, f"invalid '{field}' (got {text[:40]!r}): it is not JSON ({exc}); send a JSON "
                                    f"{example} in one form field, or the fields {fields} (the openai client's "
                                    f"extra_body)") from None


def _cache_json(text: str) -> Any:
    return _form_json("cache", text, 'object such as {"method": "first_block", "threshold": 0.12}',
                      "cache[method] and cache[threshold]")


def _lora_json(text: str) -> Any:
    return _form_json("lora", text, 'list such as [{"name": "watercolor", "scale": 0.8}]',
                      "lora[][name] and lora[][scale]")


def _file_refusal(name: str) -> FormError:
    """The 422 of a file part named ``name``, which is neither ``image`` nor ``mask``: a text field of the edit sent as
    a file, or a name no field has (``images``), then named as unknown with the fields the form takes."""
    from .schemas import ImageEditRequest

    files = "the files are 'image' (several images: one 'image[]' part each) and 'mask'"
    if name in ImageEditRequest.model_fields or _LORA.fullmatch(name) or _CACHE.fullmatch(name):
        return FormError(422, name, f"'{name}' was sent as a file, but it is a text field; {files}")
    return FormError(422, name, f"unknown field '{name}' (sent as a file; {files}); allowed fields: "
                                f"{', '.join(ImageEditRequest.model_fields)}")


async def edit_fields(form: FormData) -> dict[str, Any]:
    """The fields of :class:`~deployments.schemas.ImageEditRequest` in a parsed form: ``image`` and ``mask`` as the
    bytes of their files, ``lora`` as a list, ``cache`` as a mapping, every other field as its text (the schema
    converts and checks them).

    Several images (``image[]`` parts, or ``image`` sent more than once) come as a list, in the order sent (a
    model that edits one image refuses them in the validator, which knows the model).

    Raises:
        FormError: 422 naming the field: more than one mask, ``image`` or ``mask`` sent as text, a file for any other
            field, a field sent twice, ``stream`` other than true or false, ``lora`` or ``cache`` both as JSON and
            bracketed, or not JSON.
    """
    try:
        return await _fields(form)
    finally:
        await form.close()  # the parts' files: in memory, released now


async def _fields(form: FormData) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    images: list[bytes] = []
    masks: list[bytes] = []
    lora_parts: list[tuple[str, str, str]] = []
    cache_keys: dict[str, str] = {}
    for name, value in form.multi_items():
        is_file = isinstance(value, UploadFile)
        target = "image" if _IMAGE.fullmatch(name) else name
        if target in ("image", "mask"):
            if not is_file:
                raise FormError(422, target, f"'{name}' must be a file part (curl: -F {target}=@photo.png; the "
                                             f"openai client: {target}=open(path, 'rb')), not a text field")
            (images if target == "image" else masks).append(await value.read())
            continue
        if is_file:
            raise _file_refusal(name)
        lora = _LORA.fullmatch(name)
        if lora is not None:
            lora_parts.append((lora.group(1), lora.group(2) or "", value))
            continue
        cache = _CACHE.fullmatch(name)
        if cache is not None:  # cache[method], cache[threshold]: the openai client's extra_body={"cache": {...}}
            if cache.group(1) in cache_keys:
                raise FormError(422, "cache", f"'{name}' is sent more than once; send each field once")
            cache_keys[cache.group(1)] = value
            continue
        if name in fields:
            raise FormError(422, name, f"'{name}' is sent more than once; send each field once")
        if name in _BOOLEANS and value.lower() not in ("true", "false"):
            raise FormError(422, name, f"'{name}' is {value[:20]!r}; allowed: true or false")
        fields[name] = value
    if len(masks) > 1:
        raise FormError(422, "mask", f"{len(masks)} masks were sent; send at most one 'mask' file")
    if images:
        fields["image"] = images[0] if len(images) == 1 else images
    if masks:
        fields["mask"] = masks[0]
    # a JSON field sent as one JSON text, or as the bracketed fields the openai client's extra_body sends (the cache's
    # threshold then as text: the edit schema reads it as a number)
    for name, parts, from_json, from_parts, example in (
            ("lora", lora_parts, _lora_json, _lora_entries, "lora[][name]"),
            ("cache", cache_keys, _cache_json, dict, "cache[method]")):
        if name in fields:
            if parts:
                raise FormError(422, name, f"'{name}' is sent both as JSON and as bracketed fields ({example}); send "
                                           f"one of them")
            fields[name] = from_json(fields[name])
        elif parts:
            fields[name] = from_parts(parts)
    return fields
