"""Qwen-Image 2.1's padding adapter (:class:`QwenImage21Adapter`): the bucket forward of
:mod:`bcg_core.families.qwenimage21`'s ``QwenImage21Transformer2DModel``. Line numbers cite diffusers 0.42.1's
``models/transformers/transformer_qwenimage21.py``, T; the attention and modulation it installs on T's blocks are
:mod:`bcg_core.families.qwenimage21_attention`.

Padding contract (:class:`QwenImage21Adapter`). T joins one sequence ``[text L][target image S]`` (condition
images, not served yet, would sit inside the text at the encoder's image slots). Attention is block-causal: text
tokens see only earlier text, the target image sees everything (T's ``QwenImage21AttnProcessor`` runs it as one
attention per text segment plus one for the target, T:504-546). RoPE (``QwenImage21Rope``, T:655-713): text token
i sits at (i, i, i); the target's frame axis sits at L (where its text ends) and its height and width on a grid
centred on zero. With ``causal_condition`` the text is modulated from t = 0 (T:944-953). A bucket of T text tokens
holds ``[text L][pads T - L][target S]``: pads are zero vectors after the real text, at positions L..T-1, hidden as
keys by the mask (they come after every real text token, so causal text attention from a real token never reaches
them; the target's key mask drops them); the target's frame position is the row's own L, written per row into the
bucket's rotary buffer. Every other op is per token or per row, so a padded row equals the row alone, and rows of
different L share one forward. Pad rows copy real row 0.

This is *not* what diffusers does with a batch of prompts of different lengths: T reads the layout of row 0 of a
right-padded batch, so every row's target frame sits at the longest prompt's length, and a short prompt batched
beside a long one is another image than alone (5e-4 relative on the tiny checkpoint in fp32). bcg-serve gives every
request what diffusers gives it alone (``tests/families/test_qwenimage21.py``).

T's own forward builds positions and segments from Python lists (``tolist()``), which a CUDA graph cannot hold;
:meth:`QwenImage21Adapter.forward` is a fixed-shape entry built from T's modules (``img_in``, ``txt_in``,
``time_text_embed``, ``modulation``, the blocks, ``norm_out``, ``proj_out``, ``pos_embed.freqs``) and its
``_qwenimage21_prepare_qkv``, with the per-row rotary and masks as tensors (:class:`BucketAttnProcessor`).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

from bcg_core.capabilities import EagerMixesRows
from bcg_core.families.helpers import install_processors
from bcg_core.families.qwenimage21_attention import BucketAttnProcessor, BucketMasks, RowModulation
from bcg_core.keys import BucketKey
from bcg_core.lora.layers import LoRALayers
from bcg_core.padding import DenoiseInputs, copy_rows, fill_masked_text
from bcg_core.table import ShapeRules

__all__ = ["QWEN21_PIXELS_PER_TOKEN", "QWEN21_ROPE_POSITIONS", "QwenImage21Adapter"]

QWEN21_PIXELS_PER_TOKEN = 16
"""``QwenImage21Pipeline.vae_scale_factor`` (hard-coded 16; patch size 1)."""

QWEN21_ROPE_POSITIONS = 8192
"""Non-negative positions of ``QwenImage21Rope`` (``torch.arange(8192)``): text position i and the target's frame L
index it, so L < 8192 (beyond it the index runs into the negative table)."""


class QwenImage21Adapter(EagerMixesRows):
    """Qwen-Image 2.1 architecture: keyed on the grid (the target's RoPE grid), masked text buckets (module
    docstring, "Padding contract").

    Layout: ``DenoiseInputs.latents`` (rows, h * w, 64) tokens; ``text`` (rows, T, context_in_dim) with
    ``text_mask`` (rows, T) whose True entries are a prefix, or None; ``pooled`` (rows, 0); ``timestep`` (rows,)
    ``t / 1000`` in the latents' dtype. Output: (rows, h * w, 64), the target tokens.

    Args:
        model: a ``QwenImage21Transformer2DModel`` with the stock processor on every block (replaced by
            :class:`BucketAttnProcessor`).
        max_text_tokens: most text tokens a bucket may hold.

    Raises:
        ValueError: another attention processor, or a patch size other than 1.
    """

    family = "qwenimage21"
    timestep_max = 1.0
    guidance_embeds = False
    pooled_dim = 0
    eager_mixes_rows = True
    """:meth:`forward_eager` runs each row alone through T's own forward, whose time embedding adds a t = 0 row, so
    LoRA rows reach it one set of entries at a time (:meth:`~bcg_core.lora.rows.LoRAAdapter.forward_eager`)."""

    def __init__(self, model: torch.nn.Module, max_text_tokens: int = QWEN21_ROPE_POSITIONS - 1):
        cfg = model.config
        if int(cfg.patch_size) != 1:
            raise ValueError(f"QwenImage21Transformer2DModel patch_size {cfg.patch_size}: QwenImage21Pipeline feeds "
                             f"unpatched latents (patch_size 1)")
        self.model = model
        self.rules = ShapeRules(pixels_per_token=QWEN21_PIXELS_PER_TOKEN, grid_keyed=True, native_text_tokens=None)
        self.in_channels = int(cfg.in_channels)
        self.seq_dim = int(cfg.context_in_dim)
        self.max_text_tokens = max_text_tokens
        self._tables: dict[torch.device, list[torch.Tensor]] = {}
        install_processors(model.transformer_blocks, QwenImage21AttnProcessor, BucketAttnProcessor,
                           "QwenImage21Adapter")
        for block in model.transformer_blocks:
            if not isinstance(block._modulate, RowModulation):
                block._modulate = RowModulation(block._modulate)

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Latent tokens (rows, h * w, 64), standard normal, CPU fp32."""
        return torch.randn(rows, grid[0] * grid[1], self.in_channels, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments; S = h * w).

        Raises:
            ValueError: a key without a grid, or with more text tokens than the RoPE table holds.
        """
        if key.latent_hw is None:
            raise ValueError(f"bucket {key} has no latent_hw: Qwen-Image 2.1 buckets are keyed on the latent grid")
        if key.text_tokens > self.max_text_tokens:
            raise ValueError(f"bucket {key}: {key.text_tokens} text tokens exceed the {self.max_text_tokens} this "
                             f"model can place; use text_lengths up to {self.max_text_tokens}")
        (h, w), b, t = key.latent_hw, key.batch, key.text_tokens
        rope = sum(self.model.config.axes_dims_rope) // 2
        return {
            "latents": torch.zeros(b, h, w, self.in_channels, device=device, dtype=dtype),  # (B, h, w, C)
            "text": torch.zeros(b, t, self.seq_dim, device=device, dtype=dtype),  # (B, T, D_ctx)
            "text_mask": torch.zeros(b, t, device=device, dtype=torch.bool),  # (B, T) real tokens
            "rotary": torch.zeros(b, t + h * w, rope, device=device, dtype=torch.complex64),  # (B, T + S, D/2)
            "timestep": torch.zeros(b, device=device, dtype=dtype),  # (B,) t / 1000
        }

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Copy ``inputs`` into the buffers and write each row's RoPE from its text length (tensor ops only). Every
        element is written, so nothing of an earlier request survives.

        Raises:
            ValueError: the inputs do not fit (more rows, another grid, more text tokens, a guidance input).
        """
        lat, text, real = buffers["latents"], buffers["text"], buffers["text_mask"]
        b, h, w, c = lat.shape
        t = text.shape[1]
        if (inputs.rows > b or tuple(inputs.grid) != (h, w) or tuple(inputs.latents.shape[1:]) != (h * w, c)
                or inputs.text_tokens > t or inputs.guidance is not None):
            raise ValueError(f"inputs of {inputs.rows} rows x grid {tuple(inputs.grid)} x {inputs.text_tokens} text "
                             f"tokens do not fit bucket buffers of {b} rows x grid {(h, w)} x {t} text tokens "
                             f"(Qwen-Image 2.1 takes no guidance input)")
        copy_rows(lat.view(b, h * w, c), inputs.latents)
        fill_masked_text(text, real, inputs)
        copy_rows(buffers["timestep"], inputs.timestep)
        dev = text.device
        length = real.sum(dim=1)  # (B,) real text tokens L per row
        text_pos = torch.arange(t, device=dev).expand(b, t)
        # T's QwenImage21Rope.forward: the target's frame axis at L, height and width centred on zero.
        hh = torch.arange(-(h - h // 2), h // 2, device=dev).repeat_interleave(w)
        ww = torch.arange(-(w - w // 2), w // 2, device=dev).repeat(h)
        frame = torch.cat([text_pos, length[:, None].expand(b, h * w)], dim=1)
        height = torch.cat([text_pos, hh.expand(b, h * w)], dim=1)
        width = torch.cat([text_pos, ww.expand(b, h * w)], dim=1)
        f = self._rope_tables(dev)
        buffers["rotary"].copy_(torch.cat([f[0][frame], f[1][height], f[2][width]], dim=-1))

    def _rope_tables(self, device: torch.device) -> list[torch.Tensor]:
        """``QwenImage21Rope.freqs`` (per axis (8192 + 1024, D_axis / 2) complex64, a plain list the model keeps on
        the CPU and T's forward copies over on every call) on ``device``, copied once."""
        tables = self._tables.get(device)
        if tables is None:
            tables = self._tables[device] = [f.to(device) for f in self.model.pos_embed.freqs]
        return tables

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded, masked forward over the static buffers (module docstring): (B, h * w, 64)."""
        mdl, lat, text, real = self.model, buffers["latents"], buffers["text"], buffers["text_mask"]
        b, t, s = lat.shape[0], text.shape[1], lat.shape[1] * lat.shape[2]
        hidden = mdl.img_in(lat.flatten(1, 2))
        joint = torch.cat([mdl.txt_in(text), hidden], dim=1)
        timestep = buffers["timestep"].to(hidden.dtype)
        target = None
        if mdl.config.causal_condition:  # T: text tokens modulate from t = 0; here a t = 0 row per row
            with LoRALayers.stacked(2):  # (RowModulation), each through its row's LoRA adapters
                temb = mdl.time_text_embed(torch.cat([timestep, timestep.new_zeros(b)], dim=0), hidden)
                modulation = mdl.modulation(temb)
            target = torch.arange(t + s, device=lat.device) >= t
        else:
            temb = mdl.time_text_embed(timestep, hidden)
            modulation = mdl.modulation(temb)
        causal = torch.ones(t, t, device=lat.device, dtype=torch.bool).tril()
        masks = BucketMasks(t, causal[None, None] & real[:, None, None, :],
                            torch.cat([real, real.new_ones(b, s)], dim=1)[:, None, None, :], buffers["rotary"])
        for block in mdl.transformer_blocks:
            joint = block(hidden_states=joint, modulation=modulation, attention_mask=masks, target_token_mask=target)
        if target is not None and b > 1:  # each row's own timestep row; the text tokens' output is dropped
            temb, target = temb[:b], None
        return mdl.proj_out(mdl.norm_out(joint, temb, target))[:, t:]

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` of ``output`` (text padding leaves no trace in the target tokens)."""
        return output[: inputs.rows]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded reference forward, as ``QwenImage21Pipeline.__call__`` calls the transformer (without its KV
        cache): each row alone (its own text length), mask None, ``img_mask`` the text's slots plus S / 4 target
        slots."""
        p = next(self.model.parameters())
        h, w = inputs.grid
        outs = []
        for i in range(inputs.rows):
            text = inputs.text[i: i + 1]
            if inputs.text_mask is not None:
                text = text[:, inputs.text_mask[i].to(text.device)]
            img_mask = torch.zeros(1, text.shape[1] + h * w // 4, dtype=torch.bool, device=p.device)
            img_mask[:, text.shape[1]:] = True
            outs.append(self.model(
                hidden_states=inputs.latents[i: i + 1].to(device=p.device, dtype=p.dtype),
                encoder_hidden_states=text.to(device=p.device, dtype=p.dtype),
                timestep=inputs.timestep[i: i + 1].to(device=p.device, dtype=p.dtype),
                img_shapes=[[(1, h, w)]], img_mask=img_mask, return_dict=False)[0][:, -h * w:])
        return torch.cat(outs)
