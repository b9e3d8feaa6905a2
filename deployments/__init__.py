"""Ray Serve layer of bcg-serve: HTTP ingress (OpenAI Images API), DiT replica, app builder, and the ``bcg``
command line (:mod:`deployments.cli.main`; the local server in :mod:`deployments.cli.local`, the demo replay in
:mod:`deployments.cli.demo`, the verify and profile tables in :mod:`deployments.cli.commands`)."""

from .answers import sse_event
from .app import AppArgs, build_app, load_config
from .auth import ApiKeys
from .dit import DiTReplica
from .http_errors import error_response, find_request_error, unauthorized_response, validation_error_response
from .ingress import Ingress
from .request_args import as_generation_request
from .responses import BcgInfo, ImageData, ImageGenerationResponse, ModelCard, ModelList, Usage
from .schemas import (
    ErrorBody,
    ErrorDetail,
    ImageEditRequest,
    ImageGenerationRequest,
    RequestLimits,
    http_field_phrase,
)

__all__ = [
    "ApiKeys",
    "AppArgs",
    "BcgInfo",
    "DiTReplica",
    "ErrorBody",
    "ErrorDetail",
    "ImageData",
    "ImageEditRequest",
    "ImageGenerationRequest",
    "ImageGenerationResponse",
    "Ingress",
    "ModelCard",
    "ModelList",
    "RequestLimits",
    "Usage",
    "as_generation_request",
    "build_app",
    "error_response",
    "find_request_error",
    "http_field_phrase",
    "load_config",
    "sse_event",
    "unauthorized_response",
    "validation_error_response",
]
