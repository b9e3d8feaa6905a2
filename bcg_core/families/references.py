"""Reference images: how a family whose pipeline takes ``image`` as a list of references (FLUX.2's ``Flux2Pipeline``
and ``Flux2KleinPipeline``) sizes them, told without loading weights, so that the ingress's validator can refuse what
the pipeline refuses and count the image tokens the references add to a request's image stream (its bucket key).

A reference edit is neither image-to-image nor inpainting: its target starts from pure noise (no ``strength``), there
is no mask, and each reference image is VAE-encoded once and its tokens appended to the image stream, where they
condition every step without being denoised. The family's start does the resizing and encoding with the pipeline's own
methods; :class:`ReferenceImages` only mirrors the sizes those methods give, so that a request's bucket is known before
any pixel is decoded on a replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ReferenceImages"]


@dataclass(frozen=True)
class ReferenceImages:
    """The reference-image rules of a family's pipeline (FLUX.2: ``Flux2Pipeline.__call__`` lines 883-905 (D), the
    same in ``Flux2KleinPipeline.__call__`` 762-784 (K), and ``Flux2ImageProcessor``).

    Attributes:
        pipeline: the pipeline class whose ``image`` argument this is (named in messages and ``GET /v1/models``).
        max_images: most reference images a request may send. The pipelines set none; this is Black Forest Labs'
            published maximum for the model (docs.bfl.ai, "Reference images per model": [dev] "recommended max 6",
            [klein] "up to 4"), or ``bcg_reference_images`` in ``model_index.json``. Each reference adds its tokens
            to every row of every step (a 1024x1024 reference: 4,096 tokens, as many as the target's).
        max_area: pixels above which a reference is first resized to this area, aspect kept
            (``_resize_to_target_area``: ``int(w * s), int(h * s)`` with ``s = sqrt(max_area / (w * h))``): 1024 x 1024.
        multiple: pixels each side is then cut down to a multiple of (``vae_scale_factor * 2``; the image is centre
            cropped to it, ``preprocess(resize_mode="crop")``), also the pixels per token side.
        min_side: the shortest side a reference may have before any resizing (``check_image_input``'s
            ``min_side_length``, 64; diffusers raises below it).
        max_aspect: the most ``long side / short side`` a reference may have (``check_image_input``'s
            ``max_aspect_ratio``, 8).
    """

    pipeline: str
    max_images: int
    max_area: int = 1024 * 1024
    multiple: int = 16
    min_side: int = 64
    max_aspect: float = 8.0

    def size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` of a reference of ``width`` x ``height`` pixels as the pipeline encodes it (D:894-901):
        resized to :attr:`max_area` where above it, then each side cut down to :attr:`multiple`. Also the size of an
        edit that sends none, for its first reference (D:903-904: ``height = height or image_height``)."""
        if width * height > self.max_area:
            scale = math.sqrt(self.max_area / (width * height))
            width, height = int(width * scale), int(height * scale)
        m = self.multiple
        return width // m * m, height // m * m

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """The token grid ``(h, w)`` of a reference of ``width`` x ``height`` pixels: its :meth:`size` over
        :attr:`multiple` (one token per ``multiple`` x ``multiple`` pixels, ``_patchify_latents`` of the VAE's
        latents)."""
        w, h = self.size(width, height)
        return h // self.multiple, w // self.multiple

    def refusal(self, width: int, height: int) -> str | None:
        """Why the pipeline refuses a reference of ``width`` x ``height`` pixels (``check_image_input``, D:889-890,
        raises ``ValueError``), or None: a side below :attr:`min_side`, or an aspect ratio above :attr:`max_aspect`."""
        if width < self.min_side or height < self.min_side:
            return (f"is {width}x{height}; {self.pipeline} takes reference images whose sides are at least "
                    f"{self.min_side} pixels")
        ratio = max(width / height, height / width)
        if ratio > self.max_aspect:
            return (f"is {width}x{height} (aspect ratio {ratio:.1f}:1); {self.pipeline} takes reference images of "
                    f"aspect ratios up to {self.max_aspect:g}:1")
        return None
