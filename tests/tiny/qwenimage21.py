"""A tiny random-weight ``QwenImage21Pipeline`` (Qwen-Image 2.1) in the real checkpoint layout, built offline.

Components (real classes, real channel counts where the pipeline hard-codes them, tiny widths; every model
``.eval()``, seeded):

- ``processor``: a ``Qwen3VLProcessor`` of a ``Qwen2Tokenizer`` (:func:`tiny.qwenimage.qwen2_tokenizer`, retrained
  on the corpus plus the pipeline's system prompt, with Qwen3-VL's special tokens ``<|vision_start|>``,
  ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``), a ``Qwen2VLImageProcessorPil`` (patch 16, merge 2, as
  Qwen3-VL's: one ``<|image_pad|>`` per 32x32 pixels, one per 2x2 group of the transformer's latent tokens; the
  Pillow backend, torchvision is not installed), no video processor (``Qwen3VLVideoProcessor`` needs torchvision,
  and the pipeline passes no video) and :data:`QWEN3_VL_CHAT_TEMPLATE`.
- ``text_encoder``: ``Qwen3VLForConditionalGeneration`` (text 32 wide, 2 layers, M-RoPE sections [2, 3, 3]; a
  1-block vision tower, 16 wide, patch 16, merge 2).
- ``transformer``: ``QwenImage21Transformer2DModel`` (2 layers, 2 heads of 16, RoPE axes (4, 6, 6), ``in_channels``
  64 latent channels unpatched, text width 32, ``causal_condition`` as released).
- ``vae``: ``AutoencoderKLQwenImage21`` (``z_dim`` 64, RGBA in and out, 16x spatial downsampling as the pipeline's
  hard-coded ``vae_scale_factor``, base width 8).
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's config (:data:`tiny.qwenimage.
  QWEN_SCHEDULER_CONFIG`; the 2.1 repository's own is not readable offline).

A 2-step 64x64 run takes well under a second on a CPU.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

__all__ = ["QWEN3_VL_CHAT_TEMPLATE", "build", "loadable", "processor_class", "qwen3_vl_processor",
           "without_torchvision"]

QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen3-VL's chat template for system and user turns of text and images (what ``QwenImage21Pipeline`` renders:
its system message, to count the tokens it drops)."""

_VL_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def processor_class():
    """bcg-serve's ``Qwen3VLProcessor`` without its video processor (:class:`bcg_core.families.qwen3vl.
    Qwen3VLProcessorWithoutVideo`, the class the family loads the processor with): transformers 5.25 builds
    ``Qwen3VLProcessor``'s video processor only with torchvision, which this CPU machine's torch 2.13 has none of that
    imports beside it. :func:`without_torchvision` makes ``transformers.Qwen3VLProcessor`` name it while a test runs
    diffusers' own ``QwenImage21Pipeline.from_pretrained``; the checkpoint's files keep the real class names.
    """
    from bcg_core.families.qwen3vl import Qwen3VLProcessorWithoutVideo

    return Qwen3VLProcessorWithoutVideo


def without_torchvision(monkeypatch) -> None:
    """Point ``transformers.Qwen3VLProcessor`` at :func:`processor_class` for the test (pytest's ``monkeypatch``), so
    that diffusers' own ``QwenImage21Pipeline.from_pretrained`` loads the tiny checkpoint (which has no video processor)
    on a machine without torchvision; the family needs no patch (it loads the processor with that class itself)."""
    import transformers

    monkeypatch.setattr(transformers, "Qwen3VLProcessor", processor_class())


@contextlib.contextmanager
def loadable():
    """Within the block, ``transformers.Qwen3VLProcessor`` names :func:`processor_class` (as :func:`without_torchvision`
    does for a test), so that diffusers' own ``from_pretrained`` loads the checkpoint on a machine without torchvision
    outside pytest's ``monkeypatch`` (``reference_gate_bf16.FamilyCase.loading``, ``benchmarks/bf16_gate.py``); the
    original name is restored after. Building needs no patch (:func:`build` saves the real class names), and neither
    does the family (:mod:`bcg_core.families.qwen3vl`)."""
    import transformers

    original = transformers.Qwen3VLProcessor
    transformers.Qwen3VLProcessor = processor_class()
    try:
        yield
    finally:
        transformers.Qwen3VLProcessor = original


def qwen3_vl_processor():
    """The tiny ``Qwen3VLProcessor`` (see the module docstring; :func:`processor_class`)."""
    from transformers import Qwen2VLImageProcessorPil

    from .qwenimage import qwen2_tokenizer

    tok = qwen2_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *_VL_SPECIAL]})
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                                min_pixels=32 * 32, max_pixels=1024 * 1024,
                                                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return processor_class()(image_processor=image_processor, tokenizer=tok, chat_template=QWEN3_VL_CHAT_TEMPLATE)


def _text_encoder(tokenizer):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = dict(bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
               pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    config = Qwen3VLConfig(
        text_config=dict(
            **ids, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def build(folder: Path, causal_condition: bool = True, sample_sigmas: list[float] | None = None) -> Path:
    """Build the tiny pipeline and ``save_pretrained`` it into ``folder`` (created); returns ``folder``.

    Args:
        causal_condition: the transformer flag (the released checkpoint's True).
        sample_sigmas: the pipeline's ``sample_sigmas`` config (a fixed sigma grid; refused by the family).
    """
    import torch
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )

    from .qwenimage import QWEN_SCHEDULER_CONFIG

    processor = qwen3_vl_processor()
    torch.manual_seed(0)
    text_encoder = _text_encoder(processor.tokenizer)
    torch.manual_seed(1)
    transformer = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        context_in_dim=32, mlp_ratio=3, axes_dims_rope=(4, 6, 6), causal_condition=causal_condition,
    ).eval()
    with torch.no_grad():  # zero-centred norm weights start at 0; a trained checkpoint's are not
        g = torch.Generator().manual_seed(3)
        transformer.txt_in.text_norm.weight.copy_(0.1 * torch.randn(transformer.txt_in.text_norm.weight.shape,
                                                                    generator=g))
    torch.manual_seed(2)
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False, True, True, True]).eval()
    sched = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER_CONFIG)
    pipe = QwenImage21Pipeline(scheduler=sched, vae=vae, text_encoder=text_encoder, processor=processor,
                               transformer=transformer, sample_sigmas=sample_sigmas)
    folder = Path(folder)
    pipe.save_pretrained(folder)
    for name in ("model_index.json", "processor/processor_config.json"):  # the real class names (processor_class)
        index = json.loads((folder / name).read_text())
        if name == "model_index.json":
            index["processor"] = ["transformers", "Qwen3VLProcessor"]
        else:
            index["processor_class"] = "Qwen3VLProcessor"
        (folder / name).write_text(json.dumps(index, indent=2))
    return folder
