"""The generic text-to-image pipeline over family hooks: encode -> step-level denoising -> decode -> PNG.

Everything specific to a model family (text encoders, latent layout, schedule, CFG order, decode scaling)
lives in its module of :mod:`bcg_core.families`; this module only calls the hooks of
:class:`~bcg_core.families.Family` and never asks which family it runs.

The denoising loop is step-level (the only way it runs):

- :meth:`DiTPipeline.start` turns a planned request into a :class:`~bcg_core.families.RequestState`
  (encoded text, initial latents, its own scheduler with its timesteps, step index 0);
- :meth:`DiTPipeline.step` runs *one* transformer forward over the rows of several requests, each at its own
  step and timestep (every DiT of diffusers takes a per-row timestep), on the bucket of their total rows
  (or unpadded on a miss), then applies each request's own CFG combination and scheduler step;
- :meth:`DiTPipeline.finish` decodes a finished request to PNG files.

:meth:`DiTPipeline.generate_batch` (and :meth:`DiTPipeline.generate`, a batch of one) drives that loop for the
requests of one *batch group* (same bucket shape and token grid, :meth:`DiTPipeline.batch_group`): requests
with different step counts, guidance or seeds share forwards while they run; a request that finishes leaves
the batch, and a cancelled one leaves at the next step boundary.

Determinism: image ``i`` of a request starts from noise drawn on the CPU by a generator seeded ``seed + i``,
exactly as its family's diffusers pipeline draws it from that generator list; text, scheduler and decode are
deterministic; so the same request and seed give the same PNG bytes, equal to diffusers' own pipeline's
(``tests/test_family_*.py``), up to the float reduction order of batched kernels when rows share a forward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from .buckets import BucketKey, BucketLookup, ShapeQuery
from .config import ServeConfig
from .costs import Chunk, CostModel, ForwardPlan, measure_costs
from .errors import RequestCancelled, RequestError
from .families import Family, RequestState, concat_rows
from .images import encode_image
from .metrics import BucketMetrics, token_shares
from .models import load_model
from .padding import DenoiseInputs
from .planner import GenerationRequest, Plan, Planner
from .runner import BucketFault, BucketRunner, EagerBucketRunner

__all__ = ["DiTPipeline", "FusedStats", "GenerationResult", "build_runner", "fused_wanted", "runner_mode"]


@dataclass
class GenerationResult:
    """What one request produced.

    Attributes:
        images_png: ``n`` image files, PNG unless the request asked for another ``output_format``
            (:attr:`image_format`; the name is kept from when PNG was the only format).
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
    image_format: str = "png"

    def to_dict(self) -> dict:
        """A plain dict (PNG bytes kept as bytes)."""
        return asdict(self)


def timing_mark(device: torch.device) -> float | torch.cuda.Event:
    """A point in time of work on ``device``: on CUDA an event recorded on the current stream (the GPU's time
    when it gets there, read later without a host sync), elsewhere the host clock in seconds."""
    if torch.device(device).type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def elapsed_ms(a: float | torch.cuda.Event, b: float | torch.cuda.Event) -> float:
    """Milliseconds between two :func:`timing_mark` points (CUDA events: ``b`` must have completed)."""
    return float(a.elapsed_time(b)) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


class _StepTimer:
    """Milliseconds of each denoising step (the forward on its bucket, the guidance combinations and the
    scheduler updates). On a CUDA device, CUDA events on the current stream measure the GPU's time between a
    step's start and end and are read once after the loop (no host sync per step); elsewhere the host clock."""

    def __init__(self, device: torch.device):
        self._cuda = torch.device(device).type == "cuda"
        self._device = device
        self._spans: list[tuple] = []
        self._begin = None

    def start(self) -> None:
        """A step begins."""
        self._begin = timing_mark(self._device)

    def stop(self, key: BucketKey | None, states: Sequence[RequestState]) -> None:
        """The step that began last ends; it ran on bucket ``key`` (None: a miss) for ``states``."""
        if self._begin is not None:
            self._spans.append((self._begin, timing_mark(self._device), key, list(states)))
            self._begin = None

    def by_key(self) -> dict[BucketKey | None, list[float]]:
        """Milliseconds of every finished step per bucket, in order; each step's milliseconds are also
        appended to its states' ``step_ms`` (on CUDA this waits for the last step to finish)."""
        if not self._spans:
            return {}
        if self._cuda:
            self._spans[-1][1].synchronize()
        out: dict[BucketKey | None, list[float]] = {}
        for a, b, key, states in self._spans:
            ms = elapsed_ms(a, b)
            out.setdefault(key, []).append(ms)
            for state in states:
                state.step_ms.append(ms)
        self._spans.clear()
        return out


_META_CACHE = 256
"""Fused-step meta tensors a pipeline keeps (one per composition of a forward's images)."""


@dataclass
class FusedStats:
    """State and counters of the fused step (:mod:`bcg_core.fused`), shown in ``/v1/buckets`` as ``fused_step``.

    Attributes:
        wanted: the runner captures fused steps and the family has one (``runner.fused_step``).
        checked: :meth:`DiTPipeline.check_fused` has compared it with the host path.
        on: the check passed; steps may run fused.
        note: the check's outcome in words.
        steps: steps run fused.
        host_steps: steps that ran on the host while it was on, by reason: ``no_fused_graph`` (a miss, an
            unpadded eager chunk, a bucket without a fused graph), ``scheduler`` (a request whose scheduler or
            latents the fused update does not cover), ``cfg_pair_split`` (a split put an image's cond and uncond
            rows in different forwards), ``bucket_fault`` (a fused replay raised and its bucket now runs eager,
            :class:`~bcg_core.runner.BucketFault`).
    """

    wanted: bool = False
    checked: bool = False
    on: bool = False
    note: str = ""
    steps: int = 0
    host_steps: dict[str, int] | None = None

    def host(self, reason: str) -> None:
        """Count a step that runs on the host for ``reason``."""
        if self.host_steps is None:
            self.host_steps = {}
        self.host_steps[reason] = self.host_steps.get(reason, 0) + 1

    def describe(self) -> dict:
        """The JSON of ``/v1/buckets``' ``fused_step``."""
        note = self.note or ("off: runner.fused_step or the family has no fused step" if not self.wanted else "")
        return {"enabled": self.on, "note": note, "steps": self.steps, "host_steps": dict(self.host_steps or {})}


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


def build_runner(config: ServeConfig, model: Family, keys: list, metrics: BucketMetrics) -> BucketRunner:
    """The runner ``config.runner.mode`` asks for: CUDA graphs (``graph``, or ``auto`` on CUDA) or eager.

    Raises:
        ValueError: ``mode: graph`` on a model that is not on a CUDA device.
    """
    mode = runner_mode(config, model.device)
    fused = fused_wanted(config, model)
    if mode == "eager":
        return EagerBucketRunner(model.adapter, keys, metrics, model.device, model.dtype, fused=fused)
    from .graphs import CudaGraphRunner

    budget = config.runner.graph_memory_budget_mib
    return CudaGraphRunner(
        model.adapter, keys, metrics, model.device, model.dtype,
        budget_bytes=None if budget is None else int(budget * 2**20), lazy=config.runner.lazy_capture,
        warmup_iters=config.runner.warmup_iters, fused=fused,
    )


def fused_wanted(config: ServeConfig, model: Family) -> bool:
    """Whether ``config.runner.fused_step`` asks for the fused step on ``model`` (:mod:`bcg_core.fused`):
    never for a family without ``euler_step`` (multistep solvers, norm-rescaled CFG); ``auto`` where graphs
    are captured; ``always`` on the eager runner too."""
    how = config.runner.fused_step
    if how == "never" or not hasattr(model, "euler_step"):
        return False
    return how == "always" or runner_mode(config, model.device) == "graph"


class DiTPipeline:
    """A loaded model (its family) with its planner, bucket runner and per-bucket metrics.

    Args:
        config: the replica's config.
        model: the loaded family (see :func:`bcg_core.models.load_model`).
        runner: a bucket runner; by default the one ``config.runner`` asks for (:func:`build_runner`).
        prepare: prepare (allocate / capture) every bucket now.
    """

    def __init__(self, config: ServeConfig, model: Family, runner: BucketRunner | None = None,
                 prepare: bool = True):
        self.config = config
        self.model = model
        self.planner = Planner(config, model.spec, model.count_tokens)
        self.table = self.planner.table
        self.metrics = BucketMetrics(self.table.keys)
        self.runner: BucketRunner = runner or build_runner(config, model, self.table.keys, self.metrics)
        self.fused = FusedStats(wanted=bool(getattr(self.runner, "fused", False)) and hasattr(model, "euler_step"))
        self._meta_cache: dict[tuple, torch.Tensor] = {}
        self._meta_lock = threading.Lock()
        if prepare:
            self.prepare()

    def prepare(self, keys: Sequence[BucketKey] | None = None) -> None:
        """Prepare (capture on CUDA) ``keys`` (every bucket when None) through the runner; then, the first time
        a bucket with a fused step is ready, :meth:`check_fused`."""
        self.runner.prepare(keys)
        if self.fused.wanted and not self.fused.checked:
            self.check_fused()

    @classmethod
    def from_config(cls, config: ServeConfig | None = None) -> DiTPipeline:
        """Load the configured model (the tiny default when ``config.model.path`` is None) and prepare."""
        config = config or ServeConfig()
        return cls(config, load_model(config.model))

    # -- the step-level interface -------------------------------------------------------------------

    def start(self, plan: Plan, cancel: threading.Event | None = None) -> RequestState:
        """A planned request at step 0: encoded text, initial latents, its own scheduler (family hook)."""
        return self.model.start(plan, cancel)

    @torch.inference_mode()
    def step(self, states: Sequence[RequestState], plan: ForwardPlan | None = None,
             fused: bool | None = None) -> BucketLookup:
        """One denoising step of each of ``states`` in ONE transformer forward.

        The rows of every state (its cond rows and, with CFG, its uncond rows, at its own timestep) are
        concatenated request by request (:func:`~bcg_core.families.concat_rows`); the forward runs on the
        bucket of their total rows (:meth:`BucketTable.lookup`), or unpadded and eager on a miss; each state
        then gets its own slice of the output for its guidance and scheduler step. The step's milliseconds
        (forward, guidance, scheduler updates; on CUDA from events, read when the loop ends) are appended to
        each state's ``step_ms`` by :meth:`generate_batch`.

        With a ``plan`` (the step scheduler's, :meth:`bcg_core.costs.CostModel.plan`) the rows run as its
        chunks instead, in row order: each chunk on its bucket (padded) or unpadded and eager; every chunk
        finishes before any request advances, so an image's cond and uncond rows always share a step.

        The fused step (:mod:`bcg_core.fused`, checked at start by :meth:`check_fused`) runs the step as one
        replay per forward, guidance and scheduler update inside it, when every request's update is a plain
        flow-match Euler step, every forward is a bucket with a fused graph and every image's cond and uncond
        rows share a forward; otherwise the host path above (counted in :attr:`fused` by reason).

        Args:
            states: requests of one token grid, none finished.
            plan: the forwards to run the rows as; None: one forward on the bucket of all the rows.
            fused: None: the fused step where it is on and the step allows it; False: the host path; True: the
                fused step even before :meth:`check_fused` passed, uncounted (the check itself; raises
                ValueError where the step cannot run fused).

        Returns:
            The lookup of the forward's shape (``.key`` None on a miss).

        Raises:
            ValueError: a finished state, states of different grids, unmasked text of different lengths, or a
                plan whose rows are not the states' rows.
        """
        if any(s.done for s in states):
            raise ValueError("a finished request cannot take another step")
        parts = [self.model.model_rows(s) for s in states]
        inputs = concat_rows(parts)
        lookup = self.table.lookup(self._query(inputs, states))
        if plan is None and not lookup.hit:
            plan = self._split_plan(lookup)  # rows above the largest bucket, planned to be split: split them
            if plan is not None:  # counted as a hit of its first bucket
                lookup = BucketLookup(lookup.query, plan.chunks[0].key)
        if fused or (fused is None and self.fused.on):
            spans = [(lookup.key, inputs.rows)] if plan is None else [(c.key, c.rows) for c in plan.chunks]
            try:
                why = self._fused_step(states, parts, inputs, spans)
            except BucketFault:  # its bucket now runs eager (logged and counted); no request has advanced
                if fused:
                    raise
                why = "bucket_fault"
            if why is None:
                if not fused:
                    self.fused.steps += 1
                return lookup
            if fused:
                raise ValueError(f"this step cannot run fused: {why}")
            self.fused.host(why)
        if plan is None:
            out = self.runner.run(lookup.key, inputs)
        else:
            if plan.rows != inputs.rows:
                raise ValueError(f"the plan runs {plan.rows} rows, the step has {inputs.rows}")
            outs, a = [], 0
            for chunk in plan.chunks:
                rows = inputs.select(slice(a, a + chunk.rows)) if len(plan.chunks) > 1 else inputs
                outs.append(self.runner.run(chunk.key or chunk.home or plan.home, rows, eager=chunk.key is None))
                a += chunk.rows
            out = torch.cat(outs) if len(outs) > 1 else outs[0]
        offset = 0
        for state, part in zip(states, parts):
            self.model.advance(state, out[offset : offset + part.rows])
            offset += part.rows
        return lookup

    def _fused_step(self, states: Sequence[RequestState], parts: list[DenoiseInputs], inputs: DenoiseInputs,
                    spans: list[tuple[BucketKey | None, int]]) -> str | None:
        """Run the step fused when it can (see :meth:`step`): None when it ran, else why it cannot (a
        :attr:`FusedStats.host_steps` reason; nothing has run then)."""
        from .fused import commit_euler

        if any(key is None or not self.runner.fuses(key) for key, _ in spans):
            return "no_fused_graph"  # a miss, an eager chunk, or a bucket without a fused graph
        steps = [self.model.euler_step(s) for s in states]
        if any(e is None for e in steps):
            return "scheduler"
        cond, uncond, owner = [], [], []  # per image, in row order of its cond row
        offset = 0
        for i, (state, e, part) in enumerate(zip(states, steps, parts)):
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
        for state in states:
            commit_euler(state, nxt[k : k + state.n])
            k += state.n
        return None

    def _fused_meta(self, *rows: tuple) -> torch.Tensor:
        """The (4, m) meta tensor of a forward's images on the model's device (:func:`bcg_core.fused.fused_update`),
        remembered per composition: the same requests step together for many steps, so most steps reuse it
        (at most :data:`_META_CACHE` kept)."""
        from .fused import META_ROWS

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

    @torch.inference_mode()
    def check_fused(self) -> bool:
        """Prove the fused step bitwise equal to the host path on this device, before any request uses it.

        On the smallest prepared bucket with a fused graph, a request without CFG (and, where the family runs
        CFG, one with it) takes two steps fused and two on the host (transformer replay, then the family's
        :meth:`advance`: its CFG combination and ``scheduler.step``) from the same state; their latents must be
        bit for bit equal after each step. On any difference the fused step is turned off for this pipeline
        (:attr:`fused`, ``note`` says why; logged). Without a prepared bucket that fuses nothing is checked and
        the fused step stays off until the next :meth:`prepare`.

        Returns:
            True when the fused step is on.
        """
        import copy
        import dataclasses
        import logging

        log = logging.getLogger(__name__)
        keys = sorted((k for k in self.runner.prepared() if self.runner.fuses(k)), key=lambda k: (k.tokens, k.batch))
        cases = []
        for cfg in (False, True):
            for key in keys:
                try:
                    plan = self.planner.plan(self._check_request(key, cfg))
                except RequestError:
                    continue
                if self.model.spec.uses_cfg(plan.request) != cfg:
                    break  # this family never runs that way
                if plan.lookup.hit and self.runner.fuses(plan.lookup.key):
                    cases.append(plan)
                    break
        if not cases:
            self.fused.note = "not checked yet: no prepared bucket with a fused graph"
            return False
        for plan in cases:
            host = self.start(plan)
            mine = dataclasses.replace(host, latents=host.latents.clone(), scheduler=copy.deepcopy(host.scheduler),
                                       step_ms=[])
            for _ in range(min(2, len(host.timesteps))):
                self.step([host], fused=False)
                try:
                    self.step([mine], fused=True)  # not counted; serving steps stay on the host until it passes
                except ValueError as e:
                    self.fused.checked = True
                    self.fused.note = f"off: {e}"
                    log.warning("fused step %s", self.fused.note)
                    return False
                if not torch.equal(host.latents, mine.latents):
                    diff = (host.latents.float() - mine.latents.float()).abs()
                    self.fused.checked = True
                    self.fused.note = (f"off: the fused step differs from the host step on {plan.lookup.key} "
                                       f"(cfg {host.cfg}): {int((diff > 0).sum())} of {diff.numel()} latent "
                                       f"values, max |d| {float(diff.max()):.3g}")
                    log.warning("fused step %s", self.fused.note)
                    return False
        self.fused.checked = self.fused.on = True
        self.fused.note = (f"on: bitwise equal to the host step on {', '.join(str(p.lookup.key) for p in cases)} "
                           f"(cfg {', '.join(str(self.model.spec.uses_cfg(p.request)) for p in cases)})")
        log.info("fused step %s", self.fused.note)
        return True

    def _check_request(self, key: BucketKey, cfg: bool) -> GenerationRequest:
        """A request of one image whose shape is bucket ``key``'s tier, asking for CFG when ``cfg``."""
        spec = self.model.spec
        gh, gw = self._example_grid(key)
        ppt = self.table.rules.pixels_per_token
        fields = dict(prompt="a lighthouse on a cliff at dusk", n=1, width=gw * ppt, height=gh * ppt,
                      num_inference_steps=2, seed=0)
        if cfg:
            fields["negative_prompt"] = "blurry"
            if spec.cfg_rule == "true_cfg":
                fields["true_cfg_scale"] = 4.0
            else:
                fields["guidance_scale"] = 4.5
        elif spec.cfg_rule != "true_cfg":
            fields["guidance_scale"] = 1.0
        return GenerationRequest(**fields)

    def _split_plan(self, lookup: BucketLookup) -> ForwardPlan | None:
        """Without a cost model (``step`` called with no plan): rows that miss only in the batch dimension, for a
        planner that splits them (``runner.scheduler: step``), as full forwards of the shape's largest bucket and
        the rest in the smallest bucket that holds it. None otherwise (the forward runs as a miss)."""
        if not self.planner.splits_batches:
            return None
        home = self.table.split_home(lookup)
        if home is None:
            return None
        keys = {k.batch: k for k in self.table.keys if k.shape == home.shape}
        rows, chunks = lookup.query.batch, []
        while rows > 0:
            take = min(rows, home.batch)
            b = min(x for x in keys if x >= take)
            chunks.append(Chunk(keys[b], take, 0.0))
            rows -= take
        return ForwardPlan(tuple(chunks), home)

    def _query(self, inputs: DenoiseInputs, states: Sequence[RequestState]) -> ShapeQuery:
        """The exact shape of a forward: its rows, the grid's tokens, and the text length its plans keyed on."""
        text = max(s.plan.lookup.query.text_tokens for s in states)
        hw = inputs.grid if self.table.rules.grid_keyed else None
        return ShapeQuery(inputs.rows, inputs.grid[0] * inputs.grid[1], text, hw)

    def finish(self, state: RequestState) -> list[bytes]:
        """Image files of a finished request's ``n`` images (family decode, then Pillow's encoder for the
        request's ``output_format``, :func:`~bcg_core.images.encode_image`)."""
        r = state.request
        return [encode_image(image, r.output_format, r.output_compression) for image in self.model.decode(state)]

    # -- the request path ---------------------------------------------------------------------------

    def generate(self, request: Plan | GenerationRequest,
                 cancel: threading.Event | None = None) -> GenerationResult:
        """Denoise and decode one request (a batch of one: :meth:`generate_batch`).

        Args:
            request: a :class:`~bcg_core.planner.Plan` (trusted as planned: the ingress plans each request
                once), or a raw :class:`GenerationRequest`, which is validated and planned here.
            cancel: set by the caller to stop the request early; checked before every denoising step and
                before the decode, so a request whose client went away frees the replica within one step.

        Raises:
            RequestError: bad input, or a miss under the reject policy (a raw request only).
            RequestCancelled: ``cancel`` was set.
        """
        (result,) = self.generate_batch([request], [cancel])
        if isinstance(result, BaseException):
            raise result
        return result

    def split_home(self, plan: Plan) -> BucketKey | None:
        """The bucket a request that misses only in the batch dimension (more rows than the largest batch
        bucket) can be split across: the largest bucket of its shape. None for a hit or any other miss.

        The step scheduler serves such a request in its shape's bucket forwards (its rows split, e.g. 22 rows
        as 20 + 2), where request-level batching runs it alone, unpadded and eager."""
        return plan.home if plan.home is not None else self.table.split_home(plan.lookup)

    def batch_group(self, plan: Plan, split: bool = False) -> tuple | None:
        """The micro-batching key of a planned request: requests may share forwards only if keys are equal.

        Returns:
            None on a bucket miss (a miss always runs alone), else ``(shape, grid)``: ``shape`` is the bucket
            key without its batch dimension (e.g. ``"i1024_m_t256"``, :attr:`BucketKey.shape`), so the image
            and text buckets of every request are the same; ``grid`` is the token grid (positions, latent
            layout). Step counts, guidance, CFG, seeds and (for masked families) real text lengths may differ.
            With ``split`` (the step scheduler), a request that misses only in the batch dimension gets the
            group of its shape (:meth:`split_home`).
        """
        lookup = plan.lookup
        key = lookup.key if lookup.hit else (self.split_home(plan) if split else None)
        if key is None:
            return None
        r = plan.request
        return (key.shape, self.table.rules.grid(*self.model.spec.generation_size(r.width, r.height)))

    def generate_batch(
        self, requests: Sequence[Plan | GenerationRequest], cancels: Sequence[threading.Event | None] | None = None,
    ) -> list[GenerationResult | BaseException]:
        """Serve requests of one batch group with the step-level loop: one transformer forward per step.

        A :class:`~bcg_core.planner.Plan` is trusted as it is (validated, defaults and seed filled in, bucket
        looked up: the ingress or the micro-batcher planned it), so a planned request is never planned again.
        A raw :class:`GenerationRequest` is planned here, once; one that fails planning gets its
        :class:`RequestError` as its result and takes no part. The others must share one :meth:`batch_group`,
        and their rows must fit the largest batch bucket. They start together; each step runs the rows of
        every request still running (each at its own step) in one forward (:meth:`step`); a request leaves
        when its last step is done, or, when its cancel event is set, at the next step boundary (its result is
        then :class:`RequestCancelled`).

        Metrics: each completed request is recorded with the bucket of its first forward, its own real tokens
        and its share by rows of that forward's padded tokens (:func:`~bcg_core.metrics.token_shares`); step
        milliseconds are recorded per bucket; a loop shared by 2+ requests is counted under ``batches``.

        Returns:
            One :class:`GenerationResult` or exception per request, in order.

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
            if isinstance(request, Plan):
                plans.append((i, request))
                continue
            try:
                plans.append((i, self.planner.plan(request)))
            except RequestError as e:
                results[i] = e
        if plans:
            self._check_batch([p for _, p in plans])
            try:
                done = self._run_batch([p for _, p in plans], [cancels[i] for i, _ in plans], t0)
            except Exception as e:  # noqa: BLE001 - an error of the shared forward is every request's error
                done = [e] * len(plans)
            for (i, _), r in zip(plans, done):
                results[i] = r
        return results  # type: ignore[return-value]

    def _check_batch(self, plans: list[Plan]) -> None:
        """Raise ValueError unless the plans may share forwards (see :meth:`generate_batch`)."""
        if len(plans) == 1:
            return
        groups = {self.batch_group(p) for p in plans}
        if None in groups:
            raise ValueError("a bucket miss runs alone: it cannot share a forward with other requests")
        if len(groups) > 1:
            raise ValueError(f"requests of different batch groups cannot share a forward: {sorted(groups)}")
        rows = sum(p.lookup.query.batch for p in plans)
        largest = self.table.batch_sizes[-1]
        if rows > largest:
            raise ValueError(f"{len(plans)} requests need {rows} transformer rows, above the largest batch "
                             f"bucket {largest}")

    def _run_batch(self, plans: list[Plan], cancels: list[threading.Event | None],
                   t0: float) -> list[GenerationResult | BaseException]:
        """Start, step until every request finished or left, decode; one result per plan."""
        states = [self.start(p, c) for p, c in zip(plans, cancels)]
        t1 = time.perf_counter()
        first: dict[int, BucketLookup] = {}  # request -> the forward it first took part in
        timer = _StepTimer(self.model.device)
        try:
            running = list(range(len(states)))
            while running := [i for i in running if not states[i].cancelled]:
                timer.start()
                lookup = self.step([states[i] for i in running])
                timer.stop(lookup.key, [states[i] for i in running])
                for i in running:
                    first.setdefault(i, lookup)
                running = [i for i in running if not states[i].done]
        finally:
            for key, ms in timer.by_key().items():
                self.metrics.record_steps(key, ms)
        t2 = time.perf_counter()
        results: list[GenerationResult | BaseException] = []
        # every request that was not cancelled before it took the first step took it together: its forward's
        # padded tokens are shared among them by rows
        joined = sorted(first)
        shares = dict(zip(joined, token_shares(first[joined[0]].padded_tokens, [states[i].rows for i in joined]))) \
            if joined else {}
        for i, (plan, state) in enumerate(zip(plans, states)):
            if state.cancelled:  # left at a step boundary, or cancelled before its decode
                results.append(RequestCancelled("the request was cancelled by its caller"))
                continue
            t_dec = time.perf_counter()
            images = self.finish(state)
            t3 = time.perf_counter()
            total_ms = (t3 - t0) * 1e3
            lookup = first[i]
            share = shares[i]
            missed = () if lookup.hit else plan.lookup.missed  # rows split across buckets: a hit
            mine = BucketLookup(plan.lookup.query, lookup.key, missed)
            self.metrics.record_request(mine, total_ms, padded_tokens=share, batch_size=len(plans))
            results.append(GenerationResult(
                images_png=images, seed=plan.request.seed, bucket=str(lookup.key) if lookup.hit else None,
                hit=lookup.hit, missed=[d.value for d in missed], real_tokens=plan.lookup.query.tokens,
                padded_tokens=share, steps=plan.request.num_inference_steps,
                timings_ms={"encode": round((t1 - t0) * 1e3, 2), "denoise": round((t2 - t1) * 1e3, 2),
                            "decode": round((t3 - t_dec) * 1e3, 2), "total": round(total_ms, 2)},
                batch_size=len(plans), image_format=plan.request.output_format,
            ))
        if any(isinstance(r, GenerationResult) for r in results):
            self.metrics.record_batch(first[joined[0]].key, len(plans))
        return results

    # -- the cost model's measurements ---------------------------------------------------------------

    def example_inputs(self, key: BucketKey, rows: int, seed: int = 0) -> DenoiseInputs:
        """Seeded random real inputs of ``rows`` rows that fill ``key``'s tier: its latent grid for
        grid-keyed families, else the most square grid of exactly ``key.image_tokens`` tokens among the sizes
        the limits allow (the largest grid below it when none is exact); ``key.text_tokens`` real text tokens.
        """
        from .verify import BoundaryCase, random_inputs

        case = BoundaryCase(key, rows, self._example_grid(key), key.text_tokens)
        return random_inputs(self.model.adapter, case, self.model.device, self.model.dtype, seed)

    def _example_grid(self, key: BucketKey) -> tuple[int, int]:
        """The token grid that fills ``key``'s tier (see :meth:`example_inputs`)."""
        if key.latent_hw is not None:
            return tuple(key.latent_hw)
        step = self.table.rules.pixels_per_token
        lim = self.config.limits
        sides = range(-(-lim.min_side_px // step), lim.max_side_px // step + 1)
        grids = [(h, w) for h in sides for w in sides if h * w <= key.image_tokens]
        best = max(h * w for h, w in grids)
        return min((g for g in grids if g[0] * g[1] == best), key=lambda g: abs(g[0] - g[1]))

    def measure_costs(self, keys: Sequence[BucketKey], iters: int = 2) -> CostModel:
        """Time each of ``keys`` (prepared) and each of their shapes' unpadded eager forwards against row
        count (:func:`bcg_core.costs.measure_costs`), for the step scheduler's cost model."""
        return measure_costs(self.runner, self.model.adapter, keys, self.example_inputs, self.model.device, iters)

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
        snap["model"] = {"name": m.model_name, "family": m.name, "pipeline_class": m.spec.pipeline_class,
                         "device": str(m.device), "dtype": str(m.dtype).removeprefix("torch."),
                         "native_text_tokens": m.rules.native_text_tokens}
        snap["table"] = self.table.describe_limits()
        snap["fused_step"] = self.fused.describe()
        return snap
