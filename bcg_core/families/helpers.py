"""Helpers the families share: a component's JSON config, a pipeline loaded from a checkpoint folder, the transformer
width of most families, a tokenizer's token counter, the bucket forward's attention processors installed on a
transformer's blocks.

Imports no torch at module level: the ingress and the ownership coordinator read JSON configs and count tokens with
these helpers in processes that never load the model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["heads_width", "install_processors", "load_pipeline", "read_json", "tokenizer_counter"]


def read_json(path: Path, optional: bool = False) -> dict:
    """A component's JSON config (``config.json``, ``scheduler_config.json`` ...).

    Raises:
        ValueError: the file is missing (unless ``optional``: then ``{}``), naming it and the fix.
    """
    import json

    if not path.is_file():
        if optional:
            return {}
        raise ValueError(f"{path} is missing: the checkpoint folder is incomplete; re-save the pipeline with "
                         f"save_pretrained or copy the whole folder")
    return json.loads(path.read_text())


def load_pipeline(pipeline_cls, path: Path, device: torch.device, dtype: torch.dtype, **components):
    """A diffusers pipeline from a local checkpoint folder, every model component in eval mode on ``device``.

    ``from_pretrained(torch_dtype=dtype, local_files_only=True)``, as a user of diffusers loads it. Without
    ``accelerate``, diffusers 0.42.1 leaves an fp32-saved ``SD3Transformer2DModel`` in fp32 although the other
    components get ``torch_dtype``; a transformer left in another dtype is cast alone, so no component's own
    fp32 modules are touched. The progress bar is off (a replica logs no per-step bars). ``components`` are passed
    to ``from_pretrained`` (e.g. ``text_encoder_3=None`` for an SD3 checkpoint saved without T5).

    Reading the weights straight onto the GPU (``accelerate`` with ``device_map="cuda"``) did not pay: a FLUX.1-dev
    start on an H200 loaded in 19.1 s that way and in 17.1 s without (docs/BENCHMARKS.md, 2026-12-03).
    """
    import torch

    from bcg_core.families.vae import serialize_stateful_vae

    pipe = pipeline_cls.from_pretrained(str(path), torch_dtype=dtype, local_files_only=True, **components)
    if pipe.transformer.dtype != dtype:
        pipe.transformer.to(dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
            serialize_stateful_vae(component)
    return pipe


def heads_width(config: dict) -> int:
    """``num_attention_heads * attention_head_dim`` of a transformer config: the hidden width of FLUX.1, FLUX.2, SD3,
    PixArt-Sigma, SANA, Qwen-Image and Qwen-Image 2.1 transformers (their ``inner_dim``); their families'
    :meth:`~bcg_core.families.base.Family.transformer_width`.

    Raises:
        KeyError: the config lacks either key.
    """
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def tokenizer_counter(tokenizer) -> Callable[..., int]:
    """``(prompt, negative=False) -> tokens`` of ``tokenizer`` with its special tokens, untruncated: the count of
    families whose prompts and negative prompts tokenize alike and are never cut (FLUX, SD3, the tiny default)."""
    return lambda prompt, negative=False: len(tokenizer(prompt, truncation=False)["input_ids"])


def install_processors(blocks, stock: type, replacement: type, adapter: str) -> None:
    """Put a new ``replacement()`` attention processor on every block of ``blocks`` whose ``attn`` holds diffusers'
    ``stock`` processor (that very class, not a subclass), as a padding adapter does when it is built; a block that
    already holds a ``replacement`` (a transformer an adapter was built on before) keeps it.

    Args:
        blocks: the transformer's blocks, each with an ``attn`` (a diffusers ``Attention``: ``processor``,
            ``set_processor``).
        stock: the processor class diffusers installs (``QwenDoubleStreamAttnProcessor2_0``, ...).
        replacement: the bucket forward's processor class, built without arguments.
        adapter: the adapter's class name, for the message.

    Raises:
        ValueError: a block holding any other processor (one a caller set), naming it and the stock class needed; the
            blocks before it already hold their new processors.
    """
    for block in blocks:
        if type(block.attn.processor) is stock:
            block.attn.set_processor(replacement())
        elif not isinstance(block.attn.processor, replacement):
            raise ValueError(f"{adapter} needs the stock {stock.__name__} on every block, found "
                             f"{type(block.attn.processor).__name__}")
