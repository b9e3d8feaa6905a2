"""``benchmarks/pixel_moves.py``'s summary: the maxima the docs quote are taken over every comparison of a sweep."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pixel_moves  # noqa: E402


def _dev(levels: int, share: float, rel: float | None, psnr: float | None = None) -> dict:
    return {"max_levels": levels, "share": share, "latent_rel": rel, "psnr_db": psnr}


def test_summary_takes_each_maximum_over_the_sweep_per_model_and_placement():
    company = [
        {"model": "m", "forwards": "decider", "composition": "n=2", **_dev(1, 0.0018, 4e-7, 75.6)},
        {"model": "m", "forwards": "decider", "composition": "join n=1 head=1", **_dev(1, 0.00004, 5e-7, 90.0)},
        {"model": "m", "forwards": "decider", "composition": "n=2", **_dev(0, 0.0, 1e-7)},
        {"model": "m", "forwards": "buckets", "composition": "n=2", **_dev(0, 0.0, 0.0)},
    ]
    masked = [
        {"size": "112x96", "bcg": _dev(0, 0.0, 0.0), "kernel": _dev(3, 0.31, 6e-3, 52.0)},
        {"size": "52x44", "bcg": _dev(3, 0.28, 3e-3, 53.2), "kernel": _dev(2, 0.32, 6e-3, 52.4)},
    ]
    out = pixel_moves.summary({"company": company, "masked": masked})
    decider = out["company m decider"]
    assert (decider["max_levels"], decider["share"], decider["latent_rel"]) == (1, 0.0018, 5e-7)
    assert decider["psnr_db"] == 75.6 and decider["comparisons"] == 3 and decider["moved"] == 2
    assert decider["share by composition"] == {"n=2": 0.0018, "join n=1 head=1": 0.00004}
    assert out["company m buckets"]["moved"] == 0
    assert (out["masked bcg"]["max_levels"], out["masked bcg"]["moved"]) == (3, 1)
    assert out["masked bcg"]["sizes moved"] == ["52x44"]
    assert out["masked diffusers kernel"]["share"] == 0.32
    assert out["masked bcg / kernel, levels"] == 1.5  # 3 levels against that request's own 2
    assert out["masked bcg / kernel, latents"] == 0.5
