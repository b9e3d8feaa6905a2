"""FLUX.1 family: ``FluxPipeline`` checkpoints (dev with its guidance embedding, schnell without) and the
bcg-serve tiny layout ``BCGFluxPipeline`` (the zero-config default).

What diffusers 0.42.1 does, and what this module does the same way (``pipelines/flux/pipeline_flux.py``,
``FluxPipeline.__call__``):

- Text: ``encode_prompt`` gives T5 sequence embeddings of ``max_sequence_length`` (512) tokens, unmasked
  (padding included), and CLIP's pooled output; this module calls that very method. FLUX was trained on
  unmasked fixed-length text, so the key's text dimension is that native length (docs/DESIGN.md section 2).
- Latents: ``prepare_latents`` draws ``(n, C/4... , 2h, 2w)`` noise with ``randn_tensor`` from the
  request's generators (one per image, seeded ``seed + i``) in the transformer's dtype and packs 2x2 latent
  patches into tokens (``_pack_latents``): (n, h * w, in_channels).
- Schedule: sigmas ``linspace(1, 1/N, N)`` with ``mu = calculate_shift(image_seq_len, ...)`` through
  ``retrieve_timesteps`` (a plain ``set_timesteps(N)`` is a different schedule), ``set_begin_index(0)``.
- Step: ``timestep = t.expand(rows).to(latents.dtype) / 1000``. FLUX.1-dev gets ``guidance_scale`` as a
  per-row guidance tensor (the guidance embedding; that is *not* classifier-free guidance). True CFG runs
  only with ``true_cfg_scale > 1`` and a negative prompt: ``neg + true_cfg_scale * (cond - neg)``; diffusers
  runs two forwards, here the uncond rows ride in the same forward as the cond rows.
- Decode: ``_unpack_latents``, ``z / scaling_factor + shift_factor`` (0.3611, 0.1159), ``vae.decode``,
  ``VaeImageProcessor.postprocess``.

The tiny layout (``BCGFluxPipeline``, written by :func:`bcg_core.models.save_pipeline`) has one sentence
encoder (all-MiniLM-L6-v2) in place of CLIP and T5, and runs classifier-free guidance with uncond rows when
``guidance_scale > 1`` (its transformer has no guidance embedding); everything else is the FLUX code above.
It has no diffusers pipeline to compare with; its images are noise (random weights).

The padding adapter (:class:`FluxAdapter`: the bucket forward, its buffers and image ids) is
:mod:`bcg_core.families.flux_adapter`; this module re-exports it.
"""

from __future__ import annotations

import copy
import functools
import threading
from pathlib import Path

import numpy as np
import torch

from bcg_core.capabilities import FusedStep, Previews, StepCache
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, heads_width, load_pipeline, read_json, tokenizer_counter
from bcg_core.families.defaults import pipeline_defaults
from bcg_core.families.flux_adapter import IDS_CACHE_GRIDS, FluxAdapter, flux_image_ids
from bcg_core.families.state import RequestState, TextRows
from bcg_core.padding import DenoiseInputs
from bcg_core.step_cache.spec import METHODS as CACHE_METHODS
from bcg_core.table import ShapeRules

__all__ = ["FLUX_SCHEDULER_CONFIG", "IDS_CACHE_GRIDS", "FluxAdapter", "FluxFamily", "flux_image_ids"]

FLUX_DEFAULT_SAMPLE_SIZE = 128
"""Latent pixels per side of a ``FluxPipeline`` call without ``height``/``width`` (its ``default_sample_size``, set
in ``__init__``): x the VAE factor 8, 1024x1024."""

FLUX_DEFAULT_TEXT_TOKENS = 512
"""FLUX.1's T5 length (``FluxPipeline.__call__(max_sequence_length=512)``)."""

FLUX_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096,
)
"""The FLUX.1-dev scheduler config (``scheduler/scheduler_config.json`` of black-forest-labs/FLUX.1-dev)."""


class FluxFamily(FusedStep, Previews, StepCache):
    """A ``FluxPipeline`` checkpoint (FLUX.1-dev or -schnell), served step by step.

    Build with :meth:`load`. Request fields: ``guidance_scale`` feeds FLUX.1-dev's guidance embedding (and is
    ignored by schnell, as diffusers ignores it); ``true_cfg_scale`` > 1 with a ``negative_prompt`` runs true
    classifier-free guidance (uncond rows), as ``FluxPipeline(true_cfg_scale=...)``.

    Args:
        name: served model name.
        spec: the model's :class:`ModelSpec`.
        transformer, vae: the loaded components, on ``device`` in ``dtype``.
        scheduler: the checkpoint's scheduler (a template: each request gets a deep copy).
        image_processor: ``VaeImageProcessor`` of the pipeline (``vae_scale_factor * 2``).
        encoder: ``prompt -> TextRows`` (serialised by a lock: tokenizers are not thread-safe).
        counter: ``prompt -> tokens`` of the sequence encoder.
    """

    name = "flux"
    pipeline_classes = ("FluxPipeline",)
    lora_loader = "FluxPipeline"
    transformer_width = staticmethod(heads_width)

    def __init__(self, name: str, spec: ModelSpec, transformer, vae, scheduler, image_processor, encoder, counter,
                 device: torch.device, dtype: torch.dtype):
        self.model_name = name
        self.spec = spec
        self.rules = spec.rules
        self.guidance_embeds = spec.guidance_embeds
        self.vae = vae
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.adapter = FluxAdapter(transformer, spec.rules.native_text_tokens, self.vae_scale_factor)
        self.scheduler = scheduler
        self.image_processor = image_processor
        self._encoder = encoder
        self._counter = counter
        self._lock = threading.Lock()
        self.device, self.dtype = device, dtype

    # -- checkpoint ---------------------------------------------------------------------------------

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """Spec from ``transformer/config.json``, ``vae/config.json`` and ``model_index.json``; request defaults
        from ``FluxPipeline.__call__``'s signature (:func:`pipeline_defaults`: 28 steps, guidance 3.5, true CFG
        1.0), FLUX.1-schnell's too: ``FluxPipeline`` defaults to 28 steps whatever the checkpoint (schnell's model
        card uses 4; set ``limits.default_steps`` or ask for quality ``low``/``medium``/``high``, 1/2/4 steps), and
        schnell ignores ``guidance_scale`` (no guidance embedding) as diffusers does.

        Raises:
            ValueError: the T5 tokenizer holds fewer tokens than the model is served with.
        """
        return cls.spec_from_configs(path, index, **pipeline_defaults(index["_class_name"]))

    @classmethod
    def spec_from_configs(cls, path: Path, index: dict, **defaults) -> ModelSpec:
        """:meth:`describe` with the request ``defaults`` (:class:`ModelSpec` fields) given instead of read from
        a diffusers pipeline (the tiny layout has none)."""
        tr = read_json(path / "transformer" / "config.json")
        vae = read_json(path / "vae" / "config.json")
        scale = 2 ** (len(vae["block_out_channels"]) - 1)
        tokens = int(index.get("bcg_text_tokens", FLUX_DEFAULT_TEXT_TOKENS))
        tok_cfg = path / "tokenizer_2" / "tokenizer_config.json"
        limit = read_json(tok_cfg).get("model_max_length") if tok_cfg.is_file() else None
        if isinstance(limit, int) and limit < tokens:
            raise ValueError(f"checkpoint {str(path)!r}: tokenizer_2 holds at most {limit} tokens "
                             f"(model_max_length in {tok_cfg}), but the model is served with {tokens} T5 tokens; "
                             f"set bcg_text_tokens in model_index.json to at most {limit} (and text_lengths to match)")
        return ModelSpec(
            name=path.name, family=cls.name, pipeline_class=index["_class_name"],
            rules=ShapeRules(pixels_per_token=scale * 2 * int(tr.get("patch_size", 1)), grid_keyed=False,
                             native_text_tokens=tokens),
            guidance_embeds=bool(tr.get("guidance_embeds", False)), cfg_rule="true_cfg",
            quality_steps=QUALITY_STEPS["flux-dev" if tr.get("guidance_embeds", False) else "flux-schnell"],
            edit_pipelines=("FluxImg2ImgPipeline", "FluxInpaintPipeline") if index["_class_name"] == "FluxPipeline"
            else None, cache_methods=CACHE_METHODS,
            **{"default_size": (FLUX_DEFAULT_SAMPLE_SIZE * scale,) * 2, **defaults},
        )

    @classmethod
    def token_counter(cls, path: Path, index: dict):
        """T5 tokens of a prompt (``tokenizer_2``), with the end-of-sequence token."""
        from transformers import AutoTokenizer

        return tokenizer_counter(AutoTokenizer.from_pretrained(str(path / "tokenizer_2"), local_files_only=True))

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> FluxFamily:
        """Load with ``FluxPipeline.from_pretrained`` (local files only, :func:`load_pipeline`) onto ``device``."""
        from diffusers import FluxPipeline

        spec = cls.describe(path, index)
        pipe = load_pipeline(FluxPipeline, path, device, dtype)
        tokens = spec.rules.native_text_tokens

        def encode(prompt: str) -> TextRows:
            seq, pooled, _ = pipe.encode_prompt(prompt=[prompt], prompt_2=None, device=device,
                                                num_images_per_prompt=1, max_sequence_length=tokens)
            return TextRows(seq, pooled)

        counter = cls.token_counter(path, index)
        return cls(path.name, spec, pipe.transformer, pipe.vae, pipe.scheduler, pipe.image_processor, encode,
                   counter, device, dtype)

    # -- validation hooks ---------------------------------------------------------------------------

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """Tokens of ``prompt`` in the sequence encoder (prompts and negative prompts alike)."""
        with self._lock:
            return self._counter(prompt)

    # -- the step-level loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, prompt: str) -> TextRows:
        """One prompt's text rows (serialised: tokenizers keep mutable padding state)."""
        with self._lock:
            return self._encoder(prompt)

    @torch.inference_mode()
    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode, draw packed noise as ``FluxPipeline.prepare_latents`` and set the shifted schedule; an edit (an
        ``image``) starts from its image (:func:`~bcg_core.families.flux_edit.start_edit`)."""
        from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift, retrieve_timesteps
        from diffusers.utils.torch_utils import randn_tensor

        req = validated.request
        if req.image is not None:
            from bcg_core.families.flux_edit import start_edit

            return start_edit(self, validated, cancel)
        cond = self.encode(req.prompt)
        uncond = self.encode(req.negative_prompt or "") if self.spec.uses_cfg(req) else None
        h, w = self.rules.grid(req.width, req.height)
        channels = self.adapter.in_channels // 4
        gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        noise = randn_tensor((req.n, channels, 2 * h, 2 * w), generator=gens, device=self.device,
                             dtype=cond.text.dtype)
        latents = FluxPipeline._pack_latents(noise, req.n, channels, 2 * h, 2 * w)
        sched = copy.deepcopy(self.scheduler)
        steps = req.num_inference_steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if getattr(sched.config, "use_flow_sigmas", False):
            sigmas = None
        c = sched.config
        mu = calculate_shift(latents.shape[1], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(sched, steps, self.device, sigmas=sigmas, mu=mu)
        sched.set_begin_index(0)
        extras = {}
        if self.guidance_embeds:  # FluxPipeline: torch.full([1], guidance_scale, float32).expand(batch)
            extras["guidance"] = torch.full([1], float(req.guidance_scale), device=self.device, dtype=torch.float32)
        return RequestState(validated, cond, uncond, latents, sched, timesteps, (h, w), extras=extras, cancel=cancel)

    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """Cond rows (one per image), then with true CFG the uncond rows; timestep ``t / 1000`` per row."""
        n, lat = state.n, state.latents
        parts = [state.cond] + ([state.uncond] if state.cfg else [])
        x = torch.cat([lat] * len(parts)) if len(parts) > 1 else lat
        text = torch.cat([p.text.expand(n, -1, -1) for p in parts])
        pooled = torch.cat([p.pooled.expand(n, -1) for p in parts])
        timestep = state.timestep.expand(x.shape[0]).to(lat.dtype) / 1000
        guidance = state.extras.get("guidance")
        if guidance is not None:
            guidance = guidance.expand(x.shape[0])
        return DenoiseInputs(x, text, pooled, timestep, state.grid, guidance)

    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """``neg + scale * (cond - neg)`` with true CFG, then the request's flow-matching Euler step (and, inpainting,
        its known region put back: :func:`~bcg_core.families.edit_view.blend_known_region`)."""
        noise = output
        if state.cfg:
            cond, neg = output[: state.n], output[state.n :]
            noise = neg + self.spec.cfg_scale(state.request) * (cond - neg)
        dtype = state.latents.dtype
        state.latents = state.scheduler.step(noise, state.timestep, state.latents, return_dict=False)[0]
        if "inpaint" in state.extras:
            from bcg_core.families.edit_view import blend_known_region

            blend_known_region(state, dtype)
        state.step_index += 1

    def cache_contexts(self, state: RequestState) -> list[tuple[str, slice]]:
        """``FluxPipeline`` runs the cond rows under ``cache_context("cond")`` and, with true CFG, the uncond rows under
        ``cache_context("uncond")`` (pipeline_flux.py ``__call__``): :meth:`model_rows`' two halves."""
        n = state.n
        return [("cond", slice(0, n))] + ([("uncond", slice(n, 2 * n))] if state.cfg else [])

    def euler_step(self, state: RequestState):
        """The fused form of the next step (:func:`bcg_core.runners.fused.euler_step`): cond rows first, then with
        true CFG the uncond rows, ``neg + scale * (cond - neg)`` as :meth:`advance`."""
        from bcg_core.runners.fused import euler_step

        if "inpaint" in state.extras:  # the blend after each step runs on the host
            return None
        scale = self.spec.cfg_scale(state.request) if state.cfg else 1.0
        return euler_step(state, 0, state.n if state.cfg else None, scale, self.dtype)

    @functools.cached_property
    def _preview(self):
        from bcg_core.preview import vae_preview

        return vae_preview(self.vae, self.vae_scale_factor)

    @torch.inference_mode()
    def preview(self, state: RequestState, latents: torch.Tensor) -> list[np.ndarray]:
        """``n`` previews of mid-denoise ``latents`` (a copy of ``state.latents``, packed tokens): unpacked and
        unscaled as :meth:`decode` does, then the VAE's fitted linear latent-to-RGB map
        (:class:`~bcg_core.preview.LinearPreview`): (h, w, 3) uint8 at latent resolution (1/8 of the size)."""
        from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

        req = state.request
        z = FluxPipeline._unpack_latents(latents, req.height, req.width, self.vae_scale_factor)
        return self._preview(z / self.vae.config.scaling_factor + self.vae.config.shift_factor)

    @torch.inference_mode()
    def decode(self, state: RequestState) -> list[np.ndarray]:
        """Unpack, unscale (``z / scaling + shift``), VAE decode, ``postprocess`` to uint8 RGB."""
        from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

        req = state.request
        z = FluxPipeline._unpack_latents(state.latents, req.height, req.width, self.vae_scale_factor)
        z = z / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
        return [np.asarray(im) for im in self.image_processor.postprocess(image, output_type="pil")]
