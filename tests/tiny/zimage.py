"""A tiny random-weight ``ZImagePipeline`` in the real checkpoint layout (``Tongyi-MAI/Z-Image-Turbo``), built offline.

Components (real classes and channel counts, tiny widths; every model ``.eval()``, seeded):

- ``tokenizer``: a ``Qwen2Tokenizer`` (:func:`tiny.qwenimage.qwen2_tokenizer`, plus ``<think>``/``</think>``) with
  Qwen3's chat template (:data:`tiny.flux2.QWEN3_CHAT_TEMPLATE`); ``ZImagePipeline._encode_prompt`` renders it with
  ``enable_thinking=True``, where Qwen3's template writes no think block.
- ``text_encoder``: ``Qwen3Model`` (the published checkpoint's class; 16 wide, 3 layers: the pipeline reads
  ``hidden_states[-2]``).
- ``transformer``: ``ZImageTransformer2DModel`` (1 main layer, 1 noise- and 1 context-refiner layer, 2 heads of 16,
  RoPE axes (4, 6, 6) over (1024, 64, 64) positions, ``in_channels`` 16, patch 2x2, caption width 16).
- ``vae``: ``AutoencoderKL`` with 16 latent channels and FLUX.1's ``scaling_factor`` / ``shift_factor``, 2 blocks:
  2x downsampling, so 2 x 2 (patch) = 4 pixels per token.
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with Z-Image-Turbo's config (static shift 3.0).

A 2-step 32x32 run takes a few hundredths of a second on a CPU.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ZIMAGE_SCHEDULER_CONFIG", "build"]

ZIMAGE_SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
"""``scheduler/scheduler_config.json`` of Tongyi-MAI/Z-Image-Turbo."""


def _qwen3(tokenizer):
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                         bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    return Qwen3Model(config).eval()


def build(folder: Path) -> Path:
    """Write the tiny Z-Image pipeline to ``folder`` (created); returns it."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    from .flux2 import QWEN3_CHAT_TEMPLATE
    from .qwenimage import qwen2_tokenizer

    tokenizer = qwen2_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    torch.manual_seed(0)
    text_encoder = _qwen3(tokenizer)
    torch.manual_seed(1)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=1, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[1024, 64, 64],
    ).eval()
    with torch.no_grad():  # zeros at init; a trained checkpoint's pad tokens are not, and the gate must see them
        g = torch.Generator().manual_seed(4)
        transformer.x_pad_token.copy_(torch.randn(transformer.x_pad_token.shape, generator=g))
        transformer.cap_pad_token.copy_(torch.randn(transformer.cap_pad_token.shape, generator=g))
    torch.manual_seed(2)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=16, norm_num_groups=4, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    ).eval()
    sched = FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER_CONFIG)
    pipe = ZImagePipeline(scheduler=sched, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    folder = Path(folder)
    pipe.save_pretrained(folder)
    return folder
