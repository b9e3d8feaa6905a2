"""The bf16 gate on a GPU: every family's bf16 images, served through captured CUDA graphs, against diffusers' own
bf16 pipeline on the same GPU, within the deviations diffusers shows itself there.

``tests/reference_gate_bf16.py`` measures, per family (tiny checkpoints of ``tests/tiny/``, bf16, 4 steps, on CUDA) and in
the same run, diffusers' own deviations (``batch``: the same image alone and in a batch of two beside a longer
prompt; ``kernel``: SDPA's default backend against the math backend; ``fp32``: bf16 against fp32) and bcg-serve's
deviation from diffusers alone for an exact bucket, image padding into a masked tier (FLUX), text padding (the
masked-text families) and a request sharing its forwards with another. :func:`reference_gate_bf16.check` is the gate:

- ``runner.kernels: eager`` (kernels captured as they run eagerly): where diffusers' final latents are batch-exact
  on this GPU, bcg-serve's must be bit-identical for the exact, text-padded and batched requests (only the decode
  may then differ, by at most diffusers' own batched decode); otherwise within ``batch`` and ``kernel``. A masked
  image tier (an attention no diffusers call runs) is bounded by ``batch`` and ``kernel``.
- ``runner.kernels: compiled``: compiled kernels change rounding, so the stated, looser bound is ``batch``,
  ``kernel`` and ``fp32`` together (the scale of bf16 itself against fp32), never bit-exactness.

The bounds are measured, not written down: they are whatever diffusers does on the GPU the test runs on. TF32 is off
in this module so that the fp32 reference is fp32.
"""

import pytest
import torch

from reference_gate_bf16 import FAMILIES, check, measure_family

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_images_are_within_diffusers_own_deviations_on_cuda(family, kernels, tmp_path):
    result = measure_family(family, device="cuda", kernels=kernels, folder=tmp_path)
    assert set(result["cases"]) >= {"exact", "batched"}, result["cases"]
    if FAMILIES[family].masked_text:
        assert "text_padded" in result["cases"]
    if FAMILIES[family].image_padded_sizes:
        assert "image_padded" in result["cases"]
        assert all(r["key"].split("_")[2] == "m" for r in result["requests"] if r["case"] == "image_padded")
    bad = check(result)
    assert not bad, "\n".join(bad + [f"bounds: {result['bounds']}", f"cases: {result['cases']}"])
