"""What a request (or the server's default) asks of the step cache: diffusers' cache configs, by their own names.

A request's ``cache`` extension and the config's ``cache.default`` are one of these, told apart by ``method``:

- ``{"method": "first_block", "threshold": 0.12}``: First Block Cache, diffusers'
  ``FirstBlockCacheConfig(threshold=0.12)`` (``diffusers/hooks/first_block_cache.py``): each step runs the
  transformer's first block; where the relative mean absolute change of its output residual since the last computed
  step, ``mean|r - r_prev| / mean|r_prev|``, is at most ``threshold``, the remaining blocks are not run and their
  residual from the last computed step is added instead.

- ``{"method": "taylor_seer", "cache_interval": 5, "max_order": 1, "disable_cache_before_step": 3}``: TaylorSeer,
  diffusers' ``TaylorSeerCacheConfig(..., use_lite_mode=True)`` (``diffusers/hooks/taylorseer_cache.py``): the
  steps before ``disable_cache_before_step``, every ``cache_interval``-th step after it and every step from
  ``disable_cache_after_step`` on run the whole transformer, whose output updates a Taylor expansion (divided
  differences up to ``max_order``, kept in ``taylor_factors_dtype``); every other step's output is that expansion's
  prediction, and the transformer does not run for it. This is TaylorSeer's *lite* mode (the output projection
  predicted, the blocks skipped); diffusers' other mode (each attention's output predicted, the rest of every block
  run) is not served: ``use_lite_mode: false`` is refused, and bcg-serve's default is ``true`` (diffusers' is
  ``false``).

A ``cache`` of ``null`` (or ``{"method": "none"}``) asks for no cache, whatever the server's default.

Which transformers take a cache is the family's to say (:class:`~bcg_core.capabilities.StepCache`): in diffusers
0.42.1 those with ``CacheMixin`` whose blocks diffusers' ``TransformerBlockRegistry`` describes (FLUX.1, Qwen-Image,
and the tiny default's FLUX architecture), where diffusers' pipeline runs the hook: FLUX.2 [klein] takes TaylorSeer
only (diffusers' First Block Cache fails on FLUX.2's single-stream last block) and FLUX.2 [dev] none (its pipeline
sets no cache context); SD3, PixArt-Sigma and SANA take none.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

__all__ = ["METHODS", "FirstBlockCache", "NoCache", "StepCacheConfig", "StepCacheSpec", "TaylorSeerCache",
           "parse_cache", "read_cache", "to_diffusers"]

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


TAYLOR_DTYPES = ("bfloat16", "float16", "float32")
"""``taylor_factors_dtype`` values taken (diffusers' default: bfloat16)."""


class TaylorSeerCache(BaseModel):
    """TaylorSeer, lite mode (diffusers' ``TaylorSeerCacheConfig(use_lite_mode=True)``; see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["taylor_seer"] = "taylor_seer"
    cache_interval: int = Field(default=5, ge=1, le=1000,
                                description="After the first steps, compute every this many steps; predict between.")
    disable_cache_before_step: int = Field(
        default=3, ge=0, le=1000, description="The steps before this one all compute (the expansion's data).",
        json_schema_extra={"allowed": "an integer from 0 to 1000, 0 only with cache_interval 1"})
    disable_cache_after_step: int | None = Field(default=None, ge=0, le=1000,
                                                 description="From this step on every step computes; None: never.")
    max_order: int = Field(default=1, ge=0, le=4, description="Highest order of the Taylor expansion.")
    taylor_factors_dtype: str = Field(default="bfloat16", description="The dtype the expansion's factors are kept "
                                      "in: bfloat16 (diffusers' default), float16 or float32.",
                                      json_schema_extra={"allowed": "one of " + ", ".join(TAYLOR_DTYPES)})
    use_lite_mode: bool = Field(default=True, description="Must be true: the output predicted, the blocks skipped "
                                "(diffusers' default is false, attention outputs predicted: not served).",
                                json_schema_extra={"allowed": "true"})

    @field_validator("taylor_factors_dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in TAYLOR_DTYPES:
            raise ValueError(f"taylor_factors_dtype {v!r}: use one of {', '.join(TAYLOR_DTYPES)}")
        return v

    @model_validator(mode="after")
    def _lite(self) -> TaylorSeerCache:
        if not self.computes(0):
            raise ValueError("disable_cache_before_step 0 with cache_interval above 1 predicts the first step before "
                             "any step computed (diffusers raises there): use disable_cache_before_step of 1 or more")
        if not self.use_lite_mode:
            raise ValueError("use_lite_mode false (each attention's output predicted) is not served; bcg-serve serves "
                             "TaylorSeer's lite mode: omit use_lite_mode or set it to true")
        return self

    @property
    def factors_dtype(self):
        """:attr:`taylor_factors_dtype` as the ``torch.dtype`` the factors are kept in."""
        import torch

        return getattr(torch, self.taylor_factors_dtype)

    def computes(self, step: int) -> bool:
        """Whether the transformer runs at ``step`` (0-based: the context's calls before it), as diffusers'
        ``TaylorSeerCacheHook._measure_should_compute``: the first steps, every ``cache_interval``-th after them,
        and every step from ``disable_cache_after_step`` on."""
        before, after = self.disable_cache_before_step, self.disable_cache_after_step
        return step < before or (step - before - 1) % self.cache_interval == 0 or (after is not None and step >= after)


class NoCache(BaseModel):
    """No step cache: every step computes every block (a request that overrides the server's default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["none"] = "none"


StepCacheSpec = Annotated[FirstBlockCache | TaylorSeerCache | NoCache, Field(discriminator="method")]
"""A cache a request may ask for, told apart by ``method``."""

METHODS: tuple[str, ...] = ("first_block", "taylor_seer")
"""The cache methods bcg-serve serves, as a request's ``cache.method`` names them (``"none"`` aside)."""

_ADAPTER: TypeAdapter = TypeAdapter(StepCacheSpec)


def read_cache(value) -> FirstBlockCache | TaylorSeerCache | NoCache:
    """A ``cache`` value (a mapping such as ``{"method": "first_block", "threshold": 0.1}``, or a cache model, which
    passes as it is) as its cache model.

    Raises:
        pydantic.ValidationError: an unknown method or field, or a value out of range (the messages name the field
            and the allowed values).
    """
    return _ADAPTER.validate_python(value)


def parse_cache(value) -> FirstBlockCache | TaylorSeerCache | None:
    """A request's or a config's ``cache`` value as the cache it asks for.

    Args:
        value: None, a mapping (``{"method": "first_block", "threshold": 0.1}``), or an already parsed spec.

    Returns:
        The cache, or None for ``null`` and ``{"method": "none"}``.

    Raises:
        pydantic.ValidationError: an unknown method or field, or a value out of range (the messages name the field
            and the allowed values).
    """
    spec = None if value is None else read_cache(value)
    return None if isinstance(spec, NoCache) else spec


def to_diffusers(spec: FirstBlockCache | TaylorSeerCache):
    """The diffusers config of ``spec``, for ``transformer.enable_cache`` (the gate's reference, and what a user of
    diffusers writes for the same cache): ``FirstBlockCacheConfig(threshold=...)`` or
    ``TaylorSeerCacheConfig(..., use_lite_mode=True)``."""
    from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

    if isinstance(spec, FirstBlockCache):
        return FirstBlockCacheConfig(threshold=spec.threshold)
    return TaylorSeerCacheConfig(cache_interval=spec.cache_interval,
                                 disable_cache_before_step=spec.disable_cache_before_step,
                                 disable_cache_after_step=spec.disable_cache_after_step, max_order=spec.max_order,
                                 taylor_factors_dtype=spec.factors_dtype, use_lite_mode=True)


class StepCacheConfig(BaseModel):
    """``cache``: the step cache a request gets when it says nothing (off by default).

    A request's own ``cache`` (``null`` or ``{"method": "none"}`` for none) always wins; a model whose transformer
    takes no cache ignores the default and refuses a request that asks for one.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: StepCacheSpec | None = Field(
        default=None, description="The cache of a request that omits `cache`: e.g. {method: first_block, "
        "threshold: 0.12}; None: no cache unless a request asks for one.")
