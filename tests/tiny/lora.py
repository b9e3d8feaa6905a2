"""Tiny LoRA adapters for the tests' tiny checkpoints: made with peft and saved as diffusers saves LoRA weights, or
written in a published non-diffusers layout that diffusers' ``lora_state_dict`` converts.

:func:`make_adapter` adds a random peft ``LoraConfig`` adapter to a pipeline's transformer (``lora_B`` random too,
``init_lora_weights=False``, so the adapter changes the image), reads it back with peft's
``get_peft_model_state_dict`` and writes it with the pipeline class's ``save_lora_weights`` (the
``pytorch_lora_weights.safetensors`` layout ``load_lora_weights`` reads), then removes it from the transformer.

:func:`make_published` writes random LoRA weights on every linear layer of a checkpoint's transformer under the key
names of a layout in :data:`LAYOUTS`, the inverse of the conversion diffusers 0.42.1 applies to it
(``loaders/lora_conversion_utils.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["LAYOUTS", "make_adapter", "make_published"]


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


_FLUX2_BFL = {  # diffusers module (block index as {i}) -> FLUX.2's original (BFL) name, as ai-toolkit saves it
    "transformer_blocks.{i}.attn.to_out.0": "double_blocks.{i}.img_attn.proj",
    "transformer_blocks.{i}.attn.to_add_out": "double_blocks.{i}.txt_attn.proj",
    "transformer_blocks.{i}.ff.linear_in": "double_blocks.{i}.img_mlp.0",
    "transformer_blocks.{i}.ff.linear_out": "double_blocks.{i}.img_mlp.2",
    "transformer_blocks.{i}.ff_context.linear_in": "double_blocks.{i}.txt_mlp.0",
    "transformer_blocks.{i}.ff_context.linear_out": "double_blocks.{i}.txt_mlp.2",
    "single_transformer_blocks.{i}.attn.to_qkv_mlp_proj": "single_blocks.{i}.linear1",
    "single_transformer_blocks.{i}.attn.to_out": "single_blocks.{i}.linear2",
    "x_embedder": "img_in", "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear", "norm_out.linear": "final_layer.adaLN_modulation.1",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
}
_FLUX2_QKV = {"to_q": "img_attn.qkv", "add_q_proj": "txt_attn.qkv"}  # fused: one lora_A, lora_B of q, k and v stacked

LAYOUTS = ("flux2-bfl", "kohya", "diffusion-model")
"""Layouts :func:`make_published` writes:

- ``"flux2-bfl"``: FLUX.2's original module names with a ``diffusion_model.`` prefix and ``lora_A``/``lora_B``, as
  ai-toolkit saves FLUX.2 LoRAs (``double_blocks.0.img_attn.qkv``: one fused q/k/v projection, split by diffusers into
  ``to_q``/``to_k``/``to_v`` sharing ``lora_A``); no alphas.
- ``"kohya"``: ``lora_unet_`` and the module name with ``_`` for ``.``, ``lora_down``/``lora_up`` and an ``alpha`` per
  layer (kohya / musubi-tuner; diffusers folds ``alpha / rank`` into the weights), as Z-Image LoRAs are published.
- ``"diffusion-model"``: ``diffusion_model.`` and the diffusers module name, ``lora_down``/``lora_up`` and an
  ``alpha`` per layer (what diffusers' Qwen-Image loader converts; the names of Qwen-Image 2.1's modules).
"""


def make_published(folder: Path, name: str, layout: str, rank: int = 8, alpha: float = 4.0, seed: int = 0,
                   std: float = 0.2) -> Path:
    """Write adapter ``<folder.parent>/loras/<name>.safetensors`` in ``layout`` (:data:`LAYOUTS`): random ``lora_A``
    (rank, in) and ``lora_B`` (out, rank) on every linear layer of the checkpoint's transformer (built on the meta
    device from its config: only names and shapes are read).

    Returns:
        The ``loras`` folder.

    Raises:
        ValueError: another ``layout``, or ``"flux2-bfl"`` on a transformer that is not FLUX.2's.
    """
    import json
    import re

    import diffusers
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    cfg = json.loads((Path(folder) / "transformer" / "config.json").read_text())
    with torch.device("meta"):
        transformer = getattr(diffusers, cfg["_class_name"]).from_config(cfg)
    shapes = {n: (m.in_features, m.out_features) for n, m in transformer.named_modules()
              if isinstance(m, torch.nn.Linear)}
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def put(key: str, d_in: int, d_out: int, down: str = "lora_A", up: str = "lora_B") -> None:
        sd[f"{key}.{down}.weight"] = torch.randn(rank, d_in, generator=gen) * std
        sd[f"{key}.{up}.weight"] = torch.randn(d_out, rank, generator=gen) * std
        if down == "lora_down":
            sd[f"{key}.alpha"] = torch.tensor(float(alpha))

    for module, (d_in, d_out) in shapes.items():
        if layout == "kohya":
            put("lora_unet_" + module.replace(".", "_"), d_in, d_out, "lora_down", "lora_up")
        elif layout == "diffusion-model":
            put(f"diffusion_model.{module}", d_in, d_out, "lora_down", "lora_up")
        else:
            if cfg["_class_name"] != "Flux2Transformer2DModel":
                raise ValueError(f"layout 'flux2-bfl' is FLUX.2's, not {cfg['_class_name']}'s")
            found = re.match(r"transformer_blocks\.(\d+)\.attn\.(to_[qkv]|add_[qkv]_proj)$", module)
            if found:  # one fused projection per stream, written once (at q)
                if found.group(2) in _FLUX2_QKV:
                    put(f"diffusion_model.double_blocks.{found.group(1)}.{_FLUX2_QKV[found.group(2)]}", d_in, 3 * d_out)
                continue
            generic = re.sub(r"\.\d+\.", ".{i}.", module, count=1)
            index = re.search(r"\.(\d+)\.", module)
            put("diffusion_model." + _FLUX2_BFL[generic].format(i=index.group(1) if index else ""), d_in, d_out)
    loras = Path(folder).parent / "loras"
    loras.mkdir(exist_ok=True)
    save_file(sd, str(loras / f"{name}.safetensors"))
    return loras
