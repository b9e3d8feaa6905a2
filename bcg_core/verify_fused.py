"""The fused step's start-up check: :func:`check_fused` proves the fused step (:mod:`bcg_core.runners.fused`)
bitwise equal to the host step on this device before any request uses it (docs/DESIGN.md section 11, "The fused
step"); :class:`FusedStats` holds its outcome and counters, shown in ``/v1/buckets`` as ``fused_step``.

:meth:`bcg_core.pipeline.DiTPipeline.check_fused` runs the check the first time a bucket with a fused graph is
prepared; it logs to ``bcg_core.verify``'s logger, as it did beside the other correctness gates.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass

import torch

from bcg_core.errors import RequestError
from bcg_core.keys import BucketKey
from bcg_core.request import GenerationRequest
from bcg_core.step_cache.spec import NoCache

__all__ = ["FusedStats", "check_fused"]


class _SlotZero:
    """A stand-in lease of one adapter entry on slot 0 at scale 0: the rows of a check request carry LoRA entries,
    so a LoRA deployment's graph for adapter rows is the one checked (:func:`check_fused`)."""

    slots, scales = (0,), (0.0,)

    def release(self) -> None:
        """Nothing is pinned."""


@dataclass
class FusedStats:
    """State and counters of the fused step (:mod:`bcg_core.runners.fused`), shown in ``/v1/buckets`` as ``fused_step``.

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
            :class:`~bcg_core.runners.base.BucketFault`).
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


@torch.inference_mode()
def check_fused(pipe) -> bool:
    """Prove the fused step of ``pipe`` (a :class:`~bcg_core.pipeline.DiTPipeline`) bitwise equal to the host
    step on this device, before any request uses it.

    On the smallest prepared bucket with a fused graph, a request without CFG (and, where the family runs
    CFG, one with it) takes two steps fused and two on the host (transformer replay, then the family's
    :meth:`advance`: its CFG combination and ``scheduler.step``) from the same state; their latents must be
    bit for bit equal after each step. On any difference the fused step is turned off for this pipeline
    (:attr:`fused`, ``note`` says why; logged). Without a prepared bucket that fuses nothing is checked and
    the fused step stays off until the next :meth:`prepare`.

    Returns:
        True when the fused step is on.
    """
    log = logging.getLogger("bcg_core.verify")  # the gates' logger: its lines read as they did
    keys = sorted((k for k in pipe.runner.prepared() if pipe.runner.fuses(k)), key=lambda k: (k.tokens, k.batch))
    cases = []
    for cfg in (False, True):
        for key in keys:
            try:
                validated = pipe.validator.validate(_check_request(pipe, key, cfg))
            except RequestError:
                continue
            if pipe.model.spec.uses_cfg(validated.request) != cfg:
                break  # this family never runs that way
            if validated.lookup.hit and pipe.runner.fuses(validated.lookup.key):
                cases.append(validated)
                break
    if not cases:
        pipe.fused.note = "not checked yet: no prepared bucket with a fused graph"
        return False
    leases = [None] + ([_SlotZero()] if pipe.lora is not None else [])  # both graphs of a LoRA deployment
    for validated, lease in ((p, le) for p in cases for le in leases):
        from bcg_core.costs import Chunk, StepForwards

        forwards = StepForwards((Chunk(validated.key, validated.rows, 0.0),))
        host = pipe.start(validated, lease=lease)
        mine = dataclasses.replace(host, latents=host.latents.clone(), scheduler=copy.deepcopy(host.scheduler),
                                   step_ms=[])
        for _ in range(min(2, len(host.timesteps))):
            pipe.step([host], forwards, fused=False)
            try:
                pipe.step([mine], forwards, fused=True)  # not counted; serving steps stay on the host until it passes
            except ValueError as e:
                pipe.fused.checked = True
                pipe.fused.note = f"off: {e}"
                log.warning("fused step %s", pipe.fused.note)
                return False
            if not torch.equal(host.latents, mine.latents):
                diff = (host.latents.float() - mine.latents.float()).abs()
                pipe.fused.checked = True
                pipe.fused.note = (f"off: the fused step differs from the host step on {validated.lookup.key} "
                                   f"(cfg {host.cfg}): {int((diff > 0).sum())} of {diff.numel()} latent "
                                   f"values, max |d| {float(diff.max()):.3g}")
                log.warning("fused step %s", pipe.fused.note)
                return False
    pipe.fused.checked = pipe.fused.on = True
    pipe.fused.note = (f"on: bitwise equal to the host step on {', '.join(str(p.lookup.key) for p in cases)} "
                       f"(cfg {', '.join(str(pipe.model.spec.uses_cfg(p.request)) for p in cases)})")
    log.info("fused step %s", pipe.fused.note)
    return True


def _check_request(pipe, key: BucketKey, cfg: bool) -> GenerationRequest:
    """A request of one image whose shape is bucket ``key``'s tier, asking for CFG when ``cfg``, and for no step cache
    (a cached step never runs fused; the config's ``cache.default`` must not turn the check off)."""
    spec = pipe.model.spec
    gh, gw = pipe._example_grid(key)
    ppt = pipe.table.rules.pixels_per_token
    fields = dict(prompt="a lighthouse on a cliff at dusk", n=1, width=gw * ppt, height=gh * ppt,
                  num_inference_steps=2, seed=0, cache=NoCache())
    if cfg and spec.cfg_rule == "none":
        cfg = False  # never runs CFG: the caller sees uses_cfg() differ and skips the case
    fields.update(spec.cfg_fields(cfg))
    if cfg:
        fields["negative_prompt"] = "blurry"
    return GenerationRequest(**fields)
