"""The whole pipeline on the tiny default model: determinism, batch invariance, padded vs eager, loading."""

import io
import re

import numpy as np
import pytest
import torch
from PIL import Image

from bcg_core import (
    BucketConfig,
    CheckpointError,
    DiTPipeline,
    GenerationRequest,
    ModelConfig,
    RequestCancelled,
    RequestError,
    build_tiny,
    load_model,
    save_pipeline,
)
from bcg_core.config import EngineConfig
from bcg_core.families.tiny import TINY_TEXT_TOKENS
from bcg_core.models import describe_model
from reference_gate import padded

SMALL = EngineConfig(buckets=BucketConfig(batch_sizes=[1, 2, 4, 8], resolutions=["256x256", "512x512"],
                                         text_lengths=[TINY_TEXT_TOKENS]))


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.fixture(scope="module")
def pipe(tiny):
    return padded(DiTPipeline(SMALL, tiny))


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)


def test_same_request_and_seed_give_the_same_png(pipe):
    req = GenerationRequest("a corgi astronaut on the moon", n=1, width=256, height=256, num_inference_steps=2, seed=5)
    a, b = pipe.generate(pipe.validator.validate(req)), pipe.generate(pipe.validator.validate(req))
    assert a.image_bytes == b.image_bytes
    img = Image.open(io.BytesIO(a.image_bytes[0]))
    assert img.size == (256, 256) and img.format == "PNG"
    c = pipe.generate(pipe.validator.validate(GenerationRequest(**{**vars(req), "seed": 6})))
    assert c.image_bytes != a.image_bytes


def test_image_does_not_depend_on_how_many_images_share_its_forward(pipe):
    one, three = (pipe.generate(pipe.validator.validate(GenerationRequest("p. cubensis", n=n, width=256, height=272,
                                                                     num_inference_steps=2, seed=9))) for n in (1, 3))
    assert str(one.bucket) == "b2_i1024_m_t256" and str(three.bucket) == "b8_i1024_m_t256"  # 2 and 6 rows with CFG
    assert np.abs(_pixels(one.image_bytes[0]) - _pixels(three.image_bytes[0])).max() <= 1
    assert np.abs(_pixels(three.image_bytes[0]) - _pixels(three.image_bytes[1])).max() > 10  # other noise


def test_padded_denoise_equals_the_unpadded_eager_denoise(pipe):
    req = pipe.validator.validate(GenerationRequest("totem animal", n=3, width=256, height=320, num_inference_steps=3,
                                              seed=1, guidance_scale=4.0))
    key = req.lookup.key
    assert key is not None and key.batch == 8 and key.image_tokens == 1024  # 6 rows, 320 tokens: both padded

    def final(k):
        state = pipe.start(req)
        while not state.done:
            pipe.model.advance(state, pipe.runner.run(k, pipe.model.model_rows(state)))
        return state.latents

    padded, eager = final(key), final(None)
    err = ((padded - eager).abs().max() / eager.abs().max()).item()
    assert err < 1e-5


def test_counters_follow_hits_and_misses(tiny):
    p = padded(DiTPipeline(SMALL, tiny))
    for r in (GenerationRequest("a", n=1, width=256, height=256, num_inference_steps=1, seed=0),
              GenerationRequest("a", n=1, width=768, height=768, num_inference_steps=1, seed=0),  # no tier: miss
              GenerationRequest("a", n=1, width=256, height=256, num_inference_steps=1, guidance_scale=1.0, seed=0)):
        p.generate(p.validator.validate(r))
    s = p.stats()
    by_key = {b["key"]: b for b in s["buckets"]}
    assert by_key["b2_i256_t256"]["requests"] == 1 and by_key["b2_i256_t256"]["hits"] == 1
    assert by_key["b2_i256_t256"]["forwards"] == 1
    assert by_key["b1_i256_t256"]["requests"] == 1  # guidance 1: no uncond rows
    assert s["misses"]["requests"] == 1 and s["misses"]["by_dim"]["image_tokens"] == 1
    assert s["totals"] == {"requests": 3, "hits": 2, "misses": 1}
    assert s["model"]["name"] == "bcg-tiny-flux"


def test_padding_waste_is_measured_in_tokens(tiny):
    p = padded(DiTPipeline(SMALL, tiny))
    p.generate(p.validator.validate(GenerationRequest("a", n=3, width=256, height=256, num_inference_steps=1,
                                                seed=0)))  # 6 -> 8 rows
    b = {b["key"]: b for b in p.stats()["buckets"]}["b8_i256_t256"]
    assert b["real_tokens"] == 6 * (256 + 256) and b["padded_tokens"] == 8 * (256 + 256)
    assert b["padding_waste_pct"] == 25.0


def test_saved_tiny_pipeline_loads_back_and_gives_the_same_image(tiny, tmp_path):
    folder = save_pipeline(tiny, tmp_path / "tiny")
    assert (folder / "model_index.json").is_file() and (folder / "transformer" / "config.json").is_file()
    cfg = ModelConfig(path=str(folder))
    assert describe_model(cfg).rules == tiny.adapter.rules
    loaded = load_model(cfg)
    assert loaded.rules.native_text_tokens == TINY_TEXT_TOKENS
    req = GenerationRequest("inmates with cow heads", n=1, width=256, height=256, num_inference_steps=2, seed=3)
    a, b = DiTPipeline(SMALL, tiny), DiTPipeline(SMALL.model_copy(update={"model": cfg}), loaded)
    a, b = a.generate(a.validator.validate(req)), b.generate(b.validator.validate(req))
    assert a.image_bytes == b.image_bytes


def test_loading_a_folder_that_is_not_a_checkpoint_says_what_is_missing(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "nowhere")))
    with pytest.raises(CheckpointError, match="model_index.json is missing"):
        load_model(ModelConfig(path=str(tmp_path)))
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    from bcg_core.families import PIPELINE_CLASSES

    supported = ", ".join(sorted(PIPELINE_CLASSES))  # every class a family serves, named
    assert "FluxPipeline" in supported and "StableDiffusion3Pipeline" in supported
    refused = "StableDiffusionPipeline checkpoint .*supported: " + re.escape(supported)
    with pytest.raises(CheckpointError, match=refused):
        load_model(ModelConfig(path=str(tmp_path)))


def test_a_checkpoint_with_a_missing_or_mismatched_component_is_refused_naming_it(tiny, tmp_path):
    import json
    import shutil

    folder = save_pipeline(tiny, tmp_path / "tiny")
    shutil.rmtree(folder / "vae")
    with pytest.raises(CheckpointError, match="component 'vae' .* is missing"):
        load_model(ModelConfig(path=str(folder)))
    folder = save_pipeline(tiny, tmp_path / "mixed")
    cfg = json.loads((folder / "vae" / "config.json").read_text())
    (folder / "vae" / "config.json").write_text(json.dumps({**cfg, "_class_name": "AutoencoderDC"}))
    with pytest.raises(CheckpointError, match="names class AutoencoderDC, but model_index.json says AutoencoderKL"):
        describe_model(ModelConfig(path=str(folder)))


@pytest.mark.parametrize("breakage, match", [
    ("empty-tokenizer", "holds no tokenizer files"),
    ("no-weights", "holds no weights"),
    ("no-config", "config.json is missing"),
    ("no-scheduler-config", "scheduler_config.json is missing"),
    ("index-is-a-list", "holds a JSON list, not an object"),
    ("no-class-name", "has no _class_name"),
])
def test_a_broken_checkpoint_is_a_start_up_error_naming_the_cause(tiny, tmp_path, breakage, match):
    import json

    folder = save_pipeline(tiny, tmp_path / "tiny")
    if breakage == "empty-tokenizer":  # would load as a blank tokenizer and serve wrong text silently
        for f in (folder / "tokenizer").iterdir():
            f.unlink()
    elif breakage == "no-weights":
        for f in (folder / "transformer").glob("*.safetensors"):
            f.unlink()
    elif breakage == "no-config":
        (folder / "vae" / "config.json").unlink()
    elif breakage == "no-scheduler-config":
        (folder / "scheduler" / "scheduler_config.json").unlink()
    elif breakage == "index-is-a-list":
        (folder / "model_index.json").write_text("[1, 2]")
    else:
        index = json.loads((folder / "model_index.json").read_text())
        del index["_class_name"]
        (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=match):
        describe_model(ModelConfig(path=str(folder)))


def test_tiny_weights_are_seeded(tiny):
    other = build_tiny(ModelConfig(seed=0))
    for a, b in zip(tiny.adapter.model.parameters(), other.adapter.model.parameters(), strict=True):
        assert torch.equal(a, b)
    third = build_tiny(ModelConfig(seed=1))
    assert not torch.equal(next(tiny.adapter.model.parameters()), next(third.adapter.model.parameters()))


def test_reject_policy_turns_a_miss_into_a_request_error(tiny):
    buckets = BucketConfig(**{**SMALL.buckets.model_dump(), "miss_policy": "reject"})
    with pytest.raises(RequestError) as e:  # an image miss (rows above the largest bucket are split, never missed)
        DiTPipeline(EngineConfig(buckets=buckets), tiny).validator.validate(
            GenerationRequest("a", width=1024, height=1024))
    assert e.value.field == "size"


def test_rows_above_the_largest_bucket_run_split_in_buckets(tiny):
    """The validator splits rows above the largest batch bucket instead of missing them; with bucket forwards
    cheapest the decider runs them as the largest bucket plus the smallest bucket that holds the rest, never
    eager, even under the reject policy."""
    buckets = BucketConfig(**{**SMALL.buckets.model_dump(), "miss_policy": "reject"})
    p = padded(DiTPipeline(EngineConfig(buckets=buckets), tiny))
    r = GenerationRequest("a", n=5, width=256, height=256, num_inference_steps=1, guidance_scale=2.0, seed=3)
    result = p.generate(p.validator.validate(r))  # 10 rows > 8: 8 + 2
    assert len(result.image_bytes) == 5
    modes = {b["key"]: b["forwards_by_mode"] for b in p.stats()["buckets"]}
    assert modes["b8_i256_t256"]["static_eager"] == 1 and modes["b2_i256_t256"]["static_eager"] == 1
    assert p.stats()["misses"]["forwards"] == 0 and p.stats()["misses"]["requests"] == 0
    assert result.hit and str(result.bucket) == "b8_i256_t256" and result.missed == []


def test_a_cancelled_request_stops_before_its_next_step_and_is_not_counted(tiny):
    import threading

    p = DiTPipeline(SMALL, tiny)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RequestCancelled):
        p.generate(p.validator.validate(GenerationRequest("a", n=1, width=256, height=256, num_inference_steps=50,
                                                          seed=0)), cancel)
    assert p.stats()["totals"]["requests"] == 0
    assert sum(b["forwards"] for b in p.stats()["buckets"]) == 0  # no denoising step ran
