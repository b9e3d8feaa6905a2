"""DiT families: one module per family, chosen by the checkpoint's ``model_index.json`` ``_class_name``.

Each module implements :class:`~bcg_core.families.base.Family`; :data:`PIPELINE_CLASSES` maps every
supported ``_class_name`` to its module. Modules are imported on first use (each pulls in its diffusers
pipeline), never for their side effects. The names of the family contract (``Family``, ``RequestState`` ...) are
exported lazily too (PEP 562): importing this package, or a torch-free module of it (``spec``, ``helpers``,
``defaults``, ``tiny_spec``), loads no torch.
"""

from __future__ import annotations

import importlib

from bcg_core.families.helpers import read_json
from bcg_core.families.spec import ModelSpec

__all__ = [
    "Family", "ModelSpec", "PIPELINE_CLASSES", "RequestState", "TextRows", "UnknownPipelineClass",
    "concat_rows", "family_class", "pad_text", "read_json",
]

PIPELINE_CLASSES: dict[str, tuple[str, str]] = {
    "FluxPipeline": ("flux", "FluxFamily"),
    "BCGFluxPipeline": ("tiny", "BCGFluxFamily"),
    "StableDiffusion3Pipeline": ("sd3", "SD3Family"),
    "PixArtSigmaPipeline": ("pixart", "PixArtSigmaFamily"),
    "SanaPipeline": ("sana", "SanaFamily"),
    "QwenImagePipeline": ("qwenimage", "QwenImageFamily"),
    "Flux2Pipeline": ("flux2", "Flux2Family"),
    "Flux2KleinPipeline": ("flux2", "Flux2Family"),
    "ZImagePipeline": ("zimage", "ZImageFamily"),
    "QwenImage21Pipeline": ("qwenimage21", "QwenImage21Family"),
    "WanPipeline": ("wan", "WanFamily"),
}
"""``model_index.json`` ``_class_name`` -> (module of this package, class implementing :class:`Family`)."""


class UnknownPipelineClass(ValueError):
    """A checkpoint whose ``_class_name`` no family serves."""


def family_class(pipeline_class: str) -> type:
    """The :class:`Family` class that loads checkpoints of ``pipeline_class``.

    Raises:
        UnknownPipelineClass: naming the supported classes.
    """
    entry = PIPELINE_CLASSES.get(pipeline_class)
    if entry is None:
        raise UnknownPipelineClass(
            f"_class_name {pipeline_class or '(missing)'!r} is not a supported pipeline; supported: "
            f"{', '.join(sorted(PIPELINE_CLASSES))}"
        )
    module, name = entry
    return getattr(importlib.import_module(f".{module}", __name__), name)


_LAZY = {"Family": "base", "RequestState": "state", "TextRows": "state", "concat_rows": "state", "pad_text": "state"}


def __getattr__(name: str):
    """The torch-importing names of the family contract, imported on first use.

    Raises:
        AttributeError: ``name`` is none of them (nor a family module already imported).
    """
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
