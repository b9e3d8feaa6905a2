"""Qwen-Image 2.1's attention and modulation inside a bucket forward.

- :class:`BucketAttnProcessor`: the block-causal attention of diffusers 0.42.1's transformer
  (``models/transformers/transformer_qwenimage21.py``, T: one text segment, then the target) with per-row RoPE and key
  masks as tensors, so that a CUDA graph holds rows of different text lengths (:class:`~bcg_core.families.
  qwenimage21_adapter.QwenImage21Adapter`; the padding contract is :mod:`bcg_core.families.qwenimage21_adapter`'s
  docstring).
- :class:`RowModulation`: a block's modulation with a t = 0 row per row, where T computes one for the whole batch, so
  that each row's LoRA adapters change its own t = 0 row (rows of one forward may carry different adapters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

__all__ = ["BucketAttnProcessor", "BucketMasks", "RowModulation"]


@dataclass(frozen=True)
class BucketMasks:
    """The bucket forward's attention masks, handed to :class:`BucketAttnProcessor` as ``attention_mask``.

    Attributes:
        text_len: text slots T of the bucket.
        text: (B, 1, T, T) bool, causal and real keys only: what the text queries attend.
        keys: (B, 1, 1, T + S) bool, real text keys and every image key: what the target queries attend.
        rotary: (B, T + S, D_rope / 2) complex per-row positions (:mod:`bcg_core.families.qwenimage21_adapter`).
    """

    text_len: int
    text: torch.Tensor
    keys: torch.Tensor
    rotary: torch.Tensor


def _rope(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    # T's apply_rotary_emb_qwen(use_real=False) with a per-row table: (B, S, H, D) x (B, S, D / 2) complex.
    x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_rotated * rotary[:, :, None]).flatten(3).type_as(x)


class BucketAttnProcessor(QwenImage21AttnProcessor):
    """``QwenImage21AttnProcessor`` that also takes :class:`BucketMasks` as ``attention_mask``: the block-causal
    attention of one text segment and the target (T's prefill, T:504-546) with per-row RoPE and key masks. Given
    anything else it *is* the diffusers processor (:meth:`QwenImage21Adapter.forward_eager` sees no change)."""

    def __call__(self, attn, hidden_states, attention_mask=None, rotary_emb=None, layer_cache=None,
                 kv_cache_mode=None, cache_write_slice=None, segments=None, key_valid=None):
        """``hidden_states`` (B, T + S, dim) -> (B, T + S, dim). With :class:`BucketMasks`: text queries [0, T)
        attend text keys causally, real keys only; target queries [T, T + S) attend every real key (T:521-546
        with one text segment); the other arguments are unused (no KV cache)."""
        if not isinstance(attention_mask, BucketMasks):
            return super().__call__(attn, hidden_states, attention_mask, rotary_emb, layer_cache, kv_cache_mode,
                                    cache_write_slice, segments, key_valid)
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_qwenimage21 import _qwenimage21_prepare_qkv

        m, t = attention_mask, attention_mask.text_len
        query, key, value, _ = _qwenimage21_prepare_qkv(attn, hidden_states, None, None, None, None)
        query, key = _rope(query, m.rotary), _rope(key, m.rotary)
        text = dispatch_attention_fn(query[:, :t], key[:, :t], value[:, :t], attn_mask=m.text, dropout_p=0.0,
                                     backend=None, parallel_config=self._parallel_config)
        image = dispatch_attention_fn(query[:, t:], key, value, attn_mask=m.keys, dropout_p=0.0, backend=None,
                                      parallel_config=self._parallel_config)
        out = torch.cat([text, image], dim=1).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class RowModulation:
    """A ``QwenImage21TransformerBlock``'s ``_modulate`` (T:610-616) that also takes a t = 0 row per row.

    With ``causal_condition``, T embeds the batch's timesteps plus one t = 0 row: ``mod_params`` (B + 1, 2 dim),
    target tokens scaled and gated by their own row, text tokens by the shared last one (T's
    ``_select_modulation_rows``). The bucket forward embeds a t = 0 row per row instead, (2B, 2 dim): row ``i``'s own
    in ``[0, B)`` and its t = 0 row at ``B + i``, each through row ``i``'s LoRA adapters
    (:meth:`~bcg_core.lora.layers.LoRALayers.stacked`); its text tokens take row ``B + i``. Given anything else (T's
    own B + 1 rows, no target mask) it *is* the block's own method; at B = 1 the two layouts are one.

    Args:
        method: the block's own bound ``_modulate``.
    """

    def __init__(self, method):
        self.method = method

    def __call__(self, hidden_states: torch.Tensor, mod_params: torch.Tensor,
                 target_token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states`` (B, L, dim) modulated by ``mod_params`` (2B or B + 1 rows, 2 dim) with
        ``target_token_mask`` (L,) bool (True at target tokens): ``(hidden_states * (1 + scale), gate)``, both
        (B, L, dim)."""
        b = hidden_states.shape[0]
        if target_token_mask is None or b == 1 or mod_params.shape[0] != 2 * b:
            return self.method(hidden_states, mod_params, target_token_mask)
        scale, gate = mod_params.chunk(2, dim=-1)
        target = target_token_mask.view(1, -1, 1)
        scale = torch.where(target, scale[:b].unsqueeze(1), scale[b:].unsqueeze(1))
        gate = torch.where(target, gate[:b].unsqueeze(1), gate[b:].unsqueeze(1))
        return hidden_states * (1 + scale), gate
