"""The bf16 gate on the CPU, small: padding cases in bf16 against diffusers' own bf16 pipeline (``tests/reference_gate_bf16.py``).

The full gate (every family and case, CPU or CUDA) is ``benchmarks/bf16_gate.py`` and ``tests/gpu/test_bf16_gate.py``;
this module runs the cases where bf16 padding reaches the real tokens through another kernel path on a CPU, with the
bounds measured in the same run:

- Qwen-Image text padded by counts that are not multiples of 16 (and an exact bucket, and a request sharing its
  forwards with another): on a CPU, PyTorch's flash-attention kernel rounds a key through its vectorised ``exp`` or
  through ``std::exp`` by its position against the key length, so padding the text moves real keys between the two.
  Diffusers does the same when it pads a prompt beside a longer one in a batch, so the bound is diffusers' own
  batch deviation.
- FLUX sizes padded into a masked image tier (and an exact bucket): the masked attention over the tier's longer key
  sequence is a computation no diffusers call runs; its bound is diffusers' own batch and attention-backend
  deviations. FLUX's latents are batch-exact in diffusers, so its exact bucket must be bit-identical.

And the gate's rules themselves (:func:`reference_gate_bf16.check`) on made-up results.
"""

import pytest

from reference_gate_bf16 import FP8_SCALE, check, compare, measure_family


def _dev(levels, share, rel):
    return {"max_levels": levels, "share": share, "latent_rel": rel}


def _result(kernels="eager", batch=_dev(2, 0.2, 0.0), kernel=_dev(3, 0.3, 1e-2), fp32=_dev(7, 0.6, 2e-2), **cases):
    return {"family": "x", "device": "cpu", "kernels": kernels, "bounds": {"batch": batch, "kernel": kernel,
            "fp32": fp32}, "cases": cases}


def test_the_gate_demands_bit_identical_latents_where_diffusers_is_batch_exact():
    assert check(_result(exact=_dev(0, 0.0, 0.0), batched=_dev(4, 0.2, 0.0))) == []
    bad = check(_result(exact=_dev(0, 0.0, 1e-7)))
    assert len(bad) == 1 and "batch-exact" in bad[0]
    bad = check(_result(batched=_dev(5, 0.1, 0.0)))  # identical latents, a decode beyond 2 x diffusers' batched one
    assert len(bad) == 1 and "decode" in bad[0]
    assert len(check(_result(batch=_dev(0, 0.0, 0.0), batched=_dev(1, 0.01, 0.0)))) == 1  # 0 stays 0
    # a masked image tier is bounded by the batch and kernel deviations (x 2), not bit-exactness
    assert check(_result(image_padded=_dev(6, 0.3, 2e-2))) == []
    assert len(check(_result(image_padded=_dev(7, 0.3, 9e-3)))) == 1
    assert len(check(_result(image_padded=_dev(2, 0.3, 2.1e-2)))) == 1


def test_the_gate_bounds_by_diffusers_own_deviations_where_it_is_not_batch_exact():
    batch = _dev(4, 0.35, 4.5e-3)
    assert check(_result(batch=batch, text_padded=_dev(8, 0.5, 2e-2))) == []  # within 2 x the kernel bound
    assert len(check(_result(batch=batch, text_padded=_dev(9, 0.3, 1e-3)))) == 1
    assert len(check(_result(batch=batch, text_padded=_dev(1, 0.3, 2.1e-2)))) == 1
    # compiled kernels: the bf16-against-fp32 deviation is allowed too, and exactness is never demanded
    assert check(_result(kernels="compiled", exact=_dev(14, 0.6, 4e-2))) == []
    assert len(check(_result(kernels="compiled", exact=_dev(15, 0.6, 4e-2)))) == 1
    assert check(_result(kernels="compiled", exact=_dev(3, 0.1, 1e-2)), margin=1.0) == []


def test_fp8_is_bounded_on_latents_by_16_bf16_roundings_and_reports_psnr():
    import numpy as np

    fp32 = _dev(7, 0.6, 2e-3)  # x 16 x margin 2: 6.4e-2
    assert FP8_SCALE == 16.0
    assert check(_result(kernels="fp8", fp32=fp32, exact=_dev(120, 0.99, 6e-2))) == []  # pixels are not bounded
    bad = check(_result(kernels="fp8", fp32=fp32, exact=_dev(3, 0.1, 7e-2)))
    assert len(bad) == 1 and "fp8" in bad[0]
    a = np.zeros((2, 2, 3), np.uint8)
    b = a.copy()
    b[0, 0, 0] = 255  # one of 12 values off by 255: MSE 255² / 12, PSNR 10 log10(12)
    assert compare(b, a).psnr_db == round(10 * np.log10(12), 2) and compare(a, a).psnr_db is None


@pytest.mark.parametrize("family,cases,per_case", [
    ("qwenimage", ("exact", "text_padded", "batched"), 3),
    ("flux", ("exact", "image_padded"), 3),
])
def test_bf16_padding_on_the_cpu_is_within_diffusers_own_deviations(family, cases, per_case, tmp_path):
    result = measure_family(family, cases=cases, per_case=per_case, folder=tmp_path)
    assert set(result["cases"]) == set(cases)
    padded = [r for r in result["requests"] if r["case"] in ("text_padded", "image_padded")]
    assert len(padded) == per_case
    if family == "qwenimage":
        assert all((int(r["key"].split("_t")[1].split("_")[0]) - r["tokens"]) % 16 for r in padded)
    else:
        assert all("_m_" in r["key"] for r in padded)  # masked tiers
        assert result["bounds"]["batch"]["latent_rel"] == 0.0  # so the exact bucket must be bit-identical
    bad = check(result)
    assert not bad, "\n".join(bad + [f"bounds: {result['bounds']}", f"cases: {result['cases']}"])
