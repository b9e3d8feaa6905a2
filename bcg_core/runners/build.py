"""The runner, kernels and fused step that ``config.runner`` asks for on a loaded family: built once, where the
pipeline is built (:class:`~bcg_core.pipeline.DiTPipeline`, which re-exports these names).

- :func:`runner_mode` / :func:`build_runner`: CUDA graphs (:class:`~bcg_core.runners.cuda_graph.CudaGraphRunner`)
  or eager (:class:`~bcg_core.runners.eager.EagerBucketRunner`);
- :func:`kernel_tier` / :func:`compiled_kernels`: the kernels inside each bucket forward, installed on the
  transformer once and kept beside it (:func:`installed_kernels`), never on the family object;
- :func:`fused_wanted`: the fused step, for a family with the :class:`~bcg_core.capabilities.FusedStep` capability.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from bcg_core.capabilities import FamilyCapabilities
from bcg_core.config import EngineConfig
from bcg_core.devices import resolve_device
from bcg_core.families import Family
from bcg_core.metrics import BucketMetrics
from bcg_core.models import weights_stamp
from bcg_core.runners.base import BucketRunner
from bcg_core.runners.eager import EagerBucketRunner
from bcg_core.runners.fp8 import check_fp8, quantize_fp8
from bcg_core.runners.kernels import CompiledKernels, KernelTier
from bcg_core.step_cache.split import split_of
from bcg_core.verify import derived_tolerance

log = logging.getLogger(__name__)

__all__ = ["InstalledKernels", "build_runner", "compiled_kernels", "fused_wanted", "installed_kernels", "kernel_tier",
           "runner_mode"]


def runner_mode(config: EngineConfig, device: torch.device | None = None) -> str:
    """``"graph"`` or ``"eager"``: what ``config.runner.mode`` means on ``device`` (the configured one if None).

    Raises:
        ValueError: ``runner.mode: graph`` without CUDA, ``model.device: cuda`` where none is visible, or
            ``runner.kernels: fp8`` where float8 cannot run (:func:`~bcg_core.runners.fp8.check_fp8`).
    """
    device = device or resolve_device(config.model.device)
    mode = config.runner.mode
    if kernel_tier(config, device) is KernelTier.FP8:
        check_fp8(device)
    if mode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if mode == "graph" and device.type != "cuda":
        raise ValueError(f"runner.mode is 'graph' but the model runs on {device.type}: CUDA graphs need a CUDA "
                         f"device; use runner.mode 'auto' or 'eager'")
    return mode


def build_runner(config: EngineConfig, model: Family, keys: list, metrics: BucketMetrics, adapter=None,
                 component: str = "transformer") -> BucketRunner:
    """The runner ``config.runner.mode`` asks for: CUDA graphs (``graph``, or ``auto`` on CUDA) or eager.

    Args:
        adapter: the padding adapter it runs (None: ``model.adapter``; another expert's, :mod:`bcg_core.experts`).
        component: the checkpoint folder of that adapter's weights (``transformer_2`` for Wan 2.2's second expert),
            which keys its kept measurements (:func:`compiled_kernels`).

    Raises:
        ValueError: ``mode: graph`` on a model that is not on a CUDA device.
    """
    adapter = model.adapter if adapter is None else adapter
    mode = runner_mode(config, model.device)
    fused = fused_wanted(config, model)
    kernels = compiled_kernels(config, model, keys, adapter, component)
    if mode == "eager":
        return EagerBucketRunner(adapter, keys, metrics, model.device, model.dtype, fused=fused,
                                 kernels=kernels)
    from bcg_core.runners.cuda_graph import CudaGraphRunner

    budget = config.runner.graph_memory_budget_mib
    return CudaGraphRunner(
        adapter, keys, metrics, model.device, model.dtype,
        budget_bytes=None if budget is None else int(budget * 2**20), lazy=config.runner.lazy_capture,
        warmup_iters=config.runner.warmup_iters, fused=fused, kernels=kernels,
    )


def kernel_tier(config: EngineConfig, device: torch.device) -> KernelTier:
    """The tier ``config.runner.kernels`` means on ``device``: ``auto`` is ``compiled`` on CUDA, ``eager`` elsewhere."""
    if config.runner.kernels == "auto":
        return KernelTier.COMPILED if torch.device(device).type == "cuda" else KernelTier.EAGER
    return KernelTier(config.runner.kernels)


@dataclass
class InstalledKernels:
    """What the compiled tiers installed on one transformer, kept beside it (:func:`installed_kernels`), never on the
    family object.

    Attributes:
        compiled: its compiled kernels (:class:`~bcg_core.runners.kernels.CompiledKernels`), shared by every runner
            of the model; None before :func:`compiled_kernels` installs them.
        fp8_layers: its linear layers turned to float8 in place (``fp8``), 0 where none are.
    """

    compiled: CompiledKernels | None = None
    fp8_layers: int = 0


_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def installed_kernels(transformer: torch.nn.Module) -> InstalledKernels:
    """The kernels installed on ``transformer`` (a family's ``adapter.model``), created empty on first ask."""
    return _INSTALLED.setdefault(transformer, InstalledKernels())


def compiled_kernels(config: EngineConfig, model: Family, keys: list, adapter=None,
                     component: str = "transformer") -> CompiledKernels | None:
    """The compiled kernels ``config.runner.kernels`` asks for on ``model`` (installed on its transformer once and
    kept beside it, :func:`installed_kernels`, so a second runner of the same model shares them), or None for eager
    kernels.

    Before anything is compiled, the tolerance of the check of each bucket's compiled forward is set: the
    configured ``runner.compile_rtol``, or :func:`~bcg_core.verify.kernel_tolerance` from the eager forward's own
    rounding error on the smallest bucket of ``keys`` (:func:`~bcg_core.verify.derived_tolerance`: measured
    once per checkpoint's weights and kept beside the compile cache; not measured for ``fp8``, whose bound is
    stated). For ``fp8``
    the repeated blocks' linear layers are then turned to float8, in place, once
    (:func:`~bcg_core.runners.fp8.quantize_fp8`; the count is kept as :attr:`InstalledKernels.fp8_layers`).

    Args:
        keys: the buckets the runner serves (each block may hold one static compile per shape).
        adapter: the padding adapter whose transformer gets them (None: ``model.adapter``; another expert's).
        component: the checkpoint folder of its weights, for :func:`~bcg_core.models.weights_stamp`.
    """
    tier = kernel_tier(config, model.device)
    if tier is KernelTier.EAGER:
        return None
    adapter = model.adapter if adapter is None else adapter
    installed = installed_kernels(adapter.model)
    kernels = installed.compiled
    if kernels is None or (kernels.mode, kernels.batch_dynamic) != (config.runner.compile_mode,
                                                                   config.runner.compile_batch_dynamic):
        if config.runner.compile_rtol is not None:
            rtol, note = config.runner.compile_rtol, "runner.compile_rtol"
        else:
            rtol, note = derived_tolerance(tier.value, adapter, keys, model.device, model.dtype,
                                           config.runner.compile_cache_dir,
                                           weights_stamp(config.model.path, component))
        if tier is KernelTier.FP8 and not installed.fp8_layers:
            check_fp8(model.device)
            installed.fp8_layers = quantize_fp8(adapter.model)  # in place: every forward, misses too
        def install() -> CompiledKernels:
            return CompiledKernels(adapter.model, mode=config.runner.compile_mode,
                                   max_shapes=max(64, 2 * len(keys)), cache_dir=config.runner.compile_cache_dir,
                                   timeout_s=config.runner.compile_timeout_s, rtol=rtol,
                                   attention=config.runner.attention,
                                   batch_dynamic=config.runner.compile_batch_dynamic)

        split = split_of(adapter.model)  # a step cache's split installed first: the kernels go under it
        kernels = install() if split is None else split.around(install)
        kernels.rtol_note = note
        log.info("compiled kernels (%s): each bucket checked against eager within %.3g (%s)", tier.value, rtol, note)
        installed.compiled = kernels
    return kernels


def fused_wanted(config: EngineConfig, model: Family) -> bool:
    """Whether ``config.runner.fused_step`` asks for the fused step on ``model`` (:mod:`bcg_core.runners.fused`):
    never for a family without the :class:`~bcg_core.capabilities.FusedStep` capability (multistep solvers,
    norm-rescaled CFG); ``auto`` where graphs are captured; ``always`` on the eager runner too."""
    how = config.runner.fused_step
    if how == "never" or not FamilyCapabilities.of(model).fused_step:
        return False
    return how == "always" or runner_mode(config, model.device) == "graph"
