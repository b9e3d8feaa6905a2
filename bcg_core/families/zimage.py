"""Z-Image family: ``ZImagePipeline`` checkpoints (Z-Image and Z-Image-Turbo) with ``ZImageTransformer2DModel``, a
single-stream DiT over one joint sequence of image and caption tokens, a Qwen3-family text encoder and a FLUX.1 VAE.

What diffusers 0.42.1 does (``pipelines/z_image/pipeline_z_image.py``, P; ``models/transformers/
transformer_z_image.py``, T) and what this module reuses:

- Text: ``encode_prompt`` / ``_encode_prompt`` (called here) wrap the prompt in the tokenizer's chat template with
  ``enable_thinking=True``, tokenize padded to ``max_sequence_length`` (512) with ``truncation=True``, read the LM's
  ``hidden_states[-2]`` and keep only the real tokens: a list of (L_i, cap_feat_dim) tensors, one length per
  prompt. A prompt whose templated tokens exceed 512 is refused here (the pipeline would cut it silently).
- Latents: ``prepare_latents`` (called here) draws (n, C, 2h, 2w) fp32 noise with ``randn_tensor`` from the
  request's generators (the latent image: the transformer patchifies 2x2 itself).
- Schedule: ``get_default_z_image_sigmas`` (``linspace(1, 1/N, N)``), ``calculate_shift`` of the h * w tokens from
  the scheduler config, ``retrieve_timesteps`` (all called here), ``set_begin_index(0)``.
- Step: the transformer gets ``timestep = (1000 - t) / 1000`` (fp32, reversed: 0 is noise) and the latents cast to
  its dtype; its output is *negated* before ``scheduler.step``.
- CFG: on whenever ``guidance_scale > 0`` (not > 1), against ``negative_prompt`` (default ``""``), with
  ``pred = pos + s * (pos - neg)`` (cond rows first). ``cfg_normalization`` c > 0 caps ``|pred|`` at
  ``c * |pos|`` per image (norms over the whole latent image); ``cfg_truncation`` c <= 1 turns guidance off (one
  forward, no uncond rows) at every step whose ``(1000 - t) / 1000`` exceeds c. Both are request fields of the same
  names (:mod:`bcg_core.validation_cfg`), read per request in :meth:`ZImageFamily.start` / :meth:`ZImageFamily.advance`,
  so rows of requests with different settings share a step; a request that omits them gets the model's defaults:
  the checkpoint's ``bcg_cfg_normalization`` / ``bcg_cfg_truncation`` in ``model_index.json``, else the
  ``__call__`` defaults (False, 1.0: off). A truncated request's uncond rows leave the step loop at the first
  truncated step (its ``RequestState.rows`` halves, as diffusers' forward does). The step runs on the host path
  (the family is no :class:`~bcg_core.capabilities.FusedStep`), where :meth:`ZImageFamily.advance` applies each
  request's own settings.
- Decode: ``z / scaling_factor + shift_factor``, ``vae.decode``, ``image_processor.postprocess``.

Padding contract (:class:`ZImageAdapter`). T's forward takes per-row lists and pads them itself:

1. Each caption of L tokens is padded to ``Lc = ceil(L / 32) * 32`` (``SEQ_MULTI_OF``) with ``cap_pad_token``
   (a learned vector, written over the embedded pad slots) at RoPE positions ``(1 + i, 0, 0)``, i < Lc; each image
   of S = h * w tokens to ``Si = ceil(S / 32) * 32`` with ``x_pad_token`` at position (0, 0, 0); image token
   (r, c) sits at ``(Lc + 1, r, c)``. These internal pads are **attended**: they are part of the model's input,
   and no mask hides them.
2. Rows of different lengths are then right-padded to the longest (``pad_sequence``) and a (B, L) boolean key
   mask hides that batch padding; all rows of one length: no mask. The joint sequence is ``[image Si, caption
   Lc]``: the noise refiner runs on the image part, the context refiner on the caption part, the main layers on
   both.

bcg-serve keys on the token grid (``grid_keyed``: every row of a bucket has the same Si) and on the real caption
tokens L (masked text buckets, at most 512). A bucket of T text tokens holds ``Tc = ceil(T / 32) * 32`` caption
slots per row: slots [0, L) real, [L, Lc) the model's own ``cap_pad_token`` (attended, positions as T gives them),
[Lc, Tc) bcg-serve's padding (zero, position 0, hidden by the key mask in the context refiner and the main layers).
Pad rows copy real row 0. T's list interface decides the mask and the positions from Python lengths, so a CUDA
graph cannot hold varying L: :meth:`ZImageAdapter.forward` is a fixed-shape entry built from T's own modules
(``_patchify_image``, ``all_x_embedder``, ``t_embedder``, ``noise_refiner``, ``cap_embedder``,
``context_refiner``, ``layers``, ``all_final_layer``, ``rope_embedder``, ``create_coordinate_grid``,
``unpatchify``) that takes the per-row positions and the key mask as tensors. Every op but attention is per token
or per row, and attention gives hidden keys weight zero, so real and model-pad tokens see exactly the keys T's own
forward gives them: a padded bucket equals the unpadded forward (``tests/families/test_zimage.py``), and a row
alone whose Lc fills Tc equals it bit for bit where the attention kernel ignores an all-True mask bit for bit.

Previews (:class:`~bcg_core.capabilities.Previews`): the latent image unscaled as the decode does, then the VAE's fitted
linear latent-to-RGB map (:mod:`bcg_core.preview`).

LoRA adapters per request (:mod:`bcg_core.lora`): files are read with ``ZImagePipeline.lora_state_dict``
(``ZImageLoraLoaderMixin``: kohya's ``lora_unet_`` and ``diffusion_model.`` layouts, ``lora_down``/``lora_up`` with
alphas folded into the weights, as diffusers converts them). T's own forward feeds ``all_x_embedder`` and
``cap_embedder`` every row's tokens as one flat sequence, where a linear layer cannot tell the rows apart;
:meth:`ZImageAdapter.forward` embeds (B, Si, P) and (B, Tc, D) rows first (the same matmul, bit for bit), so each
row's adapters reach its own tokens, and the unpadded forward (T's) runs once per set of rows carrying the same
adapters (``ZImageAdapter.eager_mixes_rows``, :meth:`~bcg_core.lora.rows.LoRAAdapter.forward_eager`).

Not served yet: the fused step, edits (``ZImageImg2ImgPipeline``), the Omni and ControlNet variants; T has no
``CacheMixin``, so no step cache.
"""

from __future__ import annotations

import copy
import functools
import threading
from pathlib import Path

import numpy as np
import torch

from bcg_core.capabilities import EagerMixesRows, Previews
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, load_pipeline, read_json
from bcg_core.families.defaults import checkpoint_cfg_options, pipeline_defaults, text_tokens
from bcg_core.families.state import RequestState, TextRows, pad_text
from bcg_core.keys import BucketKey
from bcg_core.padding import DenoiseInputs, copy_rows, fill_masked_text
from bcg_core.table import ShapeRules

__all__ = ["ZImageAdapter", "ZImageFamily", "seq_multiple"]

ZIMAGE_DEFAULT_SIDE_PX = 1024
"""``ZImagePipeline.__call__``'s size without ``height``/``width`` (``height or 1024``)."""

PATCH, F_PATCH = 2, 1
"""The ``patch_size`` / ``f_patch_size`` ``ZImagePipeline`` runs (the forward's defaults; it passes neither)."""


def seq_multiple() -> int:
    """``SEQ_MULTI_OF`` of diffusers' Z-Image transformer (32): each row's image and caption lengths round up to it."""
    from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF

    return SEQ_MULTI_OF


def _round_up(n, m: int):
    return (n + m - 1) // m * m


class ZImageAdapter(EagerMixesRows):
    """Z-Image architecture (``ZImageTransformer2DModel``): keyed on the grid, masked caption buckets (module
    docstring, "Padding contract").

    Layout: ``DenoiseInputs.latents`` (rows, C, 2h, 2w) the latent image; ``text`` (rows, T, cap_feat_dim) with
    ``text_mask`` (rows, T) whose True entries are a prefix (the real tokens, as :func:`pad_text` leaves them) or
    None (all real); ``pooled`` (rows, 0); ``timestep`` (rows,) ``(1000 - t) / 1000`` in fp32. Output: (rows, C,
    2h, 2w) in the model dtype, not negated (the transformer's own output).

    Args:
        model: a ``ZImageTransformer2DModel`` whose ``all_patch_size`` holds 2 and ``all_f_patch_size`` 1.
        vae_scale_factor: pixels per latent pixel (8 for the FLUX.1 VAE).
        max_text_tokens: most caption tokens the pipeline keeps (``max_sequence_length``, 512).

    Raises:
        ValueError: a transformer without the 2x2 / 1 patch embedder the pipeline uses.
    """

    family = "zimage"
    timestep_max = 1.0
    guidance_embeds = False
    pooled_dim = 0
    eager_mixes_rows = True
    """:meth:`forward_eager` (T's own forward) embeds every row's tokens as one flat sequence, so LoRA rows reach it
    one set of entries at a time (:meth:`~bcg_core.lora.rows.LoRAAdapter.forward_eager`); :meth:`forward` keeps
    rows first."""

    def __init__(self, model: torch.nn.Module, vae_scale_factor: int = 8, max_text_tokens: int = 512):
        cfg = model.config
        if PATCH not in tuple(cfg.all_patch_size) or F_PATCH not in tuple(cfg.all_f_patch_size):
            raise ValueError(f"ZImageTransformer2DModel all_patch_size {cfg.all_patch_size} / all_f_patch_size "
                             f"{cfg.all_f_patch_size}: ZImagePipeline runs patch {PATCH}, f_patch {F_PATCH}")
        self.model = model
        self.rules = ShapeRules(pixels_per_token=vae_scale_factor * PATCH, grid_keyed=True, native_text_tokens=None)
        self.in_channels = int(cfg.in_channels)
        self.seq_dim = int(cfg.cap_feat_dim)
        self.max_text_tokens = max_text_tokens
        self.multiple = seq_multiple()
        self._embed_key = f"{PATCH}-{F_PATCH}"

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Latent images (rows, C, 2h, 2w), standard normal, CPU fp32."""
        return torch.randn(rows, self.in_channels, grid[0] * PATCH, grid[1] * PATCH, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments; Si = h * w and Tc = T rounded up to 32).

        Raises:
            ValueError: a key without a grid, or with more text tokens than the pipeline ever keeps.
        """
        if key.latent_hw is None:
            raise ValueError(f"bucket {key} has no latent_hw: Z-Image buckets are keyed on the latent grid")
        if key.text_tokens > self.max_text_tokens:
            raise ValueError(f"bucket {key}: {key.text_tokens} text tokens exceed the {self.max_text_tokens} that "
                             f"ZImagePipeline keeps (max_sequence_length); use text_lengths up to "
                             f"{self.max_text_tokens}")
        (h, w), b = key.latent_hw, key.batch
        si, tc = _round_up(h * w, self.multiple), _round_up(key.text_tokens, self.multiple)
        return {
            "latents": torch.zeros(b, self.in_channels, h * PATCH, w * PATCH, device=device, dtype=dtype),
            "text": torch.zeros(b, tc, self.seq_dim, device=device, dtype=dtype),  # (B, Tc, D_cap)
            "text_mask": torch.zeros(b, tc, device=device, dtype=torch.bool),  # (B, Tc) real caption tokens
            "cap_keep": torch.zeros(b, tc, device=device, dtype=torch.bool),  # (B, Tc) attended: [0, Lc)
            "cap_ids": torch.zeros(b, tc, 3, device=device, dtype=torch.int32),  # (B, Tc, 3) RoPE positions
            "img_ids": torch.zeros(b, si, 3, device=device, dtype=torch.int32),  # (B, Si, 3) RoPE positions
            "timestep": torch.zeros(b, device=device, dtype=torch.float32),  # (B,) (1000 - t) / 1000
        }

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Copy ``inputs`` into the buffers and write each row's positions and key mask from its caption length
        (tensor ops only: no host sync). Every element is written, so nothing of an earlier request survives.

        Raises:
            ValueError: the inputs do not fit (more rows, another grid, more text tokens).
        """
        lat, text, real = buffers["latents"], buffers["text"], buffers["text_mask"]
        b, _, hh, ww = lat.shape
        tc = text.shape[1]
        n, s = inputs.rows, inputs.text_tokens
        if n > b or tuple(inputs.latents.shape[1:]) != tuple(lat.shape[1:]) or s > tc or inputs.guidance is not None:
            raise ValueError(f"inputs of {n} rows x latents {tuple(inputs.latents.shape[1:])} x {s} text tokens do not "
                             f"fit bucket buffers of {b} rows x latents {tuple(lat.shape[1:])} x {tc} caption slots "
                             f"(Z-Image takes no guidance input)")
        copy_rows(lat, inputs.latents)
        fill_masked_text(text, real, inputs)
        copy_rows(buffers["timestep"], inputs.timestep)
        m = self.multiple
        lc = _round_up(real.sum(dim=1), m)  # (B,) caption slots the model attends: L rounded up to 32
        slot = torch.arange(tc, device=text.device)
        keep = buffers["cap_keep"]
        keep.copy_(slot[None, :] < lc[:, None])
        cap_ids = buffers["cap_ids"]
        cap_ids.zero_()
        cap_ids[..., 0] = torch.where(keep, slot[None, :] + 1, 0)  # T: grid (Lc, 1, 1) from (1, 0, 0)
        img_ids = buffers["img_ids"]
        h, w = hh // PATCH, ww // PATCH
        grid = self.model.create_coordinate_grid((1, h, w), (0, 0, 0), device=img_ids.device).flatten(0, 2)
        img_ids.zero_()  # the model's own pad tokens [h * w, Si) sit at (0, 0, 0)
        img_ids[:, : h * w, 1:] = grid[:, 1:]
        img_ids[:, : h * w, 0] = (lc + 1)[:, None].to(img_ids.dtype)  # T: image frame axis starts at Lc + 1

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded, masked forward over the static buffers (module docstring): (B, C, 2h, 2w)."""
        return self._padded(buffers["latents"], buffers["text"], buffers["text_mask"], buffers["cap_keep"],
                            buffers["cap_ids"], buffers["img_ids"], buffers["timestep"])

    def _padded(self, latents, text, real, keep, cap_ids, img_ids, timestep) -> torch.Tensor:
        # T.forward's basic (non-omni) path on fixed shapes; T's line order kept, its modules reused.
        mdl = self.model
        b, _, hh, ww = latents.shape
        s, si, tc = (hh // PATCH) * (ww // PATCH), img_ids.shape[1], text.shape[1]
        adaln = mdl.t_embedder(timestep * mdl.t_scale).type_as(latents)
        x = torch.stack([mdl._patchify_image(img.unsqueeze(1), PATCH, F_PATCH)[0] for img in latents])  # (B, S, P)
        if si > s:  # the model's own pad tokens: any value here, x_pad_token after the embedding
            x = torch.cat([x, x[:, -1:].expand(b, si - s, x.shape[2])], dim=1)
        x = mdl.all_x_embedder[self._embed_key](x)  # (B, Si, dim): rows first, as LoRA rows need (T flattens them)
        x_pad = (torch.arange(si, device=x.device) >= s).view(1, si, 1)
        x = torch.where(x_pad, mdl.x_pad_token, x)
        x_freqs = mdl.rope_embedder(img_ids.flatten(0, 1)).view(b, si, -1)
        for layer in mdl.noise_refiner:  # every row has Si image tokens: no mask, as T
            x = layer(x, None, x_freqs, adaln)
        cap = mdl.cap_embedder(text)  # (B, Tc, dim)
        cap = torch.where((keep & ~real).unsqueeze(-1), mdl.cap_pad_token, cap)
        cap_freqs = mdl.rope_embedder(cap_ids.flatten(0, 1)).view(b, tc, -1)
        for layer in mdl.context_refiner:
            cap = layer(cap, keep, cap_freqs)
        unified = torch.cat([x, cap], dim=1)
        freqs = torch.cat([x_freqs, cap_freqs], dim=1)
        mask = torch.cat([keep.new_ones(b, si), keep], dim=1)
        for layer in mdl.layers:
            unified = layer(unified, mask, freqs, adaln)
        out = mdl.all_final_layer[self._embed_key](unified, c=adaln)
        images = mdl.unpatchify(list(out.unbind(0)), [(1, hh, ww)] * b, PATCH, F_PATCH)  # T keeps the first S
        return torch.stack(images)[:, :, 0]

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` of ``output`` (caption padding leaves no trace in the image output)."""
        return output[: inputs.rows]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded reference forward, exactly as ``ZImagePipeline.__call__`` calls the transformer (P:533-541):
        per-row lists of (C, 1, 2h, 2w) latents and (L_i, D) captions (the mask's real tokens)."""
        p = next(self.model.parameters())
        lat = inputs.latents.to(device=p.device, dtype=p.dtype).unsqueeze(2)
        text = inputs.text.to(device=p.device, dtype=p.dtype)
        caps = list(text.unbind(0)) if inputs.text_mask is None else [
            t[m.to(p.device)] for t, m in zip(text.unbind(0), inputs.text_mask.unbind(0), strict=True)]
        out = self.model(list(lat.unbind(0)), inputs.timestep.to(device=p.device, dtype=torch.float32), caps,
                         return_dict=False)[0]
        return torch.stack(out)[:, :, 0]


class ZImageFamily(Previews):
    """A ``ZImagePipeline`` checkpoint, served step by step (see the module docstring).

    Request fields: ``guidance_scale`` (default 5.0, the pipeline's) above 0 runs CFG against ``negative_prompt``
    (default ``""``); ``true_cfg_scale`` is refused. ``cfg_normalization`` and ``cfg_truncation`` per request (the
    pipeline's options; defaults: the checkpoint's ``bcg_cfg_normalization`` / ``bcg_cfg_truncation`` in
    ``model_index.json``, else the pipeline's False and 1.0: :attr:`ModelSpec.default_cfg_normalization`).

    Args:
        name: served model name.
        spec: the model's :class:`ModelSpec`.
        pipe: the loaded ``ZImagePipeline`` on ``device``; its methods do the work.
        counter: ``prompt -> tokens`` (:meth:`token_counter`).
    """

    name = "zimage"
    pipeline_classes = ("ZImagePipeline",)
    lora_loader = "ZImagePipeline"

    @staticmethod
    def transformer_width(config: dict) -> int:
        """``dim`` of the ``ZImageTransformer2DModel`` config (its hidden width, ``n_heads`` x head size; the config
        has no ``num_attention_heads`` / ``attention_head_dim``)."""
        return int(config["dim"])

    def __init__(self, name: str, spec: ModelSpec, pipe, counter, device: torch.device, dtype: torch.dtype):
        self.model_name = name
        self.spec = spec
        self.rules = spec.rules
        self.guidance_embeds = False
        self.pipe = pipe
        self.vae = pipe.vae
        self.adapter = ZImageAdapter(pipe.transformer, pipe.vae_scale_factor, spec.max_text_tokens)
        self._counter = counter
        self._lock = threading.Lock()
        self.device, self.dtype = device, dtype

    # -- checkpoint ---------------------------------------------------------------------------------

    @staticmethod
    def text_tokens(index: dict) -> int:
        """``max_sequence_length``: ``bcg_text_tokens`` of ``model_index.json``, else ``__call__``'s default (512)."""
        from diffusers import ZImagePipeline

        return text_tokens(ZImagePipeline, index)

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """Spec from ``transformer/``, ``vae/`` and ``scheduler/`` configs; request defaults from
        ``ZImagePipeline.__call__``'s signature (:func:`pipeline_defaults`: 50 steps, guidance 5.0), and
        ``cfg_normalization`` / ``cfg_truncation``, overridden by the checkpoint's (:func:`checkpoint_cfg_options`).

        Raises:
            ValueError: another pipeline class, a transformer without the 2x2 patch embedder, a scheduler with
                ``stochastic_sampling`` (noise from the global RNG), or a bad ``bcg_cfg_normalization`` /
                ``bcg_cfg_truncation``.
        """
        kind = index["_class_name"]
        if kind not in cls.pipeline_classes:
            raise ValueError(f"{kind!r} is not a Z-Image pipeline ({', '.join(cls.pipeline_classes)})")
        tr = read_json(path / "transformer" / "config.json")
        vae = read_json(path / "vae" / "config.json")
        sched = read_json(path / "scheduler" / "scheduler_config.json")
        if PATCH not in tuple(tr.get("all_patch_size", (PATCH,))):
            raise ValueError(f"{path.name}: transformer all_patch_size {tr['all_patch_size']}: ZImagePipeline runs "
                             f"patch size {PATCH}")
        if sched.get("stochastic_sampling"):
            raise ValueError(f"{path.name}: scheduler stochastic_sampling=true draws its noise from the global RNG "
                             f"(not reproducible)")
        scale = 2 ** (len(vae["block_out_channels"]) - 1)  # ZImagePipeline.__init__'s vae_scale_factor
        tokens = cls.text_tokens(index)
        return ModelSpec(
            name=path.name, family=cls.name, pipeline_class=kind,
            rules=ShapeRules(pixels_per_token=scale * PATCH, grid_keyed=True, native_text_tokens=None),
            cfg_rule="guidance_positive", max_prompt_tokens=tokens, max_text_tokens=tokens,
            quality_steps=QUALITY_STEPS["zimage"], default_size=(ZIMAGE_DEFAULT_SIDE_PX,) * 2,
            **{**pipeline_defaults(kind), **checkpoint_cfg_options(index, path.name)},
        )

    @classmethod
    def token_counter(cls, path: Path, index: dict):
        """``prompt -> tokens`` of the templated prompt as ``_encode_prompt`` tokenizes it (the chat template with
        ``enable_thinking=True``), untruncated, so that a prompt over ``max_sequence_length`` is refused rather
        than cut. Tokenizer only, no weights."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)

        def count(prompt: str, negative: bool = False) -> int:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=True)
            return len(tok(text)["input_ids"])
        return count

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> ZImageFamily:
        """Load with ``ZImagePipeline.from_pretrained`` (local files only, :func:`load_pipeline`)."""
        from diffusers import ZImagePipeline

        spec = cls.describe(path, index)
        pipe = load_pipeline(ZImagePipeline, path, device, dtype)
        return cls(path.name, spec, pipe, cls.token_counter(path, index), device, dtype)

    # -- validation hooks ---------------------------------------------------------------------------

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """Templated tokens of ``prompt`` (see :meth:`token_counter`; negative prompts alike)."""
        with self._lock:
            return self._counter(prompt)

    # -- the step-level loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, prompt: str) -> TextRows:
        """One prompt through ``encode_prompt``: (1, L, D) embeddings of its real tokens, an all-True (1, L) mask."""
        with self._lock:  # a fresh list: _encode_prompt writes the templated prompt into it
            (text,), _ = self.pipe.encode_prompt(prompt=[prompt], device=self.device,
                                                 do_classifier_free_guidance=False,
                                                 max_sequence_length=self.spec.max_text_tokens)
        text = text.unsqueeze(0)
        return TextRows(text, text.new_zeros(1, 0), torch.ones(1, text.shape[1], device=text.device, dtype=torch.bool))

    @torch.inference_mode()
    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode (and, with CFG, the negative prompt), draw fp32 noise with ``prepare_latents`` and set the schedule
        (P:420-470)."""
        from diffusers.pipelines.z_image.pipeline_z_image import (
            calculate_shift,
            get_default_z_image_sigmas,
            retrieve_timesteps,
        )

        req = validated.request
        cond = self.encode(req.prompt)
        uncond = self.encode(req.negative_prompt or "") if self.spec.uses_cfg(req) else None
        gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        latents = self.pipe.prepare_latents(req.n, self.adapter.in_channels, req.height, req.width, torch.float32,
                                            self.device, gens)
        sched = copy.deepcopy(self.pipe.scheduler)
        c = sched.config
        mu = calculate_shift((latents.shape[2] // 2) * (latents.shape[3] // 2), c.get("base_image_seq_len", 256),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        steps = req.num_inference_steps
        timesteps, _ = retrieve_timesteps(sched, steps, self.device, sigmas=get_default_z_image_sigmas(steps), mu=mu)
        sched.set_begin_index(0)
        extras = {}  # the request's cfg_truncation, not the model's: rows of one step may differ
        if uncond is not None and self.cfg_options(req)[1] <= 1:  # P:486-489
            extras["t_norms"] = ((1000 - timesteps.float()) / 1000).tolist()
        state = RequestState(validated, cond, uncond, latents, sched, timesteps, self.rules.grid(req.width, req.height),
                             extras=extras, cancel=cancel)
        self._truncate(state)
        return state

    def cfg_options(self, request) -> tuple[float, float]:
        """``(cfg_normalization, cfg_truncation)`` of ``request`` as the pipeline reads them: the normalization as a
        float (False 0.0, True 1.0: ``float()``; 0 is off), both the model's defaults where the request holds None
        (a validated request holds its own, :mod:`bcg_core.validation_cfg`)."""
        norm, trunc = request.cfg_normalization, request.cfg_truncation
        norm = self.spec.default_cfg_normalization if norm is None else norm
        trunc = self.spec.default_cfg_truncation if trunc is None else trunc
        return float(norm or 0.0), float(trunc)

    def _truncate(self, state: RequestState) -> None:
        """Drop the uncond rows from the first step whose ``(1000 - t) / 1000`` exceeds the request's
        ``cfg_truncation`` (P:498-500: guidance 0 there, one forward); the normalised times grow, so they never come
        back."""
        norms = state.extras.get("t_norms")
        if state.cfg and norms is not None and not state.done \
                and norms[state.step_index] > self.cfg_options(state.request)[1]:
            state.uncond = None

    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """Cond rows (one per image), then with CFG the uncond rows (P:506-509), text padded (masked) to the longer;
        timestep ``(1000 - t) / 1000`` per row (P:495-496)."""
        n, lat = state.n, state.latents
        parts = [state.cond] + ([state.uncond] if state.cfg else [])
        tokens = max(p.tokens for p in parts)
        parts = [pad_text(p, tokens) for p in parts]
        x = torch.cat([lat] * len(parts)) if len(parts) > 1 else lat
        text = torch.cat([p.text.expand(n, -1, -1) for p in parts])
        mask = torch.cat([p.mask.expand(n, -1) for p in parts])
        timestep = (1000 - state.timestep.expand(x.shape[0])) / 1000
        return DenoiseInputs(x, text, lat.new_zeros(x.shape[0], 0), timestep, state.grid, text_mask=mask)

    @torch.inference_mode()
    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """CFG ``pos + s * (pos - neg)`` per image, capped by the request's ``cfg_normalization`` (P:543-564), the
        negated prediction through the request's scheduler step (P:566-570); then :meth:`_truncate` for the next step.
        ``output``: this request's (rows, C, 2h, 2w) slice of the step's output (cond rows, then uncond rows)."""
        n = state.n
        if state.cfg:
            scale = self.spec.cfg_scale(state.request)
            cap = self.cfg_options(state.request)[0]
            preds = []
            for j in range(n):
                pos, neg = output[j].float(), output[n + j].float()
                pred = pos + scale * (pos - neg)
                if cap > 0.0:
                    ori_pos_norm = torch.linalg.vector_norm(pos)
                    new_pos_norm = torch.linalg.vector_norm(pred)
                    max_new_norm = ori_pos_norm * cap
                    if new_pos_norm > max_new_norm:
                        pred = pred * (max_new_norm / new_pos_norm)
                preds.append(pred)
            noise = torch.stack(preds)
        else:
            noise = output[:n].float()
        state.latents = state.scheduler.step(-noise, state.timestep, state.latents, return_dict=False)[0]
        state.step_index += 1
        self._truncate(state)

    @functools.cached_property
    def _preview(self):
        from bcg_core.preview import vae_preview

        return vae_preview(self.vae, self.pipe.vae_scale_factor)

    @torch.inference_mode()
    def preview(self, state: RequestState, latents: torch.Tensor) -> list[np.ndarray]:
        """``n`` previews of mid-denoise ``latents`` (a copy of ``state.latents``): ``z / scaling_factor +
        shift_factor`` as :meth:`decode`, then the VAE's fitted linear latent-to-RGB map
        (:class:`~bcg_core.preview.LinearPreview`): (h, w, 3) uint8 at latent resolution (1/8 of the size)."""
        vae = self.vae
        return self._preview(latents.float() / vae.config.scaling_factor + vae.config.shift_factor)

    @torch.inference_mode()
    def decode(self, state: RequestState) -> list[np.ndarray]:
        """``z / scaling_factor + shift_factor``, ``vae.decode``, ``postprocess`` to uint8 RGB (P:583-588)."""
        vae = self.vae
        latents = state.latents.to(vae.dtype)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return [np.asarray(im) for im in self.pipe.image_processor.postprocess(image, output_type="pil")]
