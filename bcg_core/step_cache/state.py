"""A request's step-cache state: what its cache contexts keep between steps, on the model's device, with the request.

diffusers keeps one First Block Cache state per *cache context*: ``FluxPipeline`` and ``QwenImagePipeline`` run the
transformer once under ``cache_context("cond")`` for the prompt's rows and, with true classifier-free guidance, once
under ``cache_context("uncond")`` for the negative prompt's rows; each decides on its own rows (all of the request's
images together) and resets when the pipeline call ends (``maybe_free_model_hooks``). bcg-serve keeps the same
contexts per request (:class:`ContextCache`, rows named by the family:
:meth:`~bcg_core.capabilities.StepCache.cache_contexts`), in :class:`RequestCache`, which lives in the request's
state and is dropped with it when it finishes, fails or is cancelled: nothing of one request is ever read by another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bcg_core.step_cache.spec import FirstBlockCache, TaylorSeerCache

__all__ = ["ContextCache", "RequestCache", "reserve_bytes"]


def reserve_bytes(transformer: torch.nn.Module, spec: FirstBlockCache | TaylorSeerCache, rows: int, image_tokens: int,
                  text_tokens: int) -> int:
    """Device bytes a request's contexts hold once they computed.

    First Block Cache: per row, the head residual and the remaining blocks' residual over its image tokens and their
    text-stream residual, ``(2 * image_tokens + text_tokens) * D`` elements of the transformer's dtype,
    ``D = num_attention_heads * attention_head_dim`` (the blocks' width in FLUX.1's and Qwen-Image's configs).
    TaylorSeer: per row, ``max_order + 1`` factors of ``image_tokens * C`` elements of ``taylor_factors_dtype``,
    ``C`` the output projection's width (``proj_out.out_features``). 0 where the transformer's config does not say.

    Args:
        transformer: the diffusers transformer.
        spec: the request's cache.
        rows: the request's transformer rows (images, x2 with CFG).
        image_tokens, text_tokens: tokens per row.
    """
    if isinstance(spec, TaylorSeerCache):
        proj = getattr(transformer, "proj_out", None)
        if not isinstance(proj, torch.nn.Linear):
            return 0
        element = torch.empty((), dtype=spec.factors_dtype).element_size()
        return rows * (spec.max_order + 1) * image_tokens * proj.out_features * element
    config = transformer.config
    heads, dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if not heads or not dim:
        return 0
    element = next(transformer.parameters()).element_size()
    return rows * (2 * image_tokens + text_tokens) * int(heads) * int(dim) * element


@dataclass
class ContextCache:
    """One cache context of one request (diffusers' ``FBCSharedBlockState`` of that context).

    Attributes:
        name: the context's name, as the diffusers pipeline names it (``"cond"``, ``"uncond"``).
        rows: its rows among the request's transformer rows (:meth:`~bcg_core.families.Family.model_rows`' order).
        previous: the head block's residual at the last computed step, ``(rows, S, D)`` over the image stream's real
            tokens (diffusers' ``head_block_residual``); None before the first step.
        hidden, encoder: the remaining blocks' residuals at the last computed step, ``(rows, S, D)`` and
            ``(rows, T, D)`` (``T`` the request's own text tokens; ``encoder`` None for a transformer whose head
            block has no text stream): diffusers' ``tail_block_residuals``.
        computed, reused: steps in which this context ran its remaining blocks (TaylorSeer: the transformer), and
            in which it reused them (TaylorSeer: predicted the output).
        calls: TaylorSeer: the context's steps so far (diffusers' ``TaylorSeerState.current_step`` + 1).
        factors: TaylorSeer: the Taylor expansion of the transformer's output over the context's rows, one
            ``(rows, S, C)`` tensor per order (``taylor_factors_dtype``), from the last computed step.
        last_update: TaylorSeer: the step whose output last updated :attr:`factors`; None before the first.
    """

    name: str
    rows: slice
    previous: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    encoder: torch.Tensor | None = None
    computed: int = 0
    reused: int = 0
    calls: int = 0
    factors: list[torch.Tensor] | None = None
    last_update: int | None = None

    @property
    def nbytes(self) -> int:
        """Device bytes it holds."""
        tensors = [self.previous, self.hidden, self.encoder, *(self.factors or [])]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class RequestCache:
    """The step cache of one request: its spec and its contexts.

    Attributes:
        spec: the cache it asked for (or the server's default).
        contexts: its cache contexts, in row order.
    """

    spec: FirstBlockCache | TaylorSeerCache
    contexts: list[ContextCache] = field(default_factory=list)
    reserved_bytes: int = 0
    """What its contexts will hold once they computed (:func:`reserve_bytes`): counted by admission from the start,
    before any step has filled them."""

    @property
    def nbytes(self) -> int:
        """Device bytes its contexts hold (three ``(rows, tokens, D)`` tensors per context once it computed)."""
        return sum(c.nbytes for c in self.contexts)

    @property
    def budget_bytes(self) -> int:
        """The bytes admission counts for it: :attr:`reserved_bytes`, or what it holds where that is more."""
        return max(self.reserved_bytes, self.nbytes)

    def describe(self) -> dict:
        """The answer's ``bcg.cache``: the method and its settings, and per context the steps computed and reused
        (``{"method": "first_block", "threshold": 0.12, "steps": {"cond": {"computed": 20, "reused": 8}}}``)."""
        return {**self.spec.model_dump(), "steps": {c.name: {"computed": c.computed, "reused": c.reused}
                                                    for c in self.contexts}}

    def free(self) -> None:
        """Drop every tensor it holds (a finished or cancelled request)."""
        for c in self.contexts:
            c.previous = c.hidden = c.encoder = c.factors = None
