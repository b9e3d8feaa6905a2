"""The bf16 gate on a GPU: every family's bf16 images, served through captured CUDA graphs, against diffusers' own
bf16 pipeline on the same GPU, within the deviations diffusers shows itself there.

``tests/reference_gate_bf16.py`` measures, per family (tiny checkpoints of ``tests/tiny/``, bf16, 4 steps, on CUDA) and
in the same run, diffusers' own deviations (``batch``: the same image alone and in a batch of two beside a longer
prompt; ``kernel``: SDPA's default backend against the math backend; ``fp32``: bf16 against fp32) and bcg-serve's
deviation from diffusers alone for an exact bucket, image padding into a masked tier (FLUX), text padding (the
masked-text families) and a request sharing its forwards with another. :func:`reference_gate_bf16.check` is the gate:

- ``runner.kernels: eager`` (kernels captured as they run eagerly): where diffusers' final latents are batch-exact
  on this GPU, bcg-serve's must be bit-identical for the exact, text-padded and batched requests (only the decode
  may then differ, by at most diffusers' own batched decode); otherwise within ``batch`` and ``kernel``. A masked
  image tier (an attention no diffusers call runs) is bounded by ``batch`` and ``kernel``.
- ``runner.kernels: compiled``: compiled kernels change rounding, so the stated, looser bound is ``batch``,
  ``kernel`` and ``fp32`` together (the scale of bf16 itself against fp32), never bit-exactness.
- ``runner.kernels: fp8``: the final latents within ``FP8_SCALE`` (16, float8 e4m3's rounding against bf16's)
  times the larger of the ``kernel`` and ``fp32`` latent bounds; pixels are reported (levels, PSNR), not bounded.

Diffusers' fp32 run starts from its bf16 run's noise (``reference_gate_bf16.initial_noise``): with torch 2.11 a CPU
generator draws other noise in bf16 than in fp32, and four families' fp32 images were then other pictures
(docs/BENCHMARKS.md, 2026-12-04). As a guard, ``fp32`` bounds only where it is a rounding
(``reference_gate_bf16.fp32_is_rounding``).

The bounds are measured, not written down: they are whatever diffusers does on the GPU the test runs on. TF32 is off
in this module so that the fp32 reference is fp32.
"""

import pytest
import torch

from reference_gate_bf16 import FAMILIES, check, measure_family

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("no_tf32")]



def _fp8_runs() -> bool:
    from bcg_core.runners.fp8 import check_fp8

    try:
        check_fp8(torch.device("cuda"))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("kernels", ["eager", "compiled", "fp8"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_images_are_within_diffusers_own_deviations_on_cuda(family, kernels, tmp_path):
    if kernels == "fp8" and not _fp8_runs():
        pytest.skip("fp8 needs float8 matmuls (compute capability 8.9+) and torchao")
    result = measure_family(family, device="cuda", kernels=kernels, folder=tmp_path)
    assert set(result["cases"]) >= {"exact", "batched"}, result["cases"]
    if FAMILIES[family].masked_text:
        assert "text_padded" in result["cases"]
    if FAMILIES[family].image_padded_sizes:
        assert "image_padded" in result["cases"]
        assert all(r["key"].split("_")[2] == "m" for r in result["requests"] if r["case"] == "image_padded")
    bad = check(result)
    assert not bad, "\n".join(bad + [f"bounds: {result['bounds']}", f"cases: {result['cases']}"])
