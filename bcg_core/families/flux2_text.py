"""FLUX.2's prompt tokens as its pipelines count them: the templated prompt, tokenized before the pipeline pads or
cuts it (tokenizers only, no weights). [dev]'s tokenizer may come from its ``PixtralProcessor`` folder
(:func:`~bcg_core.families.pixtral.processor_tokenizer`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bcg_core.families.pixtral import processor_tokenizer

__all__ = ["flux2_token_counter"]


def flux2_token_counter(path: Path, index: dict) -> Callable[..., int]:
    """``(prompt, negative=False) -> tokens`` of the templated prompt as the pipeline tokenizes it before padding or
    cutting it ([dev]: ``format_input`` with the pipeline's ``system_message`` through the tokenizer's chat template;
    [klein]: the Qwen3 chat template with ``enable_thinking=False``, then the tokenizer), untruncated, so that a
    prompt over ``max_sequence_length`` is refused rather than cut; negative prompts count alike.

    Args:
        path: the checkpoint folder.
        index: its ``model_index.json`` (``_class_name`` picks the template).
    """
    from transformers import AutoTokenizer

    tok = (processor_tokenizer(path, index)
           or AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True))
    if index["_class_name"] == "Flux2Pipeline":
        from diffusers import Flux2Pipeline
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        system = Flux2Pipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=tok,
                               transformer=None).system_message

        def count(prompt: str, negative: bool = False) -> int:
            ids = tok.apply_chat_template(format_input(prompts=[prompt], system_message=system),
                                          add_generation_prompt=False, tokenize=True, return_dict=True)
            return len(ids["input_ids"][0])
        return count

    def count_qwen3(prompt: str, negative: bool = False) -> int:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
        return len(tok(text)["input_ids"])
    return count_qwen3
