"""Stable Diffusion 3 and 3.5 (``StableDiffusion3Pipeline``): MMDiT keyed on the latent grid, unmasked text.

Everything below reproduces ``diffusers/pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py``
(diffusers 0.42.1, "the pipeline") by calling its own methods; line numbers are that file's unless named.

- Text (``encode_prompt``, called as ``__call__`` calls it, with ``prompt_2``/``prompt_3`` None so every
  encoder reads the prompt): CLIP-L and CLIP-G take their *penultimate* hidden states (``hidden_states[-2]``,
  line 328) and their projected ``text_embeds`` as pooled (line 325); the two are concatenated on channels,
  zero-padded to the T5 width (line 459) and put before the T5 tokens: 77 + ``max_sequence_length`` (256) =
  333 tokens, unmasked (T5 runs without an attention mask, and the joint attention takes none). Pooled:
  CLIP-L + CLIP-G.
  With CFG the negative prompt is encoded even when empty (``negative_prompt or ""``, line 467).
- CFG: ``do_classifier_free_guidance = guidance_scale > 1``; rows ``[uncond] * n + [cond] * n`` (line 998);
  ``uncond + guidance_scale * (cond - uncond)`` (line 1086). ``guidance_scale`` is the CFG scale; SD3 has no
  guidance embedding and no ``true_cfg_scale`` (FLUX and Qwen-Image only): :meth:`SD3Family.check` refuses it.
- Skip-layer guidance (``skip_guidance_layers``, SD3.5-medium's recommended extra: a third forward without
  some layers inside its own step window ``skip_layer_guidance_start/stop``) is not a request field and is not
  supported: every request runs the pipeline's default ``skip_guidance_layers=None``.
- Latents: ``prepare_latents`` (16, H/8, W/8) in the text-embedding dtype, from generators ``seed + i``.
- Timesteps: a deep copy of the pipeline's ``FlowMatchEulerDiscreteScheduler`` per request, set by the
  pipeline's ``retrieve_timesteps``; with ``use_dynamic_shifting`` the pipeline's ``calculate_shift`` gives
  ``mu`` from ``(H/8/patch) * (W/8/patch)`` image tokens with the config's fields (``max_shift`` falls back to
  1.16 there, not FLUX's 1.15; line 1016). The transformer gets ``t.expand(rows)`` undivided (0-1000, fp32).
- Decode: ``z / scaling_factor + shift_factor`` (1.5305, 0.0609 for SD3's VAE; line 1141), ``vae.decode`` of
  the request's ``n`` latents in one call, ``image_processor.postprocess(output_type="pil")``.
- Without T5 (``text_encoder_3: [null, null]`` in ``model_index.json``, as SD3 checkpoints saved with
  ``text_encoder_3=None``): ``StableDiffusion3Pipeline.from_pretrained`` refuses such a folder unless it is given
  ``text_encoder_3=None, tokenizer_3=None`` (the way diffusers' SD3 docs drop T5), so :meth:`SD3Family.load`
  passes them; ``encode_prompt`` then uses zeros for the 256 T5 tokens (``_get_t5_prompt_embeds``), the text
  keeps its 333 tokens, and prompts are counted with CLIP-L's tokenizer and refused above its 77 tokens.
- Edits (image to image, inpainting) equal ``StableDiffusion3Img2ImgPipeline`` and ``StableDiffusion3InpaintPipeline``:
  :mod:`bcg_core.families.sd3_edit` prepares their start; their forwards are text to image's.
- Refused at load (:meth:`SD3Family.describe`): a scheduler other than ``FlowMatchEulerDiscreteScheduler``,
  or one with ``stochastic_sampling`` (the pipeline draws that noise from the global RNG: not reproducible);
  a T5 encoder without its tokenizer; a transformer whose ``in_channels`` is not the VAE's latent channels (a
  33-channel inpainting-only transformer, which only ``StableDiffusion3InpaintPipeline`` runs).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from bcg_core.capabilities import FusedStep, Previews
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, heads_width, load_pipeline, read_json, tokenizer_counter
from bcg_core.families.defaults import pipeline_defaults
from bcg_core.families.state import RequestState, TextRows
from bcg_core.keys import BucketKey
from bcg_core.padding import DenoiseInputs, copy_rows
from bcg_core.table import ShapeRules

__all__ = ["SD3Adapter", "SD3Family", "SD3_EDIT_PIPELINES", "SD3_MAX_SEQUENCE_LENGTH", "SD3_NATIVE_TEXT_TOKENS"]

SD3_MAX_SEQUENCE_LENGTH = 256
"""T5 tokens of ``StableDiffusion3Pipeline.__call__``'s default ``max_sequence_length``."""

SD3_NATIVE_TEXT_TOKENS = 77 + SD3_MAX_SEQUENCE_LENGTH
"""CLIP tokens + T5 tokens of ``StableDiffusion3Pipeline`` with its default ``max_sequence_length=256``."""

SD3_EDIT_PIPELINES = ("StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline")
"""The diffusers pipelines the edits of a ``StableDiffusion3Pipeline`` checkpoint equal (image to image, inpainting;
:mod:`bcg_core.families.sd3_edit`); their defaults (50 steps, guidance 7.0, strength 0.6) are read from their
signatures (:func:`~bcg_core.families.defaults.pipeline_defaults`)."""


class SD3Adapter:
    """SD3 padding (diffusers ``SD3Transformer2DModel``): exact latent grid, native-length unmasked text.

    Why (``diffusers/models/transformers/transformer_sd3.py``, ``.../embeddings.py``): the forward reads
    ``height, width = hidden_states.shape[-2:]`` and ``PatchEmbed`` crops its ``pos_embed_max_size``-square
    position table around the centre by those Python ints (``cropped_pos_embed``); the unpatchify reshapes by
    them. A captured graph bakes in one (h, w), so the key carries ``latent_hw`` (``grid_keyed=True``) and
    image tokens are never rounded up. The model was trained on fixed-length unmasked text (333 tokens);
    padding it changes the output (tests/families/test_sd3.py). Pad rows are copies of row 0, dropped after
    the forward (every op is per row). The timestep buffer is fp32 whatever the model dtype (bf16 would
    round 999 to 1000).

    Layout:

    - ``DenoiseInputs.latents``: (rows, in_channels, h * patch, w * patch); ``grid`` the token grid (h, w).
    - ``DenoiseInputs.text``: (rows, native_text_tokens, joint_attention_dim); ``text_mask`` must be None.
    - ``DenoiseInputs.pooled``: (rows, pooled_projection_dim) (CLIP-L and CLIP-G pooled, concatenated).
    - ``DenoiseInputs.timestep``: (rows,) the scheduler's timestep on the 0-1000 scale, not divided.
    - output: (rows, out_channels, h * patch, w * patch), the velocity prediction.

    Args:
        model: an ``SD3Transformer2DModel`` (with ``pos_embed_max_size`` set, as every SD3 checkpoint).
        native_text_tokens: 77 CLIP tokens plus ``max_sequence_length`` T5 tokens (333 by default).
        vae_scale_factor: pixels per latent pixel (8 for SD3's VAE).

    Raises:
        ValueError: the model has no ``pos_embed_max_size`` (its forward would not crop a table).
    """

    family = "sd3"
    guidance_embeds = False
    timestep_max = 1000.0

    def __init__(self, model: torch.nn.Module, native_text_tokens: int = SD3_NATIVE_TEXT_TOKENS,
                 vae_scale_factor: int = 8):
        cfg = model.config
        if not cfg.pos_embed_max_size:
            raise ValueError("SD3Adapter needs an SD3Transformer2DModel with pos_embed_max_size set "
                             "(SD3 checkpoints use 192 or 384)")
        self.model = model
        self.patch = int(cfg.patch_size)
        self.rules = ShapeRules(pixels_per_token=vae_scale_factor * self.patch, grid_keyed=True,
                                native_text_tokens=native_text_tokens)
        self.in_channels = int(cfg.in_channels)
        self.out_channels = int(cfg.out_channels or cfg.in_channels)
        self.seq_dim = int(cfg.joint_attention_dim)
        self.pooled_dim = int(cfg.pooled_projection_dim)
        self.max_grid_side = int(cfg.pos_embed_max_size)

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Latent images (rows, in_channels, h * patch, w * patch), standard normal, CPU fp32."""
        h, w = grid[0] * self.patch, grid[1] * self.patch
        return torch.randn(rows, self.in_channels, h, w, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments).

        Raises:
            ValueError: the key has no grid, or a grid side exceeds ``pos_embed_max_size``.
        """
        if key.latent_hw is None:
            raise ValueError(f"bucket {key} has no latent_hw: SD3 buckets are keyed on the latent grid")
        h, w = key.latent_hw
        if max(h, w) > self.max_grid_side:
            px = self.max_grid_side * self.rules.pixels_per_token
            raise ValueError(f"bucket {key}: grid {h}x{w} exceeds the model's pos_embed_max_size "
                             f"{self.max_grid_side} (sides up to {px} px)")
        b, t, p = key.batch, key.text_tokens, self.patch
        return {
            # (B, C, H, W)
            "latents": torch.zeros(b, self.in_channels, h * p, w * p, device=device, dtype=dtype),
            "text": torch.zeros(b, t, self.seq_dim, device=device, dtype=dtype),  # (B, T, D_text)
            "pooled": torch.zeros(b, self.pooled_dim, device=device, dtype=dtype),  # (B, D_pooled)
            "timestep": torch.zeros(b, device=device, dtype=torch.float32),  # (B,) 0-1000 scale, fp32
        }

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Copy ``inputs`` into the buffers; pad rows are copies of row 0 (every element is written).

        Raises:
            ValueError: the inputs do not fit (more rows, another grid, another text length) or carry a
                text mask (SD3 text is unmasked).
        """
        lat = buffers["latents"]
        b, t, n = lat.shape[0], buffers["text"].shape[1], inputs.rows
        if inputs.text_mask is not None:
            raise ValueError("SD3 was trained on unmasked fixed-length text: inputs.text_mask must be None")
        if n > b or tuple(inputs.latents.shape[1:]) != tuple(lat.shape[1:]) or inputs.text_tokens != t:
            raise ValueError(
                f"inputs of {n} rows x latents {tuple(inputs.latents.shape[1:])} x {inputs.text_tokens} text "
                f"tokens do not fit bucket buffers of {b} rows x latents {tuple(lat.shape[1:])} x {t} text "
                f"tokens"
            )
        copy_rows(lat, inputs.latents)
        copy_rows(buffers["text"], inputs.text)
        copy_rows(buffers["pooled"], inputs.pooled)
        copy_rows(buffers["timestep"], inputs.timestep)

    def _call(self, latents, text, pooled, timestep) -> torch.Tensor:
        return self.model(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled,
                          timestep=timestep, return_dict=False)[0]

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded forward over the static buffers: (B, C_out, H, W)."""
        return self._call(buffers["latents"], buffers["text"], buffers["pooled"], buffers["timestep"])

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` of ``output`` (no image or text padding to remove)."""
        return output[: inputs.rows]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded reference forward, as ``StableDiffusion3Pipeline`` calls the transformer (line 1074)."""
        if inputs.text_mask is not None:
            raise ValueError("SD3 was trained on unmasked fixed-length text: inputs.text_mask must be None")
        p = next(self.model.parameters())
        cast = lambda x: x.to(device=p.device, dtype=p.dtype)  # noqa: E731
        return self._call(cast(inputs.latents), cast(inputs.text), cast(inputs.pooled),
                          inputs.timestep.to(device=p.device, dtype=torch.float32))


def _is_null(index: dict, component: str) -> bool:
    """True when ``model_index.json`` saves ``component`` as ``[null, null]`` (or leaves it out)."""
    return (index.get(component) or [None])[0] is None


def _has_t5(path: Path, index: dict) -> bool:
    """True when the checkpoint has a T5 encoder (``text_encoder_3``); False for one saved without it.

    Raises:
        ValueError: a T5 encoder without its tokenizer (``tokenizer_3`` null): the pipeline could not encode.
    """
    if _is_null(index, "text_encoder_3"):
        return False
    if _is_null(index, "tokenizer_3"):
        raise ValueError(f"{path}: model_index.json has text_encoder_3 but tokenizer_3 is null: "
                         f"StableDiffusion3Pipeline cannot encode prompts for T5 without its tokenizer; save the "
                         f"checkpoint with both, or with neither (text_encoder_3 and tokenizer_3 null: served "
                         f"without T5, its text zeros, as diffusers does)")
    return True


class SD3Family(FusedStep, Previews):
    """SD3 / SD3.5 (``StableDiffusion3Pipeline``); see the module docstring for each diffusers fact.

    Built by :meth:`load`; holds the loaded pipeline (``pipe``) and calls its own methods for encoding,
    latents, timesteps and decoding. Request fields: ``guidance_scale`` is the CFG scale (uncond rows above
    1); ``negative_prompt`` is the uncond text ("" when omitted, encoded); ``true_cfg_scale`` is refused; an
    ``image`` makes an edit, with a ``mask`` inpainting (:mod:`bcg_core.families.sd3_edit`).

    Args:
        spec: the model's :class:`ModelSpec` (from :meth:`describe`).
        pipe: the loaded ``StableDiffusion3Pipeline`` on ``device`` in ``dtype``.
    """

    name: ClassVar[str] = "sd3"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("StableDiffusion3Pipeline",)
    lora_loader: ClassVar[str | None] = "StableDiffusion3Pipeline"
    transformer_width = staticmethod(heads_width)

    def __init__(self, spec: ModelSpec, pipe, device: torch.device, dtype: torch.dtype):
        self.model_name = spec.name
        self.spec = spec
        self.pipe = pipe
        self.device, self.dtype = torch.device(device), dtype
        self.guidance_embeds = False
        self.adapter = SD3Adapter(pipe.transformer, native_text_tokens=spec.rules.native_text_tokens,
                                  vae_scale_factor=int(pipe.vae_scale_factor))
        self.rules = self.adapter.rules
        self._count = tokenizer_counter(pipe.tokenizer_3 if pipe.text_encoder_3 is not None else pipe.tokenizer)
        self._lock = threading.Lock()  # tokenizers keep mutable padding state: one encode at a time

    # -- checkpoint ---------------------------------------------------------------------------------

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """The model's spec from ``model_index.json`` and the component configs (no weights).

        Edits: a ``StableDiffusion3Pipeline`` checkpoint serves image to image and inpainting
        (:data:`SD3_EDIT_PIPELINES`).

        Raises:
            ValueError: a scheduler other than ``FlowMatchEulerDiscreteScheduler``, a stochastic one, a
                transformer without ``pos_embed_max_size`` or whose ``in_channels`` differ from the VAE's latent
                channels (33: an inpainting-only transformer), or a T5 encoder without its tokenizer.
        """
        path = Path(path)
        sched_cls = (index.get("scheduler") or [None, None])[1]
        if sched_cls != "FlowMatchEulerDiscreteScheduler":
            raise ValueError(f"{path}: scheduler {sched_cls!r} is not served for SD3; use the checkpoint's "
                             f"FlowMatchEulerDiscreteScheduler (the only one this family is checked with)")
        if read_json(path / "scheduler" / "scheduler_config.json").get("stochastic_sampling"):
            raise ValueError(f"{path}: scheduler stochastic_sampling=true draws noise from the global RNG in "
                             f"StableDiffusion3Pipeline (not reproducible per seed); set it to false")
        tr = read_json(path / "transformer" / "config.json")
        if not tr.get("pos_embed_max_size"):
            raise ValueError(f"{path}: transformer config has no pos_embed_max_size "
                             f"(SD3 checkpoints use 192 or 384)")
        vae = read_json(path / "vae" / "config.json")
        latent = int(vae.get("latent_channels", 16))
        if int(tr.get("in_channels", 16)) != latent:  # e.g. 33: latents + mask + masked image, an inpainting model
            raise ValueError(
                f"{path}: transformer in_channels {tr.get('in_channels')} differ from the VAE's {latent} latent "
                f"channels: StableDiffusion3Pipeline and StableDiffusion3Img2ImgPipeline fail on such a transformer "
                f"(33 = latents, mask and masked-image latents is an inpainting-only model, which only "
                f"StableDiffusion3InpaintPipeline runs); bcg-serve does not serve it")
        scale = 2 ** (len(vae.get("block_out_channels", (0,) * 4)) - 1)
        clip = int(read_json(path / "tokenizer" / "tokenizer_config.json", optional=True).get("model_max_length", 77))
        rules = ShapeRules(pixels_per_token=scale * int(tr.get("patch_size", 2)), grid_keyed=True,
                           native_text_tokens=clip + SD3_MAX_SEQUENCE_LENGTH)
        has_t5 = _has_t5(path, index)
        return ModelSpec(name=path.name, family=cls.name, pipeline_class=index["_class_name"], rules=rules,
                         guidance_embeds=False, cfg_rule="guidance_scale",
                         max_prompt_tokens=SD3_MAX_SEQUENCE_LENGTH if has_t5 else clip,
                         max_grid_side=int(tr["pos_embed_max_size"]), quality_steps=QUALITY_STEPS["sd3"],
                         # StableDiffusion3Pipeline: default_sample_size = transformer.config.sample_size
                         default_size=(int(tr.get("sample_size", 128)) * scale,) * 2,
                         edit_pipelines=SD3_EDIT_PIPELINES if index["_class_name"] == "StableDiffusion3Pipeline"
                         else None,
                         **pipeline_defaults(index["_class_name"]))

    @classmethod
    def token_counter(cls, path: Path, index: dict) -> Callable[..., int]:
        """T5 tokens of a prompt with its end-of-sequence token (``tokenizer_3``; CLIP-L's ``tokenizer`` when
        the checkpoint has no T5 encoder)."""
        from transformers import AutoTokenizer

        path = Path(path)
        has_t5 = _has_t5(path, index)
        tok = AutoTokenizer.from_pretrained(str(path / ("tokenizer_3" if has_t5 else "tokenizer")),
                                            local_files_only=True)
        return tokenizer_counter(tok)

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> SD3Family:
        """``StableDiffusion3Pipeline.from_pretrained(path)`` (local files only), moved to ``device``; a checkpoint
        saved without T5 is loaded with ``text_encoder_3=None, tokenizer_3=None``, as diffusers documents.

        Raises:
            ValueError: as :meth:`describe`.
        """
        from diffusers import StableDiffusion3Pipeline

        spec = cls.describe(path, index)
        absent = {c: None for c in ("text_encoder_3", "tokenizer_3") if _is_null(index, c)}
        pipe = load_pipeline(StableDiffusion3Pipeline, path, device, dtype, **absent)
        return cls(spec, pipe, device, dtype)

    # -- validation hooks ---------------------------------------------------------------------------

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """T5 tokens of ``prompt``, prompts and negative prompts alike (as :meth:`token_counter`)."""
        with self._lock:
            return self._count(prompt)

    # -- the step-level loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode (``encode_prompt``), draw latents (``prepare_latents``) and set this request's scheduler; an edit
        (an ``image``) starts from its image instead (:func:`~bcg_core.families.sd3_edit.start_edit`).

        Returns:
            A state at step 0; ``latents`` (n, 16, H/8, W/8) in the text-embedding dtype, as the pipeline.

        Raises:
            RequestError: as :meth:`check`.
        """
        req, pipe = validated.request, self.pipe
        if req.image is not None:
            from bcg_core.families.sd3_edit import start_edit

            return start_edit(self, validated, cancel)
        cond, uncond = self.encode_text(req)
        width, height = self.spec.generation_size(req.width, req.height)
        generators = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        latents = pipe.prepare_latents(req.n, pipe.transformer.config.in_channels, height, width, cond.text.dtype,
                                       self.device, generators)
        scheduler = copy.deepcopy(pipe.scheduler)
        timesteps = self.set_timesteps(scheduler, req.num_inference_steps, height, width)
        return RequestState(validated=validated, cond=cond, uncond=uncond, latents=latents, scheduler=scheduler,
                            timesteps=timesteps, grid=self.rules.grid(width, height), cancel=cancel)

    def encode_text(self, req) -> tuple[TextRows, TextRows | None]:
        """``(cond, uncond)`` text rows of ``req`` from the pipeline's ``encode_prompt``, called as ``__call__``
        calls it (``prompt_2``/``prompt_3`` None, ``max_sequence_length`` 256; the edit pipelines' copies of
        ``encode_prompt`` are the same code): text (1, 333, D_text) and pooled (1, D_pooled) each; ``uncond``
        None without CFG. Serialised: tokenizers keep mutable padding state."""
        cfg = self.spec.uses_cfg(req)
        with self._lock:
            text, neg_text, pooled, neg_pooled = self.pipe.encode_prompt(
                prompt=req.prompt, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
                do_classifier_free_guidance=cfg, negative_prompt=req.negative_prompt,
                max_sequence_length=SD3_MAX_SEQUENCE_LENGTH,
            )
        return TextRows(text, pooled), TextRows(neg_text, neg_pooled) if cfg else None

    def set_timesteps(self, scheduler, steps: int, height: int, width: int) -> torch.Tensor:
        """Set ``scheduler`` (a request's own copy) to ``steps`` timesteps with the pipeline's
        ``retrieve_timesteps`` and return them, (steps,) fp32 on the 0-1000 scale. With ``use_dynamic_shifting``,
        ``mu = calculate_shift((H/8/patch) * (W/8/patch), ...)`` with the config's fields and the pipeline's
        fallbacks (``max_shift`` 1.16; ``StableDiffusion3Pipeline`` line 1016, the same in
        ``StableDiffusion3Img2ImgPipeline`` and ``StableDiffusion3InpaintPipeline``, whose helpers are copies)."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        kwargs = {}
        c = scheduler.config
        if c.get("use_dynamic_shifting", None):
            scale, patch = self.pipe.vae_scale_factor, self.pipe.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (int(height) // scale // patch) * (int(width) // scale // patch), c.get("base_image_seq_len", 256),
                c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.16),
            )
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=None, **kwargs)
        return timesteps

    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """``[uncond] * n + [cond] * n`` rows with CFG (pipeline line 998), else ``[cond] * n``; timestep
        ``t.expand(rows)`` undivided (0-1000)."""
        n, lat = state.n, state.latents
        parts = [state.uncond, state.cond] if state.cfg else [state.cond]
        text = torch.cat([p.text.expand(n, -1, -1) for p in parts])
        pooled = torch.cat([p.pooled.expand(n, -1) for p in parts])
        latents = torch.cat([lat] * 2) if state.cfg else lat
        return DenoiseInputs(latents=latents, text=text, pooled=pooled,
                             timestep=state.timestep.expand(latents.shape[0]), grid=state.grid)

    @torch.inference_mode()
    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """``uncond + guidance_scale * (cond - uncond)`` (pipeline line 1086), then the request's own
        scheduler step (and, inpainting, its known region put back:
        :func:`~bcg_core.families.edit_view.blend_known_region`)."""
        noise_pred = output
        if state.cfg:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            scale = self.spec.cfg_scale(state.request)
            noise_pred = noise_pred_uncond + scale * (noise_pred_text - noise_pred_uncond)
        state.latents = state.scheduler.step(noise_pred, state.timestep, state.latents, return_dict=False)[0]
        if "inpaint" in state.extras:
            from bcg_core.families.edit_view import blend_known_region

            blend_known_region(state)
        state.step_index += 1

    def euler_step(self, state: RequestState):
        """The fused form of the next step (:func:`bcg_core.runners.fused.euler_step`): with CFG the uncond rows
        first (pipeline line 998), ``uncond + guidance_scale * (cond - uncond)`` as :meth:`advance`."""
        from bcg_core.runners.fused import euler_step

        if "inpaint" in state.extras:  # the blend after each step runs on the host
            return None
        if state.cfg:
            return euler_step(state, state.n, 0, self.spec.cfg_scale(state.request), self.dtype)
        return euler_step(state, 0, None, 1.0, self.dtype)

    @functools.cached_property
    def _preview(self):
        from bcg_core.preview import vae_preview

        return vae_preview(self.pipe.vae, self.pipe.vae_scale_factor)

    @torch.inference_mode()
    def preview(self, state: RequestState, latents: torch.Tensor) -> list[np.ndarray]:
        """``n`` previews of mid-denoise ``latents`` (a copy of ``state.latents``): ``z / scaling + shift`` as
        :meth:`decode`, then the VAE's fitted linear latent-to-RGB map (:class:`~bcg_core.preview.LinearPreview`):
        (h, w, 3) uint8 at latent resolution (1/8 of the size)."""
        vae = self.pipe.vae
        return self._preview(latents / vae.config.scaling_factor + vae.config.shift_factor)

    @property
    def vae(self) -> torch.nn.Module:
        """The pipeline's VAE (:attr:`~bcg_core.families.Family.vae`)."""
        return self.pipe.vae

    @torch.inference_mode()
    def decode(self, state: RequestState) -> list[np.ndarray]:
        """``vae.decode(z / scaling_factor + shift_factor)`` of the ``n`` latents in one call, then
        ``image_processor.postprocess(output_type="pil")`` (pipeline line 1141): (H, W, 3) uint8 each."""
        vae = self.pipe.vae
        latents = (state.latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return [np.asarray(im) for im in self.pipe.image_processor.postprocess(image, output_type="pil")]
