"""The family contract: what the generic pipeline asks of one DiT family (:class:`Family`). Its model spec
(:class:`~bcg_core.families.spec.ModelSpec`, :data:`~bcg_core.families.spec.QUALITY_STEPS`) and the loading helpers
(:mod:`bcg_core.families.helpers`) have modules of their own; this module re-exports them, the names families and
callers import from here.

A *family* (FLUX.1, SD3, PixArt-Sigma, SANA, Qwen-Image) is one module of :mod:`bcg_core.families` that
holds everything specific to it: its padding adapter (pad, mask, unpad, key rules), text encoding (encoders,
lengths, negative prompts, CFG order), latent preparation and packing, timestep and scheduler conventions and
decode scaling. A family opts in by implementing :class:`Family` (a ``typing.Protocol``); the generic
pipeline (:mod:`bcg_core.pipeline`) only ever calls these hooks, so no code outside ``families/`` asks which
family it runs.

Step-level contract (docs/DESIGN.md section 10, "The step-level loop"):

1. :meth:`Family.start` turns one validated request into a :class:`~bcg_core.families.state.RequestState`
   (:mod:`bcg_core.families.state`, with the text rows and the row helpers): encoded text, initial
   latents (drawn exactly as the family's diffusers pipeline draws them from generators seeded
   ``seed + i``), its own scheduler instance with its timesteps set (a multistep solver's history lives
   there) and step index 0.
2. :meth:`Family.model_rows` gives the transformer rows of one request at *its* current step: a
   :class:`~bcg_core.padding.DenoiseInputs` of ``state.rows`` rows with a per-row timestep. The pipeline
   concatenates the rows of several requests, each at its own step, into one forward
   (:func:`~bcg_core.families.state.concat_rows`), runs it on a bucket, and hands each request its own slice of
   the output.
3. :meth:`Family.advance` combines that request's CFG rows (the family's own formula and order), runs
   the request's own scheduler step and moves its step index on.
4. :meth:`Family.decode` turns a finished request's latents into ``n`` RGB images, with the same
   post-processing (and, for PixArt, the same resize back from its aspect-ratio bin) as diffusers.

What only some families can do (the fused step's Euler update, streamed previews, and next the step cache) is an
optional capability, declared in :mod:`bcg_core.capabilities` (``FusedStep``, ``Previews``): a family class inherits
the capability's Protocol and implements its methods; the pipeline answers once, where it is built, which it has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
import torch

from bcg_core.families.helpers import heads_width, load_pipeline, read_json, tokenizer_counter
from bcg_core.families.spec import QUALITY_STEPS, ModelSpec
from bcg_core.families.state import RequestState
from bcg_core.padding import DenoiseInputs, DiTAdapter
from bcg_core.table import ShapeRules

__all__ = ["QUALITY_STEPS", "Family", "ModelSpec", "heads_width", "load_pipeline", "read_json", "tokenizer_counter"]


class Family(Protocol):
    """One DiT family (see the module docstring for the step-level contract).

    Class attributes name the family and the ``model_index.json`` classes it loads; instances are built by
    :meth:`load` and hold the loaded components.
    """

    name: ClassVar[str]
    """Short family id, e.g. ``"flux"``: metrics, ``/v1/buckets`` and logs use it."""
    pipeline_classes: ClassVar[tuple[str, ...]]
    """``_class_name`` values of ``model_index.json`` this family loads."""
    lora_loader: ClassVar[str | None]
    """The diffusers pipeline class whose ``lora_state_dict`` reads this family's LoRA files
    (:mod:`bcg_core.lora.files`; e.g. ``"FluxPipeline"``, ``"Flux2Pipeline"`` for both FLUX.2 pipelines), or None
    where bcg-serve serves no adapters for it: PixArt-Sigma (diffusers has no LoRA loader for it), and a family whose
    adapters bcg-serve does not serve yet (:func:`bcg_core.lora.slots.unserved` tells the two apart)."""

    model_name: str
    spec: ModelSpec
    """The model's spec: shape rules and the family's request rules (CFG rule, binning, refusals), which the
    validator applies alike at the ingress and on the replica."""
    adapter: DiTAdapter
    rules: ShapeRules
    guidance_embeds: bool
    vae: torch.nn.Module
    """The VAE its decode runs (the compiled decode, :mod:`bcg_core.runners.decode`, compiles it)."""
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """The model's spec from its JSON configs only (no weights), for the ingress.

        Raises:
            ValueError: a component that this family cannot serve (naming it and the fix).
        """
        ...

    @classmethod
    def transformer_width(cls, config: dict) -> int:
        """The transformer's hidden width (channels of each token of its stream) from its ``transformer/config.json``
        ``config``, read by the keys this family's transformer class takes (:func:`heads_width` for most; Z-Image's
        ``dim``): what a bucket's activation bytes scale with (:func:`bcg_core.models.estimate_graph_bytes`).

        Raises:
            KeyError: the config lacks a key the family reads.
        """
        ...

    @classmethod
    def token_counter(cls, path: Path, index: dict) -> Callable[..., int]:
        """``(prompt, negative=False) -> text tokens`` of the text dimension of the bucket key, counted as the
        pipeline encodes a prompt or (``negative=True``) a negative prompt (tokenizers only, no weights)."""
        ...

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> Family:
        """Load the checkpoint folder ``path`` (diffusers ``save_pretrained`` layout) onto ``device``."""
        ...

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """Text tokens of ``prompt`` in the text dimension of the bucket key, as a prompt or (``negative``) a
        negative prompt (SANA prefixes only prompts with its instruction; as :meth:`token_counter`)."""
        ...

    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode, draw the initial latents and set up the request's own scheduler (step 0)."""
        ...

    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """The request's transformer rows at its current step (``state.rows`` rows, per-row timestep)."""
        ...

    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """Apply one step: ``output`` (``state.rows`` rows of the forward, in :meth:`model_rows`' order) ->
        guidance -> the request's scheduler step -> ``state.latents``; increments ``state.step_index``."""
        ...

    def decode(self, state: RequestState) -> list[np.ndarray]:
        """``n`` images as (height, width, 3) uint8 arrays at the requested size ((height, width, 4) RGBA where
        :attr:`ModelSpec.output_alpha`), as diffusers' ``output_type="pil"`` gives them
        (``VaeImageProcessor.postprocess``)."""
        ...
