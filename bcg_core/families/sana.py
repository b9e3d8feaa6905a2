"""SANA family: ``SanaPipeline`` checkpoints, served step by step, and their padding adapter.

What diffusers 0.42.1 does (``pipelines/sana/pipeline_sana.py``, ``SanaPipeline.__call__`` unless named
otherwise), and how this module does the same:

- Resolution binning (``use_resolution_binning=True``, the default): ``transformer.config.sample_size``
  picks the bin table (128 -> ``ASPECT_RATIO_4096_BIN``, 64 -> 2048, 32 -> 1024, 16 -> 512; any other
  value raises "Invalid sample size"); the latents are generated at the nearest aspect-ratio bin
  (``classify_height_width_bin``) and the decoded image is resized back (``resize_and_crop_tensor``).
  ``ModelSpec.size_bins`` carries the table (the ingress bins without weights); :meth:`SanaFamily.decode`
  resizes back the same way.
- Text: ``encode_prompt`` with ``__call__``'s defaults (``clean_caption=False``: ``lower().strip()``;
  ``max_sequence_length=300``; the default ``complex_human_instruction``, read from ``__call__``'s signature
  so it cannot drift). The instruction is prepended to the prompt, the tokenizer pads to
  ``num_chi_prompt_tokens + 300 - 2`` (``_get_gemma_prompt_embeds``) and ``encode_prompt`` keeps
  ``[0] + last 299`` positions (``select_index``): 300 Gemma2 embeddings and their mask, which is a prefix
  (bos, the instruction's tail, the prompt; then pads). The negative prompt (default ``""``) is encoded
  *without* the instruction and without ``select_index``: its first 300 tokens. The pads are masked in the
  cross-attention (bias -10000, exp() = 0 in fp32), so this module keeps the real tokens only, and
  :meth:`SanaFamily.count_tokens` counts exactly those (the same preprocessing, tokenizer call and
  ``select_index``; ``negative=True`` counts as the negative prompt is encoded).
- CFG: ``guidance_scale > 1`` (default 4.5); rows are ``[uncond, cond]`` and
  ``uncond + g * (cond - uncond)`` is applied on the float output before a learned-sigma half (if
  ``out_channels // 2 == in_channels``) is dropped.
- Schedule: the checkpoint's scheduler, one deep copy per request (DPM-Solver++ keeps its multistep
  history in it), ``retrieve_timesteps(sched, N, device)``. With SANA's DPM-Solver (``use_flow_sigmas``,
  ``flow_prediction``) the timesteps are ``sigma * 1000`` truncated to int64 by the scheduler itself
  (``DPMSolverMultistepScheduler.set_timesteps``); ``FlowMatchEulerDiscreteScheduler`` keeps floats. The
  transformer gets ``t.expand(rows) * transformer.config.timestep_scale`` (int64 x float -> fp32).
- Latents: ``prepare_latents(n, in_channels, bin_h, bin_w, torch.float32, ...)`` from the request's
  generators (no ``init_noise_sigma``, no ``scale_model_input`` in SANA's loop); they stay fp32 and are
  cast to the transformer's dtype for the forward; ``step`` gets ``prepare_extra_step_kwargs(gens, 0.0)``.
- Decode: ``vae.decode(z / scaling_factor)`` (DC-AE, no shift factor), resize back, ``postprocess``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
from pathlib import Path

import numpy as np
import torch

from bcg_core.capabilities import Previews
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, heads_width, load_pipeline, read_json
from bcg_core.families.defaults import pipeline_defaults
from bcg_core.families.state import RequestState, TextRows, pad_text
from bcg_core.padding import DenoiseInputs, GridMaskedTextAdapter
from bcg_core.table import ShapeRules

__all__ = ["SANA_MAX_TEXT_TOKENS", "SanaAdapter", "SanaFamily", "complex_human_instruction", "sana_bins"]

SANA_MAX_TEXT_TOKENS = 300
"""``SanaPipeline.__call__``'s ``max_sequence_length``: the embedding length the model was trained with."""


def complex_human_instruction() -> list[str]:
    """The default ``complex_human_instruction`` of ``SanaPipeline.__call__`` (read from its signature)."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


def sana_bins(sample_size: int) -> dict[str, list[float]]:
    """The resolution-binning table ``SanaPipeline.__call__`` picks for ``transformer.config.sample_size``.

    Raises:
        ValueError: any size but 16, 32, 64 or 128 (diffusers raises "Invalid sample size").
    """
    from diffusers.pipelines.sana import pipeline_sana as ps

    tables = {128: ps.ASPECT_RATIO_4096_BIN, 64: ps.ASPECT_RATIO_2048_BIN, 32: ps.ASPECT_RATIO_1024_BIN,
              16: ps.ASPECT_RATIO_512_BIN}
    if sample_size not in tables:
        raise ValueError(f"transformer sample_size {sample_size} has no resolution-binning table in SanaPipeline "
                         f"(diffusers raises 'Invalid sample size'); supported: 16, 32, 64, 128")
    return {k: list(v) for k, v in tables[sample_size].items()}


class SanaAdapter(GridMaskedTextAdapter):
    """SANA (diffusers ``SanaTransformer2DModel``): exact latent grid, masked text buckets.

    How the model runs (``diffusers/models/transformers/sana_transformer.py`` lines, 0.42.1):

    - ``forward`` reads ``batch_size, num_channels, height, width = hidden_states.shape`` (486) and passes
      ``post_patch_height, post_patch_width`` (488) as Python ints to every block; the feed-forward
      ``GLUMBConv`` unflattens the tokens to that (h, w) image (286) and runs a 3x3 depthwise conv over it
      (``conv_depth``, 55), and the unpatchify reshapes by them (542-546). With ``interpolation_scale`` set
      (``pos_embed_type="sincos"``, 379), ``PatchEmbed.forward`` also recomputes the sin-cos table for the
      grid (embeddings.py:375). The captured code therefore depends on (h, w) and on which tokens are
      neighbours: the key carries ``latent_hw`` (``grid_keyed=True``) and image tokens are never padded
      (a padded latent would feed the conv and the linear self-attention, ``SanaLinearAttnProcessor2_0``,
      which sums over every token without a mask).
    - Text is only the keys and values of the cross-attention (``SanaAttnProcessor2_0``);
      ``caption_projection`` and ``caption_norm`` are per token. The 2-D ``encoder_attention_mask`` becomes
      a bias ``(1 - mask) * -10000`` (482): masked pad tokens add exp(-10000) = 0 in fp32, so text lengths
      are bucketed (``native_text_tokens=None``) and pad tokens are zero vectors with mask False. The
      unpadded reference passes an all-True mask of the real length, as the pipeline always passes a mask.
    - Timestep: ``AdaLayerNormSingle`` embeds it with sinusoidal ``Timesteps``; the pipeline passes it in
      fp32 on the 0-1000 scale (``t * timestep_scale``) whatever the model dtype, so the static buffer is fp32.
    - Batch: pad rows copy real row 0 (its mask too: no row is all-masked) and are dropped after.
    - ``guidance_embeds`` models (SANA-Sprint) need a guidance input that ``SanaPipeline`` never passes: refused.

    Layout: ``DenoiseInputs.latents`` (rows, in_channels, h * patch, w * patch); ``text`` (rows, T,
    caption_channels) with ``text_mask`` (rows, T) bool or None (all real); ``pooled`` (rows, 0);
    ``timestep`` (rows,) fp32. Output: (rows, out_channels, h * patch, w * patch).

    Args:
        model: a ``SanaTransformer2DModel`` without ``guidance_embeds``.
        max_text_tokens: the longest text ``SanaPipeline`` feeds (300 Gemma2 tokens); a larger bucket is a
            start-up error.
        vae_scale_factor: pixels per latent pixel (32 for SANA's DC-AE).

    Raises:
        ValueError: a model with ``guidance_embeds``.
    """

    family = "sana"

    def __init__(self, model: torch.nn.Module, max_text_tokens: int = SANA_MAX_TEXT_TOKENS,
                 vae_scale_factor: int = 32):
        cfg = model.config
        if cfg.guidance_embeds:
            raise ValueError("SanaAdapter serves SanaPipeline transformers (guidance_embeds=False); this one "
                             "embeds a guidance scale (SANA-Sprint), which SanaPipeline never passes")
        self.model = model
        self.patch = int(cfg.patch_size)
        self.rules = ShapeRules(pixels_per_token=vae_scale_factor * self.patch, grid_keyed=True,
                                native_text_tokens=None)
        self.in_channels = int(cfg.in_channels)
        self.out_channels = int(cfg.out_channels or cfg.in_channels)
        self.seq_dim = int(cfg.caption_channels)
        self.max_text_tokens = max_text_tokens

    def _call(self, latents, text, mask, timestep) -> torch.Tensor:
        return self.model(latents, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=timestep,
                          return_dict=False)[0]


class _Counter:
    """Gemma2 tokens that ``SanaPipeline.encode_prompt`` keeps unmasked, from the tokenizer only.

    The same steps as ``_get_gemma_prompt_embeds`` and ``encode_prompt``: ``_text_preprocessing`` (of a
    pipeline that holds only the tokenizer), right padding, the instruction prepended and
    ``max_length = num_chi_prompt_tokens + 300 - 2``, then ``select_index = [0] + last 299``; the mask's count.
    The negative prompt: no instruction, ``max_length`` 300, no ``select_index``. Serialised by a lock (the
    tokenizer's ``padding_side`` is mutable state).
    """

    def __init__(self, tokenizer):
        from diffusers import SanaPipeline

        self.pipe = SanaPipeline(tokenizer=tokenizer, text_encoder=None, vae=None, transformer=None, scheduler=None)
        self.chi = "\n".join(complex_human_instruction())
        self.lock = threading.Lock()

    def __call__(self, prompt: str, negative: bool = False) -> int:
        tok = self.pipe.tokenizer
        with self.lock:
            tok.padding_side = "right"
            text = self.pipe._text_preprocessing(prompt, clean_caption=False)
            length = SANA_MAX_TEXT_TOKENS
            if not negative:
                text = [self.chi + t for t in text]
                length = len(tok.encode(self.chi)) + SANA_MAX_TEXT_TOKENS - 2
            mask = tok(text, padding="max_length", max_length=length, truncation=True, add_special_tokens=True,
                       return_tensors="pt").attention_mask
        if not negative:
            mask = mask[:, [0] + list(range(-SANA_MAX_TEXT_TOKENS + 1, 0))]
        return int(mask.sum())


def _real_tokens(embeds: torch.Tensor, mask: torch.Tensor) -> TextRows:
    """The unmasked tokens of one ``encode_prompt`` row: (1, 300, D) and (1, 300) -> (1, T, D), mask (1, T).

    Raises:
        ValueError: a mask that is not a prefix (real tokens first), which the slice would get wrong.
    """
    real = int(mask[0].sum())
    if not bool(mask[0, :real].all()):
        raise ValueError("Gemma attention mask is not a prefix after select_index; the tokenizer must pad right")
    return TextRows(embeds[:, :real], embeds.new_zeros(1, 0), mask[:, :real].to(torch.bool))


class SanaFamily(Previews):
    """A ``SanaPipeline`` checkpoint, served step by step (see the module docstring).

    Build with :meth:`load`. Request fields: ``guidance_scale`` > 1 runs CFG with uncond rows of
    ``negative_prompt`` (default ``""``); ``true_cfg_scale`` is refused (no such option in the pipeline).

    Args:
        spec: the model's :class:`ModelSpec` (:meth:`describe`).
        pipe: the loaded ``SanaPipeline`` on ``device`` (its scheduler is a template: each request gets a
            deep copy).
    """

    name = "sana"
    pipeline_classes = ("SanaPipeline",)
    lora_loader = "SanaPipeline"
    transformer_width = staticmethod(heads_width)
    guidance_embeds = False

    def __init__(self, spec: ModelSpec, pipe, device: torch.device, dtype: torch.dtype):
        self.model_name = spec.name
        self.spec = spec
        self.pipe = pipe
        self.adapter = SanaAdapter(pipe.transformer, SANA_MAX_TEXT_TOKENS, pipe.vae_scale_factor)
        self.rules = self.adapter.rules
        if self.rules != spec.rules:
            raise ValueError(f"loaded transformer's shape rules {self.rules} differ from its config's {spec.rules}")
        self.device, self.dtype = device, dtype
        cfg = pipe.transformer.config
        # SanaPipeline.__call__ "learned sigma": keep the first half of the channels.
        self._learned_sigma = cfg.out_channels // 2 == cfg.in_channels
        self._counter = _Counter(pipe.tokenizer)
        self._instruction = complex_human_instruction()

    # -- checkpoint ---------------------------------------------------------------------------------

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """Spec from ``transformer/config.json`` and ``vae/config.json``: grid-keyed, masked text, the
        aspect-ratio bins of the transformer's ``sample_size``.

        Raises:
            ValueError: a guidance-embedding transformer (SANA-Sprint), a scheduler with
                ``use_dynamic_shifting`` (``__call__`` passes no ``mu``: diffusers itself fails), a sample size
                without a bin table, or bins that are not multiples of the token size.
        """
        tr = read_json(path / "transformer" / "config.json")
        vae = read_json(path / "vae" / "config.json")
        if tr.get("guidance_embeds"):
            raise ValueError(f"{path}: the transformer embeds a guidance scale (SANA-Sprint); SanaPipeline "
                             f"never passes one: serve it with SanaSprintPipeline")
        sched = path / "scheduler" / "scheduler_config.json"
        if sched.exists() and read_json(sched).get("use_dynamic_shifting"):
            raise ValueError(f"{path}: scheduler use_dynamic_shifting=true needs a mu that SanaPipeline.__call__ "
                             f"never passes to retrieve_timesteps (diffusers fails on it); set it to false")
        # SanaPipeline.__init__: vae_scale_factor = 2 ** (len(encoder_block_out_channels) - 1)
        scale = 2 ** (len(vae["encoder_block_out_channels"]) - 1)
        rules = ShapeRules(pixels_per_token=scale * int(tr.get("patch_size", 1)), grid_keyed=True,
                           native_text_tokens=None)
        bins = sana_bins(int(tr.get("sample_size") or 0))
        m = rules.pixels_per_token
        bad = [f"{int(w)}x{int(h)}" for h, w in bins.values() if int(h) % m or int(w) % m]
        if bad:
            raise ValueError(f"{path}: aspect-ratio bins {', '.join(bad)} are not multiples of the token size "
                             f"{m} px (VAE x patch); this checkpoint cannot be bucketed")
        return ModelSpec(name=path.name, family=cls.name, pipeline_class=index["_class_name"], rules=rules,
                         cfg_rule="guidance_scale", size_bins=bins,
                         max_text_tokens=SANA_MAX_TEXT_TOKENS, quality_steps=QUALITY_STEPS["sana"],
                         **pipeline_defaults(index["_class_name"]))

    @classmethod
    def token_counter(cls, path: Path, index: dict):
        """``(prompt, negative=False) -> Gemma2 tokens kept by encode_prompt`` (see :class:`_Counter`), from
        the tokenizer folder only (the class ``model_index.json`` names)."""
        import transformers

        _, name = index.get("tokenizer", ["transformers", "GemmaTokenizer"])
        return _Counter(getattr(transformers, name).from_pretrained(str(path / "tokenizer"), local_files_only=True))

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> SanaFamily:
        """Load with ``SanaPipeline.from_pretrained`` (local files only) and move to ``device``."""
        from diffusers import SanaPipeline

        spec = cls.describe(path, index)
        pipe = load_pipeline(SanaPipeline, path, device, dtype)
        return cls(spec, pipe, device, dtype)

    # -- validation hooks ---------------------------------------------------------------------------

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """Gemma2 tokens of ``prompt`` that ``encode_prompt`` keeps, as a prompt (with the complex human
        instruction) or, ``negative=True``, as a negative prompt (as :meth:`token_counter`)."""
        return self._counter(prompt, negative)

    # -- the step-level loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode (prompt, and the negative prompt with CFG) with ``encode_prompt`` as ``__call__`` does, set the
        request's own timesteps, draw fp32 noise at the bin size from generators seeded ``seed + i``."""
        from diffusers.pipelines.sana.pipeline_sana import retrieve_timesteps

        req = validated.request
        cfg = self.spec.uses_cfg(req)
        gen_w, gen_h = self.spec.generation_size(req.width, req.height)
        with self._counter.lock:  # the tokenizer's padding_side is shared state
            pe, pm, ne, nm = self.pipe.encode_prompt(
                req.prompt, cfg, negative_prompt=req.negative_prompt or "", num_images_per_prompt=1,
                device=self.device, clean_caption=False, max_sequence_length=SANA_MAX_TEXT_TOKENS,
                complex_human_instruction=self._instruction)
        cond = _real_tokens(pe, pm)
        uncond = _real_tokens(ne, nm) if cfg else None
        sched = copy.deepcopy(self.pipe.scheduler)
        timesteps, _ = retrieve_timesteps(sched, req.num_inference_steps, self.device)
        gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        latents = self.pipe.prepare_latents(req.n, self.adapter.in_channels, gen_h, gen_w, torch.float32,
                                            self.device, gens)
        extras = {"size": (req.width, req.height), "generation_size": (gen_w, gen_h),
                  "step_kwargs": self.pipe.prepare_extra_step_kwargs(gens, 0.0)}
        return RequestState(validated, cond, uncond, latents, sched, timesteps, self.rules.grid(gen_w, gen_h),
                            extras=extras, cancel=cancel)

    @torch.inference_mode()
    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """With CFG the uncond rows (one per image), then the cond rows; text padded to the longer of the two
        with masked zeros; timestep ``t * timestep_scale`` per row, in fp32."""
        x = torch.cat([state.latents] * 2) if state.cfg else state.latents
        parts = [state.uncond, state.cond] if state.cfg else [state.cond]
        tokens = max(p.tokens for p in parts)
        parts = [pad_text(p, tokens) for p in parts]
        n, rows = state.n, x.shape[0]
        text = torch.cat([p.text.expand(n, -1, -1) for p in parts])
        mask = torch.cat([p.mask.expand(n, -1) for p in parts])
        timestep = state.timestep.expand(rows) * self.pipe.transformer.config.timestep_scale
        return DenoiseInputs(x, text, x.new_zeros(rows, 0), timestep.to(torch.float32), state.grid, text_mask=mask)

    @torch.inference_mode()
    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """``noise.float()``, ``uncond + g * (cond - uncond)``, the learned-sigma half dropped, then the request's
        scheduler step (with the pipeline's extra step kwargs)."""
        noise = output.float()
        if state.cfg:
            uncond, cond = noise.chunk(2)
            noise = uncond + self.spec.cfg_scale(state.request) * (cond - uncond)
        if self._learned_sigma:
            noise = noise.chunk(2, dim=1)[0]
        state.latents = state.scheduler.step(noise, state.timestep, state.latents, **state.extras["step_kwargs"],
                                             return_dict=False)[0]
        state.step_index += 1

    @functools.cached_property
    def _preview(self):
        from bcg_core.preview import vae_preview

        return vae_preview(self.pipe.vae, self.pipe.vae_scale_factor)

    @torch.inference_mode()
    def preview(self, state: RequestState, latents: torch.Tensor) -> list[np.ndarray]:
        """``n`` previews of mid-denoise ``latents`` (a copy of ``state.latents``): ``z / scaling_factor`` as
        :meth:`decode`, then the VAE's fitted linear latent-to-RGB map (:class:`~bcg_core.preview.LinearPreview`):
        (h, w, 3) uint8 at latent resolution (1/32 of the aspect-ratio bin's size; the caller resizes)."""
        return self._preview(latents / self.pipe.vae.config.scaling_factor)

    @property
    def vae(self) -> torch.nn.Module:
        """The pipeline's VAE (:attr:`~bcg_core.families.Family.vae`)."""
        return self.pipe.vae

    @torch.inference_mode()
    def decode(self, state: RequestState) -> list[np.ndarray]:
        """``vae.decode(z / scaling_factor)``, resized back from the bin to the requested size
        (``resize_and_crop_tensor``), ``postprocess`` to PIL, as uint8 (height, width, 3) arrays."""
        vae, proc = self.pipe.vae, self.pipe.image_processor
        image = vae.decode(state.latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        width, height = state.extras["size"]
        image = proc.resize_and_crop_tensor(image, width, height)
        return [np.asarray(im) for im in proc.postprocess(image, output_type="pil")]
