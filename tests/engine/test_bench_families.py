"""``benchmarks/bench_families.py`` on the CPU: the smoke mode of both subcommands, and the published-size tables.

``verify --device cpu --tiny`` must pass for every family in fp32 with static eager buffers (no CUDA here);
``bench --device cpu --tiny`` must run every case through the real family path (assembled pipeline ->
``save_pretrained`` -> ``model.path``), eager only, and write the JSON fields the GPU run fills in. The published
configs are checked on the meta device only (sizes and the stand-in text widths they imply, FLUX.2's and Z-Image's
stand-in LMs included).
"""

import inspect
import json

import diffusers
import pytest
import torch

from benchmark_scripts import load

bench = load("bench_families")

ENV_KEYS = {"date", "commit", "dirty", "torch", "cuda", "diffusers", "transformers", "device", "gpu"}
NO_CFG = {"flux-dev", "flux-dev-width", "flux2-dev-slice"}  # guidance embedding: one row per image
LM_LAYERS = {"flux2-klein-4b": 28, "flux2-dev-slice": 31, "zimage": 2}  # stand-in LM depth: out layers (9, 18, 27),
# (10, 20, 30) of the FLUX.2 pipelines; Z-Image's hidden_states[-2]


@pytest.fixture(scope="module")
def verify(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "verify.json"
    rc = bench.main(["verify", "--device", "cpu", "--tiny", "--out", str(out), "--scratch", str(out.parent)])
    return rc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    rc = bench.main(["bench", "--device", "cpu", "--tiny", "--repeats", "1", "--out", str(out),
                     "--scratch", str(out.parent)])
    return rc, json.loads(out.read_text()), out.parent


def test_verify_passes_every_family_in_static_eager_mode_on_the_cpu(verify):
    rc, data = verify
    assert rc == 0 and data["ok"] is True and data["subcommand"] == "verify" and data["tiny"] is True
    assert ENV_KEYS <= set(data["env"]) and data["env"]["device"] == "cpu" and data["env"]["gpu"] is None
    assert [r["family"] for r in data["families"]] == list(bench.VERIFY)  # flux dev+schnell, sd3, sd35, ...
    for r in data["families"]:
        assert r["dtype"] == "float32" and r["rtol"] == 1e-5
        assert r["buckets"] == r["checked"] == r["passed"] > 0 and r["failed"] == [] and r["unreached"] == []
        assert r["cases"] >= r["checked"] and 0 <= r["max_rel_err"] <= r["rtol"]
        assert r["modes"] == {"static_eager": r["buckets"]}


def test_bench_smoke_runs_every_case_at_an_exact_bucket_and_reports_the_fields(bench_run):
    rc, data, scratch = bench_run
    assert rc == 0 and data["subcommand"] == "bench" and data["tiny"] is True and data["dtype"] == "float32"
    assert ENV_KEYS <= set(data["env"]) and data["env"]["torch"] == torch.__version__
    assert "stand-in" in data["stand_ins"]
    assert [(r["case"], r["n"]) for r in data["cases"]] == [(c, n) for c in bench.CASES for n in (1, 4)]
    for r in data["cases"]:
        assert r["model"] == bench.CASES[r["case"]][0] and r["exact"] is True
        assert r["cfg"] is (r["model"] not in NO_CFG) and r["rows"] == r["n"] * (2 if r["cfg"] else 1)
        assert r["bucket"].startswith(f"b{r['rows']}_")
        eager = r["eager"]
        assert eager["wall_ms"] > 0 and len(eager["walls_ms"]) == 1
        assert {"encode_ms", "denoise_ms", "decode_ms", "total_ms"} <= set(eager)
        assert eager["decode_ms"] > 0 and eager["denoise_ms"] > 0
        # no CUDA: no graphs, no speedup, no kernel floor (the fields exist for the GPU run)
        assert r["bcg"] is None and r["speedup"] is None and r["floor_ms"] is None and r["bcg_over_floor"] is None
    assert list(scratch.glob("bcg-*")) == []  # every checkpoint folder is deleted


def test_bench_smoke_records_which_text_encoders_are_stand_ins(bench_run):
    _, data, _ = bench_run
    expect = {"pixart-sigma-512": ["T5EncoderModel"], "pixart-sigma-1024": ["T5EncoderModel"],
              "sd3-medium": ["CLIPTextModelWithProjection"] * 2 + ["T5EncoderModel"],
              "sana-1.6b-1024": ["Gemma2Model"], "flux-dev": ["CLIPTextModel", "T5EncoderModel"],
              "flux-dev-width": ["CLIPTextModel", "T5EncoderModel"], "flux2-klein-4b": ["Qwen3ForCausalLM"],
              "flux2-dev-slice": ["Mistral3ForConditionalGeneration"], "zimage": ["Qwen3Model"]}
    assert set(data["models"]) == set(expect)
    for name, info in data["models"].items():
        encoders = info["text_encoders"]
        assert [e["cls"] for e in encoders.values()] == expect[name], name
        assert all(e["stand_in"] and e["random_weights"] for e in encoders.values())
        assert all(e["layers"] == LM_LAYERS[name] if name in LM_LAYERS else e["layers"] <= 2 for e in encoders.values())
        assert info["load_s"] >= 0 and info["folder_gb"] >= 0


@pytest.mark.parametrize("name, params_b, widths", [
    ("pixart-sigma-512", 0.61, {"t5": 4096}),
    ("pixart-sigma-1024", 0.61, {"t5": 4096}),
    ("sd3-medium", 2.03, {"t5": 4096, "clip": (768, 1280)}),  # CLIP-L + CLIP-G
    ("sana-1.6b-1024", 1.60, {"gemma": 2304}),  # Gemma-2-2B
    ("flux-dev", 11.90, {"t5": 4096, "clip": (768,)}),
    ("flux2-klein-4b", 3.88, {"qwen3": 2560}),  # Qwen3-4B
    ("flux2-dev-slice", 8.67, {"mistral": 5120}),  # Mistral Small 3.1; 2 + 12 of the 8 + 48 blocks
    ("zimage", 6.15, {"qwen3": 2560}),
])
def test_published_configs_have_their_sizes_and_imply_the_real_text_widths(name, params_b, widths):
    spec = bench.bench_models(tiny=False)[name]
    _, tr_cls, vae_cls = (getattr(diffusers, c) for c in bench.CLASSES[spec.family])
    with torch.device("meta"):
        model = tr_cls(**spec.transformer)
        vae = vae_cls(**spec.vae)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == params_b
    assert bench.text_widths(spec.family, spec.transformer) == widths
    vae_m = sum(p.numel() for p in vae.parameters()) / 1e6
    assert 80 < vae_m < 90 if spec.family != "sana" else 300 < vae_m < 330  # KL VAEs ~84M, DC-AE f32c32 ~312M


def test_flux2_configs_are_the_published_ones_and_the_dev_slice_keeps_its_width():
    """[dev] 32.2B, [klein] 4B 3.9B (diffusers' conversion script); the slice: [dev]'s width, a quarter of its
    blocks."""
    cls = diffusers.Flux2Transformer2DModel
    with torch.device("meta"):
        full, klein = cls(**bench.FLUX2_DEV), cls(**bench.FLUX2_KLEIN_4B)
    assert round(sum(p.numel() for p in full.parameters()) / 1e9, 2) == 32.22
    assert round(sum(p.numel() for p in klein.parameters()) / 1e9, 2) == 3.88
    defaults = {k: v.default for k, v in inspect.signature(cls.__init__).parameters.items() if k in bench.FLUX2_DEV}
    assert defaults == bench.FLUX2_DEV  # diffusers' defaults are the published [dev] config
    sliced = bench.bench_models(tiny=False)["flux2-dev-slice"].transformer
    assert {k: v for k, v in sliced.items() if k not in ("num_layers", "num_single_layers")} == {
        k: v for k, v in bench.FLUX2_DEV.items() if k not in ("num_layers", "num_single_layers")}
    assert (sliced["num_layers"] * 4, sliced["num_single_layers"] * 4) == (8, 48)


@pytest.mark.parametrize("name", ["flux2-klein-4b", "flux2-dev-slice", "zimage"])
def test_the_stand_in_lms_have_the_published_class_and_width_and_the_layers_the_pipeline_reads(name):
    spec = bench.bench_models(tiny=False)[name]
    with torch.device("meta"):
        enc = bench._text_encoders(spec)
    model, width = enc["text_encoder"], next(iter(bench.text_widths(spec.family, spec.transformer).values()))
    index = {"flux2": "Mistral3ForConditionalGeneration", "flux2-klein": "Qwen3ForCausalLM", "zimage": "Qwen3Model"}
    assert type(model).__name__ == index[spec.family]
    assert bench._text_width(model) == width and bench._text_layers(model) == LM_LAYERS[name]
    assert enc["tokenizer"].chat_template  # the pipelines template their prompts


def test_a_family_that_raises_is_recorded_the_others_still_run_and_the_exit_status_is_1(tmp_path, monkeypatch):
    real = bench._verify_one

    def flaky(name, *args, **kwargs):
        if name == "sd3":
            raise RuntimeError("capture failed")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(bench, "_verify_one", flaky)
    out = tmp_path / "verify.json"
    rc = bench.main(["verify", "--device", "cpu", "--tiny", "--families", "sd3,flux-dev", "--out", str(out),
                     "--scratch", str(tmp_path)])
    data = json.loads(out.read_text())
    assert rc == 1 and data["ok"] is False
    assert data["errors"] == ["sd3/float32: RuntimeError: capture failed"]
    assert [(r["family"], r["passed"] == r["buckets"]) for r in data["families"]] == [("flux-dev", True)]
