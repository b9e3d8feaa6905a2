"""Wan family: ``WanPipeline`` checkpoints (Wan 2.1 text to video, and Wan 2.2 A14B's two experts) with
``WanTransformer3DModel``, a UMT5 text encoder and ``AutoencoderKLWan``, a causal 3D VAE. The first video family: a
request's output is ``n`` videos of ``num_frames`` frames, and its bucket key holds the latent frames beside the grid.

What diffusers 0.42.1 does (``pipelines/wan/pipeline_wan.py``, P; ``models/transformers/transformer_wan.py``, T)
and what this module reuses:

- Text: ``encode_prompt`` / ``_get_t5_prompt_embeds`` (called here) clean the prompt (``prompt_clean``: ftfy where
  installed, HTML unescaping, whitespace collapsed), tokenize it padded to ``max_sequence_length`` (512) with
  ``truncation=True``, run UMT5 with the attention mask, keep the real tokens' ``last_hidden_state`` and pad them
  back to 512 with **zero vectors** (P:175-180). The transformer gets all 512 rows and no mask: the zero rows are
  attended (they pass ``text_embedder``'s bias and become real keys). So the text stream has one fixed length,
  512, unmasked (``native_text_tokens``), and a prompt over 512 tokens is refused here (the pipeline would cut it
  silently). The negative prompt (default ``""``) is encoded the same way.
- Latents: ``prepare_latents`` (called here) draws (n, 16, F, H / 8, W / 8) fp32 noise with ``randn_tensor`` from
  the request's generators, F = ``(num_frames - 1) // 4 + 1`` latent frames (the VAE's temporal factor,
  ``vae.config.scale_factor_temporal``). ``__call__`` rounds a ``num_frames`` that is not 1 + 4k down with a
  warning, and sizes down to multiples of 16: bcg-serve refuses both instead (the request names the field).
- Schedule: the checkpoint's ``UniPCMultistepScheduler`` (flow prediction, flow sigmas, ``flow_shift`` 3.0 at 480p,
  5.0 at 720p) with ``set_timesteps(steps)`` and ``set_begin_index(0)``: a multistep solver whose history lives in
  each request's own copy. Timesteps are int64; the transformer casts them to float in ``Timesteps`` (integers up
  to 1000 are exact in fp32, so a fp32 buffer gives the same embedding).
- Step: ``transformer(latents.to(dtype), t.expand(n), prompt_embeds)``; with CFG (``guidance_scale > 1``) a second
  forward on the negative embeddings, ``uncond + s * (cond - uncond)`` in the transformer's dtype, then
  ``scheduler.step`` on the fp32 latents. bcg-serve runs both forwards as rows of one (cond rows first).
- Experts (Wan 2.2 A14B: ``transformer_2`` and ``boundary_ratio`` in ``model_index.json``, P:585-604): the step at
  timestep ``t`` runs ``transformer`` (the high-noise expert) with ``s = guidance_scale`` where ``t >= boundary_ratio
  x num_train_timesteps``, else ``transformer_2`` (the low-noise expert) with ``s = guidance_scale_2`` (default
  ``guidance_scale``); CFG rows run or not by ``guidance_scale`` alone (``do_classifier_free_guidance``). The
  comparison is made once per request, as torch makes it (an int64 timestep against a Python float, in fp32), on
  its timesteps (:meth:`WanFamily.expert`). Each expert has its own runner and graphs (:mod:`bcg_core.experts`);
  the step scheduler steps the requests at each expert apart.
- Decode: ``latents / (1 / latents_std) + latents_mean`` per channel (the VAE config's), ``vae.decode``,
  ``video_processor.postprocess_video``; frames become uint8 as ``numpy_to_pil`` rounds them.

Padding contract (:class:`WanAdapter`). T's forward reads only shapes: ``patch_embedding`` (a Conv3d of kernel and
stride (1, 2, 2)) makes F x h x w video tokens (h = H / 16, w = W / 16 in pixels), ``rope`` builds a 3D RoPE over
that (f, h, w) grid from the latent's shape, every block runs unmasked self-attention over the video tokens and
unmasked cross-attention to the 512 text tokens, and the output is unpatchified by the same grid. Nothing is
masked anywhere, so:

1. **Video tokens are exact**: a bucket holds one (latent frames, h, w) grid; the key carries it as
   ``..._g<f>x<h>x<w>`` (:class:`~bcg_core.keys.BucketKey` ``frames`` and ``latent_hw``; ``image_tokens`` = f x h x
   w). Rounding frames or sides up would change every token's RoPE neighbours and attention; no masked tier is
   served.
2. **Text is exact**: always 512 tokens, the pipeline's own zero padding included (``native_text_tokens`` 512).
3. **Only the batch is padded**: pad rows copy real row 0 (:func:`~bcg_core.padding.copy_rows`) and are dropped
   after the forward. Every op is per row, so a padded bucket equals the unpadded forward up to the float reduction
   order of batched kernels (``tests/families/test_wan.py``).

A request's ``num_frames`` (1 + 4k, default 81 as ``__call__``) is validated by :mod:`bcg_core.validation`;
:meth:`WanFamily.decode` returns one (num_frames, height, width, 3) uint8 array per video
(:attr:`~bcg_core.request.GenerationResult.videos`).

Not served yet: Wan 2.2 TI2V-5B's ``expand_timesteps`` (a timestep per token, with a 48-channel VAE: refused when
the checkpoint is described), image to video (``WanImageToVideoPipeline``), LoRA (``WanLoraLoaderMixin``), previews
and the fused step. The step cache (First Block Cache, TaylorSeer) runs on a checkpoint of one transformer as on the
image families: T is a ``CacheMixin`` and diffusers' ``TransformerBlockRegistry`` describes ``WanTransformerBlock``
(one stream out), and the pipeline runs its cond and uncond forwards under ``cache_context("cond")`` / ``("uncond")``;
a checkpoint of two experts takes none (each expert's hooks keep their own state, which one request's cache would
have to follow across the boundary).
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import numpy as np
import torch

from bcg_core.capabilities import Experts, StepCache
from bcg_core.families.base import QUALITY_STEPS, ModelSpec, heads_width, load_pipeline, read_json
from bcg_core.families.defaults import pipeline_defaults, text_tokens
from bcg_core.families.state import RequestState, TextRows
from bcg_core.keys import BucketKey
from bcg_core.padding import DenoiseInputs, copy_rows
from bcg_core.step_cache.spec import METHODS as CACHE_METHODS
from bcg_core.table import ShapeRules

__all__ = ["WanAdapter", "WanFamily"]

EXPERT_KEYS = ("patch_size", "in_channels", "out_channels", "text_dim", "num_attention_heads", "attention_head_dim",
               "rope_max_seq_len")
"""``transformer/config.json`` keys both experts of a Wan 2.2 checkpoint must share: they serve one bucket table."""

WAN_TEXT_TOKENS = 512
"""``WanPipeline.__call__``'s ``max_sequence_length``: the text stream's fixed length (read from the signature by
:meth:`WanFamily.text_tokens`; this is its 0.42.1 value, for the docs)."""


class WanAdapter:
    """Wan padding (``WanTransformer3DModel``): exact (frames, h, w) grid, fixed unmasked 512-token text, pad rows
    only (module docstring, "Padding contract").

    Layout: ``DenoiseInputs.latents`` (rows, C, F, 2h, 2w) the latent video; ``grid`` ``(F, h, w)``; ``text`` (rows,
    512, text_dim) with ``text_mask`` None; ``pooled`` (rows, 0); ``timestep`` (rows,) on the 0-1000 scale, held in
    fp32. Output: (rows, C_out, F, 2h, 2w) in the model dtype.

    Args:
        model: a ``WanTransformer3DModel`` whose ``patch_size`` is (1, p, p).
        vae_scale_factor: pixels per latent pixel side (``vae.config.scale_factor_spatial``, 8).
        frame_stride: pixel frames per latent frame (``vae.config.scale_factor_temporal``, 4).
        text_tokens: the text stream's length (``max_sequence_length``, 512).

    Raises:
        ValueError: a transformer whose patch spans several frames or is not square.
    """

    family = "wan"
    guidance_embeds = False
    timestep_max = 1000.0
    pooled_dim = 0

    def __init__(self, model: torch.nn.Module, vae_scale_factor: int = 8, frame_stride: int = 4,
                 text_tokens: int = WAN_TEXT_TOKENS):
        cfg = model.config
        pt, ph, pw = (int(p) for p in cfg.patch_size)
        if pt != 1 or ph != pw:
            raise ValueError(f"WanTransformer3DModel patch_size {tuple(cfg.patch_size)}: bcg-serve serves (1, p, p) "
                             f"patches (Wan 2.1 and 2.2: (1, 2, 2))")
        self.model = model
        self.patch = ph
        self.rules = ShapeRules(pixels_per_token=vae_scale_factor * ph, grid_keyed=True,
                                native_text_tokens=text_tokens, frame_stride=frame_stride)
        self.in_channels = int(cfg.in_channels)
        self.out_channels = int(cfg.out_channels or cfg.in_channels)
        self.seq_dim = int(cfg.text_dim)

    def example_latents(self, rows: int, grid: tuple[int, int, int], generator: torch.Generator) -> torch.Tensor:
        """Latent videos (rows, C, F, h * p, w * p) of the token grid ``(F, h, w)``, standard normal, CPU fp32.

        Raises:
            ValueError: a grid without its frames (an image grid ``(h, w)``).
        """
        if len(grid) != 3:
            raise ValueError(f"grid {grid}: a Wan grid is (latent frames, h, w)")
        f, h, w = grid
        return torch.randn(rows, self.in_channels, f, h * self.patch, w * self.patch, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments).

        Raises:
            ValueError: a key without frames and grid, or with another text length than the pipeline's.
        """
        if key.frames is None or key.latent_hw is None:
            raise ValueError(f"bucket {key} has no frames x h x w grid: Wan buckets are keyed on it (..._g<f>x<h>x<w>)")
        if key.text_tokens != self.rules.native_text_tokens:
            raise ValueError(f"bucket {key}: Wan's text stream is always {self.rules.native_text_tokens} tokens "
                             f"(the pipeline pads every prompt to max_sequence_length); use text_lengths "
                             f"[{self.rules.native_text_tokens}]")
        (h, w), f, b, p = key.latent_hw, key.frames, key.batch, self.patch
        return {
            "latents": torch.zeros(b, self.in_channels, f, h * p, w * p, device=device, dtype=dtype),  # (B,C,F,H,W)
            "text": torch.zeros(b, key.text_tokens, self.seq_dim, device=device, dtype=dtype),  # (B, 512, D_text)
            "timestep": torch.zeros(b, device=device, dtype=torch.float32),  # (B,) 0-1000 scale, fp32
        }

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Copy ``inputs`` into the buffers; pad rows are copies of row 0 (every element is written).

        Raises:
            ValueError: the inputs do not fit (more rows, another grid, another text length) or carry a text mask.
        """
        lat, text = buffers["latents"], buffers["text"]
        b, t, n = lat.shape[0], text.shape[1], inputs.rows
        if inputs.text_mask is not None:
            raise ValueError("Wan's text is unmasked (zero-padded to 512 by the pipeline): inputs.text_mask must be "
                             "None")
        if n > b or tuple(inputs.latents.shape[1:]) != tuple(lat.shape[1:]) or inputs.text_tokens != t:
            raise ValueError(f"inputs of {n} rows x latents {tuple(inputs.latents.shape[1:])} x {inputs.text_tokens} "
                             f"text tokens do not fit bucket buffers of {b} rows x latents {tuple(lat.shape[1:])} x "
                             f"{t} text tokens")
        copy_rows(lat, inputs.latents)
        copy_rows(text, inputs.text)
        copy_rows(buffers["timestep"], inputs.timestep)

    def _call(self, latents, text, timestep) -> torch.Tensor:
        return self.model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded forward over the static buffers: (B, C_out, F, H, W)."""
        return self._call(buffers["latents"], buffers["text"], buffers["timestep"])

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` of ``output`` (only rows are padded)."""
        return output[: inputs.rows]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded reference forward, as ``WanPipeline.__call__`` calls the transformer (P:575-581)."""
        if inputs.text_mask is not None:
            raise ValueError("Wan's text is unmasked: inputs.text_mask must be None")
        p = next(self.model.parameters())
        cast = lambda x: x.to(device=p.device, dtype=p.dtype)  # noqa: E731
        return self._call(cast(inputs.latents), cast(inputs.text),
                          inputs.timestep.to(device=p.device, dtype=torch.float32))


class WanFamily(StepCache, Experts):
    """A ``WanPipeline`` checkpoint (Wan 2.1 text to video, or Wan 2.2 A14B's two experts), served step by step (see
    the module docstring).

    Request fields: ``num_frames`` (1 + 4k, default 81), ``n`` videos, ``guidance_scale`` (default 5.0, the
    pipeline's) above 1 runs CFG against ``negative_prompt`` (default ``""``); with two experts ``guidance_scale_2``
    (default ``guidance_scale``) is the low-noise expert's scale; ``true_cfg_scale`` is refused; ``cache`` (one
    transformer only): diffusers' First Block Cache or TaylorSeer (``WanTransformer3DModel`` is a ``CacheMixin``), its
    cond and uncond rows deciding apart as the pipeline's two cache contexts (:meth:`cache_contexts`).

    Args:
        name: served model name.
        spec: the model's :class:`ModelSpec` (:meth:`describe`).
        pipe: the loaded ``WanPipeline`` on ``device`` in ``dtype``; its methods do the work.
        counter: ``(prompt, negative=False) -> tokens`` (:meth:`token_counter`).
    """

    name = "wan"
    pipeline_classes = ("WanPipeline",)
    lora_loader = None
    transformer_width = staticmethod(heads_width)

    def __init__(self, name: str, spec: ModelSpec, pipe, counter, device: torch.device, dtype: torch.dtype):
        self.model_name = name
        self.spec = spec
        self.rules = spec.rules
        self.guidance_embeds = False
        self.pipe = pipe
        self.vae = pipe.vae
        models = [pipe.transformer] + ([pipe.transformer_2] if spec.boundary_ratio is not None else [])
        self.experts = tuple(WanAdapter(m, pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal,
                                        spec.rules.native_text_tokens) for m in models)
        """The experts' adapters: ``transformer``'s, and with ``boundary_ratio`` ``transformer_2``'s."""
        self.adapter = self.experts[0]
        self.boundary = (None if spec.boundary_ratio is None
                         else spec.boundary_ratio * pipe.scheduler.config.num_train_timesteps)
        """The boundary timestep (P:586): steps at or above it run expert 0, below it expert 1; None: one expert."""
        self._counter = counter
        self._lock = threading.Lock()
        self.device, self.dtype = device, dtype

    # -- checkpoint ---------------------------------------------------------------------------------

    @staticmethod
    def text_tokens(index: dict) -> int:
        """``max_sequence_length``: ``bcg_text_tokens`` of ``model_index.json``, else ``__call__``'s default (512)."""
        from diffusers import WanPipeline

        return text_tokens(WanPipeline, index)

    @classmethod
    def describe(cls, path: Path, index: dict) -> ModelSpec:
        """Spec from ``transformer/`` and ``vae/`` configs; request defaults from ``WanPipeline.__call__``'s signature
        (:func:`pipeline_defaults`: 50 steps, guidance 5.0, 832x480, 81 frames); the default table one exact tier at
        that size and frame count, 1 and 2 rows (one video, with and without CFG). ``max_grid_side`` is the RoPE
        table's length per axis (``rope_max_seq_len``, 1024): a grid side or a latent frame count above it would fail
        in T's ``rope`` (diffusers raises there too), so it is refused.

        A Wan 2.2 checkpoint of two experts (``transformer_2`` and ``boundary_ratio``) has ``boundary_ratio`` in its
        spec and no step cache (``cache_methods`` empty).

        Raises:
            ValueError: another pipeline class, no ``transformer``, only one of ``transformer_2`` and
                ``boundary_ratio`` (``WanPipeline`` would fail or never run ``transformer_2``), a ``boundary_ratio``
                outside 0..1, experts of different architectures (:data:`EXPERT_KEYS`), ``expand_timesteps`` (Wan 2.2
                TI2V), or a transformer patch other than (1, p, p).
        """
        kind = index["_class_name"]
        if kind not in cls.pipeline_classes:
            raise ValueError(f"{kind!r} is not a Wan pipeline ({', '.join(cls.pipeline_classes)})")
        if (index.get("transformer") or [None])[0] is None:
            raise ValueError(f"{path.name}: model_index.json has no transformer; bcg-serve serves Wan checkpoints "
                             f"with a transformer (and, for Wan 2.2's two experts, transformer_2 and boundary_ratio)")
        ratio = index.get("boundary_ratio")
        two = (index.get("transformer_2") or [None])[0] is not None
        if two != (ratio is not None):
            raise ValueError(f"{path.name}: transformer_2 {'set' if two else 'missing'} with boundary_ratio {ratio}: "
                             f"Wan 2.2's two experts need both (WanPipeline runs transformer_2 below boundary_ratio x "
                             f"1000), Wan 2.1 neither")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                                  or not 0.0 <= ratio <= 1.0):
            raise ValueError(f"{path.name}: boundary_ratio {ratio!r} in model_index.json: a number from 0 to 1")
        if index.get("expand_timesteps"):
            raise ValueError(f"{path.name}: expand_timesteps (Wan 2.2 TI2V-5B's per-token timesteps) is not served "
                             f"yet; serve a Wan 2.1 or Wan 2.2 A14B checkpoint")
        tr = read_json(path / "transformer" / "config.json")
        if two:
            tr2 = read_json(path / "transformer_2" / "config.json")
            differ = [k for k in EXPERT_KEYS if tr.get(k) != tr2.get(k)]
            if differ:
                raise ValueError(f"{path.name}: transformer and transformer_2 differ in {', '.join(differ)}; the two "
                                 f"experts serve one bucket table, so their architectures must match")
        vae = read_json(path / "vae" / "config.json")
        pt, ph, pw = (int(p) for p in tr.get("patch_size", (1, 2, 2)))
        if pt != 1 or ph != pw:
            raise ValueError(f"{path.name}: transformer patch_size {tr['patch_size']}: bcg-serve serves (1, p, p) "
                             f"patches (Wan 2.1 and 2.2: (1, 2, 2))")
        spatial = int(vae.get("scale_factor_spatial") or 8)  # AutoencoderKLWan's defaults, as WanPipeline reads them
        temporal = int(vae.get("scale_factor_temporal") or 4)
        tokens = cls.text_tokens(index)
        defaults = pipeline_defaults(kind)
        w, h = defaults["default_size"]
        return ModelSpec(
            name=path.name, family=cls.name, pipeline_class=kind,
            rules=ShapeRules(pixels_per_token=spatial * ph, grid_keyed=True, native_text_tokens=tokens,
                             frame_stride=temporal),
            max_prompt_tokens=tokens, quality_steps=QUALITY_STEPS["wan"], cache_methods=() if two else CACHE_METHODS,
            boundary_ratio=None if ratio is None else float(ratio),
            max_grid_side=int(tr.get("rope_max_seq_len", 1024)),
            default_buckets=dict(batch_sizes=[1, 2], resolutions=[f"{w}x{h}"], text_lengths=[tokens],
                                 frames=[defaults["default_frames"]]),
            **defaults,
        )

    @classmethod
    def token_counter(cls, path: Path, index: dict):
        """``(prompt, negative=False) -> tokens`` of the cleaned prompt (``prompt_clean``) with the tokenizer's eos, as
        ``_get_t5_prompt_embeds`` tokenizes it, untruncated, so that a prompt over ``max_sequence_length`` is refused
        rather than cut (negative prompts alike). Tokenizer only, no weights."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
        return lambda prompt, negative=False: len(tok(prompt_clean(prompt), add_special_tokens=True)["input_ids"])

    @classmethod
    def load(cls, path: Path, index: dict, device: torch.device, dtype: torch.dtype) -> WanFamily:
        """Load with ``WanPipeline.from_pretrained`` (local files only, :func:`load_pipeline`), both experts of a Wan
        2.2 checkpoint in ``dtype``."""
        from diffusers import WanPipeline

        spec = cls.describe(path, index)
        pipe = load_pipeline(WanPipeline, path, device, dtype)
        if pipe.transformer_2 is not None and pipe.transformer_2.dtype != dtype:  # as load_pipeline casts transformer
            pipe.transformer_2.to(dtype=dtype)
        return cls(path.name, spec, pipe, cls.token_counter(path, index), device, dtype)

    # -- validation hooks ---------------------------------------------------------------------------

    def count_tokens(self, prompt: str, negative: bool = False) -> int:
        """Tokens of ``prompt`` as the encoder reads it (see :meth:`token_counter`)."""
        with self._lock:
            return self._counter(prompt, negative)

    # -- the step-level loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, prompt: str) -> TextRows:
        """One prompt through ``encode_prompt``: (1, 512, D) embeddings, zero rows after the real tokens (P:175-180),
        in the transformer's dtype (P:515-517); no mask."""
        with self._lock:
            text, _ = self.pipe.encode_prompt(prompt=[prompt], do_classifier_free_guidance=False,
                                              max_sequence_length=self.rules.native_text_tokens, device=self.device)
        text = text.to(self.adapter.model.dtype)
        return TextRows(text, text.new_zeros(1, 0))

    @torch.inference_mode()
    def start(self, validated, cancel: threading.Event | None = None) -> RequestState:
        """Encode (and, with CFG, the negative prompt), draw fp32 noise with ``prepare_latents`` (one generator per
        video, seeded ``seed + i``) and set the request's own scheduler (P:519-539)."""
        req = validated.request
        cond = self.encode(req.prompt)
        uncond = self.encode(req.negative_prompt or "") if self.spec.uses_cfg(req) else None
        gens = [torch.Generator("cpu").manual_seed(req.seed + i) for i in range(req.n)]
        latents = self.pipe.prepare_latents(req.n, self.adapter.in_channels, req.height, req.width, req.num_frames,
                                            torch.float32, self.device, gens)
        sched = copy.deepcopy(self.pipe.scheduler)
        sched.set_timesteps(req.num_inference_steps, device=self.device)
        sched.set_begin_index(0)
        grid = (latents.shape[2], latents.shape[3] // self.adapter.patch, latents.shape[4] // self.adapter.patch)
        if grid != tuple(validated.grid):
            raise ValueError(f"latents of grid {grid} for a request validated at {validated.grid}")
        state = RequestState(validated, cond, uncond, latents, sched, sched.timesteps, grid, cancel=cancel)
        if self.boundary is not None:  # P:597's `t >= boundary_timestep`, as torch compares, once per request
            state.extras["experts"] = (sched.timesteps < self.boundary).to(torch.int64).tolist()
        return state

    def expert(self, state: RequestState) -> int:
        """The expert of ``state``'s next step: 0 (``transformer``) at a timestep at or above :attr:`boundary`, 1
        (``transformer_2``) below it; always 0 for one transformer."""
        experts = state.extras.get("experts")
        return 0 if experts is None else experts[state.step_index]

    def model_rows(self, state: RequestState) -> DenoiseInputs:
        """Cond rows (one per video), then with CFG the uncond rows; the step's timestep per row (P:561-590)."""
        n, lat = state.n, state.latents
        parts = [state.cond] + ([state.uncond] if state.cfg else [])
        x = torch.cat([lat] * len(parts)) if len(parts) > 1 else lat
        text = torch.cat([p.text.expand(n, -1, -1) for p in parts])
        timestep = state.timestep.to(torch.float32).expand(x.shape[0])
        return DenoiseInputs(x, text, lat.new_zeros(x.shape[0], 0), timestep, state.grid)

    def cache_contexts(self, state: RequestState) -> list[tuple[str, slice]]:
        """``WanPipeline`` runs the cond rows under ``cache_context("cond")`` and, with CFG, the uncond rows under
        ``cache_context("uncond")`` (P:573-590): :meth:`model_rows`' two halves."""
        n = state.n
        return [("cond", slice(0, n))] + ([("uncond", slice(n, 2 * n))] if state.cfg else [])

    @torch.inference_mode()
    def advance(self, state: RequestState, output: torch.Tensor) -> None:
        """CFG ``uncond + s * (cond - uncond)`` in the output's dtype (P:630-638; ``s``: ``guidance_scale``, or on the
        low-noise expert ``guidance_scale_2``), then the request's scheduler step on the fp32 latents (P:641)."""
        n = state.n
        noise = output[:n]
        if state.cfg:
            uncond = output[n : 2 * n]
            r = state.request
            scale = self.spec.cfg_scale(r) if self.expert(state) == 0 else float(r.guidance_scale_2)
            noise = uncond + scale * (noise - uncond)
        state.latents = state.scheduler.step(noise, state.timestep, state.latents, return_dict=False)[0]
        state.step_index += 1

    @torch.inference_mode()
    def decode(self, state: RequestState) -> list[np.ndarray]:
        """``n`` videos, each a (num_frames, height, width, 3) uint8 array: the latents unnormalised per channel,
        ``vae.decode``, ``video_processor.postprocess_video`` (P:626-640), rounded to uint8 as ``numpy_to_pil``
        (``(x * 255).round()``), so the frames equal diffusers' ``output_type="pil"`` frames."""
        vae = self.vae
        latents = state.latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                          latents.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                              latents.dtype)
        video = vae.decode(latents / std + mean, return_dict=False)[0]
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")  # (n, F, H, W, 3) in [0, 1]
        return [(v * 255).round().astype(np.uint8) for v in frames]
