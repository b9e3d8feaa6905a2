"""FLUX.2 [dev] in the published processor layout (``tokenizer``: ``PixtralProcessor``) loads without torchvision and
encodes prompts as diffusers' pipeline does (``bcg_core/families/pixtral.py``).

The tiny [dev] checkpoint (``tests/tiny/flux2.py``) is rewritten into the published layout: ``model_index.json`` names
``["transformers", "PixtralProcessor"]`` for ``tokenizer`` and the folder gets the processor's and image processor's
configs; a second copy keeps the chat template in the older ``chat_template.json`` instead of ``chat_template.jinja``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from diffusers import Flux2Pipeline

from bcg_core import load_model
from bcg_core.config import ModelConfig
from bcg_core.families.pixtral import PROCESSOR_CLASS, processor_tokenizer
from tiny.flux2 import TEXT_TOKENS, build

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon, digital art"]


def processor_layout(folder, legacy_template: bool = False):
    """Rewrite ``folder`` (a tiny [dev] checkpoint) into the published ``PixtralProcessor`` layout."""
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", PROCESSOR_CLASS]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    tok = folder / "tokenizer"
    (tok / "processor_config.json").write_text(json.dumps({
        "processor_class": PROCESSOR_CLASS, "patch_size": 16, "spatial_merge_size": 2, "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}))
    (tok / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "processor_class": PROCESSOR_CLASS,
        "patch_size": {"height": 16, "width": 16}, "size": {"longest_edge": 1024}}))
    if legacy_template:
        template = tok / "chat_template.jinja"
        (tok / "chat_template.json").write_text(json.dumps({"chat_template": template.read_text()}))
        template.unlink()
    return folder


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    plain = build(tmp_path_factory.mktemp("flux2-dev"), "dev")
    published = processor_layout(shutil.copytree(plain, tmp_path_factory.mktemp("x") / "published"))
    legacy = processor_layout(shutil.copytree(plain, tmp_path_factory.mktemp("y") / "legacy"), legacy_template=True)
    return plain, published, legacy


@pytest.mark.skipif(HAS_TORCHVISION, reason="torchvision installed: PixtralProcessor builds")
def test_diffusers_cannot_load_the_published_layout_without_torchvision(layouts):
    with pytest.raises((ImportError, ValueError), match="(?i)pixtral|torchvision"):  # diffusers: a placeholder class
        Flux2Pipeline.from_pretrained(str(layouts[1]), local_files_only=True)


def test_the_family_loads_the_published_layout_and_encodes_as_diffusers(layouts):
    plain, published, legacy = layouts
    reference = Flux2Pipeline.from_pretrained(str(plain), local_files_only=True)
    assert processor_tokenizer(plain, json.loads((plain / "model_index.json").read_text())) is None
    for folder in (published, legacy):
        model = load_model(ModelConfig(path=str(folder), device="cpu"))
        assert model.spec.pipeline_class == "Flux2Pipeline"
        for prompt in PROMPTS:
            with torch.inference_mode():
                want, _ = reference.encode_prompt(prompt=[prompt], device="cpu", max_sequence_length=TEXT_TOKENS)
            got = model.encode(prompt).text
            assert torch.equal(got, want), (folder.name, prompt)
            assert model.count_tokens(prompt) < TEXT_TOKENS


@pytest.mark.skipif(not HAS_TORCHVISION, reason="PixtralProcessor needs torchvision")
def test_the_processor_tokenizes_text_only_messages_as_its_tokenizer(layouts):
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from transformers import AutoProcessor

    published = layouts[1]
    processor = AutoProcessor.from_pretrained(str(published / "tokenizer"), local_files_only=True)
    tok = processor_tokenizer(published, json.loads((published / "model_index.json").read_text()))
    system = Flux2Pipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=tok, transformer=None).system_message
    kw = dict(add_generation_prompt=False, tokenize=True, return_dict=True, return_tensors="pt",
              padding="max_length", truncation=True, max_length=TEXT_TOKENS)
    messages = format_input(prompts=PROMPTS, system_message=system)
    a, b = processor.apply_chat_template(messages, **kw), tok.apply_chat_template(messages, **kw)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["attention_mask"], b["attention_mask"])
