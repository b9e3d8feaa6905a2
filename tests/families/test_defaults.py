"""Request defaults: a request without ``num_inference_steps`` or ``guidance_scale`` (or ``true_cfg_scale``) gets
what the family's diffusers pipeline gives a call without them, and the same image.

For each family, on its tiny offline checkpoint (``tests/tiny/``): the model's spec, the ingress's validator and
``GET /v1/models`` carry the defaults of the pipeline's ``__call__`` signature (read here with
``inspect.signature``, independently of ``bcg_core/families/defaults.py``), equal to the values the docs name;
a request that omits them is served as the pipeline called without them (the reference gate); values set in the
config's ``limits`` win.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from diffusers import (
    FluxPipeline,
    PixArtSigmaPipeline,
    QwenImage21Pipeline,
    QwenImagePipeline,
    SanaPipeline,
    StableDiffusion3Pipeline,
)

from bcg_core import BucketConfig, GenerationRequest, ModelConfig, RequestValidator
from bcg_core.config import EngineConfig
from bcg_core.models import describe_model
from reference_gate import assert_same, bcg_pipeline, bcg_run, diffusers_run
from tiny import flux, pixart, qwenimage, qwenimage21, sana, sd3

CASES = {
    # case: (builder, pipeline class, bucket table, size, diffusers call kwargs)
    "flux-dev": (lambda d: flux.build(d, "dev"), FluxPipeline,
                 dict(batch_sizes=[1, 2], resolutions=["32x32"], text_lengths=[flux.TEXT_TOKENS]), 32,
                 dict(max_sequence_length=flux.TEXT_TOKENS)),
    "flux-schnell": (lambda d: flux.build(d, "schnell"), FluxPipeline,
                     dict(batch_sizes=[1, 2], resolutions=["32x32"], text_lengths=[flux.TEXT_TOKENS]), 32,
                     dict(max_sequence_length=flux.TEXT_TOKENS)),
    "sd3": (lambda d: sd3.build(d), StableDiffusion3Pipeline,
            dict(batch_sizes=[1, 2], resolutions=["64x64"], text_lengths=[333]), 64, {}),
    "pixart": (lambda d: pixart.build(d), PixArtSigmaPipeline,
               dict(batch_sizes=[1, 2], resolutions=["256x256"], text_lengths=[16]), 256, {}),
    "sana": (lambda d: sana.build(d), SanaPipeline,
             dict(batch_sizes=[1, 2], resolutions=["512x512"], text_lengths=[32]), 512, {}),
    "qwenimage": (lambda d: qwenimage.build(d), QwenImagePipeline,
                  dict(batch_sizes=[1, 2], resolutions=["64x64"], text_lengths=[32]), 64, {}),
    "qwenimage21": (lambda d: qwenimage21.build(d), QwenImage21Pipeline,
                    dict(batch_sizes=[1, 2], resolutions=["64x64"], text_lengths=[32]), 64, {}),
}

DOCUMENTED = {
    # case: (num_inference_steps, guidance_scale, true_cfg_scale): what docs/API.md, README and the config's
    # field descriptions say (diffusers 0.42.1); a diffusers with other defaults must update them
    "flux-dev": (28, 3.5, 1.0),
    "flux-schnell": (28, 3.5, 1.0),
    "sd3": (28, 7.0, None),
    "pixart": (20, 4.5, None),
    "sana": (20, 4.5, None),
    "qwenimage": (50, None, 4.0),
    "qwenimage21": (40, None, 1.0),  # no guidance_scale in its __call__ at all
}

PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    return {case: build(root / case) for case, (build, *_rest) in CASES.items()}


@pytest.fixture(autouse=True)
def _loadable(monkeypatch):
    qwenimage21.without_torchvision(monkeypatch)  # Qwen-Image 2.1's processor without torchvision


def _signature(pipeline_cls) -> tuple[int, float | None, float | None]:
    params = inspect.signature(pipeline_cls.__call__).parameters
    true_cfg = params["true_cfg_scale"].default if "true_cfg_scale" in params else None
    guidance = params["guidance_scale"].default if "guidance_scale" in params else None
    return params["num_inference_steps"].default, guidance, true_cfg


def _config(folder, case: str, **limits) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=str(folder)), buckets=BucketConfig(**CASES[case][2]),
                        limits={"min_side_px": 16, **limits})


def _ingress(config: EngineConfig):
    """The ingress class outside Serve (its routes as plain methods); no DiT handle is used."""
    from deployments.settings import ServeConfig
    from ingress_fakes import bare_ingress

    return bare_ingress(object(), ServeConfig.model_validate(config.model_dump(mode="json")))


@pytest.mark.parametrize("case", list(CASES))
def test_the_family_defaults_are_its_pipelines_signature_defaults(folders, case):
    pipeline_cls = CASES[case][1]
    steps, guidance, true_cfg = _signature(pipeline_cls)
    assert (steps, guidance, true_cfg) == DOCUMENTED[case], (
        f"{pipeline_cls.__name__}'s defaults changed: update the docs and DOCUMENTED")
    spec = describe_model(ModelConfig(path=str(folders[case])))
    assert (spec.default_steps, spec.default_guidance_scale, spec.default_true_cfg_scale) == (steps, guidance, true_cfg)
    # quality's table names the pipeline's default: medium (high for Qwen-Image and 2.1; schnell is distilled for 1-4)
    if case != "flux-schnell":
        assert steps == spec.quality_steps[2 if case in ("qwenimage", "qwenimage21") else 1]
    config = _config(folders[case], case)
    validator = RequestValidator.from_config(config)  # the ingress's: tokenizer and JSON configs only
    size = CASES[case][3]
    filled = validator.validate(GenerationRequest(PROMPT, width=size, height=size, seed=0)).request
    assert (filled.num_inference_steps, filled.guidance_scale) == (steps, guidance)
    assert spec.true_cfg_scale(filled) == (true_cfg if true_cfg is not None else 1.0)
    card = _ingress(config)._model_card().bcg
    shown = {"num_inference_steps": steps, "guidance_scale": guidance}
    if true_cfg is not None:
        shown["true_cfg_scale"] = true_cfg
    assert card["defaults"] == shown
    assert card["limits"]["default_steps"] == steps and card["quality_steps"]["auto"] == steps
    assert card["limits"]["size_multiple"] == (32 if case == "qwenimage21" else spec.rules.pixels_per_token)


@pytest.mark.parametrize("case", list(CASES))
def test_values_set_in_the_config_win_over_the_familys(folders, case):
    size = CASES[case][3]
    validator = RequestValidator.from_config(_config(folders[case], case, default_steps=3, default_guidance_scale=2.0))
    filled = validator.validate(GenerationRequest(PROMPT, width=size, height=size, seed=0)).request
    assert (filled.num_inference_steps, filled.guidance_scale) == (3, 2.0)
    assert validator.validate(GenerationRequest(PROMPT, width=size, height=size, seed=0,
                                          quality="auto")).request.num_inference_steps == 3
    clipped = RequestValidator.from_config(_config(folders[case], case, max_steps=10, max_guidance_scale=1.5))
    filled = clipped.validate(GenerationRequest(PROMPT, width=size, height=size, seed=0)).request
    steps, guidance, _ = _signature(CASES[case][1])
    assert filled.num_inference_steps == 10  # every family's default is above 10: clipped to max_steps
    assert filled.guidance_scale == (None if guidance is None else min(guidance, 1.5))


@pytest.mark.parametrize("case", list(CASES))
def test_a_request_that_omits_them_equals_the_pipeline_called_without_them(folders, case):
    _, pipeline_cls, buckets, size, call_kwargs = CASES[case]
    pipe = bcg_pipeline(folders[case], buckets, min_side_px=16)
    # no steps, guidance or true CFG: each side takes its own default; the negative prompt makes CFG's defaults
    # count (uncond rows for SD3, PixArt-Sigma and SANA at their guidance, and Qwen-Image's true CFG 4.0)
    req = GenerationRequest(PROMPT, n=1, width=size, height=size, negative_prompt="blurry", seed=3)
    ours = bcg_run(pipe, req)
    ref = diffusers_run(pipeline_cls, folders[case], req, **call_kwargs)
    assert_same(ours, ref)


@pytest.mark.parametrize("case", list(CASES))
def test_the_default_size_is_what_the_pipeline_generates_without_a_size(folders, case):
    """``size: "auto"`` (or none) is served at :attr:`ModelSpec.default_size`: the size the family's diffusers
    pipeline generates when called without ``height``/``width`` (one step of it, on the tiny checkpoint)."""
    pipeline_cls = CASES[case][1]
    spec = describe_model(ModelConfig(path=str(folders[case])))
    pipe = pipeline_cls.from_pretrained(str(folders[case]), torch_dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    extra = CASES[case][4]
    with torch.inference_mode():
        (image,) = pipe("a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0), **extra).images
    assert image.size == spec.default_size
    validator = RequestValidator.from_config(_config(folders[case], case, min_side_px=16))
    validated = validator.validate(GenerationRequest("a cat", seed=1))
    assert (validated.request.width, validated.request.height) == spec.default_size
