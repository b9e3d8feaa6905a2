"""Tiny LoRA adapters for the tests' tiny checkpoints, made with peft and saved as diffusers saves LoRA weights.

:func:`make_adapter` adds a random peft ``LoraConfig`` adapter to a pipeline's transformer (``lora_B`` random too,
``init_lora_weights=False``, so the adapter changes the image), reads it back with peft's
``get_peft_model_state_dict`` and writes it with the pipeline class's ``save_lora_weights`` (the
``pytorch_lora_weights.safetensors`` layout ``load_lora_weights`` reads), then removes it from the transformer.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["make_adapter"]


def make_adapter(pipeline_cls, folder: Path, name: str, targets: list[str], rank: int = 4, alpha: float = 8.0,
                 seed: int = 0, metadata: bool = True, as_file: bool = False, std: float = 0.2, **config) -> Path:
    """Write adapter ``name`` for the pipeline in checkpoint ``folder`` into ``folder.parent / "loras"``.

    Args:
        pipeline_cls: the diffusers pipeline class (its ``save_lora_weights``).
        folder: the tiny checkpoint folder.
        name: the adapter's name (its folder, or with ``as_file`` its ``<name>.safetensors``).
        targets: peft ``target_modules``.
        rank, alpha: peft's ``r`` and ``lora_alpha``; ``config``: more ``LoraConfig`` fields (``rank_pattern``,
            ``alpha_pattern``, ``use_rslora``, ``use_dora``...).
        seed: seeds the random weights (each drawn N(0, ``std``)).
        metadata: save the ``LoraConfig`` in the file (as diffusers' training scripts do) or leave diffusers to
            infer ranks and alphas from the shapes.
        as_file: write ``<loras>/<name>.safetensors`` instead of a folder.

    Returns:
        The ``loras`` folder.
    """
    from diffusers import DiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    loras = Path(folder).parent / "loras"
    pipe = DiffusionPipeline.from_pretrained(folder) if pipeline_cls is None else pipeline_cls.from_pretrained(folder)
    transformer = pipe.transformer
    cfg = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False, target_modules=targets, **config)
    transformer.add_adapter(cfg, adapter_name=name)
    gen = torch.Generator().manual_seed(seed)
    sd = get_peft_model_state_dict(transformer, adapter_name=name)
    sd = {k: torch.randn(v.shape, generator=gen) * std for k, v in sd.items()}
    out = loras / name
    kwargs = {"transformer_lora_adapter_metadata": cfg.to_dict()} if metadata else {}
    type(pipe).save_lora_weights(str(out), transformer_lora_layers=sd, **kwargs)
    if as_file:
        (out / "pytorch_lora_weights.safetensors").rename(loras / f"{name}.safetensors")
        out.rmdir()
    return loras
