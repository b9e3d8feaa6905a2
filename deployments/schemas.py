"""Request and error bodies of the HTTP API (OpenAI Images API compatible, plus BCG extensions); the answers' bodies
are in :mod:`deployments.responses`.

This module checks the *shape* of OpenAI's request: types (strict: no ``"2"`` for an integer, no ``true`` for a
number), the values OpenAI's enumerations allow, ``WxH`` sizes, the served model name, previews only when
streamed, and no unknown fields. Limits (``n``, sizes, steps, guidance, seeds, text length, output options) are
the validator's to check, once, with the model (:meth:`bcg_core.validation.RequestValidator.validate`); the phrase of
what each field accepts comes from :func:`bcg_core.validation.engine_field_phrase` on both paths. The served
configuration comes in through pydantic's validation context as a :class:`RequestLimits`::

    ImageGenerationRequest.model_validate_json(body, context={"limits": RequestLimits(...)})

Without a context the defaults of :class:`bcg_core.config.LimitsConfig` apply.

``lora`` (LoRA adapters per request, docs/API.md "LoRA adapters") is checked here for its JSON shape and bounded
before anything else reads it: at most ``lora.max_per_request`` entries (:data:`MAX_LORA_ENTRIES` without a
configured section), names of at most :data:`MAX_LORA_NAME_CHARS` characters; the validator checks the names, scales
and duplicates, the ingress whether each name is in ``lora.dir``, the replica whether the file can be served.

``cache`` (the step cache per request, docs/API.md "Step cache") is one of the engine's own cache models
(:data:`bcg_core.step_cache.spec.StepCacheSpec`, told apart by ``method``), read as strictly as the rest of the JSON
body (no ``"0.1"`` or ``true`` for a threshold); the validator checks it against the model's cache methods and fills
in the server's default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator

from bcg_core.config import LimitsConfig, LoRAConfig, parse_size
from bcg_core.request import MAX_PARTIAL_IMAGES, GenerationRequest
from bcg_core.step_cache.spec import NoCache, StepCacheSpec
from bcg_core.validation import engine_field_phrase

__all__ = [
    "ErrorBody",
    "ErrorDetail",
    "ImageEditRequest",
    "ImageGenerationRequest",
    "LoraAdapter",
    "MAX_LORA_ENTRIES",
    "MAX_LORA_NAME_CHARS",
    "RequestLimits",
    "http_field_phrase",
    "inline_refs",
]

NO_OP_VALUES: dict[str, tuple[str, ...]] = {
    "moderation": ("auto", "low"),
    "style": ("vivid",),
}
"""OpenAI fields accepted only with the values that change nothing here: no content moderation runs (so ``low`` asks
for no less than is done), and ``style`` (a retired DALL-E 3 option) keeps its default ``vivid``, which means nothing
to these models. ``background`` takes what the served model's images are (:func:`background_values`)."""

MAX_LORA_ENTRIES = 16
"""Most ``lora`` entries the schema reads at all (the highest ``lora.max_per_request`` a config may set); the
configured ``lora.max_per_request`` is checked against the context's :attr:`RequestLimits.lora` as well."""

MAX_LORA_NAME_CHARS = 128
"""Longest adapter name (:data:`bcg_core.lora.files.NAME_RE` allows 128 characters)."""

DEFAULT_LORA_SCALE = 1.0
"""The scale of a ``lora`` entry that omits it: diffusers' ``set_adapters`` default weight."""

_CACHE: TypeAdapter = TypeAdapter(StepCacheSpec)

@dataclass(frozen=True)
class RequestLimits:
    """What the served configuration allows; handed to validation through the pydantic context.

    Attributes:
        limits: the ``limits`` section of the served ``ServeConfig``.
        size_multiple: width and height must be multiples of this many pixels (the model's pixels per
            token side, e.g. 16 = VAE factor 8 x patch size 2); None for a family with resolution binning.
        model_name: name of the served model; a request's ``model`` must equal it. None skips the check.
        resolutions: the bucket resolution tiers (for messages only).
        lora: the served ``lora`` section (its ``max_per_request`` bounds a request's ``lora`` entries; the
            ``lora`` phrase of :func:`http_field_phrase`); None: no adapters served.
        cache_methods: the served model's step-cache methods (the ``cache`` phrase); None: every method served.
        output_alpha: the served model's images carry alpha (RGBA: Qwen-Image 2.1's VAE decodes it); ``background``
            takes ``'transparent'`` then, ``'opaque'`` otherwise (and ``'auto'`` always): what the images are.
        guidance: what ``guidance_scale`` does for the served model (:meth:`bcg_core.families.ModelSpec.
            guidance_role`), for the ``guidance_scale`` phrase; None: classifier-free guidance above 1.
    """

    limits: LimitsConfig = field(default_factory=LimitsConfig)
    size_multiple: int | None = 16
    model_name: str | None = None
    resolutions: tuple[str, ...] = ()
    lora: LoRAConfig | None = None
    cache_methods: tuple[str, ...] | None = None
    output_alpha: bool = False
    guidance: str | None = None


def background_values(limits: RequestLimits) -> tuple[str, str]:
    """``background`` values a request may give: ``'auto'`` and what the served model's images are."""
    return ("auto", "transparent" if limits.output_alpha else "opaque")


def _limits(info: ValidationInfo) -> RequestLimits:
    ctx = info.context or {}
    return ctx.get("limits") or RequestLimits()


def http_field_phrase(name: str, limits: RequestLimits) -> str:
    """The phrase of what any field of the HTTP body accepts, for error messages: the engine's phrase
    (:func:`bcg_core.validation.engine_field_phrase`) for a field the engine validates, else the schema's own.

    Args:
        name: a field of :class:`ImageGenerationRequest` (or any other name, for unknown fields).
        limits: the served limits.

    Returns:
        A short phrase such as ``"an integer from 1 to 10"``.
    """
    engine = engine_field_phrase(name, limits.limits, limits.size_multiple, limits.resolutions, limits.lora,
                                 limits.cache_methods, limits.guidance)
    if engine is not None:
        return engine
    if name == "model":
        return f"{limits.model_name!r} (or omit it)" if limits.model_name else "the served model name (or omit it)"
    if name == "response_format":
        return "'b64_json'"
    if name in ("user", "safety_identifier"):
        return "a string (ignored)"
    if name == "background":
        return (", ".join(repr(v) for v in background_values(limits)) + " (what this model's images are: "
                + ("RGBA, with alpha)" if limits.output_alpha else "RGB, no alpha)"))
    if name in NO_OP_VALUES:
        return ", ".join(repr(v) for v in NO_OP_VALUES[name]) + " (the values that change nothing here)"
    if name == "stream":
        return "true or false"
    return "one of the fields " + ", ".join(ImageGenerationRequest.model_fields)


class LoraAdapter(BaseModel):
    """One entry of a request's ``lora``: an adapter in ``lora.dir`` and its weight."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(max_length=MAX_LORA_NAME_CHARS, description="An adapter name listed by GET /v1/models "
                      "(bcg.lora.adapters): the file <name>.safetensors or folder <name>/ in lora.dir.")
    scale: float | None = Field(default=DEFAULT_LORA_SCALE, description="The adapter's weight, as diffusers' "
                                "set_adapters weight: -lora.max_scale to lora.max_scale; omitted or null = 1.0.")

    @field_validator("scale")
    @classmethod
    def _scale(cls, v: float | None) -> float:
        return DEFAULT_LORA_SCALE if v is None else v


class ImageGenerationRequest(BaseModel):
    """Body of ``POST /v1/images/generations``: OpenAI's fields plus the BCG extensions.

    ``null`` for a field with a default means the default, except ``cache``: ``null`` there asks for no cache.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str = Field(description="Text to generate images for: 1 to limits.max_prompt_chars characters; "
                        "at most the model's text length in tokens (checked by the validator; for PixArt-Sigma, SANA "
                        "and Qwen-Image a prompt above the largest text bucket is a text miss).")
    model: str | None = Field(default=None, description="Served model name; omit it or send exactly that name.")
    n: int | None = Field(default=1, description="Number of images, 1 to limits.max_images.")
    size: str | None = Field(
        default="auto",
        description="'auto' (the model's default size: its diffusers pipeline's, GET /v1/models "
        "limits.default_size; 512x512 for the tiny default) or 'WxH' in pixels; each side from limits.min_side_px to "
        "limits.max_side_px and a multiple of the model's pixels per token (16 for the default model).",
    )
    response_format: Literal["b64_json"] | None = Field(
        default="b64_json", description="Only 'b64_json' (base64 PNG in the response); 'url' is not served."
    )
    user: str | None = Field(default=None, description="End-user id (OpenAI field); accepted and ignored.")
    safety_identifier: str | None = Field(default=None, description="End-user id (OpenAI field, successor of "
                                          "user); accepted and ignored.")
    output_format: Literal["png", "jpeg", "webp"] | None = Field(
        default="png", description="Image file format: 'png' (default), 'jpeg' or 'webp'; 'gif' and 'svg' are not "
        "served.")
    output_compression: int | None = Field(
        default=None, description="0 to 100 for 'jpeg' and 'webp' (Pillow quality; omitted = 100, the most "
        "detail); omit it (or send 100) for 'png'.")
    quality: Literal["low", "medium", "high", "auto", "standard", "hd"] | None = Field(
        default=None, description="A denoising step count each, set per family and in the config's quality "
        "section (GET /v1/models shows them); DALL-E 3's 'standard' and 'hd' are served as 'medium' and 'high'; "
        "num_inference_steps wins. Omitted = the default steps (GET /v1/models: defaults).")
    background: Literal["auto", "opaque", "transparent"] | None = Field(
        default=None, description="'auto', or what the served model's images are: 'opaque' (RGB; every family but "
        "Qwen-Image 2.1) or 'transparent' (RGBA: Qwen-Image 2.1, whose VAE decodes an alpha channel); the other is "
        "refused. GET /v1/models: bcg.output_alpha.")
    moderation: Literal["auto", "low"] | None = Field(default=None, description="Only 'auto' or 'low': no "
                                                      "moderation runs here.")
    style: Literal["vivid"] | None = Field(default=None, description="Only 'vivid' (DALL-E 3's default): no "
                                           "style option here.")
    stream: bool | None = Field(default=False, description="true: answer as Server-Sent Events "
                                "(image_generation.partial_image previews, then image_generation.completed).")
    partial_images: int | None = Field(
        default=None, description=f"Previews streamed while denoising, 0 to {MAX_PARTIAL_IMAGES} (with stream: "
        "true), at evenly spaced steps; a request with fewer steps gets fewer.")
    seed: int | None = Field(default=None, description="Noise seed of image 0 (image i uses seed + i), 0 to "
                      "2**63-1-limits.max_images; omitted = random, reported back.")
    num_inference_steps: int | None = Field(
        default=None, description="Denoising steps, 1 to limits.max_steps; omitted = the family's diffusers pipeline "
        "default (28 FLUX.1 and SD3, 20 PixArt-Sigma and SANA, 50 Qwen-Image, FLUX.2 and Z-Image, 40 Qwen-Image 2.1, "
        "4 the tiny default) unless the config sets limits.default_steps (GET /v1/models: defaults)."
    )
    guidance_scale: float | None = Field(
        default=None,
        description="Guidance scale, 0 to limits.max_guidance_scale. Classifier-free guidance for SD3, PixArt-Sigma, "
        "SANA, FLUX.2 [klein] (not distilled) and the tiny default: above 1 runs cond + uncond rows (2n transformer "
        "rows); Z-Image: above 0. FLUX.1-dev and FLUX.2 [dev]: their guidance embedding (no uncond rows); "
        "FLUX.1-schnell, Qwen-Image, Qwen-Image 2.1 and distilled FLUX.2 [klein] ignore it, as their diffusers "
        "pipelines do. Omitted = the family's diffusers pipeline default (3.5 FLUX.1, 7.0 SD3, 4.5 PixArt-Sigma and "
        "SANA, 4.0 FLUX.2, 5.0 Z-Image, unset Qwen-Image and Qwen-Image 2.1, 3.5 the tiny default) unless the config "
        "sets limits.default_guidance_scale (GET /v1/models: defaults).",
    )
    negative_prompt: str | None = Field(
        default=None, description="Text to guide away from (the uncond rows of CFG). Omitted = the family's default: "
        "\"\" for SD3, PixArt-Sigma, SANA, FLUX.2 [klein] and Z-Image; none for FLUX.1, Qwen-Image and Qwen-Image "
        "2.1, which then run no true CFG. FLUX.2 [dev] and distilled [klein] (no CFG) answer 422 when it is set.")
    true_cfg_scale: float | None = Field(
        default=None,
        description="True classifier-free guidance scale of FLUX.1, Qwen-Image and Qwen-Image 2.1 (their pipelines' "
        "true_cfg_scale), 0 to limits.max_guidance_scale: above 1, with a negative_prompt, runs cond + uncond rows. "
        "Omitted = the pipeline's default (1.0 FLUX.1, 4.0 Qwen-Image, 1.0 Qwen-Image 2.1). Other families answer "
        "422 when it is set.",
    )
    cfg_normalization: bool | float | None = Field(
        default=None,
        description="Z-Image only (ZImagePipeline's cfg_normalization), with classifier-free guidance (guidance_scale "
        "above 0): false or 0 = off; true (= 1.0) or a number c > 0 caps each image's guided prediction's norm at c "
        "times its cond prediction's, at every guided step. Omitted = the model's default (GET /v1/models: "
        "bcg.defaults; diffusers' false unless the checkpoint sets bcg_cfg_normalization). Other models answer 422 "
        "when it is set.",
    )
    cfg_truncation: float | None = Field(
        default=None,
        description="Z-Image only (ZImagePipeline's cfg_truncation), with classifier-free guidance, a number of at "
        "least 0: the steps whose normalized time (1000 - t) / 1000 (0 at the first step, rising towards 1) exceeds "
        "it run without guidance (cond rows only); 1 or more = every step guided. Omitted = the model's default (GET "
        "/v1/models: bcg.defaults; diffusers' 1.0 unless the checkpoint sets bcg_cfg_truncation). Other models "
        "answer 422 when it is set.",
    )
    lora: list[LoraAdapter] | None = Field(
        default=None, max_length=MAX_LORA_ENTRIES,
        description="LoRA adapters to apply, each {\"name\": ..., \"scale\": ...} (scale omitted = 1.0): at most "
        "lora.max_per_request entries with distinct names listed by GET /v1/models (bcg.lora.adapters), scales "
        "within lora.max_scale. Rows of different adapters share one forward. Omitted, null or [] = the base model.",
    )
    cache: StepCacheSpec | None = Field(
        default=None,
        description="The step cache of this request, one of diffusers' by its method (docs/API.md: Step cache): "
        "{\"method\": \"first_block\", \"threshold\": t}, First Block Cache, reuses the transformer's remaining "
        "blocks' residual in each step where the first block's output residual changed by at most t (relative mean "
        "absolute change, 0 to 10; omitted: 0.05, diffusers' default) since the last computed step. {\"method\": "
        "\"none\"} or null: no cache. Omitted: the server's cache.default. The methods a model takes: GET "
        "/v1/models bcg.cache_methods (FLUX.1, Qwen-Image and the tiny default; FLUX.2 [klein]: taylor_seer only); "
        "bcg.cache reports the steps "
        "computed and reused.",
    )

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | None, info: ValidationInfo) -> str | None:
        name = _limits(info).model_name
        if v is not None and name is not None and v != name:
            raise ValueError("not served here")  # the error message quotes the value
        return v

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_count(cls, v, info: ValidationInfo):
        # before the entries are read: a long list is refused by its length alone
        lora = _limits(info).lora
        if isinstance(v, list) and lora is not None and lora.dir is not None and len(v) > lora.max_per_request:
            raise ValueError(f"more entries than lora.max_per_request {lora.max_per_request}")
        return v

    @field_validator("cache", mode="wrap")
    @classmethod
    def _cache(cls, v, handler):
        # the engine's cache models are lax; a JSON body is read strictly (a form's text fields laxly, as sent)
        if v is None or isinstance(v, BaseModel):
            return handler(v)
        return _CACHE.validate_python(v, strict=bool(cls.model_config.get("strict")))

    @field_validator("background")
    @classmethod
    def _background(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and v not in background_values(_limits(info)):
            raise ValueError("not a served value")  # the error message quotes the value and the allowed ones
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int:
        return 1 if v is None else v

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None) -> str:
        if v is None or v == "auto":  # OpenAI's "auto": the default size (width_height), checked by the validator
            return "auto"
        try:
            w, h = parse_size(v)  # ranges are the validator's
        except ValueError:  # parse_size's message quotes the value, which the error message quotes already
            raise ValueError("not of the form 'WxH' with positive integer pixels (for example '512x512')") from None
        return f"{w}x{h}"

    @field_validator("response_format")
    @classmethod
    def _format(cls, v: str | None) -> str:
        return v or "b64_json"

    @field_validator("partial_images")
    @classmethod
    def _partials(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is None:
            return v
        if v and not info.data.get("stream"):
            raise ValueError("previews are only streamed: send stream: true with it")
        return v

    def image_format(self) -> str:
        """The output format, ``"png"`` when omitted or null."""
        return self.output_format or "png"

    @classmethod
    def body_schema(cls) -> dict:
        """The JSON schema of the request body for the OpenAPI document: :meth:`model_json_schema` with the
        ``lora`` entries' and ``cache``'s models written in place (:func:`inline_refs`); each ``cache`` model requires
        its ``method`` (the tag that tells them apart), and the discriminator keeps no mapping (its ``#/$defs``
        targets are written in place)."""
        schema = inline_refs(cls.model_json_schema())
        for option in schema["properties"]["cache"]["anyOf"]:
            if "discriminator" in option:
                option["discriminator"] = {"propertyName": "method"}
                for model in option["oneOf"]:
                    model["required"] = ["method"]
        return schema

    def engine_request(self, **edit) -> GenerationRequest:
        """The engine's request of this body (``edit``: an edit's ``image``, ``mask`` and ``strength``); previews
        only when streamed."""
        width, height = self.width_height()
        return GenerationRequest(
            prompt=self.prompt, n=self.n, width=width, height=height, num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale, negative_prompt=self.negative_prompt, seed=self.seed,
            true_cfg_scale=self.true_cfg_scale, cfg_normalization=self.cfg_normalization,
            cfg_truncation=self.cfg_truncation, quality=self.quality, output_format=self.image_format(),
            output_compression=self.output_compression,
            partial_images=(self.partial_images or 0) if self.stream else 0, lora=self.lora_entries(),
            cache=self.cache_spec(), **edit)

    def cache_spec(self) -> BaseModel | None:
        """``cache`` as :attr:`bcg_core.request.GenerationRequest.cache`: the cache sent, :class:`NoCache` for an
        explicit ``null`` (no cache, whatever the server's default), None when omitted (the server's default)."""
        if self.cache is None and "cache" in self.model_fields_set:
            return NoCache()
        return self.cache

    def lora_entries(self) -> tuple[tuple[str, float], ...]:
        """``lora`` as :attr:`bcg_core.request.GenerationRequest.lora`: ``((name, scale), ...)``; ``()`` when
        omitted, null or empty."""
        return tuple((a.name, float(a.scale)) for a in self.lora or ())

    def width_height(self) -> tuple[int, int] | tuple[None, None]:
        """``(width, height)`` in pixels of :attr:`size`; ``(None, None)`` for ``"auto"`` (or omitted): the
        validator fills in the model's default size (:attr:`~bcg_core.families.ModelSpec.default_size`)."""
        return (None, None) if self.size in (None, "auto") else parse_size(self.size)


class ImageEditRequest(ImageGenerationRequest):
    """Body of ``POST /v1/images/edits``, a ``multipart/form-data`` form (:mod:`deployments.uploads` maps its parts
    onto these fields): every field of :class:`ImageGenerationRequest`, plus the input ``image``, an inpainting
    ``mask`` and ``strength``.

    Types are lax (``"2"`` is 2, ``"true"`` is true): a form's values arrive as text. ``lora`` arrives as a JSON
    text field or as the bracketed fields of the ``openai`` client (:func:`deployments.uploads.edit_fields`).
    The image and mask are checked by the validator (:mod:`bcg_core.edits`: the header's pixel count before any
    decoding), never here.
    """

    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)

    image: bytes | list[bytes] = Field(
        description="The image to edit: one PNG, JPEG or WebP file of at most limits.max_input_pixels pixels (a file "
        "part named 'image', or one 'image[]' part); for FLUX.2 models, 1 to bcg.edits.max_reference_images "
        "reference images (one 'image[]' part each, in order).")
    mask: bytes | None = Field(default=None, description="Inpainting: a PNG or WebP with alpha of the image's size "
                               "whose fully transparent pixels mark where to edit (OpenAI's convention); omitted = "
                               "image-to-image (the whole image moves by strength).")
    strength: float | None = Field(default=None, description="How far the edit moves from the image, above 0 and at "
                                   "most 1: the edit runs the last num_inference_steps x strength steps of its "
                                   "schedule, rounded up (28 x 0.6: 17), as diffusers' edit pipelines; bcg.steps "
                                   "reports them. Omitted = the edit pipeline's default, 0.6. FLUX.2's reference "
                                   "edits take none (their image starts from noise).")

    @classmethod
    def form_schema(cls) -> dict:
        """The ``multipart/form-data`` schema of the body for the OpenAPI document: :meth:`body_schema` with no
        ``null`` alternatives (a form part is sent or omitted; a union of plain types, e.g. boolean or number, as a
        list of types), ``image`` a file part (several reference images: one
        ``image[]`` part each) and ``lora`` and ``cache`` as their JSON text fields."""
        schema = cls.body_schema()
        props = {}
        for name, prop in schema["properties"].items():
            options = [o for o in prop.get("anyOf", ()) if o.get("type") != "null"]
            if len(options) == 1:
                prop = {**{k: v for k, v in prop.items() if k not in ("anyOf", "default")}, **options[0]}
            elif options and all(set(o) == {"type"} for o in options):  # cfg_normalization: boolean or number
                prop = {**{k: v for k, v in prop.items() if k not in ("anyOf", "default")},
                        "type": [o["type"] for o in options]}
            props[name] = prop
        props["image"] = {"type": "string", "format": "binary", "description": props["image"]["description"]}
        props["lora"] = {"type": "string", "description": "LoRA adapters as a JSON list of {\"name\": ..., "
                         "\"scale\": ...} in one text field; the openai client's extra_body={\"lora\": [...]} sends "
                         "the fields lora[][name] and lora[][scale] instead, read the same."}
        props["cache"] = {"type": "string", "description": "The step cache as JSON in one text field, e.g. "
                          "{\"method\": \"first_block\", \"threshold\": 0.12}; the openai client's "
                          "extra_body={\"cache\": {...}} sends the fields cache[method] and cache[threshold] instead, "
                          "read the same."}
        return {**schema, "properties": props}


def inline_refs(schema: dict) -> dict:
    """``schema`` (a pydantic JSON schema) with every ``{"$ref": "#/$defs/X"}`` replaced by ``X`` itself and no
    ``$defs``: a body schema placed inside an OpenAPI document, where ``#/$defs`` would not resolve. Not for
    recursive models (none here)."""
    defs = schema.get("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk({**defs[ref.removeprefix("#/$defs/")], **{k: v for k, v in node.items() if k != "$ref"}})
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str = Field(description="What is wrong, naming the field and the values it accepts.")
    type: str = Field(default="invalid_request_error", description="'invalid_request_error' or 'server_error'.")
    param: str | None = Field(default=None, description="The request field at fault, if any.")
    code: str | None = Field(default=None, description="Machine-readable code, or null.")


class ErrorBody(BaseModel):
    """Body of every 4xx/5xx answer: ``{"error": {...}}``."""

    error: ErrorDetail
