"""PixArt-Sigma family: ``PixArtSigmaPipeline`` checkpoints, served step by step, and their padding adapter.

What diffusers 0.42.1 does (``pipelines/pixart_alpha/pipeline_pixart_sigma.py``, ``PixArtSigmaPipeline``
``__call__`` unless named otherwise), and how this module does the same:

- Resolution binning (``use_resolution_binning=True``, the default): the requested size is mapped to the
  nearest aspect-ratio bin (``PixArtImageProcessor.classify_height_width_bin``) of the table that
  ``transformer.config.sample_size`` selects (256 -> ``ASPECT_RATIO_2048_BIN``, 128 -> 1024, 64 -> 512,
  32 -> 256; any other value raises "Invalid sample size"). Latents are generated at the bin size and the
  decoded image is resized back (``resize_and_crop_tensor``: bilinear resize to cover, then a centre crop).
  :meth:`PixArtSigmaFamily.generation_size` is that bin (``ModelSpec.size_bins`` carries the table, so the
  ingress bins without weights); :meth:`PixArtSigmaFamily.decode` resizes back the same way.
- Text: ``encode_prompt(..., clean_caption=True, max_sequence_length=300)``, called exactly as ``__call__``
  calls it: ``_text_preprocessing`` cleans the caption when bs4 and ftfy are installed and silently falls
  back to ``lower().strip()`` when they are not; whichever runs, it runs here too. T5 pads to 300 tokens and
  the tokenizer's mask goes to the transformer as ``encoder_attention_mask``. The pad tokens' embeddings are
  masked (bias -10000, exp() = 0 in fp32), so this module keeps the real tokens only (the mask's count,
  after preprocessing and truncation to 300) and the key's text dimension is that count rounded up to a
  text bucket; :meth:`PixArtSigmaFamily.count_tokens` counts exactly those tokens (the same preprocessing
  and tokenizer call). On an AVX-512 CPU, text buckets that are multiples of 16 keep the padded forward
  bit-identical to diffusers' 300-token one (a shorter tail chunk sums in another order, ~5e-7 off).
- CFG: ``guidance_scale > 1`` (``do_classifier_free_guidance``); the negative prompt defaults to ``""`` and
  is encoded like the prompt; rows are ``[uncond, cond]`` and ``uncond + g * (cond - uncond)`` is applied to
  all output channels before the learned-sigma half is dropped (``out_channels // 2 == in_channels``: the
  first ``in_channels`` are kept).
- Schedule: the checkpoint's scheduler (DPM-Solver++ 2M with ``lower_order_final``: a first-order last
  step), one instance per request (its multistep history lives in it), ``retrieve_timesteps(sched, N,
  device)``; latents are drawn by ``prepare_latents`` from the request's generators after the timesteps
  are set, scaled by that scheduler's ``init_noise_sigma``; ``scale_model_input`` each step; ``step`` gets
  the pipeline's ``prepare_extra_step_kwargs(generators, eta=0.0)`` (the generators, for SDE variants).
- Timestep: ``t.expand(rows)`` of the integer timesteps, undivided (in fp32 here, exact below 2**24; the
  transformer's sinusoidal embedding casts to fp32 anyway).
- Decode: ``vae.decode(z / scaling_factor)`` (no shift factor), resize back, ``postprocess`` to PIL.
"""

from __future__ import annotations

import copy
import functools
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bcg_core.capabilities import Previews
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, heads_width, load_pipeline, read_json
from bcg_core.families.defaults import pipeline_defaults
from bcg_core.families.state import RequestState, TextRows, pad_text
from bcg_core.padding import DenoiseInputs, GridMaskedTextAdapter
from bcg_core.table import ShapeRules

__all__ = ["PIXART_SIGMA_MAX_TEXT_TOKENS", "PixArtAdapter", "PixArtSigmaFamily", "aspect_ratio_bins"]

PIXART_SIGMA_MAX_TEXT_TOKENS = 300
"""``PixArtSigmaPipeline``'s ``max_sequence_length``: the most T5 tokens PixArt-Sigma was trained with."""

_ADDED_COND = {"resolution": None, "aspect_ratio": None}


def aspect_ratio_bins(sample_size: int) -> dict[str, list[float]]:
    """The resolution-binning table ``PixArtSigmaPipeline.__call__`` picks for ``transformer.config.sample_size``.

    Args:
        sample_size: latent pixels per side the transformer was trained at: 256 -> ``ASPECT_RATIO_2048_BIN``,
            128 -> ``ASPECT_RATIO_1024_BIN``, 64 -> ``ASPECT_RATIO_512_BIN``, 32 -> ``ASPECT_RATIO_256_BIN``.

    Returns:
        ``{"aspect ratio": [height, width]}`` in pixels.

    Raises:
        ValueError: any other sample size (diffusers raises "Invalid sample size" for it).
    """
    from diffusers.pipelines.pixart_alpha import pipeline_pixart_sigma as ps

    tables = {256: ps.ASPECT_RATIO_2048_BIN, 128: ps.ASPECT_RATIO_1024_BIN, 64: ps.ASPECT_RATIO_512_BIN,
              32: ps.ASPECT_RATIO_256_BIN}
    if sample_size not in tables:
        raise ValueError(f"transformer sample_size {sample_size} has no resolution-binning table in "
                         f"PixArtSigmaPipeline (diffusers raises 'Invalid sample size'); supported: 32, 64, 128, 256")
    return tables[sample_size]


class PixArtAdapter(GridMaskedTextAdapter):
    """PixArt family (diffusers ``PixArtTransformer2DModel``): exact latent grid, masked text buckets.

    How the model runs (``diffusers/models/transformers/pixart_transformer_2d.py`` unless named otherwise):

    - ``forward`` takes the latent image (B, C, H, W) and computes the token grid ``H // patch, W // patch``
      as Python ints; ``PatchEmbed`` recomputes the sin-cos position table for that grid, and the
      unpatchify reshapes by it. A captured graph bakes in one (h, w): the key carries ``latent_hw``
      (``grid_keyed=True``) and image tokens are never rounded up.
    - Text is only keys and values of cross-attention (``caption_projection`` is per token), masked by the
      2-D ``encoder_attention_mask`` turned into a bias ``(1 - mask) * -10000``: masked pad tokens add
      exp(-10000) = 0 in fp32, so text lengths are bucketed (``native_text_tokens=None``) and pad tokens are
      zero vectors with mask False. The unpadded reference passes an all-True mask of the real length (on
      CUDA a mask can select another SDPA kernel; the pipeline always passes one).
    - Timestep: the scheduler's integer timesteps in [0, 1000), undivided; the static buffer holds them in
      fp32 whatever the model dtype (exact for integers; bf16 would round 999 to 1000).
    - ``added_cond_kwargs={"resolution": None, "aspect_ratio": None}`` as the pipeline passes;
      micro-conditioned models (PixArt-Alpha 1024) are refused.
    - Batch: pad rows copy real row 0 (its mask too, so no row is all-masked) and are dropped after.

    Layout: ``DenoiseInputs.latents`` (rows, in_channels, h * patch, w * patch); ``text`` (rows, T,
    caption_channels) with ``text_mask`` (rows, T) bool or None (all real); ``pooled`` (rows, 0);
    ``timestep`` (rows,). Output: (rows, out_channels, h * patch, w * patch).

    Args:
        model: a ``PixArtTransformer2DModel`` with ``use_additional_conditions`` False.
        max_text_tokens: the longest text the model was trained with (300 T5 tokens for PixArt-Sigma); a
            bucket with more text tokens is a start-up error.
        vae_scale_factor: pixels per latent pixel (8 for PixArt's SDXL VAE).

    Raises:
        ValueError: if the model uses additional (resolution, aspect-ratio) conditions.
    """

    family = "pixart"

    def __init__(self, model: torch.nn.Module, max_text_tokens: int = PIXART_SIGMA_MAX_TEXT_TOKENS,
                 vae_scale_factor: int = 8):
        if model.use_additional_conditions:
            raise ValueError("PixArtAdapter serves PixArt-Sigma (use_additional_conditions=False); this "
                             "model wants per-row resolution and aspect-ratio conditions (PixArt-Alpha 1024)")
        cfg = model.config
        self.model = model
        self.patch = int(cfg.patch_size)
        self.rules = ShapeRules(pixels_per_token=vae_scale_factor * self.patch, grid_keyed=True,
                                native_text_tokens=None)
        self.in_channels = int(cfg.in_channels)
        self.out_channels = int(model.out_channels)
        self.seq_dim = int(cfg.caption_channels or cfg.cross_attention_dim)
        self.max_text_tokens = max_text_tokens

    def _call(self, latents, text, mask, timestep) -> torch.Tensor:
        return self.model(
            latents, encoder_hidden_states=text, timestep=timestep, added_cond_kwargs=_ADDED_COND,
            encoder_attention_mask=mask, return_dict=False,
        )[0]


def _caption_pipeline(tokenizer):
    """A ``PixArtSigmaPipeline`` holding only ``tokenizer``: its ``_text_preprocessing`` without weights."""
    from diffusers import PixArtSigmaPipeline

    return PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=None, vae=None, transformer=None, scheduler=None)


def _kept_tokens(pipe, prompt: str) -> int:
    """T5 tokens of ``prompt`` that ``encode_prompt`` keeps unmasked: the same preprocessing
    (``_text_preprocessing(clean_caption=True)``) and tokenizer call, the mask's count."""
    from diffusers.utils import is_bs4_available, is_ftfy_available

    # what clean_caption=True does, without the two warnings diffusers logs for every prompt when bs4 or ftfy is
    # missing (it then falls back to clean_caption=False, as asked for here)
    text = pipe._text_preprocessing(prompt, clean_caption=is_bs4_available() and is_ftfy_available())
    ids = pipe.tokenizer(text, padding="max_length", max_length=PIXART_SIGMA_MAX_TEXT_TOKENS, truncation=True,
                         add_special_tokens=True, return_tensors="pt")
    return int(ids.attention_mask.sum())


class PixArtSigmaFamily(Previews):
    """A ``PixArtSigmaPipeline`` checkpoint, served step by step (see the module docstring).

    Build with :meth:`load`. Request fields: ``guidance_scale`` > 1 runs CFG with uncond rows of
    ``negative_prompt`` (default ``""``); ``true_cfg_scale`` is refused (no such option in the pipeline).

    Args:
        spec: the model's :class:`ModelSpec` (:meth:`describe`).
        pipe: the loaded ``PixArtSigmaPipeline`` on ``device`` (its scheduler is a template: each request
            gets a deep copy).
    """

    name = "pixart"
    pipeline_classes = ("PixArtSigmaPipeline",)
    lora_loader = None  # PixArtSigmaPipeline has no LoRA loader in diffusers
    transformer_width = staticmethod(heads_width)
    guidance_embeds = False

    def __init__(self, spec: ModelSpec, pipe, device: torch.device, dtype: torch.dtype):
        self.model_name = spec.name
        self.spec = spec
        self.pipe = pipe
        self.adapter = PixArtAdapter(pipe.transformer, PIXART_SIGMA_MAX_TEXT_TOKENS, pipe.vae_scale_factor)
        self.rules = self.adapter.rules
        if self.rules != spec.rules:
            raise ValueError(f"loaded transformer's shape rules {self.rules} differ from its config's {spec.rules}")
        self.device, self.dtype = device, dtype
        cfg = pipe.transformer.config
        # PixArtSigmaPipeline.__call__: keep the first half of the channels when they hold a learned sigma.
        self._learned_sigma = cfg.out_channels // 2 == cfg.in_channels
        self._lock = threading.Lock()  # tokenizers keep mutable padding state: one caller at a time

    # -- checkpoint ---------------------------------------------------------------------------------

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """Spec from ``transformer/config.json`` and ``vae/config.json``: grid-keyed, masked text, the
        aspect-ratio bins of the transformer's ``sample_size``.

        Raises:
            ValueError: no tokenizer or text encoder, a micro-conditioned transformer
                (``use_additional_conditions``, PixArt-Alpha 1024), a sample size without a bin table, or bins
                that are not multiples of the token size.
        """
        missing = [c for c in ("tokenizer", "text_encoder") if not (index.get(c) or [None])[-1]]
        if missing:
            raise ValueError(f"{path}: model_index.json has no {' and '.join(missing)}; PixArtSigmaPipeline can "
                             f"then only take precomputed prompt embeddings, which bcg-serve does not accept")
        tr = read_json(path / "transformer" / "config.json")
        vae = read_json(path / "vae" / "config.json")
        sample = int(tr.get("sample_size", 128))  # PixArtTransformer2DModel's defaults where a key is absent
        micro = tr.get("use_additional_conditions")
        if micro is None:  # PixArtTransformer2DModel.__init__: None means "sample_size == 128"
            micro = sample == 128
        if micro:
            raise ValueError(f"{path}: the transformer uses additional (resolution, aspect-ratio) conditions "
                             f"(PixArt-Alpha 1024); PixArtSigmaPipeline passes none: set use_additional_conditions "
                             f"false or serve it with its own pipeline")
        scale = 2 ** (len(vae["block_out_channels"]) - 1)
        rules = ShapeRules(pixels_per_token=scale * int(tr.get("patch_size", 2)), grid_keyed=True,
                           native_text_tokens=None)
        bins = aspect_ratio_bins(sample)
        m = rules.pixels_per_token
        bad = [f"{int(w)}x{int(h)}" for h, w in bins.values() if int(h) % m or int(w) % m]
        if bad:
            raise ValueError(f"{path}: aspect-ratio bins {', '.join(bad)} of sample_size {sample} are not multiples "
                             f"of the token size {m} px (VAE x patch); this checkpoint cannot be bucketed")
        return ModelSpec(name=path.name, family=cls.name, pipeline_class=index["_class_name"], rules=rules,
                         cfg_rule="guidance_scale", size_bins={k: list(v) for k, v in bins.items()},
                         max_text_tokens=PIXART_SIGMA_MAX_TEXT_TOKENS, quality_steps=QUALITY_STEPS["pixart"],
                         default_size=(sample * scale,) * 2,  # PixArtSigmaPipeline: sample_size * vae_scale_factor
                         **pipeline_defaults(index["_class_name"]))

    @classmethod
    def token_counter(cls, path: Path, index: dict):
        """``prompt -> T5 tokens kept by encode_prompt`` (after caption preprocessing, at most 300, with
        ``</s>``), from the tokenizer folder only (the class ``model_index.json`` names)."""
        import transformers

        _, name = index["tokenizer"]
        tok = getattr(transformers, name).from_pretrained(str(path / "tokenizer"), local_files_only=True)
        pipe, lock = _caption_pipeline(tok), threading.Lock()

        def count(prompt: str, negative: bool = False) -> int:
            with lock:
                return _kept_tokens(pipe, prompt)

        return count

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> PixArtSigmaFamily:
        """Load with ``PixArtSigmaPipeline.from_pretrained`` (local files only) and move to ``device``."""
        from diffusers import PixArtSigmaPipeline

        spec = cls.describe(path, index)
        pipe = load_pipeline(PixArtSigmaPipeline, path, device, dtype)
        return cls(spec, pipe, device, dtype)

    # -- validation hooks ---------------------------------------------------------------------------

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """T5 tokens of ``prompt`` that ``encode_prompt`` keeps (as :meth:`token_counter`)."""
        with self._lock:
            return _kept_tokens(self.pipe, prompt)

    # -- the step-level loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode (prompt, and negative prompt with CFG), set the request's own timesteps, draw the noise at
        the bin size from generators seeded ``seed + i``."""
        from diffusers import PixArtSigmaPipeline
        from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import retrieve_timesteps

        req = validated.request
        cfg = self.spec.uses_cfg(req)
        gen_w, gen_h = self.spec.generation_size(req.width, req.height)
        with self._lock:
            pe, pm, ne, nm = self.pipe.encode_prompt(
                req.prompt, cfg, negative_prompt=req.negative_prompt or "", num_images_per_prompt=1,
                device=self.device, clean_caption=True, max_sequence_length=PIXART_SIGMA_MAX_TEXT_TOKENS)
        cond = _real_tokens(pe, pm)
        uncond = _real_tokens(ne, nm) if cfg else None
        sched = copy.deepcopy(self.pipe.scheduler)
        timesteps, _ = retrieve_timesteps(sched, req.num_inference_steps, self.device)
        gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        # The pipeline's own prepare_latents, with this request's scheduler in place of the shared one (its
        # init_noise_sigma after set_timesteps, as __call__ reads it).
        owner = SimpleNamespace(vae_scale_factor=self.pipe.vae_scale_factor, scheduler=sched)
        latents = PixArtSigmaPipeline.prepare_latents(owner, req.n, self.adapter.in_channels, gen_h, gen_w, pe.dtype,
                                                      self.device, gens)
        extras = {"size": (req.width, req.height), "generation_size": (gen_w, gen_h),
                  "step_kwargs": self.pipe.prepare_extra_step_kwargs(gens, 0.0)}
        return RequestState(validated, cond, uncond, latents, sched, timesteps, self.rules.grid(gen_w, gen_h),
                            extras=extras, cancel=cancel)

    @torch.inference_mode()
    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """With CFG the uncond rows (one per image), then the cond rows; text padded to the longer of the two
        with masked zeros; ``scale_model_input`` latents; the timestep per row in fp32."""
        t = state.timestep
        x = torch.cat([state.latents] * 2) if state.cfg else state.latents
        x = state.scheduler.scale_model_input(x, t)
        parts = [state.uncond, state.cond] if state.cfg else [state.cond]
        tokens = max(p.tokens for p in parts)
        parts = [pad_text(p, tokens) for p in parts]
        n = state.n
        text = torch.cat([p.text.expand(n, -1, -1) for p in parts])
        mask = torch.cat([p.mask.expand(n, -1) for p in parts])
        rows = x.shape[0]
        return DenoiseInputs(x, text, x.new_zeros(rows, 0), t[None].to(torch.float32).expand(rows), state.grid,
                             text_mask=mask)

    @torch.inference_mode()
    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """``uncond + g * (cond - uncond)`` on all channels, the first half kept (learned sigma), then the
        request's scheduler step."""
        noise = output
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
        (h, w, 3) uint8 at latent resolution (1/8 of the aspect-ratio bin's size; the caller resizes)."""
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


def _real_tokens(embeds: torch.Tensor, mask: torch.Tensor) -> TextRows:
    """The unmasked tokens of one ``encode_prompt`` row: (1, 300, D) and (1, 300) -> (1, T, D), mask (1, T).

    Raises:
        ValueError: a mask that is not right-padded (real tokens first), which the slice would get wrong.
    """
    real = int(mask[0].sum())
    if not bool(mask[0, :real].all()):
        raise ValueError("T5 attention mask is not right-padded; the tokenizer must pad on the right")
    return TextRows(embeds[:, :real], embeds.new_zeros(1, 0), mask[:, :real].to(torch.bool))
