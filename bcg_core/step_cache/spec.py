"""What a request (or the server's default) asks of the step cache: diffusers' cache configs, by their own names.

A request's ``cache`` extension and the config's ``cache.default`` are one of these, told apart by ``method``:

- ``{"method": "first_block", "threshold": 0.12}``: First Block Cache, diffusers'
  ``FirstBlockCacheConfig(threshold=0.12)`` (``diffusers/hooks/first_block_cache.py``): each step runs the
  transformer's first block; where the relative mean absolute change of its output residual since the last computed
  step, ``mean|r - r_prev| / mean|r_prev|``, is at most ``threshold``, the remaining blocks are not run and their
  residual from the last computed step is added instead.

A ``cache`` of ``null`` (or ``{"method": "none"}``) asks for no cache, whatever the server's default.

Which transformers take a cache is the family's to say (:class:`~bcg_core.capabilities.StepCache`): in diffusers
0.42.1 those with ``CacheMixin`` whose blocks diffusers' ``TransformerBlockRegistry`` describes (FLUX.1, Qwen-Image,
and the tiny default's FLUX architecture); SD3, PixArt-Sigma and SANA take none.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

__all__ = ["METHODS", "FirstBlockCache", "NoCache", "StepCacheConfig", "StepCacheSpec", "parse_cache",
           "to_diffusers"]

MAX_THRESHOLD = 10.0
"""Largest ``threshold`` taken: the relative change is rarely above 1; diffusers takes any float, but a threshold
this high already reuses every step after the first."""


class FirstBlockCache(BaseModel):
    """First Block Cache (diffusers' ``FirstBlockCacheConfig``; see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["first_block"] = "first_block"
    threshold: float = Field(
        default=0.05, ge=0.0, le=MAX_THRESHOLD, allow_inf_nan=False,
        description="Reuse the remaining blocks' residual while the first block's output residual changed by at "
        "most this much (relative mean absolute change) since the last computed step; diffusers' default 0.05. "
        "Higher: more steps reused, faster, further from the uncached image.")


class NoCache(BaseModel):
    """No step cache: every step computes every block (a request that overrides the server's default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["none"] = "none"


StepCacheSpec = Annotated[FirstBlockCache | NoCache, Field(discriminator="method")]
"""A cache a request may ask for, told apart by ``method``."""

METHODS: tuple[str, ...] = ("first_block",)
"""The cache methods bcg-serve serves, as a request's ``cache.method`` names them (``"none"`` aside)."""

_ADAPTER: TypeAdapter = TypeAdapter(StepCacheSpec)


def parse_cache(value) -> FirstBlockCache | None:
    """A request's or a config's ``cache`` value as the cache it asks for.

    Args:
        value: None, a mapping (``{"method": "first_block", "threshold": 0.1}``), or an already parsed spec.

    Returns:
        The cache, or None for ``null`` and ``{"method": "none"}``.

    Raises:
        pydantic.ValidationError: an unknown method or field, or a value out of range (the messages name the field
            and the allowed values).
    """
    if value is None:
        return None
    spec = value if isinstance(value, FirstBlockCache | NoCache) else _ADAPTER.validate_python(value)
    return None if isinstance(spec, NoCache) else spec


def to_diffusers(spec: FirstBlockCache):
    """The diffusers config of ``spec``, for ``transformer.enable_cache`` (the gate's reference, and what a user of
    diffusers writes for the same cache): ``FirstBlockCacheConfig(threshold=...)``."""
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=spec.threshold)


class StepCacheConfig(BaseModel):
    """``cache``: the step cache a request gets when it says nothing (off by default).

    A request's own ``cache`` (``null`` or ``{"method": "none"}`` for none) always wins; a model whose transformer
    takes no cache ignores the default and refuses a request that asks for one.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: StepCacheSpec | None = Field(
        default=None, description="The cache of a request that omits `cache`: e.g. {method: first_block, "
        "threshold: 0.12}; None: no cache unless a request asks for one.")

    @property
    def default_cache(self) -> FirstBlockCache | None:
        """:attr:`default` as :func:`parse_cache` gives it (None for ``{"method": "none"}``)."""
        return parse_cache(self.default)
