"""Experts: a checkpoint of several transformers of one architecture, each denoising its own steps (the
:class:`~bcg_core.capabilities.Experts` capability; Wan 2.2 A14B's high-noise ``transformer`` and low-noise
``transformer_2``, switched at ``boundary_ratio x num_train_timesteps`` as ``WanPipeline`` switches them).

Two transformers are two sets of weights, so a bucket graph of one can never serve the other: the pipeline holds
one runner per expert (:func:`expert_runners`), each over the same bucket keys with its own static buffers,
graphs, compiled kernels and graph memory pool, and every forward of a step runs on the runner of the expert its
rows are at (:meth:`~bcg_core.pipeline.DiTPipeline.step`). Rows of different requests in one group may be at
different experts (one request past the boundary, another not yet): the step scheduler steps each expert's
requests apart, one decided set of forwards each (:meth:`~bcg_core.scheduler.loop.DenoisingLoop._step_group`).
The bucket table, its keys, metrics, cost model and routing are the experts' shared ones: same architecture, same
shapes, same costs (measured on expert 0's runner).

Where an expert runner differs from expert 0's: it compiles its kernels while it prepares (the background compiles
of :mod:`bcg_core.runners.background` serve expert 0's runner), and its graphs live in a pool of their own (the
graph memory budget applies per runner).
"""

from __future__ import annotations

from collections.abc import Sequence

from bcg_core.capabilities import FamilyCapabilities
from bcg_core.config import EngineConfig
from bcg_core.metrics import BucketMetrics
from bcg_core.runners.base import BucketRunner
from bcg_core.runners.build import build_runner

__all__ = ["component", "describe_experts", "expert_runners", "prepared_by_all", "step_expert"]


def component(expert: int) -> str:
    """The checkpoint folder of expert ``expert``'s weights, as diffusers names them: ``transformer`` (expert 0),
    ``transformer_2`` (expert 1), ..."""
    return "transformer" if expert == 0 else f"transformer_{expert + 1}"


def expert_runners(config: EngineConfig, model, keys: list, metrics: BucketMetrics,
                   first: BucketRunner) -> tuple[BucketRunner, ...]:
    """One runner per expert of ``model``: ``first`` (expert 0's, the pipeline's ``runner``), then one per other
    expert, built as ``config.runner`` asks (:func:`~bcg_core.runners.build.build_runner` on that expert's adapter),
    over the same ``keys`` and counting into the same ``metrics``. ``(first,)`` for a model of one transformer."""
    if FamilyCapabilities.of(model).experts == 1:
        return (first,)
    return (first, *(build_runner(config, model, keys, metrics, adapter, component(e))
                     for e, adapter in enumerate(model.experts) if e > 0))


def step_expert(experts: Sequence[int]) -> int:
    """The one expert of a step whose requests are at ``experts`` (0 for none).

    Raises:
        ValueError: requests at different experts (each expert's requests step apart, on its own runner).
    """
    found = set(experts)
    if len(found) > 1:
        raise ValueError(f"requests at experts {sorted(found)} cannot share a step: each expert's transformer runs "
                         f"its own forwards (step each expert's requests apart)")
    return found.pop() if found else 0


def prepared_by_all(runners: Sequence[BucketRunner]) -> set:
    """The buckets every runner has prepared (the decider chooses among them: a step may run on any expert)."""
    sets = [r.prepared() for r in runners]
    return sets[0] if len(sets) == 1 else set.intersection(*sets)


def describe_experts(runners: Sequence[BucketRunner]) -> list[dict] | None:
    """``/v1/buckets``' ``experts``: per expert after the first, its checkpoint folder, per-bucket state
    (``runner.describe()``) and capture totals; None for a model of one transformer (its buckets are the top-level
    ones, as are expert 0's)."""
    import dataclasses

    if len(runners) == 1:
        return None
    return [{"expert": e, "component": component(e), "buckets": r.describe(), "capture": dataclasses.asdict(r.stats)}
            for e, r in enumerate(runners) if e > 0]
