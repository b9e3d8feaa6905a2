"""The bf16 gate on the CPU, small: padding cases in bf16 against diffusers' own bf16 pipeline
(``tests/reference_gate_bf16.py``).

The full gate (every family and case, CPU or CUDA) is ``benchmarks/bf16_gate.py`` and ``tests/gpu/test_bf16_gate.py``;
this module runs the cases where bf16 padding reaches the real tokens through another kernel path on a CPU, with the
bounds measured in the same run:

- Qwen-Image text padded by counts that are not multiples of 16 (and an exact bucket, and a request sharing its
  forwards with another): on a CPU, PyTorch's flash-attention kernel rounds a key through its vectorised ``exp`` or
  through ``std::exp`` by its position against the key length, so padding the text moves real keys between the two.
  Diffusers does the same when it pads a prompt beside a longer one in a batch, so the bound is diffusers' own
  batch deviation.
- FLUX.1 and FLUX.2 [dev] sizes padded into a masked image tier (and an exact bucket): the masked attention over the
  tier's longer key sequence is a computation no diffusers call runs; its bound is diffusers' own batch and
  attention-backend deviations. Their latents are batch-exact in diffusers, so an exact bucket must be bit-identical.
- FLUX.2 [klein] with CFG, alone and sharing its forwards with another request: its cond and uncond rows run in one
  forward where diffusers runs two; diffusers' latents are batch-exact, so bit-identical latents are demanded.
- Z-Image and Qwen-Image 2.1 captions padded by counts that are not multiples of 16, an exact bucket and a request
  sharing its forwards with another. Qwen-Image 2.1's diffusers is not batch-exact beyond rounding: a batch of
  prompts of different lengths puts every row's image at the longest prompt's RoPE frame position (5e-4 relative
  in fp32 on its tiny checkpoint), inside its bf16 batch bound (about 5e-3).

And the gate's rules themselves (:func:`reference_gate_bf16.check`) on made-up results.
"""

import pytest

from reference_gate_bf16 import (
    FP8_LATENT_CAP,
    FP8_SCALE,
    FP32_ROUNDING_MAX,
    check,
    compare,
    fp32_is_rounding,
    measure_family,
)


def _dev(levels, share, rel):
    return {"max_levels": levels, "share": share, "latent_rel": rel}


def _result(kernels="eager", batch=None, kernel=None, fp32=None, **cases):
    """A gate result of ``cases``; diffusers' own deviations ``batch``, ``kernel`` and ``fp32`` default to 2, 3 and 7
    levels."""
    bounds = {"batch": _dev(2, 0.2, 0.0) if batch is None else batch,
              "kernel": _dev(3, 0.3, 1e-2) if kernel is None else kernel,
              "fp32": _dev(7, 0.6, 2e-2) if fp32 is None else fp32}
    return {"family": "x", "device": "cpu", "kernels": kernels, "bounds": bounds, "cases": cases}


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

    fp32, kernel = _dev(7, 0.6, 2e-3), _dev(3, 0.3, 1e-3)  # the larger, 2e-3, x 16 x margin 2: 6.4e-2
    assert FP8_SCALE == 16.0
    # pixels: not bounded
    assert check(_result(kernels="fp8", fp32=fp32, kernel=kernel, exact=_dev(120, 0.99, 6e-2))) == []
    bad = check(_result(kernels="fp8", fp32=fp32, kernel=kernel, exact=_dev(3, 0.1, 7e-2)))
    assert len(bad) == 1 and "fp8" in bad[0]
    # the kernel deviation scales the bound where it is the larger rounding: 4e-3 x 16 x 2 = 0.128
    kernel = _dev(3, 0.3, 4e-3)
    assert check(_result(kernels="fp8", fp32=fp32, kernel=kernel, exact=_dev(3, 0.1, 0.12))) == []
    assert len(check(_result(kernels="fp8", fp32=fp32, kernel=kernel, exact=_dev(3, 0.1, 0.13)))) == 1
    # and it is capped at FP8_RTOL (0.25, two float8 steps) after the margin: 2e-2 x 16 x 2 = 0.64 would come near
    # admitting another image (1.2-1.7 relative)
    assert FP8_LATENT_CAP * 2 == 0.25
    assert check(_result(kernels="fp8", exact=_dev(3, 0.1, 0.24))) == []
    assert len(check(_result(kernels="fp8", exact=_dev(3, 0.1, 0.26)))) == 1
    assert len(check(_result(kernels="fp8", fp32=_dev(9, 0.6, 0.04), exact=_dev(229, 0.99, 1.5)))) == 1
    a = np.zeros((2, 2, 3), np.uint8)
    b = a.copy()
    b[0, 0, 0] = 255  # one of 12 values off by 255: MSE 255² / 12, PSNR 10 log10(12)
    assert compare(b, a).psnr_db == round(10 * np.log10(12), 2) and compare(a, a).psnr_db is None


def test_an_fp32_image_that_is_another_image_bounds_nothing():
    # with torch 2.11 four families' bf16 latents were 1.2-1.7 relative from fp32 ones drawn from other noise
    other = _dev(229, 0.99, 1.6)
    assert fp32_is_rounding(_result()) and not fp32_is_rounding(_result(fp32=other))
    assert not fp32_is_rounding(_result(fp32=_dev(9, 0.6, FP32_ROUNDING_MAX * 1.01)))
    assert not fp32_is_rounding(_result(fp32=_dev(9, 0.6, 0.06)))  # twice the largest rounding measured, and more
    for kernels, case in (("compiled", _dev(14, 0.6, 0.5)), ("fp8", _dev(60, 0.9, 0.7))):
        assert check(_result(kernels=kernels, exact=case)) != []  # beyond 2 x fp32 (2e-2), and 16 x 2 x fp32
        assert check(_result(kernels=kernels, fp32=other, exact=case)) != []  # fp32 1.6 would have admitted it
    # the bound without fp32 is batch and kernel: compiled at 2 x (3 levels, 1e-2)
    assert check(_result(kernels="compiled", fp32=other, exact=_dev(6, 0.6, 2e-2))) == []
    assert len(check(_result(kernels="compiled", fp32=other, exact=_dev(7, 0.6, 2e-2)))) == 1


def test_diffusers_bf16_against_its_fp32_is_a_rounding_here(tmp_path):
    """``benchmarks/bf16_gate.py --dtypes``: diffusers' own bf16 PixArt-Sigma image against its fp32 one, each run
    drawing its own noise from the seed, is a rounding on this torch (latents within ``FP32_ROUNDING_MAX``; the
    noise the same numbers rounded to bf16). With torch 2.11 a CPU generator draws other noise in bf16, and the two
    were different pictures (docs/BENCHMARKS.md, 2026-12-04); the gate's fp32 run starts from the bf16 run's noise."""
    import importlib.util
    import json
    import logging
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bf16_gate.py"
    spec = importlib.util.spec_from_file_location("bf16_gate_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "dtypes.json"
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    levels = dlog.get_verbosity(), tlog.get_verbosity()
    try:
        assert script.main(["--dtypes", "--families", "pixart", "--out", str(out)]) == 0
    finally:  # the script quiets logging process-wide, as a command may
        logging.disable(logging.NOTSET)
        dlog.set_verbosity(levels[0]), tlog.set_verbosity(levels[1])
        dlog.enable_progress_bar(), tlog.enable_progress_bar()
    found = json.loads(out.read_text())
    assert found["env"]["transformers"] and found["env"]["device"] == "cpu"
    runs = found["dtypes"]["pixart"]
    assert runs["cpu fp32"]["latent_rel"] == 0.0 and runs["cpu fp32"]["max_levels"] == 0
    assert 0 < runs["cpu bf16"]["latent_rel"] <= FP32_ROUNDING_MAX, runs
    assert runs["cpu bf16 vs cpu fp32"] == runs["cpu bf16"]
    parts = runs["cpu components"]  # where bf16 and fp32 first part: each module's first output
    assert set(parts) == {"noise", "text_encoder", "transformer"}, parts
    assert all(0 < v <= FP32_ROUNDING_MAX for v in parts.values()), parts
    assert parts["noise"] <= 2**-8  # the same numbers drawn, rounded to bf16 (on torch 2.11 another draw: ~1.4)


@pytest.mark.parametrize("family,cases,per_case", [
    ("qwenimage", ("exact", "text_padded", "batched"), 3),
    ("flux", ("exact", "image_padded"), 3),
    ("flux2", ("exact", "image_padded"), 3),
    ("flux2-klein", ("exact", "batched"), 2),  # CFG rows beside another request's rows
    ("zimage", ("exact", "text_padded", "batched"), 2),
    ("qwenimage21", ("exact", "text_padded", "batched"), 3),
])
def test_bf16_padding_on_the_cpu_is_within_diffusers_own_deviations(family, cases, per_case, tmp_path):
    result = measure_family(family, cases=cases, per_case=per_case, folder=tmp_path)
    assert set(result["cases"]) == set(cases)
    padded = [r for r in result["requests"] if r["case"] in ("text_padded", "image_padded")]
    assert len(padded) == (per_case if {"text_padded", "image_padded"} & set(cases) else 0)
    if family in ("qwenimage", "zimage", "qwenimage21"):
        assert all((int(r["key"].split("_t")[1].split("_")[0]) - r["tokens"]) % 16 for r in padded)
    else:
        assert all("_m_" in r["key"] for r in padded)  # masked tiers
        assert result["bounds"]["batch"]["latent_rel"] == 0.0  # so the exact bucket must be bit-identical
    bad = check(result)
    assert not bad, "\n".join(bad + [f"bounds: {result['bounds']}", f"cases: {result['cases']}"])
