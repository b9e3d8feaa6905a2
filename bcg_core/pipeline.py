"""The generic text-to-image pipeline over family hooks: start -> step -> finish.

Everything specific to a model family (text encoders, latent layout, schedule, CFG order, decode scaling) lives in
its module of :mod:`bcg_core.families`; this module only calls the hooks of :class:`~bcg_core.families.Family`.

- :meth:`DiTPipeline.start` turns a validated request into a :class:`~bcg_core.families.RequestState` (encoded
  text, initial latents, its own scheduler, step index 0);
- :meth:`DiTPipeline.step` runs one denoising step of several requests, each at its own step, in the forwards it is
  given, which the cost model decided (:class:`~bcg_core.costs.StepDecider`, :attr:`DiTPipeline.decider`); it trusts
  them and decides nothing;
- :meth:`DiTPipeline.finish` decodes a finished request to image files (never NaN or inf latents).

Every request enters validated (:class:`~bcg_core.request.ValidatedRequest`, from :attr:`DiTPipeline.validator`: the one
validation path). The step scheduler (:mod:`bcg_core.scheduler`, above this module) drives these in a replica;
:meth:`DiTPipeline.generate` runs one validated request alone, for tests and scripts. The cost model and decider sit
below both (:mod:`bcg_core.costs`); what a family or runner can do beyond its contract is answered once, here, where
the pipeline is built (:mod:`bcg_core.capabilities`).

Determinism: image ``i`` of a request starts from noise drawn on the CPU by a generator seeded ``seed + i``, as its
family's diffusers pipeline draws it; so the same request and seed give the same image as diffusers' own pipeline
(``tests/families/``), up to the float reduction order of batched kernels when rows share a forward.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

import torch

from bcg_core.capabilities import FamilyCapabilities, RunnerCapabilities
from bcg_core.config import EngineConfig
from bcg_core.costs import CostModel, StepDecider, StepForwards, measure_costs
from bcg_core.devices import elapsed_ms, timing_mark
from bcg_core.errors import RequestCancelled, require_finite
from bcg_core.experts import describe_experts, expert_runners, prepared_by_all, step_expert
from bcg_core.families import Family, RequestState, concat_rows
from bcg_core.images import encode_image
from bcg_core.keys import BucketKey
from bcg_core.lora.slots import install as install_lora, lease_for
from bcg_core.metrics import BucketMetrics
from bcg_core.models import load_model, load_seconds
from bcg_core.padding import DenoiseInputs
from bcg_core.request import GenerationResult, ValidatedRequest
from bcg_core.results import build_result
from bcg_core.runners.base import BucketFault, BucketRunner
from bcg_core.runners.build import (  # re-exported: the runner config.runner asks for
    InstalledKernels,
    build_runner,
    compiled_kernels,
    fused_wanted,
    installed_kernels,
    kernel_tier,
    runner_mode,
)
from bcg_core.runners.decode import install as install_decode
from bcg_core.runners.kernels import CompiledKernels, KernelTier, kernel_stats
from bcg_core.step_cache.spec import FirstBlockCache, parse_cache
from bcg_core.step_cache.split import installed_split
from bcg_core.step_cache.state import ContextCache, RequestCache, reserve_bytes
from bcg_core.step_cache.step import CACHE_EXTRA, cached_forward, request_cache
from bcg_core.validation import RequestValidator
from bcg_core.verify_fused import FusedStats

log = logging.getLogger(__name__)

__all__ = ["DiTPipeline", "GenerationResult", "InstalledKernels", "build_runner", "compiled_kernels", "fused_wanted",
           "installed_kernels", "kernel_tier", "runner_mode"]


_META_CACHE = 256
"""Fused-step meta tensors a pipeline keeps (one per composition of a forward's images)."""


class DiTPipeline:
    """A loaded model (its family) with its validator, bucket runner and per-bucket metrics.

    Args:
        config: the replica's config.
        model: the loaded family (see :func:`bcg_core.models.load_model`).
        runner: a bucket runner; by default the one ``config.runner`` asks for (:func:`build_runner`).
        prepare: prepare (allocate / capture) every bucket now.
    """

    def __init__(self, config: EngineConfig, model: Family, runner: BucketRunner | None = None,
                 prepare: bool = True):
        from bcg_core.families.defaults import family_buckets

        config = family_buckets(config, model.spec)  # a video family's own table where the config sets none
        self.config = config
        self.model = model
        self.lora = install_lora(config, model)
        """The replica's LoRA slots (:class:`~bcg_core.lora.slots.AdapterSlots`), None without ``lora.dir``."""
        self.capabilities = FamilyCapabilities.of(model)
        """What the family and its adapter (LoRA installed) can do beyond their contracts, answered once here."""
        self.decoder, self.decode_note = None, ""
        """The compiled VAE decode (:class:`~bcg_core.runners.decode.CompiledDecode`) with ``runner.compile_decode``
        and a compiled tier, else None (``decode_note`` says why where it was asked for)."""
        if config.runner.compile_decode and kernel_tier(config, model.device) is not KernelTier.EAGER:
            installed = install_decode(model)
            self.decoder, self.decode_note = (None, installed) if isinstance(installed, str) else (installed, "")
        self.validator = RequestValidator(config, model.spec, model.count_tokens)
        self.table = self.validator.table
        self.metrics = BucketMetrics(self.table.keys)
        self.runner: BucketRunner = runner or build_runner(config, model, self.table.keys, self.metrics)
        self.runner_capabilities = RunnerCapabilities.of(self.runner)
        """What the runner can do beyond its contract, answered once here."""
        self.runners = expert_runners(config, model, self.table.keys, self.metrics, self.runner)
        """One runner per expert (:mod:`bcg_core.experts`; ``runner`` first): ``(runner,)`` for one transformer."""
        self.decider = StepDecider(self.table.keys, lambda: prepared_by_all(self.runners),
                                   graphs=self.runner_capabilities.graphs)
        """Decides each step's forwards (the cost model): :meth:`generate`, the step scheduler and a caller of
        :meth:`step` ask it (:meth:`~bcg_core.costs.StepDecider.for_states`)."""
        self.fused = FusedStats(wanted=self.runner.fused and self.capabilities.fused_step and len(self.runners) == 1)
        self._meta_cache: dict[tuple, torch.Tensor] = {}
        self._meta_lock = threading.Lock()
        self.prepare_s = 0.0
        """Seconds :meth:`prepare` took (compiles, checks and captures), summed over calls."""
        if prepare:
            self.prepare()

    def prepare(self, keys: Sequence[BucketKey] | None = None, defer_compiles: bool = False) -> None:
        """Prepare ``keys`` (every bucket when None) through the runner (``defer_compiles``: :mod:`~bcg_core.runners.
        background`; another expert's runner compiles now, :mod:`bcg_core.experts`); the first time a fused bucket is
        ready, :meth:`check_fused`. Adds to :attr:`prepare_s`."""
        t0 = time.perf_counter()
        for expert, runner in enumerate(self.runners):
            runner.prepare(keys, defer_compiles and expert == 0)
        self.prepare_s += time.perf_counter() - t0
        if self.fused.wanted and not self.fused.checked:
            self.check_fused()

    @classmethod
    def from_config(cls, config: EngineConfig | None = None) -> DiTPipeline:
        """Load the configured model (the tiny default when ``config.model.path`` is None) and prepare."""
        config = config or EngineConfig()
        return cls(config, load_model(config.model))

    # -- the step-level interface -------------------------------------------------------------------

    def start(self, validated: ValidatedRequest, cancel: threading.Event | None = None, lease=None) -> RequestState:
        """A validated request at step 0: encoded text, initial latents, its own scheduler (family hook); with
        ``lease`` (its adapters' :class:`~bcg_core.lora.slots.Lease`), its rows carry those slots."""
        state = self.model.start(validated, cancel)
        if lease is not None:
            state.extras["lora"] = lease
        spec = parse_cache(validated.request.cache)
        if spec is not None and self.capabilities.step_cache:
            query = validated.lookup.query
            state.extras[CACHE_EXTRA] = RequestCache(
                spec, [ContextCache(name, rows) for name, rows in self.model.cache_contexts(state)],
                reserve_bytes(self.model.adapter.model, spec, state.rows, query.image_tokens, query.text_tokens))
        return state

    def _rows(self, state: RequestState) -> DenoiseInputs:
        """The state's transformer rows (family hook), with its LoRA entries when this pipeline serves adapters."""
        part = self.model.model_rows(state)
        return part if self.lora is None else self.lora.attach(part, state.extras.get("lora"))

    def expert_of(self, state: RequestState) -> int:
        """The expert whose transformer runs ``state``'s next step (:mod:`bcg_core.experts`); 0 for one transformer."""
        return self.model.expert(state) if len(self.runners) > 1 else 0

    @torch.inference_mode()
    def step(self, states: Sequence[RequestState], forwards: StepForwards, fused: bool | None = None) -> StepForwards:
        """One denoising step of each of ``states``, in the forwards it is given (``forwards``, decided by
        :attr:`decider`: ``pipe.step(states, pipe.decider.for_states(states))`` where nothing else decides).

        The rows of every state (its cond rows and, with CFG, its uncond rows, at its own timestep) are concatenated
        request by request (:func:`~bcg_core.families.concat_rows`) and run as ``forwards.chunks``, in row order:
        each chunk on its bucket (padded) or unpadded and eager (``key`` None). Every chunk finishes before any
        request advances, so an image's cond and uncond rows always share a step; each state then gets its own
        slice of the output for its guidance and scheduler step. The forwards are trusted: nothing is looked up.
        A model of several experts (:mod:`bcg_core.experts`) runs them on the runner of the expert the states are at.

        The fused step (:mod:`bcg_core.runners.fused`, checked at start by :meth:`check_fused`) runs the step as one
        replay per forward, guidance and scheduler update inside it, when every request's update is a plain
        flow-match Euler step, every forward is a bucket with a fused graph and every image's cond and uncond rows
        share a forward; otherwise the host path above (counted in :attr:`fused` by reason).

        Args:
            states: requests of one token grid, none finished.
            forwards: the step's forwards, whose rows are the states' rows (:meth:`~bcg_core.costs.StepDecider.decide`
                for their shape, or :meth:`~bcg_core.costs.StepDecider.for_states`).
            fused: None: the fused step where it is on and the step allows it; False: the host path; True: the
                fused step even before :meth:`check_fused` passed, uncounted (the check itself; raises ValueError
                where the step cannot run fused).

        Returns:
            The forwards the step ran as.

        Raises:
            ValueError: a finished state, states of different grids or experts, unmasked text of different lengths,
                or forwards whose rows are not the states' rows.
        """
        if any(s.done for s in states):
            raise ValueError("a finished request cannot take another step")
        expert = step_expert([self.expert_of(s) for s in states])
        parts = [self._rows(s) for s in states]
        inputs = concat_rows(parts)
        if forwards.rows != inputs.rows:
            raise ValueError(f"the forwards run {forwards.rows} rows, the step has {inputs.rows}")
        caches = [c for c in map(request_cache, states) if c is not None]
        if caches:
            if expert:
                raise ValueError("the step cache runs on one transformer: a request on another expert takes none")
            if fused:
                raise ValueError("this step cannot run fused: step_cache")
            if fused is None and self.fused.on:
                self.fused.host("step_cache")
            # the block split only where a First Block Cache runs its halves (TaylorSeer runs whole forwards)
            split = (installed_split(self.model.adapter.model)
                     if any(isinstance(c.spec, FirstBlockCache) for c in caches) else None)
            out = cached_forward(self, split, states, parts, inputs, forwards)
            self._advance(states, parts, out)
            return forwards
        if fused or (fused is None and self.fused.on):
            spans = [(c.key, c.rows) for c in forwards.chunks]
            try:
                why = self._fused_step(states, parts, inputs, spans)
            except BucketFault:  # its bucket now runs eager (logged and counted); no request has advanced
                if fused:
                    raise
                why = "bucket_fault"
            if why is None:
                if not fused:
                    self.fused.steps += 1
                return forwards
            if fused:
                raise ValueError(f"this step cannot run fused: {why}")
            self.fused.host(why)
        self._advance(states, parts, self.run_forwards(inputs, forwards, expert))
        return forwards

    def run_forwards(self, inputs: DenoiseInputs, forwards: StepForwards, expert: int = 0) -> torch.Tensor:
        """``inputs``' rows through ``forwards``' chunks in row order: each chunk on its bucket (padded; its whole
        forward) or unpadded and eager (``key`` None), on expert ``expert``'s runner.

        Returns:
            (inputs.rows, inputs.image_tokens, out_channels), a new tensor."""
        outs, a, runner = [], 0, self.runners[expert]
        for chunk in forwards.chunks:
            rows = inputs.select(slice(a, a + chunk.rows)) if len(forwards.chunks) > 1 else inputs
            outs.append(runner.run(chunk.key or chunk.home or forwards.home, rows, eager=chunk.key is None))
            a += chunk.rows
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _advance(self, states: Sequence[RequestState], parts: list[DenoiseInputs], out: torch.Tensor) -> None:
        """Each state's guidance and scheduler step (family hook) on its slice of the step's output ``out``."""
        offset = 0
        for state, part in zip(states, parts, strict=True):
            self.model.advance(state, out[offset : offset + part.rows])
            offset += part.rows

    def _fused_step(self, states: Sequence[RequestState], parts: list[DenoiseInputs], inputs: DenoiseInputs,
                    spans: list[tuple[BucketKey | None, int]]) -> str | None:
        """Run the step fused when it can (see :meth:`step`): None when it ran, else why it cannot (a
        :attr:`FusedStats.host_steps` reason; nothing has run then)."""
        from bcg_core.runners.fused import commit_euler

        if any(key is None or not self.runner.fuses(key) for key, _ in spans):
            return "no_fused_graph"  # a miss, an eager chunk, or a bucket without a fused graph
        steps = [self.model.euler_step(s) for s in states]
        if any(e is None for e in steps):
            return "scheduler"
        cond, uncond, owner = [], [], []  # per image, in row order of its cond row
        offset = 0
        for i, (state, e, part) in enumerate(zip(states, steps, parts, strict=True)):
            for j in range(state.n):
                c = offset + e.cond + j
                cond.append(c)
                uncond.append(offset + e.uncond + j if e.uncond is not None else c)
                owner.append(i)
            offset += part.rows
        work, lo, a = [], 0, 0
        for key, rows in spans:
            b = a + rows
            hi = lo
            while hi < len(cond) and cond[hi] < b:
                hi += 1
            if any(not a <= uncond[k] < b for k in range(lo, hi)):
                return "cfg_pair_split"
            work.append((key, a, b, lo, hi, self._fused_meta(
                tuple(cond[k] - a for k in range(lo, hi)), tuple(uncond[k] - a for k in range(lo, hi)),
                tuple(float(steps[owner[k]].uncond is not None) for k in range(lo, hi)),
                tuple(steps[owner[k]].scale for k in range(lo, hi)))))
            lo, a = hi, b
        dt = torch.stack([steps[owner[k]].dt for k in range(len(cond))]).to(self.model.device)
        outs = []
        for key, a, b, lo, hi, meta in work:
            rows = inputs if len(work) == 1 else inputs.select(slice(a, b))
            outs.append(self.runner.run_fused(key, rows, meta, dt[lo:hi]))
        nxt = torch.cat(outs) if len(outs) > 1 else outs[0]
        k = 0
        for state, e in zip(states, steps, strict=True):
            commit_euler(state, nxt[k : k + state.n], e.tokens)
            k += state.n
        return None

    def _fused_meta(self, *rows: tuple) -> torch.Tensor:
        """The (4, m) meta tensor of a forward's images on the model's device
        (:func:`bcg_core.runners.fused.fused_update`), remembered per composition: the same requests step together for
        many steps, so most steps reuse it (at most :data:`_META_CACHE` kept)."""
        from bcg_core.runners.fused import META_ROWS

        with self._meta_lock:  # the denoising thread and a prepare thread's check_fused
            cache = self._meta_cache
            meta = cache.get(rows)
            if meta is None:
                host = torch.tensor(rows, dtype=torch.float32)
                assert host.shape[0] == META_ROWS
                if self.model.device.type == "cuda":  # pinned: copied to the device without a host sync
                    host = host.pin_memory()
                meta = cache[rows] = host.to(self.model.device, non_blocking=True)
                if len(cache) > _META_CACHE:
                    cache.pop(next(iter(cache)))
            return meta

    def check_fused(self) -> bool:
        """Prove the fused step bitwise equal to the host step on this device before any request uses it
        (:func:`bcg_core.verify_fused.check_fused`); returns True when it is on."""
        from bcg_core.verify_fused import check_fused

        return check_fused(self)

    def finish(self, state: RequestState) -> list[bytes]:
        """Image files of a finished request's ``n`` images (family decode, then Pillow's encoder for its
        ``output_format``, :func:`~bcg_core.images.encode_image`); ``NonFiniteOutput`` for NaN or inf latents.

        Raises:
            TypeError: a video model (its requests finish with :meth:`finish_videos`).
        """
        if self.model.spec.video:
            raise TypeError(f"{self.model.spec.pipeline_class} generates videos: finish its requests with "
                            f"finish_videos")
        images, r = self.model.decode(require_finite(state)), state.request
        return [encode_image(image, r.output_format, r.output_compression) for image in images]

    def finish_videos(self, state: RequestState) -> list:
        """A video model's finished request as its ``n`` videos, each a (num_frames, height, width, 3) uint8 numpy
        array (the family's decode); ``NonFiniteOutput`` for NaN or inf latents.

        Raises:
            TypeError: an image model (its requests finish with :meth:`finish`).
        """
        if not self.model.spec.video:
            raise TypeError(f"{self.model.spec.pipeline_class} generates images: finish its requests with finish")
        return self.model.decode(require_finite(state))

    # -- one request, synchronously ------------------------------------------------------------------

    def generate(self, validated: ValidatedRequest, cancel: threading.Event | None = None) -> GenerationResult:
        """Denoise and decode one validated request on this thread, alone: start, one :meth:`step` per denoising
        step in the forwards :attr:`decider` decides (as the step scheduler runs a request that has its shape to
        itself), finish. A video model's result carries its videos (:attr:`GenerationResult.videos`: one
        (num_frames, height, width, 3) uint8 array per video) and no image files. For tests and scripts; a replica
        serves through :class:`~bcg_core.scheduler.StepScheduler`.
        The host does not wait for the device between steps (each step's time is two CUDA events, read once the
        loop has ended), so a launch-bound step's host work overlaps the step before it, as in the step scheduler.

        A :class:`~bcg_core.request.GenerationRequest` is validated first, by :attr:`validator` (the one validation
        path, as the ingress validates what it serves): ``pipe.generate(pipe.validator.validate(request))``.

        Args:
            validated: the validated request (trusted as it is).
            cancel: set by the caller to stop early; checked before every step and before the decode.

        Raises:
            TypeError: ``validated`` is not a :class:`~bcg_core.request.ValidatedRequest` (validate a request first).
            RequestCancelled: ``cancel`` was set.
            ServiceUnavailable: its adapters did not load within ``lora.load_timeout_s``.
            NonFiniteOutput: its denoised latents hold NaN or inf (:func:`~bcg_core.errors.require_finite`).
        """
        if not isinstance(validated, ValidatedRequest):
            raise TypeError(f"generate takes a ValidatedRequest, got {type(validated).__name__}: validate it first "
                            f"with pipe.validator.validate(request), the one validation path")
        lease = self.lease(validated)
        try:
            return self._generate(validated, cancel, lease)
        finally:
            if lease is not None:
                lease.release()

    def lease(self, validated: ValidatedRequest):
        """The slots of ``validated``'s adapters, waiting here for their load (:func:`~bcg_core.lora.slots.lease_for`);
        None for a request without adapters."""
        return lease_for(self.lora, validated.request.lora)

    def _generate(self, validated: ValidatedRequest, cancel: threading.Event | None, lease) -> GenerationResult:
        t0 = time.perf_counter()
        state = self.start(validated, cancel, lease)
        if state.latents.is_cuda:  # its encodes' kernels end here, not inside the first step's time
            torch.cuda.synchronize(state.latents.device)
        t1 = time.perf_counter()
        key, share = None, 0
        marks = []  # per step (its bucket, begin, end): read after the loop, so no step waits for the device
        while not state.done and not state.cancelled:
            forwards = self.decider.decide(validated.shape, state.rows, validated.lookup.query.tokens_per_row)
            begin = timing_mark(self.model.device)
            self.step([state], forwards)
            marks.append((forwards.counted_key, begin, timing_mark(self.model.device)))
            if state.step_index == 1:
                key = forwards.counted_key or validated.key
                share = forwards.computed_tokens(validated.lookup.query.tokens // max(1, validated.rows))
        if marks and isinstance(marks[-1][2], torch.cuda.Event):
            marks[-1][2].synchronize()
        for counted, begin, end in marks:
            state.step_ms.append(elapsed_ms(begin, end))
            self.metrics.record_steps(counted, state.step_ms[-1:])
        if state.cancelled:
            raise RequestCancelled("the request was cancelled by its caller")
        t2 = time.perf_counter()
        images = self.model.decode(require_finite(state))
        t3 = time.perf_counter()
        r = state.request
        video = self.model.spec.video  # a video's frames are the result as they are (encoding them is the caller's)
        files = [] if video else [encode_image(image, r.output_format, r.output_compression) for image in images]
        t4 = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1e3, 2)  # noqa: E731
        return build_result(validated, files, key, share, 1, self.metrics, {
            "encode": ms(t0, t1), "denoise": ms(t1, t2), "decode": ms(t2, t3), "image_encode": ms(t3, t4),
            "total": ms(t0, t4)}, state=state, videos=images if video else None)

    # -- the cost model's measurements ---------------------------------------------------------------

    def example_inputs(self, key: BucketKey, rows: int, seed: int = 0) -> DenoiseInputs:
        """Seeded random real inputs of ``rows`` rows that fill ``key``'s tier: its latent grid for
        grid-keyed families, else the most square grid of exactly ``key.image_tokens`` tokens among the sizes
        the limits allow (the largest grid below it when none is exact); ``key.text_tokens`` real text tokens.
        """
        from bcg_core.verify_inputs import BoundaryCase, random_inputs

        case = BoundaryCase(key, rows, self._example_grid(key), key.text_tokens)
        return random_inputs(self.model.adapter, case, self.model.device, self.model.dtype, seed)

    def _example_grid(self, key: BucketKey) -> tuple[int, ...]:
        """The token grid that fills ``key``'s tier (see :meth:`example_inputs`; ``(frames, h, w)`` for a video)."""
        if key.grid is not None:
            return tuple(key.grid)
        step = self.table.rules.pixels_per_token
        lim = self.config.limits
        sides = range(-(-lim.min_side_px // step), lim.max_side_px // step + 1)
        grids = [(h, w) for h in sides for w in sides if h * w <= key.image_tokens]
        best = max(h * w for h, w in grids)
        return min((g for g in grids if g[0] * g[1] == best), key=lambda g: abs(g[0] - g[1]))

    def measure_costs(self, keys: Sequence[BucketKey], iters: int = 2) -> CostModel:
        """Time each of ``keys`` (prepared) and each of their shapes' unpadded eager forwards against row
        count (:func:`bcg_core.costs.measure_costs`; with LoRA adapters each bucket's LoRA graph too), for the step
        scheduler's cost model."""
        adapter = self.model.adapter
        slot_zero = adapter.on_slot_zero if self.capabilities.plain_forward else None
        return measure_costs(self.runner, adapter, keys, self.example_inputs, self.model.device, iters, slot_zero)

    # -- introspection ------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Model, table, per-bucket counters and runner state (``capture``: the runner's
        :class:`~bcg_core.runners.base.CaptureStats`; ``experts``: the other experts' runners,
        :func:`~bcg_core.experts.describe_experts`), for ``GET /v1/buckets``."""
        snap = self.metrics.snapshot()
        state = {d["key"]: d for d in self.runner.describe()}
        for b in snap["buckets"]:
            s = state.get(b["key"], {})
            b.update({"mode": s.get("mode"), "kernels": s.get("kernels"), "pool_bytes": s.get("pool_bytes", 0),
                      "capture_s": s.get("capture_s", 0.0), "compile_rel_err": s.get("compile_rel_err"),
                      "attention": s.get("attention"), "pending": s.get("pending", False),
                      "step_cache_graphs": s.get("step_cache_graphs", False), "note": s.get("note", "")})
        m = self.model
        snap["model"] = {"name": m.model_name, "family": m.name, "pipeline_class": m.spec.pipeline_class,
                         "device": str(m.device), "dtype": str(m.dtype).removeprefix("torch."),
                         "native_text_tokens": m.rules.native_text_tokens,
                         "load_s": None if (load_s := load_seconds(m)) is None else round(load_s, 3)}
        snap["table"] = self.table.describe_limits()
        snap["fused_step"] = self.fused.describe()
        snap["kernels"] = self._kernel_stats(self.runner.kernels, state)
        snap["lora"] = None if self.lora is None else self.lora.describe()
        snap["capture"] = dataclasses.asdict(self.runner.stats)
        snap["experts"] = describe_experts(self.runners)
        return snap

    def _kernel_stats(self, kernels: CompiledKernels | None, state: dict[str, dict]) -> dict:
        """``/v1/buckets``' ``kernels``: the tier and :func:`~bcg_core.runners.kernels.kernel_stats` (tolerance,
        compile time, failures, the caches, ``start``); ``decode``, the compiled VAE decode per latent shape
        (:meth:`~bcg_core.runners.decode.CompiledDecode.describe`); ``prepare_s`` is the seconds from the first
        bucket's preparation to the last one's (compiles, checks and captures)."""
        return {"tier": kernel_tier(self.config, self.model.device).value, "configured": self.config.runner.kernels,
                **kernel_stats(kernels, state),
                "fp8_layers": installed_kernels(self.model.adapter.model).fp8_layers,
                "decode": self.decoder.describe() if self.decoder else {"enabled": False, "note": self.decode_note},
                "prepare_s": round(self.prepare_s, 3)}
