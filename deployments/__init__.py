"""Ray Serve layer of bcg-serve: HTTP ingress (OpenAI Images API), DiT replica, app builder, and the ``bcg``
command line (:mod:`deployments.cli.main`; the local server in :mod:`deployments.cli.local`, the demo replay in
:mod:`deployments.cli.demo`, the verify and profile tables in :mod:`deployments.cli.commands`).

Every name below is exported lazily (PEP 562): ``from deployments import X`` imports only the module that defines
``X``, and importing one deployment's module (Ray Serve unpickles each deployment class by its module, in its own
process) no longer imports the others: the ingress and the ownership coordinator load neither diffusers nor the DiT
replica's model code.
"""

import importlib

_WHERE = {
    "answers": ("sse_event",),
    "app": ("AppArgs", "build_app", "load_config"),
    "auth": ("ApiKeys",),
    "dit": ("DiTReplica",),
    "http_errors": ("error_response", "find_request_error", "unauthorized_response", "validation_error_response"),
    "ingress": ("Ingress",),
    "request_args": ("as_generation_request",),
    "responses": ("BcgInfo", "ImageData", "ImageGenerationResponse", "ModelCard", "ModelList", "Usage"),
    "schemas": ("ErrorBody", "ErrorDetail", "ImageEditRequest", "ImageGenerationRequest", "RequestLimits",
                "http_field_phrase"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str):
    """Each exported name, imported from its module on first use.

    Raises:
        AttributeError: ``name`` is not exported (nor a submodule already imported).
    """
    if name in _MODULE:
        value = getattr(importlib.import_module(f".{_MODULE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE})


__all__ = sorted(_MODULE)
