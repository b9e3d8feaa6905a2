"""Response bodies of the HTTP API: a generation's answer (OpenAI's ``data``, ``usage`` and the ``bcg`` extension) and
the model list of ``GET /v1/models``. The request bodies, and the error bodies every route shares, are in
:mod:`deployments.schemas`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from .schemas import LoraAdapter

__all__ = ["BcgInfo", "ImageData", "ImageGenerationResponse", "ModelCard", "ModelList", "Usage", "UsageDetails"]


class ImageData(BaseModel):
    """One generated image."""

    b64_json: str = Field(description="Base64 of an image file in the answer's output_format.")


class UsageDetails(BaseModel):
    """Tokens of one side of :class:`Usage`, by kind."""

    image_tokens: int = Field(description="Image tokens: the transformer's image tokens (latent patches).")
    text_tokens: int = Field(description="Text tokens, as the model's tokenizer counts them.")


class Usage(BaseModel):
    """OpenAI's ``usage``, where its fields mean something here.

    ``input_tokens``: the prompt's text tokens (the family's tokenizer, special tokens included; the negative
    prompt is not counted), plus an edit's input image as the transformer's image tokens of one image at the
    answer's size (a reference edit's: its reference images' tokens). ``output_tokens``: the transformer's image
    tokens of every image (``n`` x tokens per image, at the generation size). ``images``: the image count (an
    extension).
    """

    input_tokens: int = Field(description="Text tokens of the prompt (plus an edit's input image tokens).")
    input_tokens_details: UsageDetails
    output_tokens: int = Field(description="Image tokens generated: n x the transformer's image tokens per image.")
    output_tokens_details: UsageDetails
    total_tokens: int = Field(description="input_tokens + output_tokens.")
    images: int = Field(description="Images generated (extension).")

    @classmethod
    def of(cls, prompt_tokens: int, n: int, image_tokens: int, input_image_tokens: int = 0) -> Usage:
        """The usage of ``n`` images of ``image_tokens`` tokens each for a prompt of ``prompt_tokens`` tokens (and an
        input image of ``input_image_tokens``, for an edit)."""
        out = n * image_tokens
        inp = prompt_tokens + input_image_tokens
        return cls(input_tokens=inp,
                   input_tokens_details=UsageDetails(image_tokens=input_image_tokens, text_tokens=prompt_tokens),
                   output_tokens=out, output_tokens_details=UsageDetails(image_tokens=out, text_tokens=0),
                   total_tokens=inp + out, images=n)


class BcgInfo(BaseModel):
    """How the request was served (extension of the OpenAI response)."""

    bucket: str | None = Field(description="Bucket key, e.g. 'b2_i1024_t256'; null on a miss (eager run).")
    hit: bool = Field(description="True when a bucket held the request.")
    missed: list[str] = Field(description="Key dimensions that missed: 'batch', 'image_tokens', 'text_tokens'.")
    seed: int = Field(description="Seed used (the request's, or the random one drawn for it).")
    steps: int | None = Field(default=None, description="Denoising steps run (num_inference_steps, or quality's).")
    timings_ms: dict[str, float] = Field(description="Milliseconds on the replica: 'queue' (waiting for admission "
                                         "to the step scheduler), 'encode', 'denoise', 'decode', 'image_encode' and "
                                         "'total' (request-level batching gives 'queue', 'encode', 'denoise', "
                                         "'decode' and 'total'); at the ingress: 'route' (waiting in Ray Serve's "
                                         "queues and in transit: 'ingress' - 'total') and 'ingress' (request sent to "
                                         "result back).")
    replica: str | None = Field(default=None, description="Id of the DiT replica that served the request.")
    owner: bool | None = Field(default=None, description="True when that replica owns the request's bucket shape "
                               "(shape-aware routing); null for a miss.")
    batch_size: int = Field(default=1, description="Most requests that shared one denoising step's forwards with "
                            "this one (1: it ran alone).")
    retries: int = Field(default=0, description="Times the request was resent because its replica died.")
    lora: list[LoraAdapter] | None = Field(default=None, description="The LoRA adapters the images were made with "
                                           "and their scales, as the request named them; null: none.")
    cache: dict | None = Field(default=None, description="The step cache the request ran with (its own, or the "
                               "server's cache.default) and what it did: method and settings, and per cache context "
                               "('cond', and 'uncond' with true CFG) the steps that ran every block ('computed') and "
                               "those that reused the remaining blocks' residual ('reused'), e.g. {'method': "
                               "'first_block', 'threshold': 0.12, 'steps': {'cond': {'computed': 20, 'reused': 8}}}; "
                               "null: none.")


class ImageGenerationResponse(BaseModel):
    """Body of a successful ``POST /v1/images/generations``."""

    created: int = Field(description="Unix time in seconds.")
    data: list[ImageData] = Field(description="n images, in order.")
    background: Literal["opaque", "transparent"] = Field(
        default="opaque", description="What the images are: 'opaque' (RGB), or 'transparent' where the model's "
        "images carry alpha (RGBA: Qwen-Image 2.1).")
    output_format: Literal["png", "jpeg", "webp"] = Field(default="png", description="Format of the images.")
    quality: Literal["low", "medium", "high"] | None = Field(
        default=None, description="The request's quality ('standard' reads 'medium', 'hd' 'high'); null when "
        "omitted or 'auto'.")
    size: str = Field(description="'WxH' of the images.")
    usage: Usage
    bcg: BcgInfo


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models`` (OpenAI's model object, plus ``bcg``)."""

    id: str = Field(description="The served model name (a request's 'model').")
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time the ingress started, seconds.")
    owned_by: str = Field(default="bcg-serve", description="Always 'bcg-serve'.")
    bcg: dict = Field(description="Extension: family, pipeline class, the bucket table summarised (batch sizes, "
                      "resolutions, text lengths, bucket count, miss policy), the request limits, the defaults of a "
                      "request that omits them (num_inference_steps, guidance_scale, true_cfg_scale for FLUX and "
                      "Qwen-Image, cfg_normalization and cfg_truncation for Z-Image: the family's diffusers "
                      "pipeline's unless the config's limits or the checkpoint set them), the "
                      "step count of each quality, lora: the adapters in lora.dir and the LoRA limits (null "
                      "without lora.dir), edits: the edit modes served ('image-to-image', 'inpainting', or FLUX.2's "
                      "'reference' with max_reference_images), their diffusers pipelines and defaults, the mask "
                      "convention and the upload bounds (null for a family that serves no edits), cache_methods: "
                      "the step-cache methods the model takes (['first_block'], or [] for a model without one), and "
                      "cache_default: the cache of a request that omits 'cache' (null: none).")


class ModelList(BaseModel):
    """Body of ``GET /v1/models``: OpenAI's list format."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
