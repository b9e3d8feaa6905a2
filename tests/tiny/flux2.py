"""Tiny random-weight FLUX.2 pipelines in the real checkpoint layouts, built offline.

Two layouts, as ``black-forest-labs/FLUX.2-dev`` and ``FLUX.2-klein-*`` publish them (real classes and channel
counts, tiny widths, every model ``.eval()``, seeded):

- ``variant="dev"``: ``Flux2Pipeline``. ``text_encoder`` a ``Mistral3ForConditionalGeneration`` (text 16 wide, 31
  layers so that the pipeline's default ``text_encoder_out_layers`` (10, 20, 30) exist; a 1-layer Pixtral vision
  tower that text prompts never run); ``tokenizer`` a byte-level BPE tokenizer with Mistral's control tokens
  (``[SYSTEM_PROMPT]``, ``[INST]`` ...) and a chat template in Mistral Small 3.1's form. The published checkpoint's
  ``tokenizer`` is a ``PixtralProcessor`` wrapping that tokenizer; transformers 5.25 refuses to build one without
  torchvision (not installed here), and for text-only messages the processor's ``apply_chat_template`` renders and
  tokenizes exactly as its tokenizer does, so the tokenizer stands in for it. Transformer with the guidance
  embedding (``guidance_embeds=True``).
- ``variant="klein"`` / ``"klein-distilled"``: ``Flux2KleinPipeline``. ``text_encoder`` a ``Qwen3ForCausalLM``
  (16 wide, 28 layers: the default out layers are (9, 18, 27)); ``tokenizer`` a ``Qwen2Tokenizer``
  (:func:`tiny.qwenimage.qwen2_tokenizer`, plus ``<think>``/``</think>``) with Qwen3's chat template for
  ``enable_thinking=False``. Transformer without the guidance embedding; ``is_distilled`` in
  ``model_index.json`` for the distilled variant.

Shared: ``Flux2Transformer2DModel`` (1 double- and 1 single-stream block, 2 heads of 16, RoPE axes (4, 4, 4, 4),
``in_channels`` 128 = 32 latent channels x 2x2 patch, text width 3 x 16 = 48), ``AutoencoderKLFlux2`` (32 latent
channels, 2x2 patch, 2 blocks: 2x downsampling, so 4 pixels per token; its batch norm's running statistics set to
seeded non-trivial values, as a trained checkpoint's are), and ``FlowMatchEulerDiscreteScheduler`` with dynamic
exponential shifting (the pipelines pass ``mu`` from ``compute_empirical_mu`` themselves, so only
``use_dynamic_shifting`` and ``time_shift_type`` of the config matter).

``bcg_text_tokens`` in ``model_index.json`` is the ``max_sequence_length`` the tiny pipelines are served with
(:data:`TEXT_TOKENS`); the reference gate calls diffusers with the same.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["MISTRAL_CHAT_TEMPLATE", "QWEN3_CHAT_TEMPLATE", "TEXT_TOKENS", "VARIANTS", "build", "mistral_tokenizer"]

TEXT_TOKENS = 96
"""``max_sequence_length`` of the tiny pipelines (``bcg_text_tokens``): above the [dev] template's own tokens (its
system message and template take ~65 of this tokenizer's tokens), so prompts of a few words fit and long ones do not."""

VARIANTS = ("dev", "klein", "klein-distilled")

MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
"""Mistral Small 3.1's chat template for text messages (system in ``[SYSTEM_PROMPT]``, user turns in ``[INST]``)."""

QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""Qwen3's chat template for plain user turns (with ``enable_thinking=False`` the empty think block is written)."""

_MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def mistral_tokenizer(vocab_size: int = 600):
    """A Mistral-style tokenizer trained offline: byte-level BPE over :func:`tiny.tokenizers.corpus` and the
    FLUX.2 system message, control tokens at ids 0-10 as in Mistral's vocabulary, :data:`MISTRAL_CHAT_TEMPLATE`.

    Returns:
        A ``PreTrainedTokenizerFast`` (``<s>`` bos, ``</s>`` eos, ``<pad>`` pad, right padding).
    """
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from .tokenizers import corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=_MISTRAL_SPECIAL, show_progress=False)
    tok.train_from_iterator(list(corpus()) + [SYSTEM_MESSAGE] * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        model_max_length=131072, padding_side="right", chat_template=MISTRAL_CHAT_TEMPLATE,
        extra_special_tokens=_MISTRAL_SPECIAL[4:],
    )


def _mistral3(tokenizer):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24,
                         max_position_embeddings=512, num_attention_heads=2, num_hidden_layers=31,
                         num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
                         **ids),
        vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=16, image_size=32, patch_size=8, num_channels=3, head_dim=8),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
    )
    return Mistral3ForConditionalGeneration(config).eval()


def _qwen3(tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24, num_hidden_layers=28,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                         bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    return Qwen3ForCausalLM(config).eval()


def build(folder: Path, variant: str = "dev", layers: tuple[int, int] = (1, 1)) -> Path:
    """Write a tiny FLUX.2 pipeline (``variant`` in :data:`VARIANTS`) to ``folder``; returns it.

    Args:
        folder: target folder (created).
        variant: ``"dev"`` (``Flux2Pipeline``), ``"klein"`` or ``"klein-distilled"`` (``Flux2KleinPipeline``,
            ``is_distilled`` False / True).
        layers: the transformer's double- and single-stream blocks.

    Raises:
        ValueError: another ``variant``.
    """
    import torch
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Pipeline,
        Flux2Transformer2DModel,
    )

    from .qwenimage import qwen2_tokenizer

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    dev = variant == "dev"
    if dev:
        tokenizer = mistral_tokenizer()
    else:
        tokenizer = qwen2_tokenizer()
        tokenizer.add_tokens(["<think>", "</think>"])
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    torch.manual_seed(0)
    text_encoder = _mistral3(tokenizer) if dev else _qwen3(tokenizer)
    torch.manual_seed(1)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=layers[0], num_single_layers=layers[1], attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=dev,
    ).eval()
    torch.manual_seed(2)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=32, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.2 * torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=g))
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                            time_shift_type="exponential")
    parts = dict(scheduler=sched, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe = Flux2Pipeline(**parts) if dev else Flux2KleinPipeline(**parts, is_distilled=variant == "klein-distilled")
    folder = Path(folder)
    pipe.save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["bcg_text_tokens"] = TEXT_TOKENS
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder
