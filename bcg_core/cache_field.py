"""A request's ``cache`` field, for the validator: read, checked against the model, and the server's default filled in.

After :meth:`~bcg_core.validation.RequestValidator.validate` a request's ``cache`` is never None (docs/API.md "Step
cache"):

- the request's own value where it sent one (``{"method": "none"}`` or ``null`` over HTTP: no cache, whatever the
  default), refused where the model's transformer does not take its method
  (:attr:`~bcg_core.families.ModelSpec.cache_methods`);
- else the config's ``cache.default`` where the model takes its method (a default for a model that takes no cache
  is ignored: every request then runs without one);
- else :class:`~bcg_core.step_cache.NoCache`.

A validated request's value is kept as it is, so validating it again (the ingress validates, the replica may too)
gives the same cache.
"""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel, ValidationError

from bcg_core.errors import RequestError, shown
from bcg_core.families.spec import ModelSpec
from bcg_core.step_cache.spec import METHODS, NoCache, StepCacheConfig, StepCacheSpec, read_cache

__all__ = ["CACHE_FAMILIES", "METHOD_FAMILIES", "cache_phrase", "check_cache", "default_cache"]

METHOD_FAMILIES: dict[str, str] = {
    "first_block": "FLUX.1, Qwen-Image, Wan 2.1 (FluxPipeline, QwenImagePipeline and WanPipeline checkpoints) and "
                   "the tiny default",
    "taylor_seer": "FLUX.1, Qwen-Image, FLUX.2 [klein], Wan 2.1 (FluxPipeline, QwenImagePipeline, Flux2KleinPipeline "
                   "and WanPipeline checkpoints) and the tiny default",
}
"""The families that take each cache method, as messages name them: those whose diffusers transformer runs it
(each declares :class:`~bcg_core.capabilities.StepCache` and lists the method in its ``cache_methods``). FLUX.2
[klein] takes TaylorSeer only (diffusers' First Block Cache fails on FLUX.2's blocks); FLUX.2 [dev] takes none (its
pipeline sets no cache context, where every diffusers cache hook fails)."""

CACHE_FAMILIES = (f"{METHOD_FAMILIES['first_block']}, and taylor_seer alone for FLUX.2 [klein] (Flux2KleinPipeline "
                  f"checkpoints)")
"""The families whose transformer takes a step cache, as messages name them (:data:`METHOD_FAMILIES` together)."""

_MODELS: dict[str, type[BaseModel]] = {m.model_fields["method"].default: m
                                       for m in typing.get_args(typing.get_args(StepCacheSpec)[0])}
"""Each cache model of :data:`~bcg_core.step_cache.spec.StepCacheSpec` by its ``method``."""


def _value_phrase(field) -> str:
    """What one key of a cache model takes, from its type and bounds (``a number from 0 to 10 (omitted: 0.05)``), or
    as its field says (``json_schema_extra["allowed"]``: a rule the type does not show)."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "allowed" in extra:
        return f"{extra['allowed']} (omitted: {json.dumps(field.default)})"
    kinds = set(typing.get_args(field.annotation)) or {field.annotation}
    bounds = {type(m).__name__: m for m in field.metadata}
    kind = "an integer" if int in kinds else "a number" if float in kinds else "true or false" if bool in kinds \
        else "a string"
    if "Ge" in bounds and "Le" in bounds:
        kind += f" from {bounds['Ge'].ge:g} to {bounds['Le'].le:g}"
    if type(None) in kinds:
        kind += " or null"
    return f"{kind} (omitted: {json.dumps(field.default)})"


def _model_phrase(method: str) -> str:
    """``{"method": "first_block", "threshold": a number from 0 to 10 (omitted: 0.05)}``."""
    keys = [f'"{k}": {_value_phrase(f)}' for k, f in _MODELS[method].model_fields.items() if k != "method"]
    return "{" + ", ".join([f'"method": "{method}"', *keys]) + "}"


def cache_phrase(methods: tuple[str, ...] | None = None) -> str:
    """What ``cache`` accepts, for messages: the one phrase of the validator's refusals and the HTTP schema's.

    Args:
        methods: the model's :attr:`~bcg_core.families.ModelSpec.cache_methods`; None where the model is not known
            (the HTTP schema without a served model): every method served (:data:`~bcg_core.step_cache.METHODS`).
    """
    served = [m for m in (METHODS if methods is None else methods) if m in _MODELS and m != "none"]
    if not served:
        return (f'{{"method": "none"}} or null, or omit \'cache\': this model takes no step cache; it is served for '
                f"{CACHE_FAMILIES}")
    return (", or ".join(_model_phrase(m) for m in served) + ', or {"method": "none"} or null for no cache; '
            "omitted: the server's cache.default")


def _message(got: object, reason: str, methods: tuple[str, ...] | None) -> str:
    """``invalid 'cache' (got ...): reason; allowed: ...``, as :func:`bcg_core.validation.invalid` words a refusal."""
    return f"invalid 'cache' (got {shown(got)}): {reason}; allowed: {cache_phrase(methods)}"


def _faults(exc: ValidationError) -> str:
    """The faults of a ``cache`` mapping, each where it is (``cache.threshold``, ``cache.method``), in words without
    pydantic's type names."""
    out = []
    for err in exc.errors(include_url=False):
        kind, loc = err.get("type", ""), [str(p) for p in err.get("loc", ())][1:]  # loc[0]: the method's tag
        where = ".".join(["cache", *loc])
        if kind == "union_tag_invalid":
            sent = err.get("input")
            out.append(f"cache.method {shown(sent.get('method') if isinstance(sent, dict) else sent)} is not a served "
                       f"method")
        elif kind == "union_tag_not_found":
            out.append("cache.method is missing")
        elif kind == "extra_forbidden":
            out.append(f"unknown key {loc[-1]!r} in cache")
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            out.append("not a mapping")
        else:
            out.append(f"{where}: {str(err.get('msg', kind)).removeprefix('Value error, ')}")
    return "; ".join(out)


def check_cache(value: object, spec: ModelSpec) -> BaseModel:
    """A request's own ``cache`` (not None), checked against ``spec``'s methods.

    Args:
        value: a cache model of :data:`~bcg_core.step_cache.spec.StepCacheSpec` (a
            :class:`~bcg_core.step_cache.FirstBlockCache`, :class:`~bcg_core.step_cache.NoCache` ...), or a mapping of
            one (``{"method": "first_block", "threshold": 0.1}``: a Python caller's).
        spec: the served model's spec.

    Returns:
        The cache it asks for (:class:`NoCache` for none).

    Raises:
        RequestError: on ``cache`` (HTTP 422): not a cache (an unknown method or key, a value out of range or of
            another type), or a method the model's transformer does not take (naming its family and those that take
            one, and that ``{"method": "none"}`` or omitting it is served).
    """
    methods = spec.cache_methods
    try:
        cache = read_cache(value)
    except ValidationError as exc:
        raise RequestError("cache", _message(value, _faults(exc), methods)) from None
    if isinstance(cache, NoCache) or cache.method in methods:
        return cache
    takes = (f"takes only {', '.join(methods)} ({cache.method} is served for {METHOD_FAMILIES[cache.method]})"
             if methods else "takes no step cache")
    raise RequestError("cache", _message(cache.model_dump(), f"{spec.pipeline_class} (family {spec.family}) {takes}",
                                         methods))


def default_cache(section: StepCacheConfig, spec: ModelSpec) -> BaseModel:
    """The cache of a request that omits ``cache``: the config's ``cache.default`` where ``spec``'s transformer takes
    its method, else :class:`NoCache` (a default the model cannot take is ignored)."""
    default = section.default
    if default is not None and not isinstance(default, NoCache) and default.method in spec.cache_methods:
        return default
    return NoCache()
