"""The engine's request, the validated request and the result: validated once (by the validator), trusted below.

:class:`GenerationRequest` is what a caller asks for (``deployments/schemas.py`` maps OpenAI's fields onto it);
:class:`ValidatedRequest` is what :meth:`bcg_core.validation.RequestValidator.validate` makes of it: every field
validated, the defaults filled in, the exact shape looked up in the bucket table once. Replicas, the step scheduler and
the pipeline accept only a :class:`ValidatedRequest`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from bcg_core.keys import BucketKey, BucketShape
from bcg_core.step_cache.spec import FirstBlockCache, NoCache
from bcg_core.table import BucketLookup

__all__ = ["GenerationRequest", "GenerationResult", "MAX_PARTIAL_IMAGES", "ValidatedRequest", "QUALITIES",
           "QUALITY_ALIASES", "SEED_MAX", "steps_run"]

SEED_MAX = 2**63 - 1
"""Largest seed (``torch.Generator.manual_seed`` takes 64-bit values; JSON clients handle int64)."""



@dataclass
class GenerationRequest:
    """One text-to-image (or, for a video model, text-to-video) request.

    Attributes:
        prompt: the text.
        n: images to generate.
        width, height: image size in pixels; None (OpenAI's ``size: "auto"``, or no size): the model's
            default size, :attr:`~bcg_core.families.ModelSpec.default_size` (its diffusers pipeline's, e.g.
            1024x1024 for FLUX.1, SD3, PixArt-Sigma 1024, SANA 1024 and Qwen-Image; 512x512 for the tiny default),
            filled in by the validator.
        num_inference_steps: denoising steps (None: ``quality``'s, else the default: ``limits.default_steps``
            where set, else the family's diffusers pipeline's ``__call__`` default).
        guidance_scale: guidance scale (None: ``limits.default_guidance_scale`` where set, else the family's
            diffusers pipeline's default; Qwen-Image's is None and stays None). For most families it is the
            classifier-free guidance scale, and above 1 adds one uncond row per image (cond and uncond in one
            forward); for guidance-distilled FLUX.1-dev it feeds the guidance embedding (see the family table
            in docs/OPERATIONS.md).
        negative_prompt: text of the uncond rows (None: the family's default, "" for most; FLUX and Qwen-Image
            run true CFG only when one is given, as their diffusers pipelines).
        seed: image ``i`` uses noise seeded with ``seed + i`` (None: a random seed, reported back).
        true_cfg_scale: true classifier-free guidance scale of FLUX and Qwen-Image (``true_cfg_scale`` of
            ``FluxPipeline``/``QwenImagePipeline``; None: the pipeline's default); refused by other families.
        quality: OpenAI's ``quality``, ``"low"``, ``"medium"``, ``"high"`` or ``"auto"`` (or DALL-E 3's
            ``"standard"`` and ``"hd"``, served as ``"medium"`` and ``"high"``: :data:`QUALITY_ALIASES`): the step
            count the config and the family set for it (:meth:`~bcg_core.families.ModelSpec.steps_for_quality`), used
            when ``num_inference_steps`` is None. None: the default steps, as ``num_inference_steps``.
        output_format: the image files' format, ``"png"``, ``"jpeg"`` or ``"webp"`` (:mod:`bcg_core.images`).
        output_compression: 0..100 for jpeg and webp (None: 100); None or 100 for png.
        partial_images: previews to stream while denoising, 0..3 (:mod:`bcg_core.preview`); 0 for a request
            that is not streamed.
        image: an edit's input image file (PNG, JPEG or WebP bytes, :mod:`bcg_core.edits`); None for text to
            image. With ``mask``: inpainting, else image-to-image, through the family's diffusers edit pipelines. For
            a family with reference edits (:attr:`~bcg_core.families.ModelSpec.references`: FLUX.2) its reference
            image, or a tuple of several files: its reference images, in order (:attr:`images`).
        mask: an inpainting mask file of the image's size; its fully transparent pixels mark where to edit.
        strength: how far an edit moves from its image, 0 to 1 (None: the edit pipeline's default, 0.6 in
            diffusers 0.42.1): the request runs the last ``num_inference_steps * strength`` of its steps, rounded
            up (:func:`steps_run`).
        lora: LoRA adapters, ``((name, scale), ...)``: each a name in ``lora.dir`` and its weight (diffusers'
            ``set_adapters`` weight, ``|scale| <= lora.max_scale``), at most ``lora.max_per_request``, names
            unique (:mod:`bcg_core.lora`). Empty: the base model.
        num_frames: frames of each video, for a video model (Wan) only: ``1 + k * frame_stride`` (1, 5, 9, ..., 81;
            :attr:`~bcg_core.table.ShapeRules.frame_stride`, the VAE's temporal factor, 4 for Wan) up to
            ``limits.max_frames``; None: the family's pipeline default (81 for ``WanPipeline``) on a video model. Set on
            an image model it is refused. ``n`` is then the number of videos, each of ``num_frames`` frames.
        guidance_scale_2: the low-noise expert's classifier-free guidance scale of a checkpoint of two experts (Wan
            2.2 A14B: ``WanPipeline``'s ``guidance_scale_2``, for the steps ``transformer_2`` runs; ``guidance_scale``
            is the high-noise expert's); None: ``guidance_scale``'s value, which the validator fills in. Refused on a
            model of one transformer, and without classifier-free guidance (``guidance_scale`` at most 1: the
            pipeline runs no uncond rows then and ignores it).
        cfg_normalization: Z-Image's ``cfg_normalization`` (``ZImagePipeline.__call__``'s, same semantics): False
            or 0 off; True (read as 1.0, as the pipeline's ``float()``) or a number c > 0 caps each image's guided
            prediction's norm at c times its cond prediction's norm, at every step that runs guidance. None: the
            model's default (the checkpoint's ``bcg_cfg_normalization``, else the pipeline's False), which the
            validator fills in (None stays for a request without classifier-free guidance, which sets neither).
            Refused by models without it (every family but Z-Image).
        cfg_truncation: Z-Image's ``cfg_truncation`` (``ZImagePipeline.__call__``'s): guidance runs only at the steps
            whose normalized time ``(1000 - t) / 1000`` is at most it (0 at the first step, rising towards 1); later
            steps run the cond rows alone. 1.0 or more: every step guided. None: the model's default (the checkpoint's
            ``bcg_cfg_truncation``, else the pipeline's 1.0), filled in by the validator as ``cfg_normalization``.
            Refused by models without it.
        cache: the step cache it asks for (:mod:`bcg_core.step_cache`: a
            :class:`~bcg_core.step_cache.FirstBlockCache`, or :class:`~bcg_core.step_cache.NoCache` for none); None:
            the config's ``cache.default``, which the validator fills in (a validated request holds a spec, never None).
    """

    prompt: str
    n: int = 1
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    true_cfg_scale: float | None = None
    quality: str | None = None
    output_format: str = "png"
    output_compression: int | None = None
    partial_images: int = 0
    lora: tuple[tuple[str, float], ...] = ()
    image: bytes | tuple[bytes, ...] | None = None
    mask: bytes | None = None
    strength: float | None = None
    cache: FirstBlockCache | NoCache | None = None
    num_frames: int | None = None
    guidance_scale_2: float | None = None
    cfg_normalization: bool | float | None = None
    cfg_truncation: float | None = None

    @property
    def images(self) -> tuple[bytes, ...]:
        """The edit's input image files, in order: ``()`` for text to image, one for a single ``image``."""
        if self.image is None:
            return ()
        return tuple(self.image) if isinstance(self.image, (tuple, list)) else (self.image,)

    def __repr__(self) -> str:  # image files are bytes: show their sizes, not their contents
        files = {k: " + ".join(f"<{len(f)} bytes>" for f in (self.images if k == "image" else (v,)))
                 for k in ("image", "mask") if (v := getattr(self, k)) is not None}
        fields = ", ".join(f"{k}={files.get(k, repr(getattr(self, k)))}" for k in self.__dataclass_fields__)
        return f"GenerationRequest({fields})"


def steps_run(steps: int, strength: float | None) -> int:
    """Denoising steps a request runs: ``steps``, or for an edit of ``strength`` the last ``steps - t_start`` of
    them, ``t_start = int(max(steps - min(steps * strength, steps), 0))`` (diffusers' edit pipelines'
    ``get_timesteps``). 0 for a strength so small that ``steps * strength`` is below one float step of ``steps``
    (e.g. 1e-17 at 28 steps: ``28 - 2.8e-16`` rounds to 28), which the validator refuses; at least 1 above that."""
    return steps if strength is None else steps - int(max(steps - min(steps * strength, steps), 0))


QUALITIES = ("low", "medium", "high", "auto")
"""OpenAI ``quality`` values served (each a step count, :meth:`~bcg_core.families.ModelSpec.steps_for_quality`)."""

QUALITY_ALIASES = {"standard": "medium", "hd": "high"}
"""DALL-E 3's ``quality`` values (which clients and gateways still send), served as the value each maps to; the
validator replaces them, so a validated request holds one of :data:`QUALITIES`."""

MAX_PARTIAL_IMAGES = 3
"""Most previews a streamed request may ask for (OpenAI's ``partial_images`` range, 0 to 3)."""


@dataclass(frozen=True)
class ValidatedRequest:
    """A request validated once by :meth:`~bcg_core.validation.RequestValidator.validate`: defaults filled in, shape
    looked up.

    Attributes:
        request: the request with every default filled in (steps, guidance, negative prompt, seed).
        lookup: the bucket table's answer for its exact forward shape (``lookup.query``: rows, image and text
            tokens; ``lookup.key`` on a hit; ``lookup.missed`` on a miss).
        prompt_tokens: tokens of its prompt, counted as its family encodes it.
        grid: its token grid ``(h, w)`` at its generation size (the aspect-ratio bin of binning families); for a
            video, ``(latent frames, h, w)``.
        shape: the bucket shape whose buckets run its rows: the hit's, or, for a request with more rows than
            the largest batch bucket (a miss in the batch dimension only), its shape's, across whose batch
            buckets the step scheduler splits its rows (it routes to that shape's owners and is never refused
            for its rows). None for a miss in another dimension: its rows run unpadded and eager, alone.
        references: the token grids ``(h, w)`` of a reference edit's reference images, in order, as its family encodes
            them (:class:`~bcg_core.families.references.ReferenceImages`); their tokens follow the target's in the image
            stream and count in ``lookup.query.image_tokens``. Requests share forwards only where their grids and
            references are equal (the step scheduler's groups). ``()`` for any other request.
    """

    request: GenerationRequest
    lookup: BucketLookup
    prompt_tokens: int
    grid: tuple[int, int]
    shape: BucketShape | None
    references: tuple[tuple[int, int], ...] = ()

    @property
    def rows(self) -> int:
        """Transformer rows of one forward of it: images, x2 when classifier-free guidance adds uncond rows."""
        return self.lookup.query.batch

    @property
    def steps_run(self) -> int:
        """Denoising steps it runs (fewer than ``num_inference_steps`` for an edit: :func:`steps_run`)."""
        return steps_run(self.request.num_inference_steps, self.request.strength)

    @property
    def key(self) -> BucketKey | None:
        """The bucket that holds all its rows (None: a miss, or rows split across its shape's buckets)."""
        return self.lookup.key


@dataclass
class GenerationResult:
    """What one request produced.

    Attributes:
        image_bytes: ``n`` image files in :attr:`image_format`: PNG unless the request asked for another
            ``output_format`` (JPEG or WebP).
        seed: the seed used (image ``i`` used ``seed + i``).
        bucket: the bucket that served the request (of its first step), None on a miss.
        hit: True when a bucket served the request.
        missed: the key dimensions that missed (empty on a hit).
        real_tokens, padded_tokens: tokens per forward, unpadded and as computed; for a request that shared
            its forward, its own real tokens and its share (by rows) of the forward's padded tokens.
        steps: denoising steps run.
        timings_ms: ``encode`` (text and noise), ``denoise``, ``decode`` (the VAE, to pixels), ``image_encode``
            (the image files, e.g. PNG) and ``total`` milliseconds (encode and denoise are the whole step's when the
            forward was shared); the step scheduler adds ``queue`` and, for a request with LoRA adapters,
            ``lora_load`` (the part of ``queue`` spent waiting for them to load).
        batch_size: most requests that shared one step with it (1 when it ran alone).
        replica, owner, retries: filled in by the Ray Serve layer (``deployments/``): the DiT replica that
            served the request, whether it owns the request's bucket shape (None for a miss), and how many
            times the request was resent; the pipeline leaves them at None, None and 0.
        image_format: the format of :attr:`image_bytes` (``png``, ``jpeg``, ``webp``).
        cache: the step cache it ran with and what it did, the answer's ``bcg.cache``
            (:meth:`~bcg_core.step_cache.RequestCache.describe`: ``{"method": "first_block", "threshold": 0.12,
            "steps": {"cond": {"computed": 20, "reused": 8}}}``, per cache context the steps whose remaining blocks
            ran and those that reused their residual); None when it ran without one.
        videos: for a video model's request, its ``n`` videos in order (video ``i`` from seed ``seed + i``), each a
            (num_frames, height, width, 3) uint8 numpy array of RGB frames, as diffusers' ``output_type="pil"``
            frames are (``VideoProcessor.postprocess_video``); :attr:`image_bytes` is then empty (encoding them, e.g.
            to mp4, is the caller's). None for an image model's request.
    """

    image_bytes: list[bytes]
    seed: int
    bucket: BucketKey | None
    hit: bool
    missed: list[str]
    real_tokens: int
    padded_tokens: int
    steps: int
    timings_ms: dict[str, float]
    batch_size: int = 1
    replica: str | None = None
    owner: bool | None = None
    retries: int = 0
    image_format: str = "png"
    cache: dict | None = None
    videos: list | None = None

    def to_dict(self) -> dict:
        """A plain dict (image files kept as bytes; the bucket as its string; video frames as copies of their
        arrays)."""
        d = asdict(self)
        d["bucket"] = None if self.bucket is None else str(self.bucket)
        return d
