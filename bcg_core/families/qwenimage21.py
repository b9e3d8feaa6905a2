"""Qwen-Image 2.1 family: ``QwenImage21Pipeline`` checkpoints (``QwenImage21Transformer2DModel``, a single-stream
block-causal DiT; a Qwen3-VL text encoder; the 16x RGBA ``AutoencoderKLQwenImage21``). Text to image.

What diffusers 0.42.1 does (``pipelines/qwenimage21/pipeline_qwenimage21.py``, P; ``models/transformers/
transformer_qwenimage21.py``, T) and what this module reuses:

- Text: ``encode_prompt`` (called here; P:240-393) wraps the prompt in ``prompt_template_t2i`` (a raw string, not
  the chat template; an empty prompt becomes ``" "``), runs Qwen3-VL with its final RMSNorm hooked off and drops
  the system turn's ``_drop_idx`` tokens; the rest is **not truncated** (Qwen-Image 1 cuts at 512). A prompt is
  limited by the encoder's positions and T's RoPE table (8192 positions) instead: :meth:`QwenImage21Family.
  count_tokens` counts exactly the tokens kept, and a prompt over ``ModelSpec.max_prompt_tokens`` is refused.
- Latents: ``prepare_latents`` (called here; P:452-491) draws (n, 1, 64, h, w) noise with ``randn_tensor`` in the
  text embeddings' dtype and flattens it to (n, h * w, 64) tokens (``_pack_latents``: 2.1 consumes latents
  unpatched, 16 pixels per token; Qwen-Image 1 packs 2x2 patches of 8-pixel latents). Sides must be multiples of
  32 (P:640-642 rounds others down: refused here instead, ``ModelSpec.size_multiple``).
- Schedule: sigmas ``linspace(1, 1/N, N)``, ``calculate_shift`` of the h * w tokens, ``retrieve_timesteps`` (both
  called here), ``set_begin_index(0)`` (P:731-747, 767). A checkpoint with ``sample_sigmas`` (a fixed sigma grid
  that replaces the request's step count, P:732-735) is refused at load.
- Step: ``timestep = t.expand(rows).to(latents.dtype) / 1000`` (P:782-786); ``scheduler.step`` (P:816). True CFG
  only with ``true_cfg_scale > 1`` (**default 1.0**, Qwen-Image 1's 4.0) and a negative prompt (``""`` counts, and
  is encoded as ``" "``): ``neg + s * (cond - neg)`` with **no norm rescale** (Qwen-Image 1 rescales), P:798-813.
- Decode: ``_unpack_latents``, ``z * latents_std + latents_mean``, ``vae.decode(...)[0][:, :, 0]``,
  ``image_processor.postprocess`` (P:840-854): **RGBA** images (the VAE decodes 4 channels), served as diffusers
  gives them (``ModelSpec.output_alpha``: PNG and WebP keep the alpha, JPEG is refused).

Padding contract: :class:`QwenImage21Adapter` (:mod:`bcg_core.families.qwenimage21_adapter`). Rows of different
text lengths share one forward, each row equal to the row alone; diffusers, given a batch of prompts of different
lengths, places every row's target frame at the longest prompt's length instead.

Previews (:class:`~bcg_core.capabilities.Previews`): the latents unpacked and un-normalised as the decode does, then the
VAE's fitted linear latent-to-RGB map (:mod:`bcg_core.preview`, fitted on opaque pictures): RGB, no alpha.

LoRA adapters per request (:mod:`bcg_core.lora`): files are read with ``QwenImage21Pipeline.lora_state_dict``
(``QwenImageLoraLoaderMixin``, Qwen-Image's: ``diffusion_model.`` names with ``lora_down``/``lora_up`` and alphas folded
into the weights as diffusers converts them; its kohya ``lora_unet_`` renaming knows Qwen-Image 1's module names only,
and fails on a 2.1 file: refused with diffusers' message, as ``load_lora_weights`` fails). With ``causal_condition`` T
embeds one t = 0 row for the whole batch, from which every row's text tokens are modulated; an adapter on the time
embedding, on ``modulation`` or on ``norm_out.linear`` changes that row, so rows with different adapters need their own.
The bucket forward embeds a t = 0 row per row (2B rows, each through its row's adapters:
:meth:`~bcg_core.lora.layers.LoRALayers.stacked`), each block's modulation takes row B + i for row i's text tokens
(:class:`~bcg_core.families.qwenimage21_attention.RowModulation`), and ``norm_out`` the rows' own timestep rows (its
text tokens' output is dropped); at B = 1 that is T's layout. The unpadded forward (T's, one row at a time) runs once
per set of rows carrying the same adapters (``QwenImage21Adapter.eager_mixes_rows``).

Not served yet: condition images (P's ``image``: an edit request is refused with a 422 naming the families that
edit), the fused step, the step cache (T has ``CacheMixin``), ``sample_sigmas`` checkpoints, and diffusers' prefix KV
cache (``use_kv_cache``, P's default: every bucket forward recomputes the text prefix; on the tiny checkpoint both
settings give bit-identical latents in fp32 on a CPU).
"""

from __future__ import annotations

import copy
import functools
import threading
from pathlib import Path

import numpy as np
import torch

from bcg_core.capabilities import Previews
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, heads_width, load_pipeline, read_json
from bcg_core.families.defaults import pipeline_defaults
from bcg_core.families.qwenimage21_adapter import QWEN21_PIXELS_PER_TOKEN, QWEN21_ROPE_POSITIONS, QwenImage21Adapter
from bcg_core.families.qwenimage21_attention import BucketAttnProcessor
from bcg_core.families.state import RequestState, TextRows, pad_text
from bcg_core.padding import DenoiseInputs
from bcg_core.table import ShapeRules

__all__ = ["BucketAttnProcessor", "QwenImage21Adapter", "QwenImage21Family"]

QWEN21_SIZE_MULTIPLE = 32
"""P's ``multiple_of = vae_scale_factor * 2``: the encoder's image slots hold 2x2 latent tokens."""


class QwenImage21Family(Previews):
    """A ``QwenImage21Pipeline`` checkpoint, served step by step (see the module docstring).

    Request fields: ``negative_prompt`` and ``true_cfg_scale`` (default 1.0: no CFG) decide true CFG, as diffusers;
    ``guidance_scale`` is accepted and unused (the pipeline has none). Sizes are multiples of 32 pixels.

    Args:
        name: served model name.
        spec: the model's :class:`ModelSpec`.
        pipe: the loaded ``QwenImage21Pipeline`` on ``device``; its methods (``encode_prompt``, ``prepare_latents``,
            ``_unpack_latents``, ``image_processor``) do the work.
        counter: ``prompt -> tokens`` (:meth:`token_counter`).
    """

    name = "qwenimage21"
    pipeline_classes = ("QwenImage21Pipeline",)
    lora_loader = "QwenImage21Pipeline"
    transformer_width = staticmethod(heads_width)

    def __init__(self, name: str, spec: ModelSpec, pipe, counter, device: torch.device, dtype: torch.dtype):
        self.model_name = name
        self.spec = spec
        self.rules = spec.rules
        self.guidance_embeds = False
        self.pipe = pipe
        self.vae = pipe.vae
        self.adapter = QwenImage21Adapter(pipe.transformer, spec.max_text_tokens)
        self._counter = counter
        self._lock = threading.Lock()
        self.device, self.dtype = device, dtype

    # -- checkpoint ---------------------------------------------------------------------------------

    @staticmethod
    def _processor(path: Path):
        from bcg_core.families.qwen3vl import load_processor  # without the video processor: no torchvision needed

        return load_processor(path / "processor")

    @staticmethod
    def default_side() -> int:
        """Pixels a side of a request without a size: ``__call__``'s ``output_resolution`` default (1024; P:635-636
        ``height or output_resolution``), read from the installed diffusers."""
        import inspect

        from diffusers import QwenImage21Pipeline

        return int(inspect.signature(QwenImage21Pipeline.__call__).parameters["output_resolution"].default)

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """Spec from ``model_index.json`` and the ``transformer/`` and ``text_encoder/`` configs; request defaults from
        ``QwenImage21Pipeline.__call__``'s signature (:func:`pipeline_defaults`: 40 steps, true CFG 1.0, no guidance).
        The prompt limit is the smaller of the RoPE table's 8191 text positions and the encoder's
        ``max_position_embeddings`` less the system tokens the pipeline drops (the encoder reads them too).

        Raises:
            ValueError: another pipeline class, ``sample_sigmas`` set (a sigma grid the model author configured, whose
                length replaces the request's step count, P:177-180 and 732-735), a patch size other than 1.
        """
        kind = index["_class_name"]
        if kind not in cls.pipeline_classes:
            raise ValueError(f"{kind!r} is not a Qwen-Image 2.1 pipeline ({', '.join(cls.pipeline_classes)})")
        if index.get("sample_sigmas"):
            raise ValueError(f"{path.name}: model_index.json sets sample_sigmas ({len(index['sample_sigmas'])} "
                             f"steps): QwenImage21Pipeline then runs that grid whatever num_inference_steps is; "
                             f"checkpoints with sample_sigmas are not served yet")
        tr = read_json(path / "transformer" / "config.json")
        if int(tr.get("patch_size", 1)) != 1:
            raise ValueError(f"{path.name}: transformer patch_size {tr['patch_size']}: QwenImage21Pipeline feeds "
                             f"unpatched latents")
        te = read_json(path / "text_encoder" / "config.json")
        positions = int(te.get("text_config", te).get("max_position_embeddings", QWEN21_ROPE_POSITIONS))
        limit = min(QWEN21_ROPE_POSITIONS - 1, positions - cls.token_counter(path, index).drop)
        return ModelSpec(
            name=path.name, family=cls.name, pipeline_class=kind,
            rules=ShapeRules(pixels_per_token=QWEN21_PIXELS_PER_TOKEN, grid_keyed=True, native_text_tokens=None),
            cfg_rule="true_cfg", max_prompt_tokens=limit, max_text_tokens=limit,
            quality_steps=QUALITY_STEPS["qwenimage21"], default_size=(cls.default_side(),) * 2,
            size_multiple=QWEN21_SIZE_MULTIPLE, output_alpha=True,
            **pipeline_defaults(kind),
        )

    @classmethod
    def token_counter(cls, path: Path, index: dict):
        """``(prompt, negative=False) -> tokens`` that ``encode_prompt`` keeps: the templated prompt's tokens less the
        ``_drop_idx`` dropped, untruncated (the pipeline truncates nothing). Template, drop count and image token
        are read from a ``QwenImage21Pipeline`` holding only the processor, so they cannot drift from diffusers.
        The counter's ``drop`` attribute is the drop count.

        Raises (from the counter):
            RequestError: the text holds the encoder's ``<|image_pad|>`` token (field ``prompt``, or
                ``negative_prompt`` with ``negative``): a condition image's slot (P:321-325). Diffusers cannot run
                it either: ``Qwen3VLProcessor`` refuses image tokens without images (a ValueError).
        """
        from diffusers import QwenImage21Pipeline

        from bcg_core.errors import RequestError

        skel = QwenImage21Pipeline(scheduler=None, vae=None, text_encoder=None, processor=cls._processor(path),
                                   transformer=None)
        tok, template, drop, image = (skel.processor.tokenizer, skel.prompt_template_t2i, skel._drop_idx,
                                      skel._img_token_id)

        def count(prompt: str, negative: bool = False) -> int:
            ids = tok(template.format(prompt or " "))["input_ids"]  # P: an empty prompt becomes " "
            if image in ids:
                field = "negative_prompt" if negative else "prompt"
                raise RequestError(field, f"{field} holds the text encoder's image token "
                                          f"{tok.convert_ids_to_tokens(image)!r}, which marks a condition image's "
                                          f"place; condition images are not served: remove it")
            return len(ids) - drop

        count.drop = drop
        return count

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> QwenImage21Family:
        """Load with ``QwenImage21Pipeline.from_pretrained`` (local files only, :func:`load_pipeline`), its processor
        loaded without the video processor (:mod:`bcg_core.families.qwen3vl`: no torchvision needed)."""
        from diffusers import QwenImage21Pipeline

        spec = cls.describe(path, index)
        pipe = load_pipeline(QwenImage21Pipeline, path, device, dtype, processor=cls._processor(path))
        return cls(path.name, spec, pipe, cls.token_counter(path, index), device, dtype)

    # -- validation hooks ---------------------------------------------------------------------------

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """Text tokens of ``prompt`` in the key (see :meth:`token_counter`; negative prompts alike)."""
        with self._lock:
            return self._counter(prompt, negative)

    # -- the step-level loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, prompt: str) -> TextRows:
        """One prompt through ``encode_prompt``: (1, L, D) embeddings, an all-True (1, L) mask."""
        with self._lock:
            text, _, slots = self.pipe.encode_prompt(prompt=[prompt], device=self.device)
        if bool(slots.any()):
            raise ValueError("the prompt's encoding holds image slots; condition images are not served yet")
        return TextRows(text, text.new_zeros(1, 0), torch.ones(1, text.shape[1], device=text.device, dtype=torch.bool))

    @torch.inference_mode()
    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode (and, with true CFG, the negative prompt), draw noise with ``prepare_latents`` and set the shifted
        schedule (P:677-747, 767).

        Raises:
            ValueError: an edit request (``request.image``: condition images are not served; the validator refuses
                them first).
        """
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift, retrieve_timesteps

        req = validated.request
        if req.image is not None:
            raise ValueError("Qwen-Image 2.1 condition images are not served yet")
        cond = self.encode(req.prompt)
        uncond = self.encode(req.negative_prompt) if self.spec.uses_cfg(req) else None
        gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        latents, _ = self.pipe.prepare_latents(None, req.n, self.adapter.in_channels, req.height, req.width,
                                               cond.text.dtype, self.device, gens)
        sched = copy.deepcopy(self.pipe.scheduler)
        c = sched.config
        mu = calculate_shift(latents.shape[1], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        steps = req.num_inference_steps
        timesteps, _ = retrieve_timesteps(sched, steps, self.device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        sched.set_begin_index(0)
        return RequestState(validated, cond, uncond, latents, sched, timesteps,
                            self.rules.grid(req.width, req.height), cancel=cancel)

    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """Cond rows (one per image), then with CFG the uncond rows, text padded (masked) to the longer; timestep
        ``t.to(latents.dtype) / 1000`` per row (P:782-786)."""
        n, lat = state.n, state.latents
        parts = [state.cond] + ([state.uncond] if state.cfg else [])
        tokens = max(p.tokens for p in parts)
        parts = [pad_text(p, tokens) for p in parts]
        x = torch.cat([lat] * len(parts)) if len(parts) > 1 else lat
        text = torch.cat([p.text.expand(n, -1, -1) for p in parts])
        mask = torch.cat([p.mask.expand(n, -1) for p in parts])
        timestep = state.timestep.expand(x.shape[0]).to(lat.dtype) / 1000
        return DenoiseInputs(x, text, lat.new_zeros(x.shape[0], 0), timestep, state.grid, text_mask=mask)

    @torch.inference_mode()
    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """True CFG ``neg + s * (cond - neg)`` (P:798-813), then the request's scheduler step (P:816)."""
        noise_pred = output[: state.n]
        if state.cfg:
            neg_noise_pred = output[state.n:]
            noise_pred = neg_noise_pred + self.spec.cfg_scale(state.request) * (noise_pred - neg_noise_pred)
        state.latents = state.scheduler.step(noise_pred, state.timestep, state.latents, return_dict=False)[0]
        state.step_index += 1

    def unpacked_latents(self, latents: torch.Tensor, width: int, height: int, dtype: torch.dtype) -> torch.Tensor:
        """Packed ``latents`` (n, h * w, 64) as the VAE takes them: ``_unpack_latents``, then ``z * latents_std +
        latents_mean`` in ``dtype`` (P:840-850): (n, z_dim, 1, h, w)."""
        pipe, vae = self.pipe, self.vae
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(dtype)
        z, dev = vae.config.z_dim, latents.device
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(dev, dtype)
        std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(dev, dtype)
        return latents * std + mean

    @functools.cached_property
    def _preview(self):
        from bcg_core.preview import LazyPreview, vae_latents

        def encode(x: torch.Tensor) -> torch.Tensor:  # opaque RGBA pictures, one frame in, one latent frame out
            return vae_latents(self.vae, torch.cat([x, torch.ones_like(x[:, :1])], dim=1)[:, :, None])[:, :, 0]

        return LazyPreview(encode, self.pipe.vae_scale_factor)

    @torch.inference_mode()
    def preview(self, state: RequestState, latents: torch.Tensor) -> list[np.ndarray]:
        """``n`` previews of mid-denoise ``latents`` (a copy of ``state.latents``, packed tokens): unpacked and
        un-normalised as :meth:`decode`, then the VAE's fitted linear latent-to-RGB map (:class:`~bcg_core.preview.
        LinearPreview`, fitted on opaque pictures): (h, w, 3) uint8 RGB at latent resolution (1/16 of the size), no
        alpha."""
        req = state.request
        return self._preview(self.unpacked_latents(latents, req.width, req.height, torch.float32)[:, :, 0])

    @torch.inference_mode()
    def decode(self, state: RequestState) -> list[np.ndarray]:
        """:meth:`unpacked_latents`, the first frame decoded, ``postprocess`` (P:840-854): (height, width, 4) uint8
        RGBA, as diffusers' PIL images."""
        req = state.request
        latents = self.unpacked_latents(state.latents, req.width, req.height, self.vae.dtype)
        image = self.vae.decode(latents, return_dict=False)[0][:, :, 0]
        return [np.asarray(im) for im in self.pipe.image_processor.postprocess(image, output_type="pil")]
