"""The validator's guidance options of one family's pipeline: Z-Image's ``cfg_normalization`` and ``cfg_truncation``
(``ZImagePipeline.__call__``'s, same names, defaults and semantics; the combination is
:meth:`bcg_core.families.zimage.ZImageFamily.advance`).

:class:`CfgOptionFields` is a part of :class:`~bcg_core.validation.RequestValidator` (its base class): it reads the
validator's ``spec`` and words a refused field with its ``_bad`` (the one wording of limit messages,
:mod:`bcg_core.field_phrases`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from bcg_core.families.spec import ModelSpec
from bcg_core.request import GenerationRequest

__all__ = ["CFG_OPTIONS", "CfgOptionFields"]

CFG_OPTIONS = ("cfg_normalization", "cfg_truncation")
"""The request fields of this module, in the order :meth:`CfgOptionFields._cfg_options` returns them."""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class CfgOptionFields:
    """``cfg_normalization`` and ``cfg_truncation`` of :class:`~bcg_core.validation.RequestValidator` (module
    docstring)."""

    spec: ModelSpec

    @property
    def cfg_option_defaults(self) -> dict[str, bool | float]:
        """``{"cfg_normalization": ..., "cfg_truncation": ...}`` of a request that omits them (``GET /v1/models``
        ``bcg.defaults``); empty for a family without them."""
        if self.spec.default_cfg_normalization is None:
            return {}
        return {"cfg_normalization": self.spec.default_cfg_normalization,
                "cfg_truncation": self.spec.default_cfg_truncation}

    def _cfg_options(self, r: GenerationRequest, g: float | None) -> tuple[bool | float | None, float | None]:
        """``(cfg_normalization, cfg_truncation)`` of ``r`` with the model's defaults filled in (``g``: the request's
        guidance scale, defaults filled in): ``cfg_normalization`` a bool as sent (the pipeline reads True as 1.0)
        or a float, ``cfg_truncation`` a float; ``(None, None)`` for a family without them and for a request without
        classifier-free guidance (nothing to apply them to; a filled request validates again unchanged).

        Raises:
            RequestError: naming the field: set on a model whose pipeline has no such option (every family but
                Z-Image); ``cfg_normalization`` neither a boolean nor a finite number at least 0; ``cfg_truncation``
                not a finite number at least 0 (a boolean included); either set on a request that runs no
                classifier-free guidance (``guidance_scale`` 0 on Z-Image: the pipeline would ignore it).
        """
        spec = self.spec
        sent = {name: getattr(r, name) for name in CFG_OPTIONS if getattr(r, name) is not None}
        if spec.default_cfg_normalization is None:
            if sent:
                name, v = next(iter(sent.items()))
                raise self._bad(name, v, f"it is not an option of {spec.pipeline_class} (family {spec.family}); "
                                         f"leave it unset")
            return None, None
        norm = r.cfg_normalization
        if norm is None:
            norm = spec.default_cfg_normalization
        elif not isinstance(norm, bool):
            if not _number(norm):
                raise self._bad("cfg_normalization", norm, "not a boolean or a number")
            if not math.isfinite(norm) or norm < 0:
                raise self._bad("cfg_normalization", norm, "out of range")
            norm = float(norm)
        trunc = r.cfg_truncation
        if trunc is None:
            trunc = spec.default_cfg_truncation
        else:
            if not _number(trunc):
                raise self._bad("cfg_truncation", trunc, "not a number")
            if not math.isfinite(trunc) or trunc < 0:
                raise self._bad("cfg_truncation", trunc, "out of range")
        if not spec.uses_cfg(replace(r, guidance_scale=g)):  # nothing to apply them to
            if sent:
                name, v = next(iter(sent.items()))
                raise self._bad(name, v, f"guidance_scale {g} runs no classifier-free guidance (guidance_scale: "
                                         f"{spec.guidance_role()}), so {name} would be ignored; raise guidance_scale "
                                         f"or leave {name} unset")
            return None, None
        return norm, float(trunc)
