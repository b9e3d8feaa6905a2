"""bcg-serve's torch-only engine: bucket keys and table, model families, bucket runners, the pipeline.

Never imports Ray (the Ray Serve layer lives in ``deployments/`` and ``router/``). The family adapters
(``FluxAdapter``, ``SD3Adapter``, ``PixArtAdapter``, ``SanaAdapter``, ``QwenImageAdapter``) are exported lazily:
each pulls in its diffusers pipeline module on first use.
"""

import importlib

from .buckets import BucketKey, BucketLookup, BucketTable, Dim, ShapeQuery, ShapeRules
from .config import (
    BucketConfig, LimitsConfig, MissPolicy, ModelConfig, RunnerConfig, ServeConfig, load_config, parse_size,
)
from .errors import BucketMissError, RequestCancelled, RequestError
from .families import Family, ModelSpec, RequestState, TextRows
from .metrics import BucketCounters, BucketMetrics
from .models import CheckpointError, LoadedModel, build_tiny, describe_model, load_model, save_pipeline
from .padding import DenoiseInputs, DiTAdapter
from .pipeline import DiTPipeline, GenerationResult
from .planner import GenerationRequest, Plan, Planner
from .runner import BucketEntry, BucketRunner, EagerBucketRunner, RunMode
from .traffic import TrafficHistogram, TrafficKey, load_traffic
from .images import IMAGE_FORMATS, encode_image
from .preview import LinearPreview, PartialImage, preview_steps

_ADAPTERS = {
    "FluxAdapter": "flux", "SD3Adapter": "sd3", "PixArtAdapter": "pixart", "SanaAdapter": "sana",
    "QwenImageAdapter": "qwenimage",
}


def __getattr__(name: str):
    """The family adapters, imported from :mod:`bcg_core.families` on first use."""
    if name in _ADAPTERS:
        return getattr(importlib.import_module(f".families.{_ADAPTERS[name]}", __name__), name)
    raise AttributeError(f"module 'bcg_core' has no attribute {name!r}")


__all__ = [
    "BucketConfig", "BucketCounters", "BucketEntry", "BucketKey", "BucketLookup", "BucketMetrics", "BucketMissError",
    "BucketRunner", "BucketTable", "CheckpointError", "DenoiseInputs", "DiTAdapter", "DiTPipeline", "Dim",
    "EagerBucketRunner", "Family", "GenerationRequest", "GenerationResult", "LimitsConfig", "LoadedModel",
    "MissPolicy", "ModelConfig", "ModelSpec", "Plan", "Planner", "RequestCancelled", "RequestError", "RequestState",
    "RunMode", "RunnerConfig", "ServeConfig", "ShapeQuery", "ShapeRules", "TextRows", "TrafficHistogram",
    "TrafficKey", "build_tiny", "describe_model", "load_config", "load_model", "load_traffic", "parse_size",
    "save_pipeline", *_ADAPTERS,
]
__all__ += ["IMAGE_FORMATS", "LinearPreview", "PartialImage", "encode_image", "preview_steps"]
