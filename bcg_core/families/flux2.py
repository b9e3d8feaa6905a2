"""FLUX.2 family: ``Flux2Pipeline`` ([dev]: Mistral-family text encoder, guidance embedding) and
``Flux2KleinPipeline`` ([klein]: Qwen3-family text encoder; classifier-free guidance unless ``is_distilled``), both
with ``Flux2Transformer2DModel`` and ``AutoencoderKLFlux2``.

What diffusers 0.42.1 does (``pipelines/flux2/pipeline_flux2.py``, D; ``pipeline_flux2_klein.py``, K;
``models/transformers/transformer_flux2.py``, T) and what this module reuses:

- Text: ``encode_prompt`` (D, K; called here) wraps the prompt in a chat template ([dev]: Mistral's, with the
  pipeline's ``system_message``; [klein]: Qwen3's, ``enable_thinking=False``), tokenizes it padded to
  ``max_sequence_length`` (512, the ``__call__`` default) with ``truncation=True``, runs the LM with its attention
  mask and stacks the hidden states of ``text_encoder_out_layers`` ((10, 20, 30) / (9, 18, 27), the defaults) into
  (1, 512, 3 x hidden) embeddings. The transformer gets all 512 rows, padding included, with **no mask**. Text ids
  (``_prepare_text_ids``): (t, h, w, l) = (0, 0, 0, i).
- Latents: ``prepare_latents`` (called here) draws (n, 4 x C, H/16, W/16) noise with ``randn_tensor`` from the
  request's generators in the text embeddings' dtype, packs it to tokens (n, h * w, 128) and gives the latent ids
  (``_prepare_latent_ids``: (0, row, column, 0), int64).
- Schedule: sigmas ``linspace(1, 1/N, N)``, ``mu = compute_empirical_mu(h * w, N)`` (not FLUX.1's
  ``calculate_shift``: it depends on the step count too), ``retrieve_timesteps``, ``set_begin_index(0)``.
- Step: ``timestep = t.expand(rows).to(latents.dtype) / 1000`` (T multiplies by 1000 again). [dev] passes
  ``guidance = full([1], guidance_scale, float32).expand(rows)`` to the guidance embedding (not CFG, no negative
  prompt). [klein] passes no guidance; with ``guidance_scale > 1`` and not ``is_distilled`` it runs a second
  forward on the negative prompt (``""``, or ``negative_prompt_embeds``) and takes ``neg + s * (cond - neg)``;
  here the uncond rows ride in the cond rows' forward, and a request's ``negative_prompt`` is encoded as a user of
  diffusers passes it through ``negative_prompt_embeds``. Distilled [klein] ignores ``guidance_scale``.
- Decode: ``_unpack_latents_with_ids``, the VAE's batch-norm statistics undone
  (``z * sqrt(bn.running_var + batch_norm_eps) + bn.running_mean``, inline in D/K ``__call__``),
  ``_unpatchify_latents``, ``vae.decode``, ``image_processor.postprocess``.

Padding contract: FLUX.1's, text at its native length and unmasked, ids int64 (:class:`Flux2Adapter`,
:mod:`bcg_core.families.flux2_adapter`). Prompt tokens are counted as the pipelines template them
(:func:`~bcg_core.families.flux2_text.flux2_token_counter`).

Reference edits (the pipelines' ``image``: ``POST /v1/images/edits`` with one or several images, no mask, no
strength; :mod:`bcg_core.families.flux2_edit`): each reference's tokens follow the target's in every row's image
stream, with ids (10 + 10 * i, row, column, 0) for reference ``i``. Their padding contract is the adapter's, the
reference tokens counted as real image tokens:

- the key's image tokens are the target's plus every reference's (the validator counts them before any decoding,
  :class:`~bcg_core.families.references.ReferenceImages`); an exact tier holds them unmasked, a masked tier pads after
  them (zero latents, zero ids, masked keys), and a larger stream than the largest tier is a miss (unpadded, eager).
- rows share a forward only with rows of the same target grid and reference grids (the step scheduler's groups,
  ``DenoiseInputs.references``): the transformer takes one ``img_ids`` for the whole batch (T:1322-1323 keeps row 0),
  so a reference edit never shares a forward with text to image, nor with references of other sizes.
- only the target's tokens of the output go to the scheduler step (host and fused step alike).

The fused step (:mod:`bcg_core.runners.fused`) runs [klein]'s ``neg + s * (cond - neg)`` and the Euler update in the
bucket's graph, as FLUX.1's.

Step cache (:class:`~bcg_core.capabilities.StepCache`, :data:`FLUX2_CACHE_METHODS`): T is a ``CacheMixin`` and both
of its block classes are in diffusers' ``TransformerBlockRegistry``, but of diffusers' two served methods only
TaylorSeer (lite mode) runs, and only on [klein]:

- [klein] runs the cond forward under ``cache_context("cond")`` and the CFG forward under ``cache_context("uncond")``
  (K:850, K:865), so each decides on its own rows, as FLUX.1's (:meth:`Flux2Family.cache_contexts`). TaylorSeer lite
  hooks ``proj_out`` (the transformer's output: nothing follows it in T's forward) and returns zeros from every
  block on a predicted step, so the output is the prediction over the whole image stream, a reference edit's
  reference tokens included (their rows of the prediction are dropped with the output's, as the pipeline drops them).
- diffusers' First Block Cache fails on T: its last block is a ``Flux2SingleTransformerBlock``, which returns the
  joint text-and-image stream as one tensor, while the first (a ``Flux2TransformerBlock``) returns the two streams,
  so ``FBCBlockHook``'s tail residual ``output - head_block_output`` subtracts a list from a tensor (``TypeError`` at
  the first step). There is no diffusers result to equal: ``first_block`` is refused on FLUX.2 (422 on ``cache``,
  naming the models that take it), and the block split refuses the transformer
  (:class:`~bcg_core.step_cache.split.BlockSplit`).
- [dev] (D) calls the transformer under no cache context, so every diffusers cache hook raises ``No cache context is
  set`` at the first step: [dev] takes no step cache (``cache`` other than none is a 422).

Previews (:class:`~bcg_core.capabilities.Previews`): mid-denoise latents unpacked as the decode unpacks them
(:meth:`Flux2Family.unpacked_latents`), then the VAE's fitted linear latent-to-RGB map (:mod:`bcg_core.preview`).

LoRA adapters per request (:mod:`bcg_core.lora`), read with ``Flux2Pipeline.lora_state_dict`` ([klein]'s loader too):
the layouts it converts are read as diffusers reads them (FLUX.2's original names as ai-toolkit saves them, the fused
``qkv`` split into ``to_q``/``to_k``/``to_v`` sharing ``lora_A``; kohya's). Every linear layer of T keeps the rows
first (the single blocks' fused ``to_qkv_mlp_proj`` and the modulation layers shared by the blocks too), as FLUX.1's.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
from pathlib import Path

import numpy as np
import torch

from bcg_core.capabilities import FusedStep, Previews, StepCache
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, heads_width, read_json
from bcg_core.families.defaults import pipeline_defaults, text_tokens
from bcg_core.families.flux2_adapter import Flux2Adapter, flux2_latent_ids, flux2_reference_ids, flux2_text_ids
from bcg_core.families.flux2_text import flux2_token_counter
from bcg_core.families.pixtral import load_flux2_pipeline
from bcg_core.families.references import ReferenceImages
from bcg_core.families.state import RequestState, TextRows
from bcg_core.padding import DenoiseInputs
from bcg_core.table import ShapeRules

__all__ = ["Flux2Adapter", "Flux2Family", "flux2_latent_ids", "flux2_reference_ids", "flux2_text_ids"]

FLUX2_DEFAULT_SAMPLE_SIZE = 128
"""Latent pixels per side of a call without ``height``/``width`` (``default_sample_size`` in both pipelines'
``__init__``): x the VAE factor 8, 1024x1024."""

FLUX2_REFERENCE_IMAGES = {"Flux2Pipeline": 6, "Flux2KleinPipeline": 4}
"""Most reference images of an edit, per pipeline (the pipelines set none): Black Forest Labs' published maxima
(docs.bfl.ai, "Reference images per model": [dev] "recommended max 6", [klein] 4B and 9B "up to 4");
``bcg_reference_images`` in ``model_index.json`` overrides it."""

FLUX2_CACHE_METHODS: dict[str, tuple[str, ...]] = {"Flux2Pipeline": (), "Flux2KleinPipeline": ("taylor_seer",)}
"""Step-cache methods per pipeline (:attr:`ModelSpec.cache_methods`): those diffusers 0.42.1 runs on the pipeline
(module docstring): [dev] none (no cache context), [klein] TaylorSeer (First Block Cache fails on T's blocks)."""


def _pipeline_class(name: str):
    import diffusers

    return getattr(diffusers, name)


class Flux2Family(FusedStep, Previews, StepCache):
    """A ``Flux2Pipeline`` or ``Flux2KleinPipeline`` checkpoint, served step by step (module docstring).

    Request fields: ``guidance_scale`` feeds [dev]'s guidance embedding; on [klein] above 1 it runs classifier-free
    guidance against ``negative_prompt`` (default ``""``, the pipeline's) unless the checkpoint ``is_distilled``
    (then it is ignored, as diffusers ignores it). A ``negative_prompt`` where no CFG can run ([dev], distilled
    [klein]) is refused (:class:`ModelSpec` ``cfg_rule="none"``). An ``image`` (one file or several) makes a reference
    edit (module docstring, :mod:`bcg_core.families.flux2_edit`). A ``cache`` is served where diffusers runs one
    (:data:`FLUX2_CACHE_METHODS`: TaylorSeer on [klein]).

    Args:
        name: served model name.
        spec: the model's :class:`ModelSpec`.
        pipe: the loaded pipeline on ``device``; its methods do the work.
        counter: ``prompt -> tokens`` (:meth:`token_counter`).
    """

    name = "flux2"
    pipeline_classes = ("Flux2Pipeline", "Flux2KleinPipeline")
    lora_loader = "Flux2Pipeline"
    transformer_width = staticmethod(heads_width)

    def __init__(self, name: str, spec: ModelSpec, pipe, counter, device: torch.device, dtype: torch.dtype):
        self.model_name = name
        self.spec = spec
        self.rules = spec.rules
        self.guidance_embeds = spec.guidance_embeds
        self.pipe = pipe
        self.vae = pipe.vae
        self.adapter = Flux2Adapter(pipe.transformer, spec.rules.native_text_tokens, pipe.vae_scale_factor,
                                    guidance=spec.guidance_embeds)
        self._counter = counter
        self._lock = threading.Lock()
        self.device, self.dtype = device, dtype

    # -- checkpoint ---------------------------------------------------------------------------------

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """Spec from ``transformer/`` and ``vae/`` configs and ``model_index.json`` (``is_distilled``); request
        defaults from the pipeline's ``__call__`` signature (:func:`pipeline_defaults`: 50 steps, guidance 4.0, both
        pipelines); the text length is ``bcg_text_tokens`` or ``__call__``'s ``max_sequence_length`` (512); reference
        edits (:attr:`ModelSpec.references`): ``check_image_input``'s bounds, ``vae_scale_factor * 2``-pixel sides,
        :data:`FLUX2_REFERENCE_IMAGES` (or ``bcg_reference_images``) images at most.

        Raises:
            ValueError: another pipeline class.
        """
        kind = index["_class_name"]
        if kind not in cls.pipeline_classes:
            raise ValueError(f"{kind!r} is not a FLUX.2 pipeline ({', '.join(cls.pipeline_classes)})")
        tr = read_json(path / "transformer" / "config.json")
        vae = read_json(path / "vae" / "config.json")
        scale = 2 ** (len(vae["block_out_channels"]) - 1)  # the pipelines' vae_scale_factor
        tokens = text_tokens(_pipeline_class(kind), index)
        dev = kind == "Flux2Pipeline"
        distilled = bool(index.get("is_distilled", False)) and not dev
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        from bcg_core.families.flux2_edit import FLUX2_REFERENCE_AREA

        check = inspect.signature(Flux2ImageProcessor.check_image_input).parameters

        references = ReferenceImages(
            pipeline=kind, max_images=int(index.get("bcg_reference_images", FLUX2_REFERENCE_IMAGES[kind])),
            max_area=FLUX2_REFERENCE_AREA, multiple=scale * 2, min_side=int(check["min_side_length"].default),
            max_aspect=float(check["max_aspect_ratio"].default))
        return ModelSpec(
            name=path.name, family=cls.name, pipeline_class=kind,
            rules=ShapeRules(pixels_per_token=scale * 2 * int(tr.get("patch_size", 1)), grid_keyed=False,
                             native_text_tokens=tokens),
            guidance_embeds=dev, cfg_rule="guidance_scale" if not (dev or distilled) else "none",
            quality_steps=QUALITY_STEPS["flux2-distilled" if distilled else "flux2"],
            default_size=(FLUX2_DEFAULT_SAMPLE_SIZE * scale,) * 2, references=references,
            cache_methods=FLUX2_CACHE_METHODS[kind], **pipeline_defaults(kind),
        )

    @classmethod
    def token_counter(cls, path: Path, index: dict):
        """``prompt -> tokens`` of the templated prompt as the pipeline tokenizes it, untruncated
        (:func:`~bcg_core.families.flux2_text.flux2_token_counter`). Tokenizer only, no weights."""
        return flux2_token_counter(path, index)

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> Flux2Family:
        """Load with the checkpoint's pipeline class ``from_pretrained`` (local files only, :func:`load_pipeline`; a
        [dev] ``PixtralProcessor`` as its tokenizer: :func:`~bcg_core.families.pixtral.load_flux2_pipeline`)."""
        spec = cls.describe(path, index)
        pipe = load_flux2_pipeline(_pipeline_class(index["_class_name"]), path, index, device, dtype)
        return cls(path.name, spec, pipe, cls.token_counter(path, index), device, dtype)

    # -- validation hooks ---------------------------------------------------------------------------

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """Templated tokens of ``prompt`` (see :meth:`token_counter`; negative prompts alike)."""
        with self._lock:
            return self._counter(prompt)

    # -- the step-level loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, prompt: str) -> TextRows:
        """One prompt through ``encode_prompt`` at the native length: (1, T, D) embeddings, pooled (1, 0), no mask."""
        with self._lock:
            text, _ = self.pipe.encode_prompt(prompt=[prompt], device=self.device, num_images_per_prompt=1,
                                              max_sequence_length=self.rules.native_text_tokens)
        return TextRows(text, text.new_zeros(1, 0))

    @torch.inference_mode()
    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode (and, with CFG, the negative prompt), draw packed noise with ``prepare_latents`` and set the
        schedule with ``compute_empirical_mu`` (D:907-957)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

        req = validated.request
        cond = self.encode(req.prompt)
        uncond = self.encode(req.negative_prompt or "") if self.spec.uses_cfg(req) else None
        gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        latents, latent_ids = self.pipe.prepare_latents(
            batch_size=req.n, num_latents_channels=self.adapter.in_channels // 4, height=req.height,
            width=req.width, dtype=cond.text.dtype, device=self.device, generator=gens)
        sched = copy.deepcopy(self.pipe.scheduler)
        steps = req.num_inference_steps
        sigmas = None if getattr(sched.config, "use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=steps)
        timesteps, _ = retrieve_timesteps(sched, steps, self.device, sigmas=sigmas, mu=mu)
        sched.set_begin_index(0)
        extras = {}
        if self.guidance_embeds:  # Flux2Pipeline: torch.full([1], guidance_scale, float32).expand(batch)
            extras["guidance"] = torch.full([1], float(req.guidance_scale), device=self.device, dtype=torch.float32)
        grid = self.rules.grid(req.width, req.height)
        state = RequestState(validated, cond, uncond, latents, sched, timesteps, grid, extras=extras, cancel=cancel)
        if req.image is not None:  # a reference edit: its references' tokens, encoded once (no generator drawn)
            from bcg_core.families.flux2_edit import reference_latents

            state.extras["reference_latents"] = reference_latents(self, state)
        return state

    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """Cond rows (one per image), then with CFG the uncond rows; timestep ``t.to(latents.dtype) / 1000``. A
        reference edit's rows, cond and uncond alike, carry its reference tokens after the target's (D:970-972,
        K:846-848; ``DenoiseInputs.references`` their token grids): (rows, S + S_r, 128)."""
        n, lat = state.n, state.latents
        parts = [state.cond] + ([state.uncond] if state.cfg else [])
        refs = state.extras.get("reference_latents")  # (1, S_r, 128)
        x = lat if refs is None else torch.cat([lat, refs.expand(n, -1, -1)], dim=1)
        x = torch.cat([x] * len(parts)) if len(parts) > 1 else x
        text = torch.cat([p.text.expand(n, -1, -1) for p in parts])
        timestep = state.timestep.expand(x.shape[0]).to(lat.dtype) / 1000
        guidance = state.extras.get("guidance")
        if guidance is not None:
            guidance = guidance.expand(x.shape[0])
        return DenoiseInputs(x, text, lat.new_zeros(x.shape[0], 0), timestep, state.grid, guidance,
                             references=tuple(state.validated.references) if refs is not None else ())

    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """``neg + guidance_scale * (cond - neg)`` with CFG ([klein], K:864-876), then the request's
        flow-matching Euler step, on the target's tokens only (``noise_pred[:, :latents.size(1)]``, D:985, K:862:
        a reference edit's reference tokens are dropped)."""
        output = output[:, : state.latents.shape[1]]
        noise = output[: state.n]
        if state.cfg:
            neg = output[state.n :]
            noise = neg + self.spec.cfg_scale(state.request) * (noise - neg)
        state.latents = state.scheduler.step(noise, state.timestep, state.latents, return_dict=False)[0]
        state.step_index += 1

    def cache_contexts(self, state: RequestState) -> list[tuple[str, slice]]:
        """``Flux2KleinPipeline`` runs the cond rows under ``cache_context("cond")`` and, with CFG, the uncond rows
        under ``cache_context("uncond")`` (K:850, K:865): :meth:`model_rows`' two halves, a reference edit's alike.

        Raises:
            ValueError: a [dev] checkpoint (``Flux2Pipeline`` sets no cache context: it takes no step cache).
        """
        if not self.spec.cache_methods:
            raise ValueError(f"{self.spec.pipeline_class} runs its transformer under no cache context, so diffusers' "
                             f"step caches fail on it: it takes no step cache")
        n = state.n
        return [("cond", slice(0, n))] + ([("uncond", slice(n, 2 * n))] if state.cfg else [])

    def euler_step(self, state: RequestState):
        """The fused form of the next step (:func:`bcg_core.runners.fused.euler_step`): cond rows first, then with CFG
        the uncond rows, ``neg + guidance_scale * (cond - neg)`` as :meth:`advance`."""
        from bcg_core.runners.fused import euler_step

        scale = self.spec.cfg_scale(state.request) if state.cfg else 1.0
        tokens = state.latents.shape[1] if "reference_latents" in state.extras else None
        return euler_step(state, 0, state.n if state.cfg else None, scale, self.dtype, tokens)

    def unpacked_latents(self, latents: torch.Tensor, latent_ids: torch.Tensor) -> torch.Tensor:
        """Packed latents (n, h * w, 128) as the VAE takes them: ``_unpack_latents_with_ids``, batch-norm
        statistics undone, ``_unpatchify_latents`` (D:1017-1024, K:906-916): (n, 32, 2h, 2w); what
        ``Flux2KleinPipeline(output_type="latent")`` returns."""
        pipe, vae = self.pipe, self.pipe.vae
        z = pipe._unpack_latents_with_ids(latents, latent_ids)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        return pipe._unpatchify_latents(z * std + mean)

    @functools.cached_property
    def _preview(self):
        from bcg_core.preview import vae_preview

        return vae_preview(self.vae, self.pipe.vae_scale_factor)

    @torch.inference_mode()
    def preview(self, state: RequestState, latents: torch.Tensor) -> list[np.ndarray]:
        """``n`` previews of mid-denoise ``latents`` (a copy of ``state.latents``, packed tokens):
        :meth:`unpacked_latents` as :meth:`decode`, then the VAE's fitted linear latent-to-RGB map
        (:class:`~bcg_core.preview.LinearPreview`): (h, w, 3) uint8 at latent resolution (1/8 of the size)."""
        ids = flux2_latent_ids(tuple(state.grid), str(latents.device)).expand(latents.shape[0], -1, -1)
        return self._preview(self.unpacked_latents(latents, ids))

    @torch.inference_mode()
    def decode(self, state: RequestState) -> list[np.ndarray]:
        """:meth:`unpacked_latents`, ``vae.decode``, ``postprocess`` to uint8 RGB: one image per row of
        ``state.latents`` (the decode thread merges requests of one size into one state: the ids are the grid's, one
        row per latent row, not one request's ``latent_ids`` of ``prepare_latents``, which has its own rows only)."""
        lat = state.latents
        ids = flux2_latent_ids(tuple(state.grid), str(lat.device)).expand(lat.shape[0], -1, -1)
        z = self.unpacked_latents(lat, ids)
        image = self.vae.decode(z.to(self.vae.device), return_dict=False)[0]
        return [np.asarray(im) for im in self.pipe.image_processor.postprocess(image, output_type="pil")]
