"""The body of ``POST /v1/videos``: OpenAI's ``videos.create`` fields plus four BCG extensions, read as JSON or as the
``multipart/form-data`` form the ``openai`` client sends (always: its ``create`` posts a form, with or without an
``input_reference`` file), and its mapping onto the engine's request (docs/API.md "Videos").

JSON is read as strictly as ``POST /v1/images/generations`` (no ``"2"`` for an integer); a form's fields arrive as
text and are read laxly. ``seconds`` is OpenAI's decimal string (``"4"``), a number too in JSON; ``size`` is ``"WxH"``;
both are checked against the served tiers by :class:`~deployments.videos.options.VideoOptions`. ``input_reference``
(image to video) is read, to refuse it by name: no served video family takes an image yet.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from bcg_core.errors import RequestError, shown
from bcg_core.field_phrases import engine_field_phrase, invalid
from bcg_core.request import GenerationRequest

from ..uploads import MULTIPART, FormError, media_type, read_body, read_form, repeated_json_key
from .options import VideoOptions, VideoShape

__all__ = ["VIDEO_BODY", "VIDEO_CONTENT", "VideoCreateForm", "VideoCreateRequest", "read_create", "refuse_reference",
           "schema_error"]


class VideoCreateRequest(BaseModel):
    """Body of ``POST /v1/videos`` as JSON."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str = Field(description="Text to generate the video for: 1 to limits.max_prompt_chars characters, at most "
                        "the model's text length in tokens (Wan: 512).")
    model: str | None = Field(default=None, description="Served model name; omit it or send exactly that name.")
    seconds: str | int | float | None = Field(
        default=None, description="Duration: one of the served durations (GET /v1/models bcg.videos.seconds; 1 + "
        "seconds x fps frames, Wan 2.1: '5' = 81 frames at 16 fps); omitted: the model's default where served.")
    size: str | None = Field(default=None, description="'WxH': one of the video buckets' sizes (GET /v1/models "
                             "bcg.videos.sizes; Wan's default table: 832x480); omitted: the model's default.")
    input_reference: Any = Field(default=None, description="An image to start from (image to video): not served yet; "
                                 "a request with one is refused.")
    seed: int | None = Field(default=None, description="Noise seed, 0 to 2**63-2; omitted = random, kept with the job "
                             "(a job that runs again after a replica died makes the same video).")
    num_inference_steps: int | None = Field(default=None, description="Denoising steps, 1 to limits.max_steps; "
                                            "omitted = limits.default_steps, else the pipeline's (Wan: 50).")
    guidance_scale: float | None = Field(default=None, description="Classifier-free guidance scale (Wan: above 1 "
                                         "runs cond + uncond rows; default 5.0, the pipeline's).")
    negative_prompt: str | None = Field(default=None, description="Text to guide away from (Wan's default: \"\").")
    guidance_scale_2: float | None = Field(default=None, description="Wan 2.2 checkpoints of two experts only: the "
                                           "low-noise expert's classifier-free guidance scale, with guidance_scale "
                                           "above 1 (omitted: guidance_scale's).")

    def engine_request(self, shape: VideoShape) -> GenerationRequest:
        """The engine's request of one video at ``shape``."""
        return GenerationRequest(prompt=self.prompt, n=1, width=shape.width, height=shape.height,
                                 num_frames=shape.num_frames, seed=self.seed,
                                 num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
                                 negative_prompt=self.negative_prompt, guidance_scale_2=self.guidance_scale_2)


class VideoCreateForm(VideoCreateRequest):
    """Body of ``POST /v1/videos`` as a form: the same fields, read laxly (a form's values are text), and
    ``input_reference`` as a file part's bytes."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


def _body_schema() -> dict:
    schema = VideoCreateRequest.model_json_schema()
    form = {**schema, "properties": {**schema["properties"], "input_reference": {
        "type": "string", "format": "binary", "description": "An image file (image to video): not served yet."}}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema},
                                                          "multipart/form-data": {"schema": form}}}}


VIDEO_BODY = _body_schema()
"""The OpenAPI ``requestBody`` of ``POST /v1/videos``: the JSON schema, and the form (``input_reference`` a file)."""

VIDEO_CONTENT = {"description": "The file: video/mp4 (video), image/webp (thumbnail) or image/jpeg (spritesheet).",
                 "content": {t: {"schema": {"type": "string", "format": "binary"}}
                             for t in ("video/mp4", "image/webp", "image/jpeg")}}
"""The OpenAPI 200 answer of ``GET /v1/videos/{id}/content``."""


def _phrase(name: str, options: VideoOptions, validator) -> str:
    """What field ``name`` of the body takes, for messages (the engine's phrase for the fields it validates)."""
    if name == "seconds":
        return options.seconds_phrase()
    if name == "size":
        return options.size_phrase()
    if name == "model":
        return f"{options.model!r} (or omit it)"
    if name == "input_reference":
        return "nothing yet (image to video is not served)"
    spec = validator.spec
    engine = engine_field_phrase(name, validator.limits, None, (), None, spec.cache_methods, spec.guidance_role(),
                                 validator.rules.frame_stride) if name in VideoCreateRequest.model_fields else None
    return engine or "one of the fields " + ", ".join(VideoCreateRequest.model_fields)


def schema_error(exc: ValidationError, options: VideoOptions, validator) -> RequestError:
    """The refusal of a body that fails :class:`VideoCreateRequest`: 400 when the body is not JSON, else 422 naming
    each field at fault (the first as ``field``) and what it takes."""
    messages, first, status = [], None, 422
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err.get("loc", ())]
        kind, msg = err.get("type", ""), str(err.get("msg", "")).removeprefix("Value error, ")
        if kind == "json_invalid":
            return RequestError("request", f"request body is not valid JSON ({err.get('ctx', {}).get('error', msg)}); "
                                           f"send a JSON object with the fields "
                                           f"{', '.join(VideoCreateRequest.model_fields)}", status=400)
        name = loc[0] if loc else None
        if name is None:
            messages.append(f"request body must be a JSON object with the fields "
                            f"{', '.join(VideoCreateRequest.model_fields)} ({msg})")
            continue
        first = first or name
        if kind == "extra_forbidden":
            messages.append(f"unknown field '{name}'; allowed fields: {', '.join(VideoCreateRequest.model_fields)}")
        elif kind == "missing":
            messages.append(f"'{name}' is required: {_phrase(name, options, validator)}")
        else:
            messages.append(invalid(name, err.get("input"), msg, _phrase(name, options, validator)))
    return RequestError(first or "request", "; ".join(dict.fromkeys(messages)) or str(exc), status=status)


async def _form_fields(request: Request, max_bytes: int) -> dict[str, Any]:
    """The form's fields: ``input_reference`` as its file's bytes (or, sent as the ``openai`` client sends a reference
    object, ``input_reference[image_url]`` / ``[file_id]``, as that mapping), every other field as its text.

    Raises:
        FormError: 422 for a file part under another name or a field sent twice; 400 for an unreadable body.
        BodyTooLarge: over ``max_bytes``.
    """
    form = await read_form(request, max_bytes)
    try:
        fields: dict[str, Any] = {}
        for name, value in form.multi_items():
            is_file = isinstance(value, UploadFile)
            if name.startswith("input_reference[") and name.endswith("]") and not is_file:
                fields.setdefault("input_reference", {})[name[len("input_reference["):-1]] = value
                continue
            if name in fields:
                raise FormError(422, name, f"'{name}' is sent more than once; send each field once")
            if is_file and name != "input_reference":
                raise FormError(422, name, f"'{name}' was sent as a file; the one file part is 'input_reference'")
            fields[name] = await value.read() if is_file else value
        return fields
    finally:
        await form.close()


async def read_create(request: Request, options: VideoOptions, validator, upload_bytes: int) -> VideoCreateRequest:
    """The body of ``POST /v1/videos``, JSON (within ``limits.max_body_bytes``) or ``multipart/form-data`` (within
    ``upload_bytes``: room for an ``input_reference`` image), checked against its schema (``validator``: the
    served model's :class:`~bcg_core.validation.RequestValidator`, for the fields' phrases).

    Raises:
        BodyTooLarge: over its bound.
        FormError: an unreadable form, or one no request can be made of.
        RequestError: 400 for a body that is not JSON, 415 for another content type, 422 for a field at fault (a
            key sent twice in JSON included).
    """
    kind = media_type(request)
    if kind == MULTIPART:
        fields = await _form_fields(request, upload_bytes)
        try:
            return VideoCreateForm.model_validate(fields)
        except ValidationError as exc:
            raise schema_error(exc, options, validator) from None
    if kind not in ("", "application/json", "application/x-www-form-urlencoded"):
        raise RequestError("request", f"POST /v1/videos takes a JSON or multipart/form-data body, not {kind}",
                           status=415)
    body = await read_body(request, validator.limits.max_body_bytes)
    if kind == "application/x-www-form-urlencoded" and not body.lstrip().startswith(b"{"):  # curl -d '{...}' is JSON
        raise RequestError("request", "POST /v1/videos takes a JSON or multipart/form-data body, not "
                                      "application/x-www-form-urlencoded (curl: -F prompt=... or -H 'Content-Type: "
                                      "application/json' -d '{...}')", status=415)
    if (key := repeated_json_key(body)) is not None:
        raise RequestError(key.split(".")[0], f"'{key}' is sent more than once in the JSON body; send each field "
                                              f"once")
    try:
        return VideoCreateRequest.model_validate_json(body)
    except ValidationError as exc:
        raise schema_error(exc, options, validator) from None


def refuse_reference(req: VideoCreateRequest, spec) -> None:
    """Refuse an ``input_reference``: the served video model is text to video (no served family takes an image).

    Raises:
        RequestError: 422 on ``input_reference``, naming the model and what it takes.
    """
    if req.input_reference is not None:
        got = "a file" if isinstance(req.input_reference, bytes) else shown(req.input_reference, 40)
        raise RequestError("input_reference", f"invalid 'input_reference' (got {got}): image to video is not served "
                                              f"yet; {spec.name} ({spec.pipeline_class}) generates video from text "
                                              f"only: omit input_reference")

