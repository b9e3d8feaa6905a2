"""Qwen-Image 2.1's ``Qwen3VLProcessor`` loaded without its video processor, so that the family needs no torchvision.

``Qwen3VLProcessor`` (transformers) holds a tokenizer, an image processor and a video processor; transformers builds
the video processor (``Qwen3VLVideoProcessor``) only with torchvision, which ``scripts/install.sh`` does not install
(``pip install torchvision`` would replace the pinned CPU torch with a CUDA build). ``QwenImage21Pipeline`` never
passes videos, and bcg-serve serves images: :class:`Qwen3VLProcessorWithoutVideo` is the same processor with only its
tokenizer and image processor, which tokenizes a prompt and processes an image exactly as the real class (every method
but the video path is the real one). :func:`load_processor` loads a checkpoint's ``processor/`` folder with it, with or
without torchvision (a checkpoint's video processor config, where it has one, is not read).
"""

from __future__ import annotations

from pathlib import Path

from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

__all__ = ["Qwen3VLProcessorWithoutVideo", "load_processor"]


class Qwen3VLProcessorWithoutVideo(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` with its tokenizer and image processor only (module docstring): transformers reads a
    processor's parts from its ``__init__`` signature, which names no ``video_processor`` here."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        kwargs.pop("video_processor", None)  # a checkpoint's nested video processor config: not built
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(folder: str | Path) -> Qwen3VLProcessorWithoutVideo:
    """The processor of a Qwen-Image 2.1 checkpoint's ``processor/`` folder (local files only), without its video
    processor (module docstring)."""
    return Qwen3VLProcessorWithoutVideo.from_pretrained(str(folder), local_files_only=True)
