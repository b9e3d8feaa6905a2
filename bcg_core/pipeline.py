"""The text-to-image pipeline: text encode -> denoising loop over the bucket runner -> VAE decode -> PNG.

The denoising loop is FLUX's (diffusers ``FluxPipeline``): packed 2x2 latents, a flow-matching Euler
scheduler with resolution-dependent shift (``calculate_shift``), and the transformer forward done by the
bucket runner on the request's bucket. With ``guidance_scale > 1`` (and a model without distilled
guidance) classifier-free guidance puts cond and uncond rows into the same forward:
``noise = uncond + g * (cond - uncond)``.

Micro-batching (:meth:`DiTPipeline.generate_batch`): requests of one *batch group* (same bucket shape,
size, step count and guidance mode, :meth:`DiTPipeline.batch_group`) run one denoising loop together, one
transformer forward per step on the bucket of their total rows. Rows are laid out as in a single request:
the cond rows of every request (request by request, image by image), then, with CFG, their uncond rows in
the same order; guidance is applied per row with each request's own ``guidance_scale``. A batch of one is
exactly the single-request path (:meth:`DiTPipeline.generate` is a batch of one).

Determinism: image ``i`` of a request starts from noise drawn on the CPU by a generator seeded with
``seed + i``; text, scheduler and decode are deterministic; so the same request and seed give the same
PNG bytes, and an image does not depend on how many other images (of its own or of other requests) share
its forward (up to the float reduction order of the batched kernels: ~1e-6 relative in fp32).
"""

from __future__ import annotations

import copy
import io
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .buckets import BucketKey, BucketLookup, ShapeQuery
from .config import ServeConfig
from .errors import RequestCancelled, RequestError
from .metrics import BucketMetrics, token_shares
from .models import LoadedModel, load_model
from .padding import DenoiseInputs
from .planner import GenerationRequest, Plan, Planner
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
        real_tokens, padded_tokens: tokens per forward, unpadded and as computed; for a request that shared
            its forward, its own real tokens and its share (by rows) of the forward's padded tokens.
        steps: denoising steps run.
        timings_ms: ``encode``, ``denoise``, ``decode`` and ``total`` milliseconds (encode and denoise are
            the whole batch's when the forward was shared); a micro-batcher adds ``queue``.
        batch_size: requests that shared the forward (1 when the request ran alone).
        replica, owner, retries: filled in by the Ray Serve layer (``deployments/``): the DiT replica that
            served the request, whether it owns the request's bucket shape (None for a miss), and how many
            times the request was resent; the pipeline leaves them at None, None and 0.
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
    batch_size: int = 1
    replica: str | None = None
    owner: bool | None = None
    retries: int = 0

    def to_dict(self) -> dict:
        """A plain dict (PNG bytes kept as bytes)."""
        return asdict(self)


class _StepTimer:
    """Milliseconds of each denoising step (the transformer forward on the bucket, the guidance combination and the
    scheduler update). On a CUDA device, CUDA events on the current stream measure the GPU's time between a step's
    start and end and are read once after the loop (no host sync per step); elsewhere the host clock."""

    def __init__(self, device: torch.device):
        self._cuda = torch.device(device).type == "cuda"
        self._device = device
        self._spans: list[tuple] = []
        self._begin = None

    def _now(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def start(self) -> None:
        """A step begins."""
        self._begin = self._now()

    def stop(self) -> None:
        """The step that began last ends."""
        if self._begin is not None:
            self._spans.append((self._begin, self._now()))
            self._begin = None

    def step_ms(self) -> list[float]:
        """Milliseconds of every finished step, in order (on CUDA this waits for the last step to finish)."""
        if not self._spans:
            return []
        if self._cuda:
            self._spans[-1][1].synchronize()
            return [float(a.elapsed_time(b)) for a, b in self._spans]
        return [(b - a) * 1e3 for a, b in self._spans]


def _cancelled(cancel: threading.Event | None) -> bool:
    return cancel is not None and cancel.is_set()


def _check_all(cancels: Sequence[threading.Event | None]) -> None:
    """Raise :class:`RequestCancelled` when every request of a batch was cancelled."""
    if cancels and all(_cancelled(c) for c in cancels):
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


_TOKENIZER_ATTRS = ("tokenizer", "t5_tokenizer", "clip_tokenizer")
"""Tokenizer attributes of the text encoders in :mod:`bcg_core.text`."""


def _counting_encoder(text_encoder):
    """A shallow copy of ``text_encoder`` with deep copies of its tokenizers, for ``count_tokens``.

    A ``transformers`` fast tokenizer keeps padding and truncation as mutable state of its backend, set by
    each call: counting (no padding, no truncation) in one thread while another thread encodes (padding to
    ``max_length``) makes either call fail ("Unable to create tensor ..."). Planning runs on the replica's
    event loop while batches encode in worker threads, so counting gets tokenizers of its own.

    Returns:
        ``(counter, separate)``: ``separate`` is False when no tokenizer was found to copy (``counter`` is
        then ``text_encoder`` itself).
    """
    counter = copy.copy(text_encoder)
    separate = False
    for name in _TOKENIZER_ATTRS:
        tok = getattr(text_encoder, name, None)
        if tok is not None:
            setattr(counter, name, copy.deepcopy(tok))
            separate = True
    return (counter, True) if separate else (text_encoder, False)


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
        # Text encoding runs in worker threads (one per running batch) and token counting on the caller's
        # thread: encodes are serialised, and counting uses tokenizers of its own (see _counting_encoder).
        self._encode_lock = threading.Lock()
        counter, separate = _counting_encoder(model.text_encoder)
        count_lock = threading.Lock() if separate else self._encode_lock

        def count(prompt: str) -> int:
            with count_lock:
                return counter.count_tokens(prompt)

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
        """Validate, plan, denoise and decode one request (a batch of one: :meth:`generate_batch`).

        Args:
            request: the request.
            cancel: set by the caller to stop the request early; checked before every denoising step and
                before the decode, so a request whose client went away frees the replica within one step.

        Raises:
            RequestError: bad input, or a miss under the reject policy.
            RequestCancelled: ``cancel`` was set.
        """
        (result,) = self.generate_batch([request], [cancel])
        if isinstance(result, BaseException):
            raise result
        return result

    def batch_group(self, plan: Plan) -> tuple | None:
        """The micro-batching key of a planned request: requests may share a forward only if keys are equal.

        Returns:
            None on a bucket miss (a miss always runs alone), else the hashable tuple
            ``(shape, width, height, num_inference_steps, cfg, text_tokens)``: ``shape`` is the bucket key
            without its batch dimension (e.g. ``"i1024_m_t256"``, see :attr:`BucketKey.shape`), so the image and text
            padding of every request is the same; width and height fix the token grid (positions, VAE decode
            size) and the scheduler's shift; ``cfg`` is True when uncond rows are added; ``text_tokens`` is the
            exact text length encoded (the model's native length for FLUX).
        """
        lookup = plan.lookup
        if not lookup.hit:
            return None
        r = plan.request
        return (lookup.key.shape, r.width, r.height, r.num_inference_steps, self._cfg(r),
                lookup.query.text_tokens)

    def _cfg(self, request: GenerationRequest) -> bool:
        """True when ``request`` runs classifier-free guidance with uncond rows (not a guidance-embedding model)."""
        return request.cfg and not self.model.adapter.guidance_embeds

    def generate_batch(
        self, requests: Sequence[GenerationRequest], cancels: Sequence[threading.Event | None] | None = None,
    ) -> list[GenerationResult | BaseException]:
        """Serve requests of one batch group with one denoising loop: one transformer forward per step.

        Every request is planned; a request that fails planning gets its :class:`RequestError` as its
        result and takes no part. The others must share one :meth:`batch_group` and their transformer rows
        (``sum(n_i)``, doubled with CFG) must fit the largest batch bucket; they then run on the bucket of
        their total rows (a single request that misses runs alone, unpadded). Layout of the forward's
        ``R = sum(rows_i)`` rows (``N = sum(n_i)`` images; ``S`` image tokens, ``T`` text tokens):

        - latents (N, S, 64): each request's initial noise (image ``i`` seeded ``seed + i``), concatenated
          in request order; the forward's input is latents, then (CFG) the same latents again: (R, S, 64);
        - text (R, T, D_text) and pooled (R, D_pooled): the cond rows of every request, then (CFG) the
          uncond rows of every request, each request's text encoded on its own exactly as a lone request;
        - CFG: ``noise = uncond + g * (cond - uncond)`` with ``g`` (N, 1, 1) the image's own request's
          ``guidance_scale``; guidance-embedding models get a (R,) guidance tensor per row instead.

        Cancellation: a request whose event is set gets :class:`RequestCancelled` as its result, is not
        decoded and is not counted; the loop stops early only when every request is cancelled.

        Metrics: each completed request is recorded with the batch's bucket, its own real tokens and its
        share by rows of the forward's padded tokens (:func:`~bcg_core.metrics.token_shares`; the shares of
        a batch sum to the bucket's tokens); a loop shared by 2+ requests is counted under ``batches``.

        Args:
            requests: the requests, in the order of the results.
            cancels: one event (or None) per request; None: no cancellation.

        Returns:
            One :class:`GenerationResult` (``batch_size`` = requests that shared the forward) or exception
            (:class:`RequestError`, :class:`RequestCancelled`, or the error that broke the batch) per request.

        Raises:
            ValueError: the requests that planned do not share one batch group (a miss in a batch of more than
                one, or different keys), or their rows exceed the largest batch bucket; or ``cancels`` does not
                match ``requests`` in length.
        """
        t0 = time.perf_counter()
        cancels = list(cancels) if cancels is not None else [None] * len(requests)
        if len(cancels) != len(requests):
            raise ValueError(f"{len(cancels)} cancel events for {len(requests)} requests")
        results: list[GenerationResult | BaseException | None] = [None] * len(requests)
        plans: list[tuple[int, Plan]] = []
        for i, request in enumerate(requests):
            try:
                plans.append((i, self.planner.plan(request)))
            except RequestError as e:
                results[i] = e
        if plans:
            lookup = self._batch_lookup([p for _, p in plans])
            try:
                done = self._run_batch([p for _, p in plans], lookup, [cancels[i] for i, _ in plans], t0)
            except Exception as e:  # noqa: BLE001 - an error of the shared forward is every request's error
                done = [e] * len(plans)
            for (i, _), r in zip(plans, done):
                results[i] = r
        return results  # type: ignore[return-value]

    def _batch_lookup(self, plans: list[Plan]) -> BucketLookup:
        """The bucket of the batch's total rows (the plan's own lookup for a batch of one).

        Raises:
            ValueError: mixed batch groups, a miss in a batch of several, or too many rows.
        """
        if len(plans) == 1:
            return plans[0].lookup
        groups = {self.batch_group(p) for p in plans}
        if None in groups:
            raise ValueError("a bucket miss runs alone: it cannot share a forward with other requests")
        if len(groups) > 1:
            raise ValueError(f"requests of different batch groups cannot share a forward: {sorted(groups)}")
        q = plans[0].lookup.query
        rows = sum(p.lookup.query.batch for p in plans)
        largest = self.table.batch_sizes[-1]
        if rows > largest:
            raise ValueError(f"{len(plans)} requests need {rows} transformer rows, above the largest batch "
                             f"bucket {largest}")
        lookup = self.table.lookup(ShapeQuery(rows, q.image_tokens, q.text_tokens, q.latent_hw))
        assert lookup.hit and lookup.key.shape == plans[0].lookup.key.shape, lookup
        return lookup

    def _run_batch(self, plans: list[Plan], lookup: BucketLookup, cancels: list[threading.Event | None],
                   t0: float) -> list[GenerationResult | BaseException]:
        """Encode, denoise and decode planned requests of one group on ``lookup``'s bucket (None: a miss)."""
        reqs = [p.request for p in plans]
        cfg = self._cfg(reqs[0])
        text, pooled = self.encode_batch(reqs, cfg, lookup.query.text_tokens)
        t1 = time.perf_counter()
        try:
            latents = self.denoise_batch(reqs, cfg, text, pooled, lookup.key, cancels)
        except RequestCancelled as e:
            return [e] * len(plans)
        t2 = time.perf_counter()
        shares = token_shares(lookup.padded_tokens, [p.lookup.query.batch for p in plans])
        results: list[GenerationResult | BaseException] = []
        offset, served = 0, 0
        for plan, cancel, share in zip(plans, cancels, shares):
            req = plan.request
            start, offset = offset, offset + req.n
            if _cancelled(cancel):
                results.append(RequestCancelled("the request was cancelled by its caller"))
                continue
            t_dec = time.perf_counter()
            images = [self.decode(latents[i : i + 1], req.width, req.height) for i in range(start, start + req.n)]
            t3 = time.perf_counter()
            total_ms = (t3 - t0) * 1e3
            mine = BucketLookup(plan.lookup.query, lookup.key, plan.lookup.missed)
            self.metrics.record_request(mine, total_ms, padded_tokens=share, batch_size=len(plans))
            served += 1
            results.append(GenerationResult(
                images_png=images, seed=req.seed, bucket=str(lookup.key) if lookup.hit else None, hit=lookup.hit,
                missed=[d.value for d in plan.lookup.missed], real_tokens=plan.lookup.query.tokens,
                padded_tokens=share, steps=req.num_inference_steps,
                timings_ms={"encode": round((t1 - t0) * 1e3, 2), "denoise": round((t2 - t1) * 1e3, 2),
                            "decode": round((t3 - t_dec) * 1e3, 2), "total": round(total_ms, 2)},
                batch_size=len(plans),
            ))
        if served:
            self.metrics.record_batch(lookup.key, len(plans))
        return results

    @torch.inference_mode()
    def encode(self, req: GenerationRequest, cfg: bool, text_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Text embeddings of the forward's rows: cond rows then (with CFG) uncond rows.

        Returns:
            ``(text, pooled)``: (rows, text_tokens, seq_dim) and (rows, pooled_dim), fp32.
        """
        prompts = [req.prompt] + ([req.negative_prompt or ""] if cfg else [])
        with self._encode_lock:
            seq, pooled = self.model.text_encoder.encode(prompts, text_tokens)
        index = torch.tensor([0] * req.n + ([1] * req.n if cfg else []), device=seq.device)
        return seq.index_select(0, index), pooled.index_select(0, index)

    def encode_batch(self, reqs: Sequence[GenerationRequest], cfg: bool,
                     text_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Text embeddings of a batch's rows: every request's cond rows, then (CFG) every request's uncond rows.

        Each request is encoded on its own by :meth:`encode` (so a batch of one is exactly :meth:`encode`).

        Returns:
            ``(text, pooled)``: (R, text_tokens, seq_dim) and (R, pooled_dim), fp32, ``R = sum(n_i)`` (x 2
            with CFG).
        """
        parts = [self.encode(r, cfg, text_tokens) for r in reqs]
        if len(parts) == 1:
            return parts[0]
        halves = range(2 if cfg else 1)  # each request's rows: n cond rows, then (CFG) n uncond rows
        text = torch.cat([t[h * r.n : (h + 1) * r.n] for h in halves for (t, _), r in zip(parts, reqs)])
        pooled = torch.cat([p[h * r.n : (h + 1) * r.n] for h in halves for (_, p), r in zip(parts, reqs)])
        return text, pooled

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
        """The denoising loop of one request. Returns packed latents (n, image_tokens, 64), fp32.

        Raises:
            RequestCancelled: ``cancel`` was set before a step.
        """
        return self.denoise_batch([req], cfg, text, pooled, key, [cancel])

    @torch.inference_mode()
    def denoise_batch(self, reqs: Sequence[GenerationRequest], cfg: bool, text: torch.Tensor, pooled: torch.Tensor,
                      key: BucketKey | None, cancels: Sequence[threading.Event | None] | None = None) -> torch.Tensor:
        """One denoising loop for requests of one batch group: one forward per step on bucket ``key``.

        Args:
            reqs: planned requests of one group (same size and steps; ``N = sum(n_i)`` images).
            cfg: True when uncond rows follow the cond rows (all requests alike).
            text, pooled: (R, text_tokens, seq_dim) and (R, pooled_dim) from :meth:`encode_batch`, ``R = N``
                (``2N`` with CFG).
            key: the bucket of ``R`` rows, or None for an unpadded eager forward (a miss).
            cancels: one event (or None) per request; the loop stops before a step only when all are set.

        Metrics: the milliseconds of every finished step (forward, guidance and scheduler update, as the caller
        sees them: waiting for the runner lock while another batch's forward runs is included) are recorded on
        ``key`` (:meth:`~bcg_core.metrics.BucketMetrics.record_steps`), also for a loop that is cancelled.

        Returns:
            Packed latents (N, image_tokens, 64), fp32, images in request order.

        Raises:
            RequestCancelled: every request was cancelled before a step.
        """
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        adapter, dtype = self.model.adapter, self.model.dtype
        cancels = list(cancels) if cancels is not None else []
        req = reqs[0]
        latents = torch.cat([self.initial_latents(r) for r in reqs]) if len(reqs) > 1 else self.initial_latents(req)
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
        scales = [r.guidance_scale for r in reqs for _ in range(r.n)]  # per image, (N,)
        guidance = None
        if adapter.guidance_embeds:  # per row: cond rows, then (CFG) uncond rows
            per_row = scales * (rows // len(scales))
            guidance = torch.tensor(per_row, device=latents.device, dtype=dtype)
        # One guidance scale for all: the Python float, exactly as a lone request; else (N, 1, 1) per image.
        g = scales[0] if len(set(scales)) == 1 else torch.tensor(scales, device=latents.device).view(-1, 1, 1)
        timer = _StepTimer(latents.device)
        try:
            for t in sched.timesteps:
                _check_all(cancels)
                timer.start()
                x = torch.cat([latents, latents]) if cfg else latents
                ts = (t / 1000.0).expand(rows).to(dtype)
                out = self.runner.run(key, DenoiseInputs(x.to(dtype), text, pooled, ts, grid, guidance)).float()
                if cfg:
                    cond, uncond = out.chunk(2)
                    out = uncond + g * (cond - uncond)
                latents = sched.step(out, t, latents, return_dict=False)[0]
                timer.stop()
        except RequestCancelled:
            self.metrics.record_steps(key, timer.step_ms())  # the steps that ran before the cancel
            raise
        self.metrics.record_steps(key, timer.step_ms())
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
