"""The validator's edit and video fields: an edit's image, mask and defaults, its size and ``strength``; a video's
``num_frames``; a two-expert model's ``guidance_scale_2``.

:class:`EditFields` is a part of :class:`~bcg_core.validation.RequestValidator` (its base class): the methods below
read the validator's ``spec``, ``limits``, ``rules``, ``default_steps`` and ``default_guidance_scale``, and word a
refused field with its ``_bad`` (the one wording of limit messages, :mod:`bcg_core.field_phrases`).
"""

from __future__ import annotations

from bcg_core.config import LimitsConfig
from bcg_core.errors import RequestError
from bcg_core.families.spec import ModelSpec
from bcg_core.request import GenerationRequest, steps_run
from bcg_core.table import ShapeRules

__all__ = ["EditFields", "is_int"]


def is_int(v) -> bool:
    """True for an ``int`` that is not a ``bool`` (JSON's ``true`` is no count)."""
    return isinstance(v, int) and not isinstance(v, bool)


class EditFields:
    """The edit and video fields of :class:`~bcg_core.validation.RequestValidator` (module docstring)."""

    spec: ModelSpec
    limits: LimitsConfig
    rules: ShapeRules
    default_steps: int
    default_guidance_scale: float | None

    def _frames(self, r: GenerationRequest) -> int:
        """A video request's latent frames (its ``num_frames``, or the family's default, through
        :meth:`~bcg_core.table.ShapeRules.latent_frames`); 1 for an image model's request.

        Raises:
            RequestError: ``num_frames`` on an image model, out of 1..``limits.max_frames``, not ``1 + k x
                frame_stride`` or of more latent frames than the model's position table holds; ``partial_images`` on a
                video model (no previews of videos).
        """
        if not self.spec.video:
            if r.num_frames is not None:
                raise RequestError("num_frames", f"invalid 'num_frames' (got {r.num_frames!r}): "
                                                 f"{self.spec.pipeline_class} (family {self.spec.family}) generates "
                                                 f"images, not videos; leave num_frames unset")
            return 1
        if r.partial_images:
            raise self._bad("partial_images", r.partial_images, "previews are not served for videos; send 0")
        nf = self.spec.default_frames if r.num_frames is None else r.num_frames
        if not is_int(nf) or not 1 <= nf <= self.limits.max_frames:
            raise self._bad("num_frames", nf, "out of range")
        try:
            latent = self.rules.latent_frames(nf)
        except ValueError as e:
            raise self._bad("num_frames", nf, str(e).removeprefix(f"num_frames {nf} ")) from None
        most = self.spec.max_grid_side
        if most is not None and latent > most:  # the frames axis of the model's position table
            raise self._bad("num_frames", nf, f"its {latent} latent frames exceed this model's position table ({most} "
                                              f"a side): at most {(most - 1) * self.rules.frame_stride + 1} frames")
        return latent

    def _guidance_2(self, r: GenerationRequest, g: float | None) -> float | None:
        """``guidance_scale_2`` of a model of two experts (:attr:`ModelSpec.boundary_ratio`): the request's, else
        ``g`` (as ``WanPipeline``); None on one transformer or without CFG. Raises RequestError where set on one
        transformer (diffusers raises too), out of 0 to ``limits.max_guidance_scale``, or beside a ``guidance_scale``
        of at most 1 (no uncond rows run)."""
        g2 = r.guidance_scale_2
        if g2 is None:
            return None if self.spec.boundary_ratio is None or g is None or g <= 1.0 else float(g)
        if self.spec.boundary_ratio is None:
            raise self._bad("guidance_scale_2", g2, f"{self.spec.pipeline_class} checkpoint {self.spec.name!r} has "
                                                    f"one transformer (no boundary_ratio); leave it unset")
        if isinstance(g2, bool) or not isinstance(g2, (int, float)) or not 0.0 <= g2 <= self.limits.max_guidance_scale:
            raise self._bad("guidance_scale_2", g2, "out of range")
        if g is None or g <= 1.0:
            raise self._bad("guidance_scale_2", g2, f"guidance_scale {g} runs no classifier-free guidance, so the "
                                                    f"low-noise expert's scale would be ignored; set guidance_scale "
                                                    f"above 1 or leave guidance_scale_2 unset")
        return float(g2)

    def _edit_defaults(self, r: GenerationRequest) -> dict | None:
        """For an edit (``image`` set): its image read and checked (:mod:`bcg_core.edits`) and the defaults of the
        family's edit pipeline (image-to-image, or inpainting with a ``mask``): ``steps`` and ``guidance``
        (``limits.default_steps`` / ``default_guidance_scale`` where set), ``strength``, ``image_size``, the
        image's size with each side rounded down to the model's token size (the size of an edit without one), and
        ``references`` ``()``. A reference edit (:attr:`ModelSpec.references`: FLUX.2) has its pipeline's own
        defaults (text to image's: the same ``__call__``), ``strength`` None, ``image_size`` its first image's as the
        pipeline resizes it and ``references`` the images' token grids (:func:`~bcg_core.edits.read_references`).
        None for text to image.

        Raises:
            RequestError: a mask without an image, a family without edits (naming the families that edit), several
                images where the family edits one, or an image or mask that is not served (:mod:`bcg_core.edits`).
        """
        if r.image is None:
            if r.mask is not None:
                raise RequestError("image", "'mask' needs an 'image' to edit; send both (or neither)")
            if r.strength is not None:
                raise RequestError("strength", "'strength' applies to edits (POST /v1/images/edits) only")
            return None
        from bcg_core.edits import read_image, read_mask, read_references
        from bcg_core.families.defaults import edit_defaults

        if not r.images:  # an empty list of files
            raise RequestError("image", "'image' holds no file; send the image to edit as the file part 'image'")
        if self.spec.references is not None:
            refs, size = read_references(r, self.spec.references, self.limits.max_input_pixels)
            return {"steps": self.default_steps, "guidance": self.default_guidance_scale, "strength": None,
                    "image_size": size, "references": refs}
        if self.spec.edit_pipelines is None:
            raise RequestError("image", f"'image': {self.spec.pipeline_class} (family {self.spec.family}) is not "
                                        f"served for edits; edits are served for FLUX.1, SD3/SD3.5 and Qwen-Image "
                                        f"(FluxPipeline, StableDiffusion3Pipeline and QwenImagePipeline "
                                        f"checkpoints) and the tiny default; reference-image edits for FLUX.2 "
                                        f"(Flux2Pipeline and Flux2KleinPipeline checkpoints)")
        if len(r.images) > 1:
            raise RequestError("image", f"'image': {len(r.images)} images were sent; {self.spec.pipeline_class} edits "
                                        f"one image (several reference images are served for FLUX.2 checkpoints)")
        image = read_image(r.images[0], self.limits.max_input_pixels)
        if r.mask is not None:
            read_mask(r.mask, image.size, self.limits.max_input_pixels)
        return {**edit_defaults(self.spec, self.limits, r.mask is not None),
                "image_size": self._edit_size(image.width, image.height), "references": ()}

    def _edit_size(self, width: int, height: int) -> tuple[int, int]:
        """The size of an edit that sends none: its image's, scaled (aspect kept) to fit ``limits.min_side_px`` ..
        ``max_side_px`` where a side falls outside (a 4032x3024 photo at max 2048: 2048x1536), each side then rounded
        down to the model's pixels per token (up where that would fall below ``min_side_px``). The image is resized
        to it, as to a size the request names."""
        lim, px = self.limits, self.rules.pixels_per_token
        scale = min(1.0, lim.max_side_px / max(width, height))
        if min(width, height) * scale < lim.min_side_px:
            scale = min(lim.max_side_px / max(width, height), lim.min_side_px / min(width, height))

        def side(v: float) -> int:
            s = max(px, int(v + 1e-6) // px * px)
            return s if s >= lim.min_side_px else -(-lim.min_side_px // px) * px
        return side(width * scale), side(height * scale)

    def _strength(self, r: GenerationRequest, edit: dict | None, steps: int) -> tuple[float | None, int]:
        """``(strength, steps run)`` (:func:`~bcg_core.request.steps_run`); text to image: ``(None, steps)``."""
        if edit is None or edit["references"]:  # text to image, or a reference edit (its target starts from noise)
            return None, steps
        s = edit["strength"] if r.strength is None else r.strength
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 < s <= 1.0:
            raise self._bad("strength", s, "out of range")
        runs = steps_run(steps, s)
        if runs < 1:  # steps x strength below one ulp of steps: diffusers' get_timesteps leaves no step either
            raise self._bad("strength", s, f"runs no denoising step of {steps}: {steps} x strength is below the "
                                           f"float resolution of {steps} (diffusers' edit pipelines refuse it too)")
        return float(s), runs

