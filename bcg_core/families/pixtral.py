"""FLUX.2 [dev]'s ``PixtralProcessor`` replaced by its own tokenizer, so that the family needs no torchvision.

The published FLUX.2 [dev] checkpoint names ``["transformers", "PixtralProcessor"]`` as its ``tokenizer`` in
``model_index.json``; transformers (5.x) refuses to build a ``PixtralProcessor`` without torchvision, which
``scripts/install.sh`` does not install (``pip install torchvision`` would replace the pinned CPU torch with a CUDA
build), so ``Flux2Pipeline.from_pretrained`` fails there with an ``ImportError``. ``Flux2Pipeline`` uses its
``tokenizer`` for one thing bcg-serve runs, ``_get_mistral_3_small_prompt_embeds``: ``tokenizer.apply_chat_template``
on text-only messages (``format_input``), tokenized, padded to ``max_sequence_length``. For text-only messages the
processor renders the same chat template (the folder's ``chat_template.jinja``, or ``chat_template.json`` in the
older processor layout, which :func:`processor_tokenizer` reads into the tokenizer where the tokenizer has none)
and tokenizes the rendered text with that tokenizer, without adding special tokens when the text starts with the
BOS token (Mistral's template does), as the tokenizer's own ``apply_chat_template`` always does: the same ids, mask
and padding. Reference images never pass through the processor (the pipeline encodes them with the VAE); only
``upsample_prompt`` (image-aware prompt rewriting, which bcg-serve does not run) needs the image processor.

``tests/families/test_flux2_processor.py`` loads a [dev] checkpoint in the published processor layout with the
family and compares it with the tokenizer layout; where torchvision is installed, it also compares the processor's
``apply_chat_template`` with the tokenizer's.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["PROCESSOR_CLASS", "load_flux2_pipeline", "processor_tokenizer"]

PROCESSOR_CLASS = "PixtralProcessor"
"""The ``tokenizer`` component class of the published FLUX.2 [dev] checkpoint (``model_index.json``)."""


def processor_tokenizer(path: Path, index: dict):
    """The tokenizer inside the folder's ``PixtralProcessor``, or None where ``index`` names no such processor.

    Args:
        path: the checkpoint folder (``tokenizer/`` inside it).
        index: its ``model_index.json``.

    Returns:
        The tokenizer of ``path/tokenizer`` (its chat template read from ``chat_template.json`` where the tokenizer
        files carry none) where ``index`` names ``PixtralProcessor`` as the ``tokenizer``, else None.

    Raises:
        OSError: (transformers) ``tokenizer/`` holds no tokenizer files.
    """
    entry = index.get("tokenizer") or [None, None]
    if entry[-1] != PROCESSOR_CLASS:
        return None
    from transformers import AutoTokenizer

    folder = Path(path) / "tokenizer"
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    legacy = folder / "chat_template.json"
    if not getattr(tok, "chat_template", None) and legacy.is_file():
        tok.chat_template = json.loads(legacy.read_text())["chat_template"]
    return tok


def load_flux2_pipeline(pipeline_cls, path: Path, index: dict, device, dtype):
    """:func:`~bcg_core.families.base.load_pipeline` of a FLUX.2 checkpoint, with :func:`processor_tokenizer` as the
    ``tokenizer`` where the folder has a ``PixtralProcessor``: loaded with ``tokenizer=None`` and registered after
    (diffusers 0.42.1 cannot take it as a ``from_pretrained`` component: its type check compares it with the
    processor's import placeholder and raises ``TypeError``)."""
    from bcg_core.families.base import load_pipeline

    tok = processor_tokenizer(path, index)
    if tok is None:
        return load_pipeline(pipeline_cls, path, device, dtype)
    pipe = load_pipeline(pipeline_cls, path, device, dtype, tokenizer=None)
    pipe.register_modules(tokenizer=tok)
    return pipe
