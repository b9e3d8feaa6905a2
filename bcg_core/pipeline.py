"""The text-to-image pipeline: text encode -> denoising loop over the bucket runner -> VAE decode -> PNG.

The denoising loop is FLUX's (diffusers ``FluxPipeline``): packed 2x2 latents, a flow-matching Euler
scheduler with resolution-dependent shift (``calculate_shift``), and the transformer forward done by the
bucket runner on the request's bucket. With ``guidance_scale > 1`` (and a model without distilled
guidance) classifier-free guidance puts cond and uncond rows into the same forward:
``noise = uncond + g * (cond - uncond)``.

Determinism: image ``i`` of a request starts from noise drawn on the CPU by a generator seeded with
``seed + i``; text, scheduler and decode are deterministic; so the same request and seed give the same
PNG bytes, and an image does not depend on how many other images share its forward (up to the float
reduction order of the batched kernels: ~1e-6 relative in fp32).
"""

from __future__ import annotations

import io
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .config import ServeConfig
from .errors import RequestCancelled
from .metrics import BucketMetrics
from .models import LoadedModel, load_model
from .padding import DenoiseInputs
from .planner import GenerationRequest, Planner
from .runner import BucketRunner, EagerBucketRunner

__all__ = ["DiTPipeline", "GenerationResult", "build_runner", "runner_mode"]


@dataclass
class GenerationResult:
    """What one request produced.

    Attributes:
        images_png: ``n`` PNG files.
        seed: the seed used (image ``i`` used ``seed + i``).
        bucket: ``str(BucketKey)`` that served the request, None on a miss.
        hit: True when a bucket served the request.
        missed: the key dimensions that missed (empty on a hit).
        real_tokens, padded_tokens: tokens per forward, unpadded and as computed.
        steps: denoising steps run.
        timings_ms: ``encode``, ``denoise``, ``decode`` and ``total`` milliseconds.
    """

    images_png: list[bytes]
    seed: int
    bucket: str | None
    hit: bool
    missed: list[str]
    real_tokens: int
    padded_tokens: int
    steps: int
    timings_ms: dict[str, float]

    def to_dict(self) -> dict:
        """A plain dict (PNG bytes kept as bytes)."""
        return asdict(self)


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise RequestCancelled("the request was cancelled by its caller")


def runner_mode(config: ServeConfig, device: torch.device | None = None) -> str:
    """``"graph"`` or ``"eager"``: what ``config.runner.mode`` means on ``device`` (the configured one if None).

    Raises:
        ValueError: ``runner.mode: graph`` without CUDA, or ``model.device: cuda`` where none is visible.
    """
    from .models import resolve_device

    device = device or resolve_device(config.model.device)
    mode = config.runner.mode
    if mode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if mode == "graph" and device.type != "cuda":
        raise ValueError(f"runner.mode is 'graph' but the model runs on {device.type}: CUDA graphs need a CUDA "
                         f"device; use runner.mode 'auto' or 'eager'")
    return mode


def build_runner(config: ServeConfig, model: LoadedModel, keys: list, metrics: BucketMetrics) -> BucketRunner:
    """The runner ``config.runner.mode`` asks for: CUDA graphs (``graph``, or ``auto`` on CUDA) or eager.

    Raises:
        ValueError: ``mode: graph`` on a model that is not on a CUDA device.
    """
    mode = runner_mode(config, model.device)
    if mode == "eager":
        return EagerBucketRunner(model.adapter, keys, metrics, model.device, model.dtype)
    from .graphs import CudaGraphRunner

    budget = config.runner.graph_memory_budget_mib
    return CudaGraphRunner(
        model.adapter, keys, metrics, model.device, model.dtype,
        budget_bytes=None if budget is None else int(budget * 2**20), lazy=config.runner.lazy_capture,
        warmup_iters=config.runner.warmup_iters,
    )


class DiTPipeline:
    """A loaded model with its planner, bucket runner and per-bucket metrics.

    Args:
        config: the replica's config.
        model: the loaded model (see :func:`bcg_core.models.load_model`).
        runner: a bucket runner; by default the one ``config.runner`` asks for (:func:`build_runner`).
        prepare: prepare (allocate / capture) every bucket now.
    """

    def __init__(self, config: ServeConfig, model: LoadedModel, runner: BucketRunner | None = None,
                 prepare: bool = True):
        self.config = config
        self.model = model
        count = model.text_encoder.count_tokens
        self.planner = Planner(config, model.adapter.rules, count, cfg_rows=not model.adapter.guidance_embeds)
        self.table = self.planner.table
        self.metrics = BucketMetrics(self.table.keys)
        self.runner: BucketRunner = runner or build_runner(config, model, self.table.keys, self.metrics)
        if prepare:
            self.runner.prepare()

    @classmethod
    def from_config(cls, config: ServeConfig | None = None) -> "DiTPipeline":
        """Load the configured model (the tiny default when ``config.model.path`` is None) and prepare."""
        config = config or ServeConfig()
        return cls(config, load_model(config.model))

    # -- the request path -------------------------------------------------------------------------

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> GenerationResult:
        """Validate, plan, denoise and decode one request.

        Args:
            request: the request.
            cancel: set by the caller to stop the request early; checked before every denoising step and
                before the decode, so a request whose client went away frees the replica within one step.

        Raises:
            RequestError: bad input, or a miss under the reject policy.
            RequestCancelled: ``cancel`` was set.
        """
        t0 = time.perf_counter()
        plan = self.planner.plan(request)
        req, lookup = plan.request, plan.lookup
        cfg = req.cfg and not self.model.adapter.guidance_embeds
        text, pooled = self.encode(req, cfg, lookup.query.text_tokens)
        t1 = time.perf_counter()
        latents = self.denoise(req, cfg, text, pooled, lookup.key, cancel)
        t2 = time.perf_counter()
        _check(cancel)
        images = [self.decode(latents[i : i + 1], req.width, req.height) for i in range(req.n)]
        t3 = time.perf_counter()
        total_ms = (t3 - t0) * 1e3
        self.metrics.record_request(lookup, total_ms)
        return GenerationResult(
            images_png=images, seed=req.seed, bucket=str(lookup.key) if lookup.hit else None, hit=lookup.hit,
            missed=[d.value for d in lookup.missed], real_tokens=lookup.query.tokens,
            padded_tokens=lookup.padded_tokens, steps=req.num_inference_steps,
            timings_ms={"encode": round((t1 - t0) * 1e3, 2), "denoise": round((t2 - t1) * 1e3, 2),
                        "decode": round((t3 - t2) * 1e3, 2), "total": round(total_ms, 2)},
        )

    @torch.inference_mode()
    def encode(self, req: GenerationRequest, cfg: bool, text_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Text embeddings of the forward's rows: cond rows then (with CFG) uncond rows.

        Returns:
            ``(text, pooled)``: (rows, text_tokens, seq_dim) and (rows, pooled_dim), fp32.
        """
        prompts = [req.prompt] + ([req.negative_prompt or ""] if cfg else [])
        seq, pooled = self.model.text_encoder.encode(prompts, text_tokens)
        index = torch.tensor([0] * req.n + ([1] * req.n if cfg else []), device=seq.device)
        return seq.index_select(0, index), pooled.index_select(0, index)

    def initial_latents(self, req: GenerationRequest) -> torch.Tensor:
        """Packed starting noise: (n, image_tokens, 64), image ``i`` from a CPU generator seeded ``seed + i``."""
        from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

        channels = self.model.adapter.in_channels // 4
        h, w = self.model.adapter.rules.grid(req.width, req.height)
        noise = [
            torch.randn(1, channels, 2 * h, 2 * w, generator=torch.Generator("cpu").manual_seed(req.seed + i))
            for i in range(req.n)
        ]
        packed = FluxPipeline._pack_latents(torch.cat(noise), req.n, channels, 2 * h, 2 * w)
        return packed.to(self.model.device)

    @torch.inference_mode()
    def denoise(self, req: GenerationRequest, cfg: bool, text: torch.Tensor, pooled: torch.Tensor,
                key, cancel: threading.Event | None = None) -> torch.Tensor:
        """The denoising loop. Returns packed latents (n, image_tokens, 64), fp32.

        Raises:
            RequestCancelled: ``cancel`` was set before a step.
        """
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        adapter, dtype = self.model.adapter, self.model.dtype
        latents = self.initial_latents(req)
        grid = adapter.rules.grid(req.width, req.height)
        sched = FlowMatchEulerDiscreteScheduler.from_config(self.model.scheduler_config)
        c = sched.config
        steps = req.num_inference_steps
        # As FluxPipeline.__call__: sigmas 1 -> 1/steps, shifted by mu from the image sequence length.
        mu = calculate_shift(latents.shape[1], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps), mu=mu, device=latents.device)
        rows = text.shape[0]
        text, pooled = text.to(dtype), pooled.to(dtype)
        guidance = None
        if adapter.guidance_embeds:
            guidance = torch.full((rows,), req.guidance_scale, device=latents.device, dtype=dtype)
        for t in sched.timesteps:
            _check(cancel)
            x = torch.cat([latents, latents]) if cfg else latents
            ts = (t / 1000.0).expand(rows).to(dtype)
            out = self.runner.run(key, DenoiseInputs(x.to(dtype), text, pooled, ts, grid, guidance)).float()
            if cfg:
                cond, uncond = out.chunk(2)
                out = uncond + req.guidance_scale * (cond - uncond)
            latents = sched.step(out, t, latents, return_dict=False)[0]
        return latents

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, width: int, height: int) -> bytes:
        """One image: packed latents (1, image_tokens, 64) -> PNG bytes of ``width`` x ``height``."""
        from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

        vae = self.model.vae
        z = FluxPipeline._unpack_latents(latents, height, width, self.model.vae_scale_factor)
        z = z / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = vae.decode(z.to(self.model.dtype), return_dict=False)[0]
        array = ((image[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(array).save(buf, format="PNG")
        return buf.getvalue()

    # -- introspection ------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Model, table, per-bucket counters and runner state, for ``GET /v1/buckets``."""
        snap = self.metrics.snapshot()
        state = {d["key"]: d for d in self.runner.describe()}
        for b in snap["buckets"]:
            s = state.get(b["key"], {})
            b.update({"mode": s.get("mode"), "pool_bytes": s.get("pool_bytes", 0),
                      "capture_s": s.get("capture_s", 0.0), "note": s.get("note", "")})
        m = self.model
        snap["model"] = {"name": m.name, "family": m.adapter.family, "device": str(m.device),
                         "dtype": str(m.dtype).removeprefix("torch."), "native_text_tokens": m.native_text_tokens}
        snap["table"] = self.table.describe_limits()
        return snap
