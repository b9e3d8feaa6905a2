"""The bucket table: which padded shape serves a request, decided once per request.

The table *decides*; the runners (:mod:`bcg_core.runners`) trust the key they are handed. A request's exact
shape (:class:`~bcg_core.keys.ShapeQuery`) is rounded up, per dimension, to the smallest bucket that holds it,
in O(1) (a precomputed round-up array per dimension). A request that fits no bucket is a *miss*, a normal
return value that names the dimensions that missed. docs/DESIGN.md section 2 says which dimensions round up
and why; :mod:`bcg_core.keys` defines the key.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from bcg_core.config import BucketConfig, MissPolicy
from bcg_core.keys import BucketKey, Dim, ShapeQuery

__all__ = ["BucketLookup", "BucketTable", "ShapeRules", "fit_size"]


@dataclass(frozen=True, slots=True)
class ShapeRules:
    """What a model family's forward depends on; supplied by its adapter.

    Attributes:
        pixels_per_token: image pixels per token side (VAE downsampling x patch size; FLUX: 8 x 2 = 16).
        grid_keyed: the forward depends on the latent grid, so the key carries ``latent_hw`` and the
            image dimension never rounds up.
        native_text_tokens: fixed unmasked text length the model was trained with, or None when the
            model was trained with a text key-padding mask (then any text bucket list is valid).
        frame_stride: for a video family (Wan), pixel frames per latent frame after the first (the VAE's temporal
            compression, 4): a request's ``num_frames`` must be ``1 + k * frame_stride`` and it has
            ``(num_frames - 1) / frame_stride + 1`` latent frames, each a grid of tokens; None for an image family.
    """

    pixels_per_token: int
    grid_keyed: bool
    native_text_tokens: int | None
    frame_stride: int | None = None

    @property
    def video(self) -> bool:
        """True for a video family (:attr:`frame_stride` set)."""
        return self.frame_stride is not None

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of a video of ``num_frames`` frames: ``(num_frames - 1) // frame_stride + 1``.

        Raises:
            ValueError: an image family, or ``num_frames`` that is not ``1 + k * frame_stride`` (k >= 0), naming the
                nearest allowed counts.
        """
        m = self.frame_stride
        if m is None:
            raise ValueError("num_frames: this model generates images, not videos")
        if num_frames < 1 or (num_frames - 1) % m:
            lo = max(1, num_frames - (num_frames - 1) % m)
            hi = lo + m if num_frames > lo else lo
            near = f"use {lo} or {hi}" if lo != hi else f"use {lo}"
            first = ", ".join(str(1 + m * k) for k in range(3))
            raise ValueError(f"num_frames {num_frames} is not 1 plus a multiple of {m} ({first}, ...); {near}")
        return (num_frames - 1) // m + 1

    def grid(self, width_px: int, height_px: int) -> tuple[int, int]:
        """Token grid ``(h, w)`` of an image of ``width_px`` x ``height_px`` pixels."""
        return height_px // self.pixels_per_token, width_px // self.pixels_per_token

    def check_size(self, width_px: int, height_px: int, where: str = "size", multiple: int | None = None) -> None:
        """Raise ``ValueError`` if a side is not a multiple of :attr:`pixels_per_token` (or of ``multiple``, where the
        model needs more: :attr:`~bcg_core.families.ModelSpec.size_step`), naming the nearest multiples."""
        m = multiple or self.pixels_per_token
        for name, v in (("width", width_px), ("height", height_px)):
            if v % m:
                lo, hi = max(m, v - v % m), v - v % m + m
                raise ValueError(f"{where} {width_px}x{height_px}: {name} {v} is not a multiple of {m}; "
                                 f"use {lo} or {hi}")


@dataclass(frozen=True, slots=True)
class BucketLookup:
    """Result of :meth:`BucketTable.lookup`: a hit carries ``key``; a miss names ``missed`` dimensions."""

    query: ShapeQuery
    key: BucketKey | None
    missed: tuple[Dim, ...] = ()

    @property
    def hit(self) -> bool:
        """True when a bucket holds the query."""
        return self.key is not None

    @property
    def padded_tokens(self) -> int:
        """Tokens of the forward that serves the query (the bucket's on a hit, the query's own on a miss)."""
        return self.key.tokens if self.key is not None else self.query.tokens


class BucketTable:
    """All buckets of one replica, built once from :class:`BucketConfig` and validated.

    Lookup is O(1): each dimension has a precomputed round-up array indexed by the exact value
    (batch rows, image tokens, text tokens), so serving never searches.

    Args:
        config: the bucket lists and policies.
        rules: the model family's shape rules.
        min_image_tokens: fewest image tokens a valid request can have (from the smallest allowed side);
            a tier gets a masked variant only if some valid request falls strictly between it and the
            tier below.

    Raises (at construction):
        ValueError: a tier not a multiple of the model's token size, duplicate tiers, or text buckets that
            contradict the model's training (fixed-length unmasked text accepts only its native length).
    """

    def __init__(self, config: BucketConfig, rules: ShapeRules, min_image_tokens: int = 1):
        self.config = config
        self.rules = rules
        self.miss_policy = MissPolicy(config.miss_policy)
        self.batch_sizes: tuple[int, ...] = tuple(config.batch_sizes)
        self.text_lengths: tuple[int, ...] = tuple(config.all_text_lengths())
        """Every text bucket of any tier, ascending (``text_lengths`` and ``text_lengths_by_resolution``)."""
        native = rules.native_text_tokens
        if native is not None and self.text_lengths != (native,):
            raise ValueError(
                f"buckets.text_lengths: {list(self.text_lengths)} (with text_lengths_by_resolution) do not match the "
                f"model: it was trained on unmasked "
                f"fixed-length text of {native} tokens, and padding or masking its text changes the output; "
                f"use text_lengths: [{native}] and no text_lengths_by_resolution"
            )
        grids: list[tuple[int, int]] = []
        tier_texts: dict[object, set[int]] = {}
        frames = self._latent_frames(config, rules)
        for s, (w, h) in zip(config.resolutions, config.resolution_pairs(), strict=True):
            rules.check_size(w, h, where="buckets.resolutions:")
            g = rules.grid(w, h)
            grids.append(g)
            for tier in ([(f, *g) for f in frames] if frames else [g] if rules.grid_keyed else [g[0] * g[1]]):
                tier_texts.setdefault(tier, set()).update(config.texts_of(s))
        self._tier_texts: dict[object, tuple[int, ...]] = {k: tuple(sorted(v)) for k, v in tier_texts.items()}
        self._tier_text_up = {k: self._round_up_array(v) for k, v in self._tier_texts.items()}
        self.frames: tuple[int, ...] = tuple(frames)
        """Latent frames of the video tiers (``buckets.frames`` through :meth:`ShapeRules.latent_frames`); ``()`` for
        an image family."""
        if rules.grid_keyed:
            self.grids: tuple[tuple[int, ...], ...] = tuple(sorted(
                {(f, *g) for f in frames for g in grids} if frames else set(grids)))
            """The token grids of the tiers: ``(h, w)``, or ``(frames, h, w)`` for a video family."""
            self.image_tiers: tuple[int, ...] = tuple(sorted({math.prod(g) for g in self.grids}))
        else:
            self.grids = ()
            by_tokens: dict[int, list[str]] = {}
            for s, (h, w) in zip(config.resolutions, grids, strict=True):
                by_tokens.setdefault(h * w, []).append(s)
            for same in by_tokens.values():
                if len(same) > 1:
                    raise ValueError(
                        f"resolutions {same} have the same number of image tokens and would share one bucket "
                        f"(this model's forward depends only on the token count); keep one of them"
                    )
            tiers = sorted(by_tokens)
            self.image_tiers = tuple(tiers)
        self._batch_up = self._round_up_array(self.batch_sizes)
        self._text_up = self._round_up_array(self.text_lengths)
        self._image_up = self._round_up_array(self.image_tiers)
        self._grid_set = frozenset(self.grids)
        self._tier_set = frozenset(self.image_tiers)
        self.pad_images = config.image_padding == "masked" and not rules.grid_keyed
        self.min_image_tokens = min_image_tokens
        self._keys = self._all_keys()

    @staticmethod
    def _latent_frames(config: BucketConfig, rules: ShapeRules) -> list[int]:
        """Latent frames of ``buckets.frames`` (video families), ascending; ``[]`` for an image family.

        Raises:
            ValueError: frames set for an image family, none for a video family, or a count the family cannot
                generate (naming the allowed counts).
        """
        if not rules.video:
            if config.frames:
                raise ValueError(f"buckets.frames: {config.frames}: this model generates images, not videos; leave "
                                 f"frames empty")
            return []
        if not rules.grid_keyed:
            raise ValueError("a video family's shape rules must be grid-keyed (its RoPE spans frames x h x w)")
        if not config.frames:
            raise ValueError("buckets.frames is empty: this model generates videos, and its buckets hold one frame "
                             "count each; list the num_frames to serve, e.g. frames: [81]")
        out = []
        for n in config.frames:
            try:
                out.append(rules.latent_frames(n))
            except ValueError as e:
                raise ValueError(f"buckets.frames: {e}") from None
        return sorted(set(out))

    @staticmethod
    def _round_up_array(values: tuple[int, ...]) -> tuple[int, ...]:
        """``arr[v]`` = smallest bucket value >= v, for v in 0..max(values)."""
        return tuple(values[bisect.bisect_left(values, v)] for v in range(values[-1] + 1))

    @property
    def keys(self) -> list[BucketKey]:
        """Every bucket, sorted by batch, then image tokens, then text tokens (exact before masked)."""
        return list(self._keys)

    def _all_keys(self) -> tuple[BucketKey, ...]:
        if self.rules.grid_keyed:
            images = [(math.prod(g), g, False) for g in self.grids]
        else:
            images = [(t, None, False) for t in self.image_tiers]
            if self.pad_images:
                below = (0,) + self.image_tiers[:-1]
                images += [(t, None, True) for t, prev in zip(self.image_tiers, below, strict=True)
                           if max(prev + 1, self.min_image_tokens) < t]
        return tuple(sorted(
            BucketKey(b, t, s, None if g is None else g[-2:], m, g[0] if g is not None and len(g) == 3 else None)
            for b in self.batch_sizes for t, g, m in images
            for s in self._tier_texts[g if g is not None else t]
        ))

    def texts_for(self, image_tokens: int, latent_hw: tuple[int, int] | None = None,
                  frames: int | None = None) -> tuple[int, ...]:
        """Text buckets of the tier that serves ``image_tokens`` (or the grid ``latent_hw`` of a grid-keyed family,
        with its latent ``frames`` for a video family), ascending: its ``text_lengths_by_resolution`` entry, else
        ``text_lengths``; every text bucket of the table when no tier holds the image."""
        if self.rules.grid_keyed:
            tier = latent_hw if frames is None or latent_hw is None else (frames, *latent_hw)
            return self._tier_texts.get(tier, self.text_lengths)
        if image_tokens not in self._tier_set and self.pad_images and 0 < image_tokens < len(self._image_up):
            image_tokens = self._image_up[image_tokens]
        return self._tier_texts.get(image_tokens, self.text_lengths)

    def __len__(self) -> int:
        return len(self._keys)

    def lookup(self, query: ShapeQuery) -> BucketLookup:
        """Round ``query`` up to its bucket, O(1).

        Args:
            query: exact shape of the request's forward.

        Returns:
            A hit with the key, or a miss listing every dimension that exceeds the largest bucket (or, for
            grid-keyed families, whose grid, with its frames for a video family, is not a tier).
        """
        image_missed: list[Dim] = []
        hw, masked = None, False
        t = query.image_tokens
        if self.rules.grid_keyed:
            hw = query.grid
            if hw not in self._grid_set:
                image_missed.append(Dim.IMAGE)
        elif t not in self._tier_set:
            if self.pad_images:
                t, masked = self._up(self._image_up, t, Dim.IMAGE, image_missed), True
            else:
                image_missed.append(Dim.IMAGE)
        # the text rounds up among its tier's text buckets (every bucket of the table when the image missed)
        text_up = self._text_up if image_missed else self._tier_text_up[hw if hw is not None else t]
        missed: list[Dim] = []
        b = self._up(self._batch_up, query.batch, Dim.BATCH, missed)
        s = self._up(text_up, query.text_tokens, Dim.TEXT, missed)
        missed += image_missed
        if missed:
            return BucketLookup(query, None, tuple(missed))
        return BucketLookup(query, BucketKey(b, t, s, None if hw is None else hw[-2:], masked, query.frames))

    def split_home(self, lookup: BucketLookup) -> BucketKey | None:
        """For a lookup that missed only in the batch dimension (more rows than the largest batch bucket): the
        largest bucket of its shape, across whose batch sizes the step scheduler splits its rows. None for a
        hit or any other miss."""
        if lookup.hit or set(lookup.missed) != {Dim.BATCH}:
            return None
        q = lookup.query
        return self.lookup(ShapeQuery(self.batch_sizes[-1], q.image_tokens, q.text_tokens, q.latent_hw, q.frames)).key

    @staticmethod
    def _up(arr: tuple[int, ...], v: int, dim: Dim, missed: list[Dim]) -> int:
        if 0 < v < len(arr):
            return arr[v]
        missed.append(dim)
        return v

    def describe_limits(self) -> dict[str, object]:
        """The largest value each dimension can hold, for error messages and ``GET /v1/buckets``."""
        return {
            "batch_sizes": list(self.batch_sizes),
            "image_tokens": list(self.image_tiers),
            "grids": [list(g) for g in self.grids] or None,
            "frames": list(self.config.frames) or None,
            "text_tokens": list(self.text_lengths),
            "text_tokens_by_resolution": {k: list(v) for k, v in self.config.text_lengths_by_resolution.items()}
            or None,
            "resolutions": list(self.config.resolutions),
            "image_padding": "masked" if self.pad_images else "exact",
            "miss_policy": self.miss_policy.value,
        }


def fit_size(size: tuple[int, int], min_side: int, max_side: int, multiple: int) -> tuple[int, int]:
    """``size`` fitted into the side limits: unchanged where both sides lie in ``[min_side, max_side]``, else scaled
    with its aspect kept until its longer side is ``max_side`` (or its shorter side ``min_side``), each side then
    rounded down to a multiple of ``multiple`` and kept within the limits' multiples.

    Used for a model's default size (a request without one) on a server whose ``limits`` leave it out (Z-Image's
    1024x1024 under ``max_side_px: 512``), so such a request is served at the largest default that fits rather than
    refused for a size it did not send.

    Args:
        size: ``(width, height)`` in pixels.
        min_side, max_side: ``limits.min_side_px`` and ``limits.max_side_px``.
        multiple: the model's size step (pixels a side must be a multiple of).

    Returns:
        ``(width, height)`` in pixels.
    """
    w, h = size
    if min_side <= min(w, h) and max(w, h) <= max_side:
        return size
    scale = max_side / max(w, h) if max(w, h) > max_side else min_side / min(w, h)
    lo, hi = -(-min_side // multiple) * multiple, max_side // multiple * multiple

    def side(v: int) -> int:
        return min(max(int(v * scale) // multiple * multiple, lo), hi)
    return side(w), side(h)
