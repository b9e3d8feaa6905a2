"""A tiny random-weight ``FluxPipeline`` in the real layout, built offline (docs/DESIGN.md section 4).

Components as diffusers' own ``tests/pipelines/flux/test_pipeline_flux.py`` sizes them: a
``FluxTransformer2DModel`` with one double- and one single-stream block, CLIP (``CLIPTextModel``) and T5
(``T5EncoderModel``) text encoders of width 32, FLUX's 16-channel ``AutoencoderKL`` layout with few channels,
and the FLUX.1-dev scheduler config. ``variant="dev"`` has the guidance embedding, ``"schnell"`` not (and
schnell's fixed-shift scheduler, ``use_dynamic_shifting=False``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tokenizers import clip_tokenizer, t5_tokenizer

__all__ = ["TEXT_TOKENS", "build"]

TEXT_TOKENS = 32
"""``max_sequence_length`` the tiny pipelines are saved for (``bcg_text_tokens``) and called with."""


def build(folder: Path, variant: str = "dev", layers: tuple[int, int] = (1, 1)) -> Path:
    """Write a tiny ``FluxPipeline`` (``variant`` ``"dev"`` or ``"schnell"``) to ``folder``; returns it. ``layers``:
    its double- and single-stream blocks (the step cache's gate uses more, so that blocks sit between the first and
    the last)."""
    import json

    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if variant not in ("dev", "schnell"):
        raise ValueError(f"variant must be 'dev' or 'schnell', got {variant!r}")
    torch.manual_seed(0)
    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=layers[0], num_single_layers=layers[1], attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=variant == "dev", axes_dims_rope=(4, 6, 6),
    )
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=32, bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
    ))
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    ))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
        sample_size=32, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )
    sched = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0 if variant == "dev" else 1.0, use_dynamic_shifting=variant == "dev",
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(scheduler=sched, vae=vae.eval(), text_encoder=clip.eval(), tokenizer=clip_tok,
                        text_encoder_2=t5.eval(), tokenizer_2=t5_tok, transformer=transformer.eval())
    folder = Path(folder)
    pipe.save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["bcg_text_tokens"] = TEXT_TOKENS
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder
