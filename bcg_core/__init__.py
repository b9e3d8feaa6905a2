"""bcg-serve's torch-only engine: bucket keys and table, the validator, model families, runners, the step scheduler.

Never imports Ray or ``deployments/`` (the Ray Serve layer lives in ``deployments/`` and ``router/``). The family
adapters (``FluxAdapter``, ``SD3Adapter``, ``PixArtAdapter``, ``SanaAdapter``, ``QwenImageAdapter``) and the
step scheduler are exported lazily: each pulls in heavier modules on first use. The layout is in README.md.
"""

import importlib

from bcg_core.config import (
    BucketConfig,
    EngineConfig,
    LimitsConfig,
    MissPolicy,
    ModelConfig,
    RunnerConfig,
    parse_size,
)
from bcg_core.errors import BucketMissError, RequestCancelled, RequestError
from bcg_core.families import Family, ModelSpec, RequestState, TextRows
from bcg_core.families.tiny import build_tiny
from bcg_core.images import IMAGE_FORMATS, encode_image
from bcg_core.keys import BucketKey, BucketShape, Dim, ShapeQuery
from bcg_core.metrics import BucketCounters, BucketMetrics
from bcg_core.models import CheckpointError, describe_model, load_model, save_pipeline
from bcg_core.padding import DenoiseInputs, DiTAdapter
from bcg_core.pipeline import DiTPipeline
from bcg_core.planning.traffic import TrafficHistogram, TrafficKey, load_traffic
from bcg_core.preview import LinearPreview, PartialImage, preview_steps
from bcg_core.request import GenerationRequest, GenerationResult, ValidatedRequest
from bcg_core.runners import BucketEntry, BucketRunner, EagerBucketRunner, RunMode
from bcg_core.table import BucketLookup, BucketTable, ShapeRules
from bcg_core.validation import RequestValidator

_LAZY = {
    "FluxAdapter": "bcg_core.families.flux", "SD3Adapter": "bcg_core.families.sd3",
    "PixArtAdapter": "bcg_core.families.pixart", "SanaAdapter": "bcg_core.families.sana",
    "QwenImageAdapter": "bcg_core.families.qwenimage", "StepScheduler": "bcg_core.scheduler",
    "CostModel": "bcg_core.costs", "StepForwards": "bcg_core.costs",
}


def __getattr__(name: str):
    """The family adapters and the step scheduler, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bcg_core' has no attribute {name!r}")


__all__ = [
    "BucketConfig", "BucketCounters", "BucketEntry", "BucketKey", "BucketLookup", "BucketMetrics", "BucketMissError",
    "BucketRunner", "BucketShape", "BucketTable", "CheckpointError", "DenoiseInputs", "DiTAdapter", "DiTPipeline",
    "Dim", "EagerBucketRunner", "Family", "GenerationRequest", "GenerationResult", "IMAGE_FORMATS", "LimitsConfig",
    "LinearPreview", "MissPolicy", "ModelConfig", "ModelSpec", "PartialImage", "RequestCancelled",
    "RequestError", "RequestState", "RequestValidator", "RunMode", "RunnerConfig", "EngineConfig", "ShapeQuery",
    "ShapeRules", "TextRows", "TrafficHistogram", "TrafficKey", "ValidatedRequest", "build_tiny", "describe_model",
    "encode_image", "load_model", "load_traffic", "parse_size", "preview_steps", "save_pipeline",
    *_LAZY,
]
