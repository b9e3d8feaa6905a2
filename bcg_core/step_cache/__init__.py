"""Step caching inside the bucketed steps: diffusers' First Block Cache and TaylorSeer, per request in a batched step.

- :mod:`bcg_core.step_cache.spec`: what a request's ``cache`` (or the config's ``cache.default``) asks for, by
  diffusers' names (:class:`FirstBlockCache`, :class:`TaylorSeerCache`), and the config section
  (:class:`StepCacheConfig`).
- :mod:`bcg_core.step_cache.split`: the transformer cut after its first block (:class:`BlockSplit`), the two halves
  of a cached step as diffusers' hooks cut it.
- :mod:`bcg_core.step_cache.state`: a request's cache contexts and what they keep between steps
  (:class:`RequestCache`).
- :mod:`bcg_core.step_cache.step`: one step of several requests, each deciding on its own rows
  (:func:`cached_forward`).

Families whose transformer takes a cache declare :class:`~bcg_core.capabilities.StepCache`.
"""

from bcg_core.step_cache.spec import (
    METHODS,
    FirstBlockCache,
    NoCache,
    StepCacheConfig,
    TaylorSeerCache,
    parse_cache,
    to_diffusers,
)

__all__ = ["METHODS", "BlockSplit", "FirstBlockCache", "NoCache", "RequestCache", "StepCacheConfig",
           "TaylorSeerCache", "cached_forward", "installed_split", "parse_cache", "request_cache", "to_diffusers"]


def __getattr__(name: str):  # torch-importing parts load on first use
    if name in ("BlockSplit", "installed_split"):
        from bcg_core.step_cache import split

        return getattr(split, name)
    if name == "RequestCache":
        from bcg_core.step_cache.state import RequestCache

        return RequestCache
    if name in ("cached_forward", "request_cache"):
        from bcg_core.step_cache import step

        return getattr(step, name)
    raise AttributeError(name)
