"""Optional capabilities of families, their padding adapters and runners: declared here, answered once.

Every family implements :class:`~bcg_core.families.Family`, every padding adapter
:class:`~bcg_core.padding.DiTAdapter` and every runner :class:`~bcg_core.runners.BucketRunner`. What only some of
them can do is declared here, one runtime-checkable ``typing.Protocol`` per capability (as vLLM's
``model_executor/models/interfaces.py``): a class opts in by inheriting the Protocol and implementing its methods.

- :class:`FusedStep` (a family): its step may be a plain flow-match Euler update, run inside the bucket's graph
  (:mod:`bcg_core.runners.fused`): FLUX.1, SD3, the tiny default.
- :class:`Previews` (a family): cheap streamed previews of mid-denoise latents: every family here.
- :class:`PlainForward` (a padding adapter): a forward without LoRA rows beside the one with them, which a bucket
  captures as its plain graph (:class:`~bcg_core.lora.rows.LoRAAdapter`).
- :class:`StepCache` (a family): its transformer takes diffusers' step cache (``CacheMixin.enable_cache``), which
  bcg-serve runs per request inside a batched step (:mod:`bcg_core.step_cache`): FLUX.1, Qwen-Image, the tiny default,
  and FLUX.2, whose [klein] checkpoints take TaylorSeer only (its ``ModelSpec.cache_methods`` say which).
- :class:`EagerMixesRows` (a padding adapter): its unpadded forward mixes rows in a linear layer's input, so per-row
  LoRA entries run one forward per set of rows (Z-Image, Qwen-Image 2.1).
- :class:`GraphReplay` (a runner): replays captured CUDA graphs (:class:`~bcg_core.runners.cuda_graph.CudaGraphRunner`).
- :class:`Experts` (a family): several transformers of one architecture, each denoising its own steps (Wan 2.2's
  high- and low-noise experts); the pipeline builds one runner per expert (:mod:`bcg_core.experts`).

:class:`FamilyCapabilities` and :class:`RunnerCapabilities` answer, once, where the pipeline is built (a runner
answers :func:`supports_plain_forward` for its adapter once, where it is built), and are stored there. Nothing else
asks a family, adapter or runner what it has: ``tests/unit/test_layout.py`` fails on ``hasattr`` or ``getattr``
applied to one outside this module.

Adding a capability: a Protocol here, a field of the record that answers it, and its
implementations (the classes that inherit the Protocol).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from bcg_core.families.state import RequestState
    from bcg_core.padding import DenoiseInputs
    from bcg_core.runners.fused import EulerStep

__all__ = ["EagerMixesRows", "Experts", "FamilyCapabilities", "FusedStep", "GraphReplay", "PlainForward", "Previews",
           "RunnerCapabilities", "StepCache", "eager_mixes_rows", "supports_plain_forward"]


@runtime_checkable
class FusedStep(Protocol):
    """A family whose scheduler update may be a plain flow-match Euler step, which the fused step runs inside the
    bucket's graph after the forward (:mod:`bcg_core.runners.fused`, ``runner.fused_step``)."""

    def euler_step(self, state: RequestState) -> EulerStep | None:
        """The fused form of ``state``'s next step (:class:`~bcg_core.runners.fused.EulerStep`: its cond and
        uncond row offsets, CFG scale and ``dt``), or None where this step must run on the host (another
        scheduler, a blend after the step)."""
        ...


@runtime_checkable
class Previews(Protocol):
    """A family that draws streamed previews (``partial_images``) of mid-denoise latents."""

    def preview(self, state: RequestState, latents: torch.Tensor) -> list[np.ndarray]:
        """``n`` previews of ``latents``, a copy of ``state.latents`` taken mid-denoise: (h, w, 3) uint8 arrays of
        any size (the caller resizes them to the requested size). Called on the replica's preview thread, never
        the denoising thread; each family here uses its VAE's fitted linear latent-to-RGB map
        (:class:`~bcg_core.preview.LinearPreview`) rather than a decode."""
        ...


@runtime_checkable
class StepCache(Protocol):
    """A family whose transformer takes diffusers' step cache (``CacheMixin``, with blocks diffusers'
    ``TransformerBlockRegistry`` describes), which :mod:`bcg_core.step_cache` runs per request inside a batched step.
    Its :class:`~bcg_core.families.ModelSpec` lists the methods in ``cache_methods``."""

    def cache_contexts(self, state: RequestState) -> list[tuple[str, slice]]:
        """``(name, rows)`` of each cache context of ``state``'s transformer rows (:meth:`model_rows`' order), as the
        family's diffusers pipeline runs the transformer under ``cache_context(name)``: e.g. FLUX.1's ``"cond"``
        rows and, with true CFG, its ``"uncond"`` rows, each deciding on its own."""
        ...


@runtime_checkable
class PlainForward(Protocol):
    """A padding adapter whose forwards carry per-row LoRA entries, with a forward without them beside it
    (:class:`~bcg_core.lora.rows.LoRAAdapter`): a bucket captures both, and a forward in which no row has an adapter
    (``inputs.lora_slots`` None) replays the plain one."""

    def forward_plain(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """The padded forward with no LoRA rows, shaped as ``forward``'s output."""
        ...

    def on_slot_zero(self, inputs: DenoiseInputs) -> DenoiseInputs:
        """``inputs`` with every row on slot 0 at scale 0: through a bucket, the LoRA graph at a real adapter's
        cost (what the checks and the cost model run it with)."""
        ...


@runtime_checkable
class EagerMixesRows(Protocol):
    """A padding adapter whose unpadded forward (``forward_eager``) feeds a linear layer something other than one
    entry per row: Z-Image's transformer embeds every row's tokens as one flat sequence, Qwen-Image 2.1's runs each row
    alone with an extra t = 0 row. Per-row LoRA entries then cannot ride along in one forward:
    :meth:`~bcg_core.lora.rows.LoRAAdapter.forward_eager` runs one forward per set of rows carrying the same entries."""

    eager_mixes_rows: bool


@runtime_checkable
class Experts(Protocol):
    """A family whose checkpoint holds several transformers of one architecture (its *experts*), each run for the
    steps its diffusers pipeline picks it for: ``WanPipeline`` with ``transformer_2`` and ``boundary_ratio`` (Wan 2.2
    A14B) runs ``transformer`` at timesteps at or above ``boundary_ratio x num_train_timesteps`` and ``transformer_2``
    below. Each expert has its own weights, so its own runner, bucket graphs and compiled kernels
    (:mod:`bcg_core.experts`); a step's rows on different experts run as separate forwards."""

    experts: tuple
    """The experts' padding adapters, expert 0 first (the family's ``adapter``); one for a single transformer."""

    def expert(self, state: RequestState) -> int:
        """The index in :attr:`experts` of the transformer that runs ``state``'s next step."""
        ...


@runtime_checkable
class GraphReplay(Protocol):
    """A runner whose bucket forwards replay captured CUDA graphs."""

    @property
    def graph_count(self) -> int:
        """Buckets that hold a captured graph."""
        ...


def supports_plain_forward(adapter) -> bool:
    """Whether ``adapter`` has the :class:`PlainForward` capability (a LoRA deployment's adapter); a runner asks
    once, where it is built."""
    return isinstance(adapter, PlainForward)


def eager_mixes_rows(adapter) -> bool:
    """Whether ``adapter`` has the :class:`EagerMixesRows` capability; a LoRA adapter asks once, where it is built."""
    return isinstance(adapter, EagerMixesRows)


@dataclass(frozen=True)
class FamilyCapabilities:
    """What a loaded family (and its padding adapter, as installed) can do beyond :class:`~bcg_core.families.Family`.

    Attributes:
        fused_step: the family is a :class:`FusedStep`.
        previews: the family is a :class:`Previews`.
        plain_forward: its adapter is a :class:`PlainForward` (LoRA adapters are installed).
        step_cache: the family is a :class:`StepCache`.
        experts: its transformers (:class:`Experts`): 1 for a family of one transformer.
    """

    fused_step: bool = False
    previews: bool = False
    plain_forward: bool = False
    step_cache: bool = False
    experts: int = 1

    @classmethod
    def of(cls, family) -> FamilyCapabilities:
        """The capabilities of ``family`` with its adapter as it is now (after LoRA is installed)."""
        return cls(fused_step=isinstance(family, FusedStep), previews=isinstance(family, Previews),
                   plain_forward=supports_plain_forward(family.adapter), step_cache=isinstance(family, StepCache),
                   experts=len(family.experts) if isinstance(family, Experts) else 1)


@dataclass(frozen=True)
class RunnerCapabilities:
    """What a bucket runner can do beyond :class:`~bcg_core.runners.BucketRunner`.

    Attributes:
        graphs: it is a :class:`GraphReplay` (bucket forwards are graph replays: the cost model's token-count
            stand-in prices a replay at a tenth of an eager launch, :meth:`~bcg_core.costs.CostModel.token_model`).
    """

    graphs: bool = False

    @classmethod
    def of(cls, runner) -> RunnerCapabilities:
        """The capabilities of ``runner``."""
        return cls(graphs=isinstance(runner, GraphReplay))
