"""Streamed previews: which steps get one, and a cheap latent-to-RGB approximation every family can use.

A request streamed with ``partial_images`` k (0..3) gets a preview after each of the steps
:func:`preview_steps` picks: evenly spaced, never the last (the final image follows it). The step scheduler
copies the request's latents at that step and hands the copy to its preview thread, so the denoising thread
only pays for one device copy and a queue put (:mod:`bcg_core.scheduler.step_scheduler`); the family's
``preview(state, latents)`` hook turns the copy into images.

Every family here previews with :class:`LinearPreview`: RGB = A z + b per latent pixel, a 3 x C matrix and a bias
fitted by least squares to the family's own VAE: on first use, seeded synthetic pictures (colour fields and
soft discs) are encoded by the VAE and each latent pixel is paired with the mean colour of the pixels it covers.
This is the approximation ComfyUI's ``latent_rgb_factors`` make by hand, derived from the checkpoint itself
(so it holds for any VAE, FLUX's 16 channels, SANA's 32-channel DC-AE or Qwen-Image's video VAE alike). It
costs one (n, C, h, w) x (C, 3) product on the host, about a millisecond for a 1024x1024 image's 128x128 latents,
against a VAE decode of tens of milliseconds on a GPU that the denoising steps need. The preview is drawn at
latent resolution (8 or 32 pixels per latent pixel) and resized bilinearly to the requested size: a blurry,
colour-true look at where the image is going, not a decode.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["LazyPreview", "LinearPreview", "PartialImage", "StepProgress", "preview_steps", "vae_latents",
           "vae_preview"]


def preview_steps(steps: int, partial_images: int) -> tuple[int, ...]:
    """After which steps (counted from 1) a request of ``steps`` steps sends its ``partial_images`` previews.

    Evenly spaced: step ``round(steps * (i + 1) / (k + 1))`` for preview ``i`` of ``k``, where ``k`` is
    ``partial_images`` capped at ``steps - 1`` (the last step gives the final image, not a preview), duplicates
    dropped. E.g. 20 steps, 3 previews: (5, 10, 15); 4 steps, 3: (1, 2, 3); 2 steps, 3: (1,); 1 step: ().

    Raises:
        ValueError: ``steps`` < 1 or ``partial_images`` < 0.
    """
    if steps < 1 or partial_images < 0:
        raise ValueError(f"steps must be >= 1 and partial_images >= 0, got {steps} and {partial_images}")
    k = min(partial_images, steps - 1)
    picked = {min(steps - 1, max(1, round(steps * (i + 1) / (k + 1)))) for i in range(k)}
    return tuple(sorted(picked))


@dataclass(frozen=True)
class PartialImage:
    """One streamed preview.

    Attributes:
        index: the preview's ``partial_image_index`` (0-based, in step order).
        image_index: which of the request's ``n`` images it shows.
        step: denoising steps done when it was taken.
        data: the image file, in the request's ``output_format``, at the requested size.
    """

    index: int
    image_index: int
    step: int
    data: bytes


@dataclass(frozen=True)
class StepProgress:
    """A request's denoising progress, streamed after each of its steps when its caller asks for it
    (:meth:`~bcg_core.scheduler.step_scheduler.StepScheduler.submit_stream` with ``progress``; a video job's
    ``progress``, :mod:`deployments.videos.worker`).

    Attributes:
        step: steps done, 1..``steps``.
        steps: steps the request runs (an edit's: its strength's share, :attr:`~bcg_core.request.ValidatedRequest.
            steps_run`).
    """

    step: int
    steps: int


def vae_latents(vae: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The raw latents (before any scaling) of ``images`` (n, 3, H, W) in [-1, 1]: the mean of a KL VAE's
    latent distribution (``AutoencoderKL``), or a DC-AE's latent (``AutoencoderDC``)."""
    out = vae.encode(images.to(device=vae.device, dtype=vae.dtype))
    dist = getattr(out, "latent_dist", None)
    return dist.mode() if dist is not None else out.latent


def _fit_pictures(n: int, size: int, seed: int) -> torch.Tensor:
    """(n, 3, size, size) in [-1, 1]: seeded smooth colour fields with soft discs (the fit's pictures)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, 4, 4, generator=g) * 2 - 1
    img = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    y, x = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    for i in range(n):
        for _ in range(4):
            cx, cy, r = (torch.rand(3, generator=g) * torch.tensor([0.8, 0.8, 0.25]) + torch.tensor([0.1, 0.1, 0.05]))
            mask = ((x - cx) ** 2 + (y - cy) ** 2).sqrt().lt(r).float()
            img[i] = img[i] * (1 - mask) + mask * (torch.rand(3, 1, 1, generator=g) * 2 - 1)
    return img.clamp(-1, 1)


class LinearPreview:
    """RGB = A z + b for each latent pixel: latents (n, C, h, w) to (n, h, w, 3) uint8 images.

    Args:
        weight: (3, C) float32, from raw latents to RGB in [-1, 1].
        bias: (3,) float32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        self.weight = weight.float().cpu()
        self.bias = bias.float().cpu()

    @classmethod
    def fit(cls, encode: Callable[[torch.Tensor], torch.Tensor], factor: int, pictures: int = 8,
            seed: int = 0) -> LinearPreview:
        """Least squares over ``pictures`` seeded synthetic pictures of ``16 * factor`` pixels a side.

        Args:
            encode: (n, 3, H, W) in [-1, 1] -> raw latents (n, C, H / factor, W / factor).
            factor: pixels per latent pixel (8 for SD/FLUX VAEs, 32 for SANA's DC-AE).

        Raises:
            ValueError: ``encode`` gives latents of another size.
        """
        size = 16 * factor
        x = _fit_pictures(pictures, size, seed)
        with torch.inference_mode():
            z = encode(x).float().cpu()
        h = size // factor
        if z.shape[-2:] != (h, h):
            raise ValueError(f"the VAE gave latents of {tuple(z.shape[-2:])} for {size}x{size} pictures; expected "
                             f"{(h, h)} at {factor} pixels per latent pixel")
        target = torch.nn.functional.avg_pool2d(x, factor)  # (n, 3, h, h): each latent pixel's mean colour
        zs = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        design = torch.cat([zs, torch.ones(zs.shape[0], 1)], dim=1).double()
        rgb = target.permute(0, 2, 3, 1).reshape(-1, 3).double()
        sol = torch.linalg.lstsq(design, rgb).solution  # (C + 1, 3)
        return cls(sol[:-1].T.float(), sol[-1].float())

    def __call__(self, latents: torch.Tensor) -> list[np.ndarray]:
        """``n`` previews of raw latents (n, C, h, w), as (h, w, 3) uint8 arrays.

        The map runs where the latents are (on a GPU only the uint8 result crosses to the host): on the host, torch's
        intra-op thread pool would take every core for a moment and slow the replica's denoising thread."""
        z = latents.detach().float()
        weight, bias = self._on(z.device)
        rgb = torch.einsum("nchw,kc->nhwk", z, weight) + bias
        arr = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
        return [np.ascontiguousarray(a) for a in arr]

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and bias on ``device`` (copied once per device)."""
        cached = getattr(self, "_device_copy", None)
        if cached is None or cached[0] != device:
            cached = (device, self.weight.to(device), self.bias.to(device))
            self._device_copy = cached
        return cached[1], cached[2]


class LazyPreview:
    """A :class:`LinearPreview` fitted on first use (thread-safe), so loading a model never pays for it.

    Args:
        encode, factor: as :meth:`LinearPreview.fit`.
    """

    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], factor: int):
        self._encode, self._factor = encode, factor
        self._lock = threading.Lock()
        self._fitted: LinearPreview | None = None

    def get(self) -> LinearPreview:
        """The fitted projection (fits it now if it is the first call)."""
        with self._lock:
            if self._fitted is None:
                self._fitted = LinearPreview.fit(self._encode, self._factor)
            return self._fitted

    def __call__(self, latents: torch.Tensor) -> list[np.ndarray]:
        return self.get()(latents)


def vae_preview(vae: torch.nn.Module, factor: int) -> LazyPreview:
    """The :class:`LazyPreview` of a family whose VAE's ``encode`` takes (n, 3, H, W) pictures
    (:func:`vae_latents`), ``factor`` pixels per latent pixel (the pipeline's ``vae_scale_factor``)."""
    return LazyPreview(lambda x: vae_latents(vae, x), factor)
