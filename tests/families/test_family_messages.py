"""Refusal texts say what the served family does: ``guidance_scale`` out of range names the model's use of it (FLUX.2
[dev]'s guidance embedding, Z-Image's CFG above 0, Qwen-Image 2.1's none), FLUX.2's ``true_cfg_scale`` refusal does not
point at a CFG [dev] lacks, and Qwen-Image 2.1's 32-pixel sizes are refused in the usual form, with the nearest valid
sides and the ``allowed`` phrase. On the tiny checkpoints' specs (JSON configs only, as the ingress reads them).
"""

from __future__ import annotations

import pytest

from bcg_core import BucketConfig, GenerationRequest, LimitsConfig, RequestError, RequestValidator
from bcg_core.config import EngineConfig
from bcg_core.families import family_class
from bcg_core.families.base import read_json
from deployments.schemas import RequestLimits, http_field_phrase
from tiny import flux2, qwenimage21, zimage

CASES = {  # case: (builder, bucket resolution, guidance_scale's role in the refusal)
    "flux2-dev": (flux2.build, "32x32", "it feeds this model's guidance embedding; no classifier-free guidance"),
    "flux2-klein": (lambda d: flux2.build(d, "klein"), "32x32", "above 1 enables classifier-free guidance"),
    "flux2-klein-distilled": (lambda d: flux2.build(d, "klein-distilled"), "32x32",
                              "this model ignores it: it runs no classifier-free guidance"),
    "zimage": (zimage.build, "32x32", "above 0 enables classifier-free guidance"),
    "qwenimage21": (qwenimage21.build, "64x64",
                    "this model ignores it: its classifier-free guidance is true_cfg_scale above 1 with a "
                    "negative_prompt"),
}


@pytest.fixture(scope="module")
def validators(tmp_path_factory):
    root = tmp_path_factory.mktemp("messages")
    out = {}
    for case, (build, resolution, _) in CASES.items():
        folder = build(root / case)
        index = read_json(folder / "model_index.json")
        spec = family_class(index["_class_name"]).describe(folder, index)
        cfg = EngineConfig(buckets=BucketConfig(batch_sizes=[1, 2], resolutions=[resolution],
                                                text_lengths=[spec.rules.native_text_tokens or 32]),
                           limits=LimitsConfig(min_side_px=16, max_side_px=1024))
        out[case] = RequestValidator(cfg, spec, count_tokens=lambda s, negative=False: 8)
    return out


def _refusal(validator: RequestValidator, **kw) -> RequestError:
    req = GenerationRequest(**{"prompt": "a cat", "width": 64, "height": 64, "num_inference_steps": 2, **kw})
    with pytest.raises(RequestError) as e:
        validator.validate(req)
    return e.value


@pytest.mark.parametrize("case", sorted(CASES))
def test_guidance_scale_out_of_range_says_what_it_does_for_this_model(case, validators):
    role = CASES[case][2]
    e = _refusal(validators[case], guidance_scale=31.0)
    assert e.field == "guidance_scale" and e.message.endswith(f"allowed: a number from 0 to 30 ({role})"), e.message
    if case != "flux2-klein":
        assert "above 1 enables" not in e.message
    # the HTTP schema's type errors use the same phrase (the ingress hands it the spec's role)
    limits = RequestLimits(guidance=validators[case].spec.guidance_role())
    assert http_field_phrase("guidance_scale", limits) == f"a number from 0 to 30 ({role})"


def test_flux2_devs_true_cfg_scale_refusal_points_at_its_guidance_embedding(validators):
    e = _refusal(validators["flux2-dev"], true_cfg_scale=2.0)
    assert e.field == "true_cfg_scale" and "classifier-free guidance above 1" not in e.message
    assert e.message.endswith("leave it unset (guidance_scale: it feeds this model's guidance embedding; no "
                              "classifier-free guidance)")
    e = _refusal(validators["zimage"], true_cfg_scale=2.0)
    assert e.message.endswith("leave it unset (guidance_scale: above 0 enables classifier-free guidance)")


@pytest.mark.parametrize("size, side", [((48, 48), "width 48 is not a multiple of 32; use 32 or 64"),
                                        ((64, 80), "height 80 is not a multiple of 32; use 64 or 96")])
def test_qwenimage21_sizes_off_32_pixels_are_refused_with_the_nearest_and_the_allowed_sizes(size, side, validators):
    e = _refusal(validators["qwenimage21"], width=size[0], height=size[1])
    assert e.field == "size"
    assert e.message.startswith(f"invalid 'size' (got '{size[0]}x{size[1]}'): {side}; allowed: ")
    assert "each a multiple of 32; bucketed sizes: 64x64" in e.message
