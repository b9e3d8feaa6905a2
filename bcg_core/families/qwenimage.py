"""Qwen-Image family: ``QwenImagePipeline`` checkpoints (Qwen/Qwen-Image and its fine-tunes).

What diffusers 0.42.1 does, and what this module does the same way. Line numbers are
``pipelines/qwenimage/pipeline_qwenimage.py`` (P) and ``models/transformers/transformer_qwenimage.py`` (T).

- Text (P:187-268): the prompt is wrapped in a chat template (``prompt_template_encode``), tokenized
  (truncated at ``tokenizer_max_length + 34`` = 1058 tokens), run through Qwen2.5-VL, and the last hidden
  state of the first ``prompt_template_encode_start_idx`` (34) tokens is dropped; ``encode_prompt`` then
  cuts to ``max_sequence_length`` (512, the ``__call__`` default; P:432). One prompt's mask is all ones and
  comes back as None (P:265). This module calls ``encode_prompt`` itself; :meth:`QwenImageFamily.count_tokens`
  counts exactly the tokens left, and that count is the key's text dimension.
- CFG (P:553-581, 656-672): only with a ``negative_prompt`` (even ``""``) *and* ``true_cfg_scale > 1``; the
  default ``true_cfg_scale`` is 4.0. ``guidance_scale`` is ignored (P:623, the transformer is not
  guidance-distilled). Prompt and negative prompt are encoded separately, and the combined prediction is
  rescaled to the cond prediction's per-token norm: ``comb * (|cond| / |comb|)`` over the channel dim.
  Diffusers runs two forwards; here the uncond rows ride in the cond rows' forward, text padded (masked)
  to the longer of the two.
- Latents (P:332-381): ``prepare_latents`` draws ``(n, 1, 16, 2h, 2w)`` noise (a frame dim: the VAE is a
  video VAE) with ``randn_tensor`` from the request's generators in the text embeddings' dtype and packs
  2x2 patches into tokens (``_pack_latents``): (n, h * w, 64). ``img_shapes = [[(1, h, w)]]`` (P:595).
- Schedule (P:598-613, 635): sigmas ``linspace(1, 1/N, N)``, ``mu = calculate_shift(h * w, ...)`` from the
  scheduler config (Qwen-Image: 256..8192 tokens -> 0.5..0.9, exponential shift, ``shift_terminal`` 0.02),
  ``retrieve_timesteps``, ``set_begin_index(0)``.
- Step (P:643-676): ``timestep = t.expand(rows).to(latents.dtype) / 1000``; ``scheduler.step``.
- Decode (P:700-715): ``_unpack_latents`` to (n, 16, 1, 2h, 2w), cast to the VAE dtype,
  ``z / (1 / latents_std) + latents_mean`` per channel, ``vae.decode(...)[0][:, :, 0]`` (first frame),
  ``image_processor.postprocess``.
- Edits: a request with an ``image`` starts from it as ``QwenImageImg2ImgPipeline`` (with a ``mask``:
  ``QwenImageInpaintPipeline``, its known region put back after every step); its steps are text to image's
  (:mod:`bcg_core.families.qwen_edit`).

Refused at load (:meth:`QwenImageFamily.describe`, ``ValueError``): ``guidance_embeds`` transformers (in
0.42.1 ``QwenImageTransformer2DModel.forward`` passes ``guidance`` to ``QwenTimestepProjEmbeddings``, which
takes no such argument: T:938-945 raise ``TypeError``), the Edit/Layered variants' ``zero_cond_t``,
``use_additional_t_cond`` and ``use_layer3d_rope`` (inputs ``QwenImagePipeline`` never passes) and a
scheduler with ``stochastic_sampling`` (its noise comes from the global RNG).
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from pathlib import Path

import numpy as np
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from bcg_core.capabilities import Previews, StepCache
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, heads_width, load_pipeline
from bcg_core.families.defaults import pipeline_defaults
from bcg_core.families.helpers import install_processors
from bcg_core.families.state import RequestState, TextRows, pad_text
from bcg_core.keys import BucketKey
from bcg_core.padding import DenoiseInputs, copy_rows, fill_masked_text
from bcg_core.step_cache.spec import METHODS as CACHE_METHODS
from bcg_core.table import ShapeRules

__all__ = ["QWEN_MAX_TEXT_TOKENS", "QwenImageAdapter", "QwenImageFamily", "TextMaskAttnProcessor"]

QWEN_DEFAULT_SAMPLE_SIZE = 128
"""Latent pixels per side of a ``QwenImagePipeline`` call without ``height``/``width`` (its ``default_sample_size``,
set in ``__init__``): x the VAE factor 8, 1024x1024."""

QWEN_MAX_TEXT_TOKENS = 512
"""``QwenImagePipeline.__call__(max_sequence_length=512)``: text tokens kept after the template is dropped."""


class TextMaskAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """``QwenDoubleStreamAttnProcessor2_0`` that also takes the text key mask as ``text_key_mask`` (through
    the forward's ``attention_kwargs``), for CUDA graph capture.

    Why: with ``encoder_hidden_states_mask`` given, ``QwenImageTransformer2DModel.forward`` calls
    ``compute_text_seq_len_from_mask`` (T:144-171), whose ``torch.as_tensor(text_seq_len, device=...)``
    (T:169) copies a pageable CPU scalar to the GPU on every call: CUDA graph capture refuses that copy
    ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned";
    seen on an H200, torch 2.11). The function's only outputs the forward uses are the text length (a shape)
    and the mask as bool, which the processor then joins with an all-True image mask (T:506-510). Passing
    the bool mask straight to the processor, with ``encoder_hidden_states_mask=None`` at the top, is
    therefore the same computation without the copy. Without ``text_key_mask`` this processor *is* the
    diffusers one (``forward_eager`` and any other caller see no change).
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None, text_key_mask=None):
        if text_key_mask is not None:
            encoder_hidden_states_mask = text_key_mask
        return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                attention_mask, image_rotary_emb)


class QwenImageAdapter:
    """Qwen-Image architecture (diffusers ``QwenImageTransformer2DModel``): keyed on the grid, masked text.

    What the forward depends on besides tensor values (T = ``transformer_qwenimage.py``):

    - The token grid: ``img_shapes`` is a Python list, and ``QwenEmbedRope.forward`` (T:241-296) builds
      the image RoPE for ``img_shapes[0]`` only (``scale_rope=True``: positions centred, ``-h/2..h/2``,
      T:311-315) and starts the text positions at ``max(h // 2, w // 2)`` (T:285-293). So a graph bakes in
      one (h, w): the key carries ``latent_hw`` (``grid_keyed=True``); 512x768 and 768x512 differ.
    - The text length ``T`` (a shape): text token ``i`` gets RoPE position ``max(h//2, w//2) + i`` whatever
      ``T`` is (``pos_freqs[max_vid_index : max_vid_index + T]``, T:293, with ``T`` from
      ``compute_text_seq_len_from_mask``, T:150), so padding text at the end leaves real tokens' positions
      as they are. ``encoder_hidden_states_mask`` becomes a boolean key mask ``[text mask, ones(image)]``
      of the joint attention (T:506-510); every other op on text is per token (``txt_norm``, ``txt_in``,
      the text MLPs) or per row (modulation), so masked zero pad tokens leave real outputs unchanged, and
      text lengths are bucketed (``native_text_tokens=None``) up to 512.
    - Nothing else: ``modulate_index`` exists only with ``zero_cond_t`` (refused), and the RoPE tables are
      cached per (grid, device) on the model (``lru_cache``), filled by the warm-up forwards before capture.

    The padded forward hands the mask to the attention processors directly (:class:`TextMaskAttnProcessor`,
    installed on every block at construction; it replaces only the stock processor): the forward's own mask
    path cannot be captured in a CUDA graph. :meth:`forward_eager` calls the model exactly as the pipeline.

    Layout: ``DenoiseInputs.latents`` (rows, h * w, in_channels) packed tokens; ``text`` (rows, T,
    joint_attention_dim) with ``text_mask`` (rows, T) or None (all real); ``pooled`` (rows, 0); ``timestep``
    (rows,) the scheduler's timestep / 1000 in the latents' dtype. Output: (rows, h * w, 4 * out_channels).

    Args:
        model: a ``QwenImageTransformer2DModel``.
        vae_scale_factor: pixels per latent pixel (8).
        max_text_tokens: longest text the pipeline passes (512); a bigger text bucket is a start-up error.
    """

    family = "qwenimage"
    timestep_max = 1.0
    guidance_embeds = False
    pooled_dim = 0

    def __init__(self, model: torch.nn.Module, vae_scale_factor: int = 8,
                 max_text_tokens: int = QWEN_MAX_TEXT_TOKENS):
        cfg = model.config
        self.model = model
        # QwenImagePipeline packs 2x2 latent pixels into one token; img_in is a Linear over the packed channels.
        self.rules = ShapeRules(pixels_per_token=vae_scale_factor * 2, grid_keyed=True, native_text_tokens=None)
        self.in_channels = int(cfg.in_channels)
        self.out_channels = int(cfg.patch_size) ** 2 * int(model.out_channels)
        self.seq_dim = int(cfg.joint_attention_dim)
        self.max_text_tokens = max_text_tokens
        install_processors(model.transformer_blocks, QwenDoubleStreamAttnProcessor2_0, TextMaskAttnProcessor,
                           "QwenImageAdapter")

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Packed latents (rows, h * w, in_channels), standard normal, CPU fp32."""
        return torch.randn(rows, grid[0] * grid[1], self.in_channels, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments).

        The latents buffer is kept as (B, h, w, C_in) so that its shape carries the grid the RoPE is built
        for; :meth:`forward` flattens it to the (B, h * w, C_in) tokens the model takes (a view).

        Raises:
            ValueError: a key without a grid, or with more text tokens than the pipeline ever passes.
        """
        if key.latent_hw is None:
            raise ValueError(f"bucket {key} has no latent_hw: Qwen-Image buckets are keyed on the latent grid")
        if key.text_tokens > self.max_text_tokens:
            raise ValueError(f"bucket {key}: {key.text_tokens} text tokens exceed the {self.max_text_tokens} that "
                             f"QwenImagePipeline keeps (max_sequence_length); use text_lengths up to "
                             f"{self.max_text_tokens}")
        (h, w), b, t = key.latent_hw, key.batch, key.text_tokens
        return {
            "latents": torch.zeros(b, h, w, self.in_channels, device=device, dtype=dtype),  # (B, h, w, C_in)
            "text": torch.zeros(b, t, self.seq_dim, device=device, dtype=dtype),  # (B, T, D_text)
            "text_mask": torch.zeros(b, t, device=device, dtype=torch.bool),  # (B, T), True = real token
            "timestep": torch.zeros(b, device=device, dtype=dtype),  # (B,) t / 1000
        }

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Copy ``inputs`` into the buffers: pad rows copy row 0 (its mask too), pad text tokens are zeros
        with mask False. Every element is written, so nothing of an earlier request survives.

        Raises:
            ValueError: the inputs do not fit (more rows, another grid, more text tokens).
        """
        lat, text, mask = buffers["latents"], buffers["text"], buffers["text_mask"]
        b, h, w, c = lat.shape
        t = text.shape[1]
        n, s = inputs.rows, inputs.text_tokens
        if (n > b or tuple(inputs.grid) != (h, w) or tuple(inputs.latents.shape[1:]) != (h * w, c) or s > t
                or inputs.guidance is not None):
            raise ValueError(
                f"inputs of {n} rows x grid {tuple(inputs.grid)} x {s} text tokens"
                f"{' with guidance' if inputs.guidance is not None else ''} do not fit bucket buffers of {b} rows "
                f"x grid {(h, w)} x {t} text tokens (Qwen-Image takes no guidance input)"
            )
        copy_rows(lat.view(b, h * w, c), inputs.latents)
        fill_masked_text(text, mask, inputs)
        copy_rows(buffers["timestep"], inputs.timestep)

    def _call(self, latents, text, mask, timestep, grid: tuple[int, int], attention_kwargs: dict) -> torch.Tensor:
        # As QwenImagePipeline.__call__ (P:645-654): img_shapes one [(frame, h, w)] per row (only [0] is read).
        return self.model(
            hidden_states=latents, timestep=timestep, guidance=None, encoder_hidden_states_mask=mask,
            encoder_hidden_states=text, img_shapes=[[(1, grid[0], grid[1])]] * latents.shape[0],
            attention_kwargs=attention_kwargs, return_dict=False,
        )[0]

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded, masked forward over the static buffers: (B, h * w, C_out). The mask goes to the attention
        processors (:class:`TextMaskAttnProcessor`), not through the forward's capture-breaking mask path."""
        lat = buffers["latents"]
        return self._call(lat.flatten(1, 2), buffers["text"], None, buffers["timestep"],
                          (lat.shape[1], lat.shape[2]), {"text_key_mask": buffers["text_mask"]})

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` of ``output`` (text padding leaves no trace in the image output)."""
        return output[: inputs.rows]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded reference forward, as the pipeline calls it: mask None when every token is real (what
        ``encode_prompt`` returns for one prompt), else the given mask."""
        p = next(self.model.parameters())
        mask = inputs.text_mask
        if mask is not None:
            mask = None if bool(mask.all()) else mask.to(device=p.device, dtype=torch.bool)
        cast = lambda x: x.to(device=p.device, dtype=p.dtype)  # noqa: E731
        return self._call(cast(inputs.latents), cast(inputs.text), mask, cast(inputs.timestep), inputs.grid, {})


def _refusals(transformer: dict, scheduler: dict) -> list[str]:
    """Why a checkpoint's configs cannot be served exactly as ``QwenImagePipeline`` runs them (empty: it can)."""
    why = [f"transformer {flag}=true belongs to the Qwen-Image Edit/Layered pipelines, not QwenImagePipeline"
           for flag in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope") if transformer.get(flag)]
    if transformer.get("guidance_embeds"):
        why.insert(0, "transformer guidance_embeds=true: diffusers 0.42.1 QwenImageTransformer2DModel has no "
                      "guidance embedding (its forward raises TypeError when given guidance)")
    if scheduler.get("stochastic_sampling"):
        why.append("scheduler stochastic_sampling=true draws its noise from the global RNG (not reproducible)")
    return why


class QwenImageFamily(Previews, StepCache):
    """A ``QwenImagePipeline`` checkpoint, served step by step (see the module docstring).

    Request fields: ``negative_prompt`` (None: no CFG) and ``true_cfg_scale`` (None: 4.0) decide true CFG;
    ``guidance_scale`` is accepted and ignored, as diffusers ignores it.

    Args:
        name: served model name.
        spec: the model's :class:`ModelSpec`.
        pipe: the loaded ``QwenImagePipeline`` on ``device``; its methods (``encode_prompt``,
            ``prepare_latents``, ``_unpack_latents``, ``image_processor``) do the work.
        counter: ``prompt -> tokens`` (:meth:`token_counter`).
    """

    name = "qwenimage"
    pipeline_classes = ("QwenImagePipeline",)
    lora_loader = "QwenImagePipeline"
    transformer_width = staticmethod(heads_width)

    def __init__(self, name: str, spec: ModelSpec, pipe, counter, device: torch.device, dtype: torch.dtype):
        self.model_name = name
        self.spec = spec
        self.rules = spec.rules
        self.guidance_embeds = False
        self.pipe = pipe
        self.adapter = QwenImageAdapter(pipe.transformer, pipe.vae_scale_factor)
        self._counter = counter
        self._lock = threading.Lock()
        self.device, self.dtype = device, dtype

    # -- checkpoint ---------------------------------------------------------------------------------

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """Spec from ``transformer/``, ``vae/`` and ``scheduler/`` configs; request defaults from
        ``QwenImagePipeline.__call__``'s signature (:func:`pipeline_defaults`: 50 steps, no guidance, true CFG 4.0),
        an edit's from its edit pipeline's (``QwenImageImg2ImgPipeline``, ``QwenImageInpaintPipeline``: the same and
        strength 0.6; read by the validator).

        Raises:
            ValueError: a configuration this family refuses (module docstring), naming each reason.
        """
        tr, vae, sched = (json.loads((path / f).read_text()) for f in (
            "transformer/config.json", "vae/config.json", "scheduler/scheduler_config.json"))
        why = _refusals(tr, sched)
        if why:
            raise ValueError(f"{path.name}: cannot serve this QwenImagePipeline checkpoint: {'; '.join(why)}")
        scale = 2 ** len(vae.get("temperal_downsample", [False, True, True]))  # QwenImagePipeline.__init__
        return ModelSpec(
            name=path.name, family=cls.name, pipeline_class=index["_class_name"],
            rules=ShapeRules(pixels_per_token=scale * 2, grid_keyed=True, native_text_tokens=None),
            guidance_embeds=False, cfg_rule="true_cfg",
            max_text_tokens=QWEN_MAX_TEXT_TOKENS, quality_steps=QUALITY_STEPS["qwenimage"],
            default_size=(QWEN_DEFAULT_SAMPLE_SIZE * scale,) * 2,
            edit_pipelines=("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")
            if index["_class_name"] == "QwenImagePipeline" else None, cache_methods=CACHE_METHODS,
            **pipeline_defaults(index["_class_name"]),
        )

    @classmethod
    def token_counter(cls, path: Path, index: dict):
        """``prompt -> tokens`` that ``encode_prompt`` keeps: the templated prompt's tokens (truncated as
        the pipeline truncates) minus the 34 dropped, at most 512. Template, drop count and tokenizer limit
        are read from a ``QwenImagePipeline`` holding only the tokenizer, so they cannot drift from diffusers.
        """
        from diffusers import QwenImagePipeline
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
        skel = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=tok, transformer=None)
        template, drop = skel.prompt_template_encode, skel.prompt_template_encode_start_idx
        limit = skel.tokenizer_max_length + drop

        def count(prompt: str, negative: bool = False) -> int:
            mask = tok([template.format(prompt)], max_length=limit, padding=True, truncation=True)["attention_mask"]
            return min(max(sum(mask[0]) - drop, 0), QWEN_MAX_TEXT_TOKENS)

        return count

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> QwenImageFamily:
        """Load with ``QwenImagePipeline.from_pretrained`` (local files only) and move to ``device``."""
        from diffusers import QwenImagePipeline

        spec = cls.describe(path, index)
        pipe = load_pipeline(QwenImagePipeline, path, device, dtype)
        return cls(path.name, spec, pipe, cls.token_counter(path, index), device, dtype)

    # -- validation hooks ---------------------------------------------------------------------------

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """Text tokens of ``prompt`` in the key (see :meth:`token_counter`)."""
        with self._lock:
            return self._counter(prompt)

    # -- the step-level loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, prompt: str) -> TextRows:
        """One prompt's text rows via ``encode_prompt``: (1, T, D) embeddings, an all-True (1, T) mask."""
        with self._lock:
            text, _ = self.pipe.encode_prompt(prompt=[prompt], device=self.device, num_images_per_prompt=1,
                                              max_sequence_length=QWEN_MAX_TEXT_TOKENS)
        mask = torch.ones(1, text.shape[1], device=text.device, dtype=torch.bool)
        return TextRows(text, text.new_zeros(1, 0), mask)

    @torch.inference_mode()
    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode, draw packed noise with ``prepare_latents`` and set the shifted schedule (P:565-635); an edit (an
        ``image``) starts from its image (:func:`~bcg_core.families.qwen_edit.start_edit`)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        req = validated.request
        if req.image is not None:
            from bcg_core.families.qwen_edit import start_edit

            return start_edit(self, validated, cancel)
        cond = self.encode(req.prompt)
        uncond = self.encode(req.negative_prompt) if self.spec.uses_cfg(req) else None
        gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        latents = self.pipe.prepare_latents(req.n, self.adapter.in_channels // 4, req.height, req.width,
                                            cond.text.dtype, self.device, gens)
        sched = copy.deepcopy(self.pipe.scheduler)
        steps = req.num_inference_steps
        c = sched.config
        mu = calculate_shift(latents.shape[1], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sigmas = np.linspace(1.0, 1 / steps, steps)
        timesteps, _ = retrieve_timesteps(sched, steps, self.device, sigmas=sigmas, mu=mu)
        sched.set_begin_index(0)
        grid = self.rules.grid(req.width, req.height)
        return RequestState(validated, cond, uncond, latents, sched, timesteps, grid, cancel=cancel)

    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """Cond rows (one per image), then with CFG the uncond rows, text padded (masked) to the longer;
        timestep ``t.to(latents.dtype) / 1000`` per row (P:643-647)."""
        n, lat = state.n, state.latents
        parts = [state.cond] + ([state.uncond] if state.cfg else [])
        tokens = max(p.tokens for p in parts)
        parts = [pad_text(p, tokens) for p in parts]
        x = torch.cat([lat] * len(parts)) if len(parts) > 1 else lat
        text = torch.cat([p.text.expand(n, -1, -1) for p in parts])
        mask = torch.cat([p.mask.expand(n, -1) for p in parts])
        timestep = state.timestep.expand(x.shape[0]).to(lat.dtype) / 1000
        return DenoiseInputs(x, text, lat.new_zeros(x.shape[0], 0), timestep, state.grid, text_mask=mask)

    def cache_contexts(self, state: RequestState) -> list[tuple[str, slice]]:
        """``QwenImagePipeline`` runs the cond rows under ``cache_context("cond")`` and, with true CFG, the uncond rows
        under ``cache_context("uncond")`` (P:644-667): :meth:`model_rows`' two halves."""
        n = state.n
        return [("cond", slice(0, n))] + ([("uncond", slice(n, 2 * n))] if state.cfg else [])

    @torch.inference_mode()
    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """True CFG with the norm rescale (P:668-672), then the request's flow-matching Euler step (P:676) and,
        inpainting, its known region put back (:func:`~bcg_core.families.edit_view.blend_known_region`). The family
        has no fused ``euler_step`` (the norm rescale is not a plain Euler update), so an edit's blend always runs
        here on the host."""
        noise_pred = output[: state.n]
        if state.cfg:
            neg_noise_pred = output[state.n :]
            comb_pred = neg_noise_pred + self.spec.cfg_scale(state.request) * (noise_pred - neg_noise_pred)
            cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
            noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
            noise_pred = comb_pred * (cond_norm / noise_norm)
        state.latents = state.scheduler.step(noise_pred, state.timestep, state.latents, return_dict=False)[0]
        if "inpaint" in state.extras:
            from bcg_core.families.edit_view import blend_known_region

            blend_known_region(state)
        state.step_index += 1

    @functools.cached_property
    def _preview(self):
        from bcg_core.preview import LazyPreview, vae_latents

        def encode(x: torch.Tensor) -> torch.Tensor:  # a video VAE: one frame in, one latent frame out
            return vae_latents(self.pipe.vae, x[:, :, None])[:, :, 0]

        return LazyPreview(encode, self.pipe.vae_scale_factor)

    @torch.inference_mode()
    def preview(self, state: RequestState, latents: torch.Tensor) -> list[np.ndarray]:
        """``n`` previews of mid-denoise ``latents`` (a copy of ``state.latents``, packed tokens): unpacked and
        un-normalised per channel as :meth:`decode`, then the VAE's fitted linear latent-to-RGB map
        (:class:`~bcg_core.preview.LinearPreview`): (h, w, 3) uint8 at latent resolution (1/8 of the size)."""
        pipe, vae, req = self.pipe, self.pipe.vae, state.request
        z = pipe._unpack_latents(latents, req.height, req.width, pipe.vae_scale_factor).float()
        c = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(z.device)
        std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(z.device)
        return self._preview((z * std + mean)[:, :, 0])

    @property
    def vae(self) -> torch.nn.Module:
        """The pipeline's VAE (:attr:`~bcg_core.families.Family.vae`)."""
        return self.pipe.vae

    @torch.inference_mode()
    def decode(self, state: RequestState) -> list[np.ndarray]:
        """Unpack, un-normalise per channel, decode the first frame, ``postprocess`` to uint8 RGB (P:703-715)."""
        pipe, vae, req = self.pipe, self.pipe.vae, state.request
        latents = pipe._unpack_latents(state.latents, req.height, req.width, pipe.vae_scale_factor).to(vae.dtype)
        z = vae.config.z_dim
        dev, dt = latents.device, latents.dtype
        latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(dev, dt)
        latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(dev, dt)
        latents = latents / latents_std + latents_mean
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return [np.asarray(im) for im in pipe.image_processor.postprocess(image, output_type="pil")]
