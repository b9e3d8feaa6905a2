"""A tiny random-weight ``QwenImagePipeline`` in the real checkpoint layout, built offline.

Components (real classes, real channel counts, tiny widths; every model ``.eval()``, seeded):

- ``tokenizer``: a ``Qwen2Tokenizer`` (byte-level BPE with Qwen2's pre-tokenizer regex and NFC
  normaliser), trained with the ``tokenizers`` library on :func:`tiny.tokenizers.corpus` plus the
  pipeline's system prompt, so that the chat-template prefix tokenizes to exactly the 34 tokens that
  ``QwenImagePipeline._get_qwen_prompt_embeds`` drops (``prompt_template_encode_start_idx``), as with the
  real tokenizer; ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` are special tokens.
- ``text_encoder``: ``Qwen2_5_VLForConditionalGeneration`` (text 32 wide, 2 layers, M-RoPE sections
  [2, 3, 3]; a 1-block vision tower that text-only prompts never run).
- ``transformer``: ``QwenImageTransformer2DModel`` (2 layers, 2 heads of 16, RoPE axes (4, 6, 6),
  ``in_channels`` 64 = 16 latent channels x 2x2 packing, ``out_channels`` 16, text width 32).
- ``vae``: ``AutoencoderKLQwenImage`` (``z_dim`` 16, 8x spatial downsampling, the real ``latents_mean``
  and ``latents_std``, base width 16).
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's own config (dynamic exponential
  shift, ``max_shift`` 0.9 over 256..8192 tokens, ``shift_terminal`` 0.02).

A 2-step 64x64 run takes a few hundredths of a second on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["QWEN_SCHEDULER_CONFIG", "SYSTEM_PROMPT", "build", "qwen2_tokenizer"]

SYSTEM_PROMPT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of "
    "the objects and background:"
)
"""The system message of ``QwenImagePipeline.prompt_template_encode``."""

QWEN_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    invert_sigmas=False, stochastic_sampling=False, use_karras_sigmas=False, use_exponential_sigmas=False,
    use_beta_sigmas=False,
)
"""``scheduler/scheduler_config.json`` of Qwen/Qwen-Image."""

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen2_tokenizer(vocab_size: int = 800):
    """A ``Qwen2Tokenizer`` trained offline (see the module docstring).

    Returns:
        The tokenizer; ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` take the ids after the BPE
        vocabulary, as in Qwen's own vocabulary.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from .tokenizers import corpus

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    # The template's words often enough that each becomes one token (34 template tokens, as Qwen's vocab).
    template = [f"system\n{SYSTEM_PROMPT}\nuser\nassistant\n"] * 50
    tok.train_from_iterator(list(corpus()) + template, trainer)
    vocab = dict(tok.get_vocab())
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" "))
              for m in json.loads(tok.to_str())["model"]["merges"]]
    for s in _SPECIAL:
        vocab[s] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=131072,
                          extra_special_tokens=["<|im_start|>", "<|im_end|>"])


def _text_encoder(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab_size = len(tokenizer)
    ids = dict(bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
               pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    config = Qwen2_5_VLConfig(
        text_config=dict(
            **ids, vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
            rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
            rope_theta=1000000.0,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        vocab_size=vocab_size, **ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build(folder: Path, guidance_embeds: bool = False, scheduler: dict | None = None) -> Path:
    """Build the tiny pipeline and ``save_pretrained`` it into ``folder``.

    Args:
        folder: target folder (created).
        guidance_embeds: the transformer config flag of guidance-distilled variants (refused by the family:
            diffusers 0.42.1 has no guidance embedding for Qwen-Image).
        scheduler: overrides of :data:`QWEN_SCHEDULER_CONFIG`.

    Returns:
        ``folder``.
    """
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    folder = Path(folder)
    tokenizer = qwen2_tokenizer()
    torch.manual_seed(0)
    text_encoder = _text_encoder(tokenizer)
    torch.manual_seed(1)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),
    ).eval()
    torch.manual_seed(2)
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True]).eval()
    sched = FlowMatchEulerDiscreteScheduler(**{**QWEN_SCHEDULER_CONFIG, **(scheduler or {})})
    pipe = QwenImagePipeline(scheduler=sched, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    pipe.save_pretrained(folder)
    return folder
