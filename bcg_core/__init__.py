"""bcg-serve's torch-only engine: bucket keys and table, the validator, model families, runners, the step scheduler.

Never imports Ray or ``deployments/`` (the Ray Serve layer lives in ``deployments/`` and ``router/``). Every name
below is exported lazily (PEP 562): ``import bcg_core`` or ``from bcg_core.config import ...`` loads no torch, and
``from bcg_core import X`` imports only the module that defines ``X``, so the processes that need none of the model
(the ingress, the ownership coordinator) do not pay for torch and diffusers. The layout is in README.md.
"""

import importlib

_WHERE = {
    "bcg_core.config": ("BucketConfig", "EngineConfig", "LimitsConfig", "MissPolicy", "ModelConfig", "RunnerConfig",
                        "parse_size"),
    "bcg_core.errors": ("BucketMissError", "RequestCancelled", "RequestError"),
    "bcg_core.families": ("Family", "ModelSpec", "RequestState", "TextRows"),
    "bcg_core.families.tiny": ("build_tiny",),
    "bcg_core.images": ("IMAGE_FORMATS", "encode_image"),
    "bcg_core.keys": ("BucketKey", "BucketShape", "Dim", "ShapeQuery"),
    "bcg_core.metrics": ("BucketCounters", "BucketMetrics"),
    "bcg_core.models": ("CheckpointError", "describe_model", "load_model", "save_pipeline"),
    "bcg_core.padding": ("DenoiseInputs", "DiTAdapter"),
    "bcg_core.pipeline": ("DiTPipeline",),
    "bcg_core.planning.traffic": ("TrafficHistogram", "TrafficKey", "load_traffic"),
    "bcg_core.preview": ("LinearPreview", "PartialImage", "preview_steps"),
    "bcg_core.request": ("GenerationRequest", "GenerationResult", "ValidatedRequest"),
    "bcg_core.runners": ("BucketEntry", "BucketRunner", "EagerBucketRunner", "RunMode"),
    "bcg_core.table": ("BucketLookup", "BucketTable", "ShapeRules"),
    "bcg_core.validation": ("RequestValidator",),
    "bcg_core.families.flux": ("FluxAdapter",),
    "bcg_core.families.sd3": ("SD3Adapter",),
    "bcg_core.families.pixart": ("PixArtAdapter",),
    "bcg_core.families.sana": ("SanaAdapter",),
    "bcg_core.families.qwenimage": ("QwenImageAdapter",),
    "bcg_core.scheduler": ("StepScheduler",),
    "bcg_core.costs": ("CostModel", "StepForwards"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str):
    """Each exported name, imported from its module on first use.

    Raises:
        AttributeError: ``name`` is not exported (nor a submodule already imported).
    """
    if name in _MODULE:
        value = getattr(importlib.import_module(_MODULE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'bcg_core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE})


__all__ = sorted(_MODULE)
