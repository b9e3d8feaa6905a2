"""A Python caller's request for the ingress's handle method ``Ingress.images``: a
:class:`~bcg_core.request.GenerationRequest` or a mapping of its fields, read as a ``GenerationRequest`` (then validated
by the ingress like an HTTP request)."""

from __future__ import annotations

import dataclasses

from bcg_core.errors import RequestError
from bcg_core.request import GenerationRequest

__all__ = ["as_generation_request"]

_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest))


def as_generation_request(request: GenerationRequest | dict) -> GenerationRequest:
    """Accept a :class:`GenerationRequest` or a mapping of its fields. A mapping's ``lora`` entries may be
    ``(name, scale)`` pairs or, as over HTTP, ``{"name": ..., "scale": ...}`` mappings (scale omitted: 1.0); the
    validator checks them. Its ``cache`` may be a :class:`~bcg_core.step_cache.FirstBlockCache` or
    :class:`~bcg_core.step_cache.NoCache`, or, as over HTTP, a mapping (``{"method": "first_block", "threshold":
    0.12}``, ``{"method": "none"}``), which the validator reads and checks (:func:`bcg_core.cache_field.check_cache`);
    None or no ``cache``: the server's ``cache.default``.

    Raises:
        RequestError: a mapping with an unknown field or without ``prompt`` (field ``"request"``).
    """
    if isinstance(request, GenerationRequest):
        return request
    if not isinstance(request, dict):
        raise RequestError("request", f"request must be a GenerationRequest or a dict with the fields "
                           f"{', '.join(_REQUEST_FIELDS)}; got {type(request).__name__}")
    unknown = sorted(set(request) - set(_REQUEST_FIELDS))
    if unknown:
        raise RequestError("request", f"unknown request field(s) {unknown}; allowed: {', '.join(_REQUEST_FIELDS)}")
    if "prompt" not in request:
        raise RequestError("prompt", "prompt is required: a non-empty string")
    lora = request.get("lora")
    if isinstance(lora, (list, tuple)) and any(isinstance(e, dict) for e in lora):
        request = {**request, "lora": tuple(_lora_pair(e) for e in lora)}
    return GenerationRequest(**request)


def _lora_pair(entry):
    """A ``{"name", "scale"}`` mapping as ``(name, scale)``; anything else as it is (the validator refuses it)."""
    if not isinstance(entry, dict) or set(entry) - {"name", "scale"} or "name" not in entry:
        return entry
    scale = entry.get("scale")
    return (entry["name"], 1.0 if scale is None else scale)
