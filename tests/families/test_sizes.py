"""The size rule is one rule: over HTTP (``POST /v1/images/generations``, the schema then the validator) and from Python
(the application handle's ``images``, and a bare :class:`~bcg_core.RequestValidator` as ``DiTPipeline`` uses it) a size
is accepted or refused alike, with the same field and message.

A family with resolution binning (PixArt-Sigma) takes any size within ``limits.min_side_px``..``max_side_px``
(generated at its aspect-ratio bin, resized back); a family without (SD3) takes sizes whose sides are multiples of
its pixels per token (16), within the limits and its position table. The ingress class runs outside Serve with a
fake DiT handle (no Ray), on tiny offline checkpoints (``tests/tiny/``).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from bcg_core import GenerationRequest, RequestError, RequestValidator
from deployments.settings import ServeConfig
from ingress_fakes import FakeDiT, bare_ingress, http_request
from tiny import pixart, sd3

CASES = {
    # family: (builder, bucket table, sizes accepted, sizes refused)
    "pixart": (pixart.build, {"batch_sizes": [1, 2], "resolutions": ["256x256"], "text_lengths": [32]},
               ["256x256", "300x200", "250x250", "17x999"], ["8x8", "256x2000", "1025x300"]),
    "sd3": (sd3.build, {"batch_sizes": [1, 2], "resolutions": ["64x64"], "text_lengths": [333]},
            ["64x64", "96x64", "512x16"], ["72x72", "300x200", "8x8", "528x64", "64x2000"]),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request, tmp_path_factory):
    family = request.param
    build, buckets, _, _ = CASES[family]
    folder = build(tmp_path_factory.mktemp(family) / family)
    config = ServeConfig.model_validate({"model": {"path": str(folder)}, "buckets": buckets,
                                         "limits": {"min_side_px": 16, "max_side_px": 1024}})
    dit = FakeDiT()
    ingress = bare_ingress(dit, config)
    return family, config, ingress, dit


def _outcome(call):
    """``("ok", width, height, grid)`` of a validated request, or ``("refused", field, message)``."""
    try:
        validated = call()
    except RequestError as e:
        return "refused", e.field, e.message
    return "ok", validated.request.width, validated.request.height, validated.grid


def _over_http(ingress, dit, size: str):
    body = {"prompt": "a photo of a cat", "size": size, "n": 1, "seed": 1, "num_inference_steps": 1}
    before = len(dit.sent)
    answer = asyncio.run(ingress.generate(http_request(body)))
    if getattr(answer, "status_code", 200) != 200:
        error = json.loads(answer.body)["error"]
        return "refused", error["param"], error["message"]
    (_, validated), = dit.sent[before:]
    return "ok", validated.request.width, validated.request.height, validated.grid


def _from_the_handle(ingress, dit, w: int, h: int):
    before = len(dit.sent)
    try:
        asyncio.run(ingress.images({"prompt": "a photo of a cat", "width": w, "height": h, "n": 1, "seed": 1,
                                    "num_inference_steps": 1}))
    except RequestError as e:
        return "refused", e.field, e.message
    (_, validated), = dit.sent[before:]
    return "ok", validated.request.width, validated.request.height, validated.grid


def test_a_size_is_accepted_or_refused_alike_over_http_and_from_python(served):
    family, config, ingress, dit = served
    _, _, accepted, refused = CASES[family]
    validator = RequestValidator.from_config(config)
    binning = bool(validator.spec.size_bins)
    assert binning == (family == "pixart")
    for size in accepted + refused:
        w, h = (int(v) for v in size.split("x"))
        request = GenerationRequest("a photo of a cat", width=w, height=h, n=1, seed=1, num_inference_steps=1)
        python = _outcome(lambda request=request: validator.validate(request))
        assert _over_http(ingress, dit, size) == python, size
        assert _from_the_handle(ingress, dit, w, h) == python, size
        assert python[0] == ("ok" if size in accepted else "refused"), (size, python)
        if python[0] == "refused":
            assert python[1] == "size"
    if binning:  # any size in range: generated at its aspect-ratio bin, resized back
        assert _outcome(lambda: validator.validate(GenerationRequest("a cat", width=300, height=200, seed=1,
                                                               num_inference_steps=1)))[1:3] == (300, 200)
    else:  # the pixels per token, named with the nearest sizes
        _, _, message = _outcome(lambda: validator.validate(GenerationRequest("a cat", width=72, height=72, seed=1)))
        assert "multiple of 16" in message and "64 or 80" in message
