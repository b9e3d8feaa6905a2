"""The fused step: classifier-free guidance and the flow-match Euler update inside the bucket graph.

Without it a denoising step is a bucket replay (the transformer alone) followed, per request, by its CFG
combination and its scheduler's ``step`` on the host: a handful of small kernels and some Python per
request per step. With it, one replay computes the transformer forward, every image's CFG combination and
its Euler update, and returns the next latents of every image in the bucket (docs/DESIGN.md section 11).

It applies where the update is stateless: ``FlowMatchEulerDiscreteScheduler`` (FLUX.1, SD3) without
stochastic sampling or per-token timesteps, and the plain CFG combination ``u + s * (c - u)``. Multistep
solvers (PixArt-Sigma's and SANA's DPM-Solver) keep history in the scheduler and stay on the host;
Qwen-Image's norm-rescaled true CFG does too.

Exactness. diffusers 0.42.1 computes (``FlowMatchEulerDiscreteScheduler.step``, ``FluxPipeline.__call__``,
``StableDiffusion3Pipeline.__call__``)::

    noise = u + s * (c - u)                    # s a Python float; c, u in the model dtype
    dt = sigmas[i + 1] - sigmas[i]             # a 0-dim fp32 tensor on the sigmas' device
    x_next = (x.to(fp32) + dt * noise).to(noise.dtype)

Under PyTorch's type promotion a 0-dim tensor does not promote a dimensioned one: ``dt * noise`` is
computed in fp32 from ``dt`` cast to the model dtype and rounded back to it, while ``s`` (a wrapped number)
enters the product at fp32. :func:`fused_update` reproduces each rounding with per-row tensors (``dt``
cast to the model dtype, then the product; ``s`` at fp32, the product rounded to the model dtype), so the
next latents are bitwise those of the host path. :meth:`bcg_core.pipeline.DiTPipeline.check_fused`
proves it at start on the device itself and turns the fused step off if a single bit differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EulerStep", "META_ROWS", "euler_step", "fused_update", "commit_euler"]

META_ROWS = 4
"""Rows of the ``(4, B)`` fp32 meta buffer: cond row, uncond row, CFG flag (1/0), CFG scale."""


@dataclass(frozen=True)
class EulerStep:
    """How one request's current step runs fused.

    Attributes:
        cond: offset of the request's cond rows within its own rows (0 for FLUX, ``n`` for SD3 with CFG,
            whose pipeline puts the uncond rows first).
        uncond: offset of its uncond rows, None without classifier-free guidance.
        scale: the CFG scale ``s`` of ``u + s * (c - u)`` (unused without CFG).
        dt: ``sigmas[i + 1] - sigmas[i]``, a 0-dim fp32 tensor on the sigmas' device, computed exactly as
            ``FlowMatchEulerDiscreteScheduler.step`` computes it.
        tokens: the tokens of ``state.latents`` where its rows' image stream holds more (FLUX.2 reference edits: the
            reference tokens follow, and their updated values are dropped, as the pipeline keeps
            ``noise_pred[:, :latents.size(1)]``); None: every token of the output is the request's.
    """

    cond: int
    uncond: int | None
    scale: float
    dt: torch.Tensor
    tokens: int | None = None


def euler_step(state, cond: int, uncond: int | None, scale: float, dtype: torch.dtype,
               tokens: int | None = None) -> EulerStep | None:
    """The fused form of ``state``'s next step, or None where it must run on the host.

    Args:
        state: a :class:`~bcg_core.families.RequestState` whose model rows' latents are ``state.latents``
            (repeated for the uncond rows; with ``tokens``, followed by other tokens in each row).
        cond, uncond, scale, tokens: see :class:`EulerStep`.
        dtype: the model's dtype; the latents must be in it (the fused graph reads them from the bucket's
            static latents buffer).

    Returns None for any scheduler but a plain ``FlowMatchEulerDiscreteScheduler`` (exact class; no
    ``stochastic_sampling``), or latents in another dtype.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = state.scheduler
    if type(sched) is not FlowMatchEulerDiscreteScheduler or sched.config.get("stochastic_sampling", False):
        return None
    if state.latents.dtype != dtype:
        return None
    if sched.step_index is None:
        sched._init_step_index(state.timestep)  # as step() does on its first call
    dts = state.extras.get("euler_dt")
    if dts is None:  # every step's dt at once: elementwise the same fp32 subtraction, one kernel per request
        dts = state.extras["euler_dt"] = sched.sigmas[1:] - sched.sigmas[:-1]
    return EulerStep(cond, uncond, float(scale), dts[sched.step_index], tokens)


def commit_euler(state, latents: torch.Tensor, tokens: int | None = None) -> None:
    """Finish a fused step of ``state``: its next latents (the first ``tokens`` of each row where set:
    :attr:`EulerStep.tokens`), and the step counters that ``step()`` advances."""
    state.latents = latents if tokens is None else latents[:, :tokens]
    state.scheduler._step_index += 1
    state.step_index += 1


def fused_update(output: torch.Tensor, latents: torch.Tensor, meta: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """CFG combination and flow-match Euler update of every image of a bucket forward (captured in its graph).

    Args:
        output: (B, ...) the transformer's output, in the model dtype.
        latents: (B, ...) the forward's input latents (the bucket's static buffer), same shape and dtype.
        meta: (4, B) fp32: per output image ``j`` the row of its cond output, the row of its uncond output
            (its cond row without CFG), 1.0 when it runs CFG, and its scale ``s``; pad entries point at row 0.
        dt: (B,) fp32 per image ``j``: ``sigmas[i + 1] - sigmas[i]`` of its request (0 for pad entries).

    Returns:
        (B, ...) in the model dtype: image ``j``'s next latents at row ``j`` (rows past the images are
        padding), bitwise equal to the host path (module docstring).
    """
    shape = (-1,) + (1,) * (output.ndim - 1)
    c = output.index_select(0, meta[0].long())
    u = output.index_select(0, meta[1].long())
    guided = u + (meta[3].view(shape) * (c - u).float()).to(output.dtype)
    noise = torch.where(meta[2].view(shape) > 0, guided, c)
    x = latents.index_select(0, meta[0].long())
    step = dt.to(output.dtype).view(shape) * noise
    return (x.float() + step.float()).to(output.dtype)
