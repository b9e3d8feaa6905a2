"""Qwen-Image 2.1 loads in the README's install (``scripts/install.sh``: no torchvision), with nothing patched:
``transformers.Qwen3VLProcessor`` builds its video processor only with torchvision, so the family loads the processor
without it (``bcg_core/families/qwen3vl.py``). ``bcg config --check`` and a replica's load (``DiTPipeline.from_config``,
what ``bcg serve`` runs) on the tiny checkpoint, then one request served; the processor tokenizes as the real class.
"""

from __future__ import annotations

import pytest
import transformers

from bcg_core import GenerationRequest
from bcg_core.families.qwen3vl import Qwen3VLProcessorWithoutVideo, load_processor
from reference_gate import bcg_pipeline
from tiny.qwenimage21 import build


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwenimage21") / "qwen21")  # saves the real class names


def test_the_family_loads_and_serves_without_any_patch(folder):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    assert transformers.Qwen3VLProcessor is Qwen3VLProcessor  # the real class: nothing patched here
    pipe = bcg_pipeline(folder, {"batch_sizes": [1], "resolutions": ["64x64"], "text_lengths": [32]})
    processor = pipe.model.pipe.processor
    assert isinstance(processor, Qwen3VLProcessorWithoutVideo) and "video_processor" not in processor.get_attributes()
    validated = pipe.validator.validate(GenerationRequest("a red cube", width=64, height=64, num_inference_steps=2,
                                                          seed=0))
    result = pipe.generate(validated)
    assert len(result.image_bytes) == 1


def test_bcg_config_check_passes_on_a_qwenimage21_config(folder, tmp_path):
    from deployments.cli.local import check_file

    config = tmp_path / "qwen21.yaml"
    config.write_text(f"model: {{path: {folder}, device: cpu}}\nlimits: {{min_side_px: 64}}\n"
                      "buckets: {batch_sizes: [1, 2], resolutions: ['64x64'], text_lengths: [32]}\n")
    assert ": ok (model " in check_file(config)


def test_the_processor_tokenizes_as_the_checkpoints_tokenizer(folder):
    processor = load_processor(folder / "processor")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder / "processor"), local_files_only=True)
    text = "<|im_start|>user\na photo of a cat<|im_end|>\n"
    assert processor(text=[text])["input_ids"][0] == tok(text)["input_ids"]
