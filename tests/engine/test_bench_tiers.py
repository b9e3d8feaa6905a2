"""``benchmarks/bench_tiers.py`` on the CPU: the smoke mode (``--tiny``, fp32, 2 steps) for FLUX.2 [klein], the FLUX.2
[dev] slice and Z-Image, diffusers' eager pipeline against bcg-serve's eager kernels (no CUDA: no graphs, no compile,
no fp8), through the real path (assembled pipeline -> ``save_pretrained`` -> both sides load the folder).

The compute accounting must see each side's forwards as it runs them: FLUX.2 [klein]'s CFG as two diffusers forwards
per step against one of two rows in bcg-serve; Z-Image's per-row list forward in diffusers and bcg-serve's fixed-shape
forward, which never calls the transformer's ``forward`` and is counted on its bucket buffers.
"""

import json

import pytest

from benchmark_scripts import load

tiers = load("bench_tiers")

CASES = ("flux2-klein-1024", "flux2-dev-slice-1024", "zimage-1024")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiers") / "tiers.json"
    rc = tiers.main(["--device", "cpu", "--tiny", "--repeats", "1", "--modes", "diffusers,bcg-eager",
                     "--cases", ",".join(CASES), "--scratch", str(out.parent), "--out", str(out)])
    return rc, json.loads(out.read_text()), out.parent


def test_every_new_case_runs_both_sides_and_reports_the_served_comparison(run):
    rc, data, scratch = run
    assert rc == 0 and data["dtype"] == "float32" and data["gpu"] is None
    assert [c["case"] for c in data["cases"]] == list(CASES)
    for c in data["cases"]:
        assert c["steps"] == 2 and c["size"] == "64x64" and c["n"] == 1
        assert set(c["modes"]) == {"diffusers", "bcg-eager"}
        for mode, r in c["modes"].items():
            assert r["wall_ms"] > 0 and len(r["walls_ms"]) == 1 and r["served_ms"] >= r["wall_ms"], (c["case"], mode)
            assert r["image_encode_ms"] > 0 and r["forward_tflop"] > 0
        assert c["modes"]["diffusers"]["vs_diffusers"] == 1.0
        assert c["modes"]["bcg-eager"]["denoise_ms"] > 0  # bcg-serve's split
        assert c["built"]["params_b"] >= 0 and c["built"]["text_encoders"] and c["peak_gpu_gb"] is None  # no CUDA
    assert list(scratch.glob("bcg-tiers-*")) == []  # every checkpoint folder is deleted


def test_the_compute_counts_each_sides_own_forwards(run):
    _, data, _ = run
    compute = {c["case"]: c["compute"] for c in data["cases"]}
    klein, dev, zimage = (compute[c] for c in CASES)
    # [klein], guidance 4.0, not distilled: diffusers a cond and an uncond forward per step, bcg-serve one of 2 rows
    assert (klein["diffusers"]["per_step"], klein["diffusers"]["rows"]) == (2, 1)
    assert (klein["bcg"]["per_step"], klein["bcg"]["rows"]) == (1, 2)
    assert klein["bcg"]["forward_tflop"] == pytest.approx(2 * klein["diffusers"]["forward_tflop"], rel=1e-6)
    assert klein["diffusers"]["forwards"] == 4 and klein["bcg"]["forwards"] == 2
    # [dev]: guidance embedding, one row, the native 512 text tokens on both sides
    for side in dev.values():
        assert (side["per_step"], side["rows"], side["text_tokens"]) == (1, 1, 512)
    assert dev["bcg"]["forward_tflop"] == dev["diffusers"]["forward_tflop"]
    # Z-Image: 2 CFG rows on both sides; diffusers' caption list holds the real tokens, bcg-serve's buffer the 32
    # caption slots the transformer rounds them to, so the counted work is the same
    assert (zimage["diffusers"]["rows"], zimage["bcg"]["rows"]) == (2, 2)
    assert zimage["diffusers"]["text_tokens"] < zimage["bcg"]["text_tokens"] == 32
    assert zimage["bcg"]["forward_tflop"] == pytest.approx(zimage["diffusers"]["forward_tflop"], rel=1e-6)
    assert zimage["diffusers"]["latents"][:2] == zimage["bcg"]["latents"][:2] == [2, 16]
