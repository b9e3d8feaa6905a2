"""A tiny ``StableDiffusion3Pipeline`` in the real layout, built offline with seeded random weights.

Components and the real sizes they stand in for (stabilityai/stable-diffusion-3-medium-diffusers,
stable-diffusion-3.5-medium / -large):

- ``transformer``: ``SD3Transformer2DModel``, patch 2, 16 latent channels (real), 2 joint blocks of
  2 heads x 8 channels (real: 24-38 blocks of 64-channel heads), ``pos_embed_max_size`` 32 (real 192),
  ``joint_attention_dim`` 48 = the T5 width (real 4096), ``pooled_projection_dim`` 32 = CLIP-L + CLIP-G
  projections (real 768 + 1280).
  Variant ``sd35``: ``qk_norm="rms_norm"`` (every SD3.5) and ``dual_attention_layers=(0,)`` (SD3.5-medium's
  MMDiT-X self-attention branch; pass ``dual_attention=False`` for the SD3.5-large layout).
- ``text_encoder`` / ``text_encoder_2``: ``CLIPTextModelWithProjection`` (CLIP-L, CLIP-G), hidden 16, 2 layers
  (the pipeline takes the penultimate hidden states, so one layer would give the embeddings only);
  their 16 + 16 = 32 channels are zero-padded to the T5 width 48 by ``encode_prompt``, as 2048 -> 4096.
- ``text_encoder_3``: ``T5EncoderModel``, d_model 48, one layer; ``t5=False`` saves the pipeline without it
  (``text_encoder_3`` and ``tokenizer_3`` null in ``model_index.json``, as SD3 checkpoints shipped without T5):
  ``StableDiffusion3Pipeline`` then uses zeros for the T5 part of the text.
- ``vae``: ``AutoencoderKL`` with SD3's 16 latent channels, 8x downsampling, ``scaling_factor`` 1.5305,
  ``shift_factor`` 0.0609 and no quant convs (as SD3's VAE), few channels.
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler(shift=3.0)`` (SD3's config); ``dynamic_shifting=True``
  switches on ``use_dynamic_shifting`` so that ``__call__`` computes ``mu`` from the latent size (no released
  SD3 checkpoint does, but the pipeline supports it).
"""

from __future__ import annotations

from pathlib import Path

from .tokenizers import clip_tokenizer, t5_tokenizer

__all__ = ["VARIANTS", "build"]

VARIANTS = ("sd3", "sd35")
"""``sd3``: SD3-medium's architecture; ``sd35``: SD3.5's (RMS qk-norm, and dual attention for 3.5-medium)."""

_CLIP_HIDDEN = 16
_T5_WIDTH = 48


def _clip(tok, seed: int):
    import torch
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=len(tok), hidden_size=_CLIP_HIDDEN, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=_CLIP_HIDDEN, hidden_act="gelu",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(cfg).eval()


def build(folder: Path, variant: str = "sd3", dual_attention: bool = True,
          dynamic_shifting: bool = False, t5: bool = True) -> Path:
    """Build and save a tiny SD3 pipeline.

    Args:
        folder: where ``save_pretrained`` writes the checkpoint (created if missing).
        variant: ``"sd3"`` or ``"sd35"`` (see the module docstring).
        dual_attention: with ``sd35``, give block 0 SD3.5-medium's second self-attention.
        dynamic_shifting: scheduler ``use_dynamic_shifting=True`` (``mu`` from the latent size).
        t5: with the T5 encoder and tokenizer; False saves them as null.

    Returns:
        ``folder``.

    Raises:
        ValueError: an unknown variant.
    """
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: use one of {', '.join(VARIANTS)}")
    sd35 = variant == "sd35"
    folder = Path(folder)
    tok, tok2, tok3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    text_encoder = _clip(tok, 1)
    text_encoder_2 = _clip(tok2, 2)
    torch.manual_seed(3)
    text_encoder_3 = T5EncoderModel(T5Config(
        vocab_size=len(tok3), d_model=_T5_WIDTH, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()
    torch.manual_seed(4)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=_T5_WIDTH, caption_projection_dim=16, pooled_projection_dim=2 * _CLIP_HIDDEN,
        out_channels=16, pos_embed_max_size=32,
        dual_attention_layers=(0,) if sd35 and dual_attention else (), qk_norm="rms_norm" if sd35 else None,
    ).eval()
    torch.manual_seed(5)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 16, 16),
        layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=4,
        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()
    sched = dict(num_train_timesteps=1000, shift=3.0)
    if dynamic_shifting:
        sched.update(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.16, base_image_seq_len=256,
                     max_image_seq_len=4096)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**sched), vae=vae,
        text_encoder=text_encoder, tokenizer=tok, text_encoder_2=text_encoder_2, tokenizer_2=tok2,
        text_encoder_3=text_encoder_3 if t5 else None, tokenizer_3=tok3 if t5 else None,
    )
    folder.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(folder)
    return folder
