"""Qwen-Image 2.1's attention inside a bucket forward: the block-causal attention of diffusers 0.42.1's transformer
(``models/transformers/transformer_qwenimage21.py``, T: one text segment, then the target) with per-row RoPE and key
masks as tensors, so that a CUDA graph holds rows of different text lengths (:class:`~bcg_core.families.qwenimage21.
QwenImage21Adapter`; the padding contract is :mod:`bcg_core.families.qwenimage21`'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

__all__ = ["BucketAttnProcessor", "BucketMasks"]


@dataclass(frozen=True)
class BucketMasks:
    """The bucket forward's attention masks, handed to :class:`BucketAttnProcessor` as ``attention_mask``.

    Attributes:
        text_len: text slots T of the bucket.
        text: (B, 1, T, T) bool, causal and real keys only: what the text queries attend.
        keys: (B, 1, 1, T + S) bool, real text keys and every image key: what the target queries attend.
        rotary: (B, T + S, D_rope / 2) complex per-row positions (:mod:`bcg_core.families.qwenimage21`).
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
