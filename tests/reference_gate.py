"""The reference gate: bcg-serve against the family's own diffusers pipeline, same folder, request and seed.

For one request, :func:`diffusers_run` calls the diffusers pipeline class on the checkpoint folder with the
same prompt, negative prompt, steps, guidance, size and generators (image ``i`` from
``torch.Generator("cpu").manual_seed(seed + i)``), once with ``output_type="latent"`` and once with
``output_type="pil"`` (PNG-encoded with PIL's defaults). :func:`bcg_run` serves the same request through
:class:`~bcg_core.DiTPipeline` (step-level loop, bucket runner on static padded buffers) and returns its final
latents and PNG files. :func:`assert_same` asserts latents within 1e-5 relative (fp32 on CPU) and the same
images: byte-equal PNGs where the latents are bit-identical (a request alone at an exact bucket), else at
most one level on at most 0.1% of the pixel values (float reduction order of a padded or shared forward).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
import torch

from bcg_core import BucketConfig, DiTPipeline, GenerationRequest, LimitsConfig, ModelConfig
from bcg_core.config import EngineConfig
from bcg_core.costs import CostModel

__all__ = ["GateRun", "PIXEL_SHARE", "RTOL", "assert_same", "bcg_pipeline", "bcg_run", "bcg_state", "bucket_costs",
           "padded", "bcg_run_joined", "diffusers_run", "pixels"]

RTOL = 1e-5
"""Relative tolerance on the final latents (fp32 on CPU, docs/DESIGN.md section 4)."""


@dataclass
class GateRun:
    """Final latents (in the pipeline's ``output_type="latent"`` layout) and PNG files of one request."""

    latents: torch.Tensor
    pngs: list[bytes] = field(default_factory=list)


def bcg_pipeline(folder, buckets: dict, device: str = "cpu", fused_step: str = "auto", dtype: str = "float32",
                 kernels: str = "eager", lora: dict | None = None, **limits) -> DiTPipeline:
    """A :class:`DiTPipeline` on ``folder`` (weights in ``dtype``, fp32 unless given) with bucket table ``buckets``
    and small-size limits, on ``device`` (``"cuda"``: the runner captures and replays CUDA graphs),
    ``runner.fused_step`` and ``runner.kernels`` as given, and :func:`bucket_costs` (every step on buckets,
    padded), which is what the gate checks. ``lora``: the ``lora`` section (adapters per request)."""
    lim = {"min_side_px": 16, "max_side_px": 1024, "max_steps": 50, **limits}
    cfg = EngineConfig(model=ModelConfig(path=str(folder), device=device, dtype=dtype),
                       buckets=BucketConfig(**buckets), limits=LimitsConfig(**lim),
                       runner={"fused_step": fused_step, "kernels": kernels}, lora=lora or {})
    return padded(DiTPipeline.from_config(cfg))


def bucket_costs(pipe: DiTPipeline) -> CostModel:
    """Costs under which every bucket forward costs the same and eager forwards are off: a step runs in the fewest
    bucket forwards, each the smallest bucket that holds its rows (padded), as the bucket table alone places
    them. On a CPU the token-count stand-in would run padded rows unpadded (there a padded row is pure extra
    work), and the gates would no longer check padding."""
    return CostModel({k: 1.0 for k in pipe.table.keys}, eager=False)


def padded(pipe: DiTPipeline) -> DiTPipeline:
    """``pipe`` with :func:`bucket_costs` in its decider."""
    pipe.decider.set_costs(bucket_costs(pipe), merge=False)
    return pipe


def png_bytes(image) -> bytes:
    """A PIL image as PNG file bytes (Pillow's encoder, default settings)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def edit_masks(size: tuple[int, int], box: tuple[int, int, int, int]):
    """One inpainting region in both conventions, drawn independently (the gate does not take bcg-serve's
    conversion on trust): OpenAI's mask as PNG bytes, an RGBA image of ``size`` (width, height) opaque everywhere
    and fully transparent inside ``box`` (x0, y0, x1, y1: edit there), and diffusers' mask, an ``L`` image white
    inside ``box`` (repaint there) and black elsewhere."""
    from PIL import Image

    w, h = size
    x0, y0, x1, y1 = box
    ours = np.full((h, w, 4), 255, dtype=np.uint8)
    ours[y0:y1, x0:x1, 3] = 0
    theirs = np.zeros((h, w), dtype=np.uint8)
    theirs[y0:y1, x0:x1] = 255
    return png_bytes(Image.fromarray(ours, "RGBA")), Image.fromarray(theirs, "L")


def diffusers_run(pipeline_cls, folder, request: GenerationRequest, device: str = "cpu",
                  load_kwargs: dict | None = None, lora_dir=None, setup=None, images: bool = True,
                  **call_kwargs) -> GateRun:
    """Run the diffusers pipeline itself on ``request`` (its ``seed`` must be set), fp32 on ``device``.

    ``load_kwargs`` go to ``from_pretrained`` (e.g. ``text_encoder_3=None, tokenizer_3=None`` for an SD3
    checkpoint saved without T5, as diffusers documents); ``call_kwargs`` are passed on to the call as they are
    (e.g. ``max_sequence_length``); prompt, n, size, generators (CPU generators, as bcg-serve's) and, where
    ``request`` sets them, negative prompt, steps, guidance, true CFG scale and Z-Image's ``cfg_normalization`` /
    ``cfg_truncation`` come from ``request`` (one it leaves unset is left to the pipeline's default, as a diffusers
    user who omits it). The request's ``lora`` adapters
    are read from ``lora_dir`` with ``load_lora_weights(path, adapter_name=name)`` and weighted by
    ``set_adapters(names, scales)``, as a diffusers user applies them. An edit's ``image`` is passed as its PIL
    image (several, a reference edit's: a list of them, in order) and its ``strength`` as set; an inpainting mask
    is the caller's (``mask_image=``, in diffusers' own convention, white where to repaint), so the gate does not
    take bcg-serve's conversion on trust. ``setup(pipe)`` runs on the loaded pipeline before the calls (e.g.
    ``pipe.transformer.enable_cache(...)``, as a diffusers user turns a step cache on). ``images=False``: the final
    latents only (one call; no PNGs).
    """
    pipe = pipeline_cls.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True,
                                        **(load_kwargs or {})).to(device)
    pipe.set_progress_bar_config(disable=True)
    if setup is not None:
        setup(pipe)
    if request.lora:
        from pathlib import Path

        for name, _ in request.lora:
            file = Path(lora_dir) / f"{name}.safetensors"
            pipe.load_lora_weights(str(file if file.is_file() else Path(lora_dir) / name), adapter_name=name)
        pipe.set_adapters([n for n, _ in request.lora], [s for _, s in request.lora])
    kwargs = dict(prompt=request.prompt, num_images_per_prompt=request.n, width=request.width,
                  height=request.height, **call_kwargs)
    for name in ("num_inference_steps", "guidance_scale", "negative_prompt", "true_cfg_scale", "strength",
                 "cfg_normalization", "cfg_truncation"):
        if getattr(request, name) is not None and name not in kwargs:  # unset: the pipeline's own default
            kwargs[name] = getattr(request, name)
    if request.image is not None and "image" not in kwargs:  # an edit: its image(s) as the user's PIL images
        from PIL import Image

        images = [Image.open(io.BytesIO(data)).convert("RGB") for data in request.images]
        kwargs["image"] = images[0] if isinstance(request.image, bytes) else images

    def gens():
        return [torch.Generator("cpu").manual_seed(request.seed + i) for i in range(request.n)]

    with torch.inference_mode():
        latents = pipe(**kwargs, generator=gens(), output_type="latent").images
        pils = pipe(**kwargs, generator=gens(), output_type="pil").images if images else []
    return GateRun(latents.float().cpu(), [png_bytes(im) for im in pils])


def bcg_state(pipe: DiTPipeline, request: GenerationRequest):
    """Denoise ``request`` alone through the step-level loop (its adapters leased first, released after); the
    finished :class:`~bcg_core.families.RequestState`, not decoded."""
    validated = pipe.validator.validate(request)
    lease = pipe.lease(validated)
    state = pipe.start(validated, lease=lease)
    while not state.done:
        pipe.step([state], pipe.decider.for_states([state]))
    if lease is not None:
        lease.release()
    return state


def bcg_run(pipe: DiTPipeline, request: GenerationRequest) -> GateRun:
    """Serve ``request`` alone through the step-level loop (:func:`bcg_state`); its final latents and PNGs."""
    state = bcg_state(pipe, request)
    return GateRun(state.latents.float().cpu(), pipe.finish(state))


def bcg_run_joined(pipe: DiTPipeline, request: GenerationRequest, other: GenerationRequest,
                   head_start: int, images: bool = True) -> tuple[GateRun, GateRun]:
    """``other`` runs ``head_start`` steps alone, then ``request`` joins it: both step together (one forward
    per step, each at its own step and timestep) until each is done. ``images=False``: the final latents only (not
    decoded; no PNGs).

    Returns:
        ``(request's run, other's run)``.
    """
    pb, pa = pipe.validator.validate(other), pipe.validator.validate(request)
    b = pipe.start(pb, lease=pipe.lease(pb))
    for _ in range(head_start):
        pipe.step([b], pipe.decider.for_states([b]))
    a = pipe.start(pa, lease=pipe.lease(pa))
    assert a.step_index == 0 and b.step_index == head_start
    while not (a.done and b.done):
        live = [s for s in (a, b) if not s.done]
        pipe.step(live, pipe.decider.for_states(live))
    for s in (a, b):
        if s.extras.get("lora") is not None:
            s.extras["lora"].release()
    return tuple(GateRun(s.latents.float().cpu(), pipe.finish(s) if images else []) for s in (a, b))


PIXEL_SHARE = 1e-3
"""Most share of pixel values that may differ (by one level) where the latents are not bit-identical."""


def pixels(png: bytes) -> np.ndarray:
    """(height, width, 3) int16 pixel values of a PNG file."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)


def assert_same(ours: GateRun, ref: GateRun, rtol: float = RTOL, exact: bool = False,
                pixel_share: float = PIXEL_SHARE) -> None:
    """The gate: latents within ``rtol`` relative (``max|a-b| / max|b|``), no NaN, and the same images.

    Where the final latents are bit-identical (``exact=True`` demands it: a request alone at an exact
    bucket runs the very forwards diffusers runs), the PNG files must be byte-equal. Where rows shared a
    padded or batched forward, fp32 reduction order differs in the last bits (~1e-7 relative, docs/DESIGN.md
    section 4), and a pixel value that lies on a rounding boundary may move by one level: then at most
    :data:`PIXEL_SHARE` of the pixel values may differ, by at most one level.
    """
    assert ours.latents.shape == ref.latents.shape, (ours.latents.shape, ref.latents.shape)
    assert not torch.isnan(ours.latents).any()
    err = ((ours.latents - ref.latents).abs().max() / ref.latents.abs().max()).item()
    assert err < rtol, f"final latents differ from diffusers' by {err:.2e} relative (tolerance {rtol:.0e})"
    identical = torch.equal(ours.latents, ref.latents)
    assert identical or not exact, f"latents are not bit-identical to diffusers' (max relative {err:.2e})"
    assert len(ours.pngs) == len(ref.pngs)
    for i, (a, b) in enumerate(zip(ours.pngs, ref.pngs, strict=True)):
        if identical:
            assert a == b, f"image {i}: PNG differs from diffusers' own pipeline although the latents are identical"
            continue
        pa, pb = pixels(a), pixels(b)
        assert pa.shape == pb.shape, (pa.shape, pb.shape)
        diff = np.abs(pa - pb)
        share = float((diff > 0).mean())
        assert diff.max() <= 1 and share <= pixel_share, (
            f"image {i}: {share:.2%} of pixel values differ from diffusers' (max {diff.max()} levels)")
