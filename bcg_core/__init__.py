"""bcg-serve's torch-only engine: bucket keys and table, model adapters, bucket runners, the pipeline.

Never imports Ray (the Ray Serve layer lives in ``deployments/`` and ``router/``).
"""

from .buckets import BucketKey, BucketLookup, BucketTable, Dim, ShapeQuery, ShapeRules
from .config import (
    BucketConfig, LimitsConfig, MissPolicy, ModelConfig, RunnerConfig, ServeConfig, load_config, parse_size,
)
from .errors import BucketMissError, RequestCancelled, RequestError
from .metrics import BucketCounters, BucketMetrics
from .models import LoadedModel, ModelSpec, build_tiny, describe_model, load_model, save_pipeline
from .padding import DenoiseInputs, DiTAdapter, FluxAdapter
from .pixart import PixArtAdapter
from .pipeline import DiTPipeline, GenerationResult
from .planner import GenerationRequest, Plan, Planner
from .runner import BucketEntry, BucketRunner, EagerBucketRunner, RunMode
from .sd3 import SD3Adapter

__all__ = [
    "BucketConfig", "BucketMissError", "BucketCounters", "BucketEntry", "BucketKey", "BucketLookup", "BucketMetrics", "BucketRunner",
    "BucketTable", "DenoiseInputs", "DiTAdapter", "DiTPipeline", "Dim", "EagerBucketRunner", "FluxAdapter",
    "GenerationRequest", "GenerationResult", "LimitsConfig", "LoadedModel", "MissPolicy", "ModelConfig",
    "ModelSpec", "PixArtAdapter", "Plan", "Planner", "RequestCancelled", "RequestError", "RunMode", "SD3Adapter", "ServeConfig",
    "ShapeQuery", "ShapeRules", "RunnerConfig", "build_tiny", "describe_model", "load_config", "load_model", "parse_size", "save_pipeline",
]
