"""The validator's size and bucket lookup: the prompt's token limit, a request's forward shape, its rows, and the
error of a shape that misses the bucket table; at start, the bucket resolutions that resolution binning never reaches.

:class:`BucketShapes` is a part of :class:`~bcg_core.validation.RequestValidator` (its base class): the methods below
read the validator's ``spec``, ``rules`` and ``table`` (the :class:`~bcg_core.table.BucketTable` of its config).
docs/DESIGN.md section 2 says how a shape rounds up to its bucket.
"""

from __future__ import annotations

from bcg_core.config import EngineConfig
from bcg_core.errors import BucketMissError
from bcg_core.families.spec import ModelSpec
from bcg_core.keys import Dim, ShapeQuery
from bcg_core.request import GenerationRequest
from bcg_core.table import BucketLookup, BucketTable, ShapeRules

__all__ = ["BucketShapes"]


class BucketShapes:
    """The size and bucket lookup of :class:`~bcg_core.validation.RequestValidator` (module docstring)."""

    spec: ModelSpec
    rules: ShapeRules
    table: BucketTable

    @staticmethod
    def _check_bins(config: EngineConfig, spec: ModelSpec) -> None:
        """Refuse bucket resolutions that are not aspect-ratio bins of a model with resolution binning
        (:attr:`ModelSpec.size_bins`): every image is generated at a bin, so no request would reach them.

        Raises:
            ValueError: naming the dead resolutions and the bins nearest the table's.
        """
        if spec.size_bins:
            bins = {(int(w), int(h)) for h, w in spec.size_bins.values()}
            dead = [r for r, wh in zip(config.buckets.resolutions, config.buckets.resolution_pairs(), strict=True)
                    if wh not in bins]
            if dead:
                near = sorted({f"{w}x{h}" for w, h in (spec.generation_size(*wh)
                                                       for wh in config.buckets.resolution_pairs())})
                raise ValueError(f"buckets.resolutions: {dead} are not aspect-ratio bins of this model: resolution "
                                 f"binning generates every image at a bin, so no request would reach them; use bins, "
                                 f"e.g. {', '.join(near)}")

    @property
    def text_limit(self) -> int:
        """Most prompt tokens a request may have: what the text encoder reads (:attr:`ModelSpec.max_prompt_tokens`),
        else the native length; for a masked-text family (PixArt-Sigma, SANA, Qwen-Image) the encoder's cut
        (:attr:`ModelSpec.max_text_tokens`): a prompt longer than the largest text bucket is a text miss, served
        unpadded on eager kernels under ``miss_policy: eager`` and refused as a miss (:class:`BucketMissError`,
        counted by dimension) under ``reject``; else the largest text bucket."""
        if self.spec.max_prompt_tokens is not None:
            return self.spec.max_prompt_tokens
        native = self.rules.native_text_tokens
        if native is not None:
            return native
        cut = self.spec.max_text_tokens
        return max(cut, self.table.text_lengths[-1]) if cut is not None else self.table.text_lengths[-1]

    def _too_long(self, tokens: int) -> str:
        """``"N tokens long"``, or ``"at least N tokens long"`` where N is the family's cut (the encoder keeps no
        more: PixArt-Sigma, SANA and Qwen-Image cut as their pipelines do)."""
        cut = self.spec.max_text_tokens
        return f"{'at least ' if cut is not None and tokens >= cut else ''}{tokens} tokens long"

    @property
    def _limit_reason(self) -> str:
        """Why :attr:`text_limit` is the limit, and what to do."""
        limit = self.text_limit
        if self.spec.max_prompt_tokens is not None:
            return f"this model's text encoder reads at most {limit} tokens (more would be cut); shorten it"
        if self.rules.native_text_tokens is not None:
            return f"this model takes at most {limit} tokens; shorten it"
        most = self.spec.max_text_tokens
        if most is not None:  # text_limit is then the encoder's cut
            return f"this model's text encoder keeps at most {most} tokens; shorten it"
        return f"the largest text bucket (buckets.text_lengths) holds {limit} tokens; shorten it"

    def rows(self, request: GenerationRequest) -> int:
        """Transformer rows of ``request``: ``n``, doubled when classifier-free guidance adds uncond rows."""
        return request.n * (2 if self.spec.uses_cfg(request) else 1)

    def query(self, request: GenerationRequest, prompt_tokens: int, negative_tokens: int = 0,
              references: tuple[tuple[int, int], ...] = ()) -> ShapeQuery:
        """The exact forward shape of a validated request (at its generation size: the aspect-ratio bin of
        families with resolution binning); a reference edit's image stream also holds its ``references``' tokens
        (token grids, :attr:`~bcg_core.request.ValidatedRequest.references`)."""
        grid = self.rules.grid(*self.spec.generation_size(request.width, request.height))
        native = self.rules.native_text_tokens
        text = native if native is not None else max(prompt_tokens, negative_tokens)
        frames = self.rules.latent_frames(request.num_frames) if self.spec.video else None
        image = grid[0] * grid[1] * (frames or 1) + sum(h * w for h, w in references)
        return ShapeQuery(self.rows(request), image, text, grid if self.rules.grid_keyed else None, frames)

    def _miss_error(self, request: GenerationRequest, lookup: BucketLookup,
                    references: tuple[tuple[int, int], ...] = ()) -> BucketMissError:
        """One error naming every dimension that missed; ``field`` is the first one's request field. The batch
        dimension never misses: the step scheduler splits rows above the largest batch bucket."""
        t = self.table
        parts: list[tuple[str, str]] = []
        missed = tuple(d for d in lookup.missed if d is not Dim.BATCH)
        for dim in missed:
            if dim is Dim.IMAGE and self.spec.video:
                q = lookup.query
                parts.append(("size", f"size {request.width}x{request.height} at {request.num_frames} frames "
                                      f"({q.frames} latent frames) fits no video bucket; served tiers: "
                                      f"{', '.join(t.config.resolutions)} at num_frames {t.config.frames} (exactly "
                                      f"these sizes and frame counts)"))
            elif dim is Dim.IMAGE:
                if t.pad_images:
                    rule = "any size with at most as many pixels as a tier"
                elif self.rules.grid_keyed:
                    rule = "exactly these sizes"
                else:
                    rule = "sizes with exactly a tier's number of image tokens"
                refs = sum(h * w for h, w in references)
                also = (f" with its reference images' {refs} tokens ({lookup.query.image_tokens} image tokens in "
                        f"all; a tier of 'WxH' holds W x H / {self.rules.pixels_per_token ** 2})") if refs else ""
                parts.append(("size", f"size {request.width}x{request.height}{also} fits no resolution bucket; "
                                      f"served tiers: {', '.join(t.config.resolutions)} ({rule})"))
            else:
                q = lookup.query
                texts = t.texts_for(q.image_tokens, q.latent_hw, q.frames)
                where = "" if texts == t.text_lengths else f" of its resolution tier ({list(texts)})"
                parts.append(("prompt", f"prompt needs {q.text_tokens} text tokens, above the largest "
                                        f"text bucket{where} {texts[-1]} (buckets.miss_policy is reject; under "
                                        f"eager it would run unpadded)"))
        return BucketMissError(parts[0][0], "; and ".join(m for _, m in parts), tuple(d.value for d in missed))
