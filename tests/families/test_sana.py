"""SANA family against ``SanaPipeline`` itself (the reference gate, fp32 on CPU), and its bucket adapter.

A tiny random-weight SANA (``tests/tiny/sana.py``: Gemma2 text encoder, ``GemmaTokenizer``, a 32x DC-AE,
``sample_size`` 16 -> ``ASPECT_RATIO_512_BIN``) is served through :class:`~bcg_core.DiTPipeline` and compared
with diffusers on the same folder, request and generators: final latents within 1e-5 relative, and byte-equal
PNGs where the latents are bit-identical. Cases: an exact bin size at an exact text bucket; rows and text
padded up at a size generated at its aspect-ratio bin and resized back; a request joining another that started
steps earlier; learned sigma + sin-cos positions + flow-match Euler, and SDE-DPM-Solver (noise drawn in each
step from the request's generators). Plus the validation rules (token counts with the complex human
instruction, the bin table, refused options and checkpoints) and, on a bare ``SanaTransformer2DModel``, the
bucket gates of docs/DESIGN.md section 4 (every bucket at its boundary shapes, pad-value invariance, stale data).

On this CPU, fp32 cross-attention over a text length that is a multiple of 16 gives bit-identical outputs
whatever the masked padding behind it (diffusers always feeds 300 tokens, mostly masked); other lengths differ
by ~2e-7. The exact case therefore uses a 16-token prompt in a 16-token bucket.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import SanaPipeline, SanaTransformer2DModel
from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_512_BIN

from bcg_core import (
    BucketConfig,
    BucketMetrics,
    BucketTable,
    DenoiseInputs,
    Dim,
    EagerBucketRunner,
    GenerationRequest,
    LimitsConfig,
    RequestError,
    ShapeQuery,
)
from bcg_core.families import family_class
from bcg_core.families.sana import (
    SANA_MAX_TEXT_TOKENS,
    SanaAdapter,
    SanaFamily,
    complex_human_instruction,
    sana_bins,
)
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases
from closeness import RTOL, assert_close, rel_err
from reference_gate import assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run
from tiny.sana import build

BUCKETS = {"batch_sizes": [1, 2, 4, 8], "resolutions": ["512x512", "608x416", "416x608"], "text_lengths": [8, 16, 32]}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sana")
    return {
        "sana": build(root / "tiny-sana"),
        "variant": build(root / "tiny-sana-euler", learned_sigma=True, pos_embed=True, scheduler="euler", seed=1),
        "sde": build(root / "tiny-sana-sde", scheduler="sde", seed=2),
    }


@pytest.fixture(scope="module")
def folder(folders) -> Path:
    return folders["sana"]


@pytest.fixture(scope="module")
def pipe(folder):
    return bcg_pipeline(folder, BUCKETS)


def _ref(folder, request):
    return diffusers_run(SanaPipeline, folder, request)


def _encoded_counts(pipe, prompt: str) -> tuple[int, int]:
    """Real tokens of ``prompt`` as ``SanaPipeline.__call__`` encodes it, as prompt and as negative prompt."""
    _, pm, _, nm = pipe.model.pipe.encode_prompt(prompt, True, negative_prompt=prompt, device=CPU, clean_caption=False,
                                                 max_sequence_length=300,
                                                 complex_human_instruction=complex_human_instruction())
    return int(pm.sum()), int(nm.sum())


# -- the reference gate -------------------------------------------------------------------------------


def test_the_family_loads_from_the_registry_with_grid_keys_and_masked_text(pipe):
    assert family_class("SanaPipeline") is SanaFamily
    fam = pipe.model
    assert isinstance(fam, SanaFamily) and fam.name == "sana"
    assert fam.rules.grid_keyed and fam.rules.native_text_tokens is None and fam.rules.pixels_per_token == 32
    assert fam.spec.size_bins == {k: list(v) for k, v in ASPECT_RATIO_512_BIN.items()}


def test_an_exact_bin_size_at_an_exact_text_bucket_equals_diffusers_bit_for_bit(pipe, folder):
    prompt = "A Watercolor painting of a lighthouse at dusk"
    assert pipe.model.count_tokens(prompt) == 16  # exactly the text bucket (bos + instruction tail + prompt)
    req = GenerationRequest(prompt=prompt, n=1, width=512, height=512, num_inference_steps=3, guidance_scale=4.5,
                            seed=1)
    assert str(pipe.validator.validate(req).lookup.key) == "b2_i256_t16_g16x16"  # [uncond, cond]: nothing padded
    assert_same(bcg_run(pipe, req), _ref(folder, req), exact=True)


def test_padded_rows_and_text_at_a_binned_size_equal_diffusers(pipe, folder):
    # 300x200 is generated at the 0.68 bin (608x416) and resized back; 3 images x [uncond, cond] = 6 rows in the
    # batch-8 bucket; prompt (12 tokens) and negative prompt (5) below the 16-token text bucket.
    req = GenerationRequest(prompt="portrait of an old man, studio lighting, 85mm", n=3, width=300, height=200,
                            num_inference_steps=4, guidance_scale=4.5, negative_prompt="blurry", seed=7)
    assert pipe.model.spec.generation_size(300, 200) == (608, 416)
    key = pipe.validator.validate(req).lookup.key
    assert (key.batch, key.latent_hw, key.text_tokens) == (8, (13, 19), 16)
    ours = bcg_run(pipe, req)
    assert len(ours.pngs) == 3
    assert_same(ours, _ref(folder, req))


def test_a_prompt_longer_than_the_largest_text_bucket_is_a_text_miss_that_equals_diffusers(pipe, folder):
    # miss_policy eager (the default): above the 32-token bucket, served unpadded on eager kernels
    req = GenerationRequest(prompt=", ".join(["a lighthouse on a cliff at dusk"] * 6), n=1, width=512, height=512,
                            num_inference_steps=2, guidance_scale=4.5, seed=2)
    assert pipe.model.count_tokens(req.prompt) > 32
    validated = pipe.validator.validate(req)
    assert not validated.lookup.hit and Dim.TEXT in validated.lookup.missed
    assert_same(bcg_run(pipe, req), _ref(folder, req))


def test_a_request_joining_one_that_started_earlier_equals_diffusers_for_both(pipe, folder):
    # Both at the 1.46 bin (416x608 pixels, grid 19x13): A with CFG and 2 images, B without CFG, 2 steps ahead;
    # their 4 + 2 rows share one forward (bucket 8) at different timesteps and DPM-Solver orders.
    a = GenerationRequest(prompt="portrait of an old man, studio lighting, 85mm", n=2, width=416, height=608,
                          num_inference_steps=4, guidance_scale=3.0, seed=11)
    b = GenerationRequest(prompt="an astronaut riding a horse", n=2, width=400, height=600, num_inference_steps=5,
                          guidance_scale=1.0, seed=5)
    assert pipe.model.spec.generation_size(400, 600) == (416, 608)
    ours_a, ours_b = bcg_run_joined(pipe, a, b, head_start=2)
    assert_same(ours_a, _ref(folder, a))
    assert_same(ours_b, _ref(folder, b))


@pytest.mark.parametrize("variant", ["variant", "sde"])
def test_learned_sigma_positions_euler_and_sde_steps_equal_diffusers(folders, variant):
    # "variant": 64 output channels (the first 32 kept after CFG), sin-cos positions recomputed for the grid,
    # FlowMatchEulerDiscreteScheduler (float timesteps). "sde": SDE-DPM-Solver++ draws noise in every step from
    # the generators that drew the latents (prepare_extra_step_kwargs passes them on).
    folder = folders[variant]
    pipe = bcg_pipeline(folder, BUCKETS)
    req = GenerationRequest(prompt="a photo of a cat sitting on a red chair", n=2, width=512, height=512,
                            num_inference_steps=3, guidance_scale=4.5, negative_prompt="blurry, low quality",
                            seed=3)
    assert_same(bcg_run(pipe, req), _ref(folder, req))


def test_dpm_timesteps_are_truncated_integers_and_reach_the_transformer_as_fp32(pipe):
    req = GenerationRequest(prompt="a red chair", n=1, width=512, height=512, num_inference_steps=4,
                            guidance_scale=1.0, seed=0)
    state = pipe.start(pipe.validator.validate(req))
    assert state.timesteps.dtype == torch.int64 and state.timesteps[0].item() == 999
    rows = pipe.model.model_rows(state)
    assert rows.timestep.dtype == torch.float32 and rows.timestep.tolist() == [999.0]
    assert state.latents.dtype == torch.float32 and state.latents.shape == (1, 32, 16, 16)


# -- validation rules ---------------------------------------------------------------------------------


def test_token_counts_are_what_encode_prompt_keeps_with_the_instruction_and_without_it(pipe, folder):
    index = json.loads((folder / "model_index.json").read_text())
    ingress = SanaFamily.token_counter(folder, index)
    long = " ".join(["a watercolor painting of a lighthouse"] * 80)
    counts = {}
    for prompt in ["a photo of a cat", "  A PHOTO OF A CAT  ", "blurry", "blurry, low quality, watermark, text", "",
                   long]:
        as_prompt, as_negative = _encoded_counts(pipe, prompt)
        assert pipe.model.count_tokens(prompt) == ingress(prompt) == as_prompt
        assert pipe.model.count_tokens(prompt, negative=True) == ingress(prompt, negative=True) == as_negative
        counts[prompt] = (as_prompt, as_negative)
    assert ingress("  A PHOTO OF A CAT  ") == ingress("a photo of a cat")  # lower().strip(), as the pipeline
    assert counts[""] == (2, 1)  # bos + the instruction's last token; the empty negative prompt is bos only
    assert counts["blurry"] == (4, 5)  # the instruction's trailing space merges into the prompt's first word
    assert counts[long] == (SANA_MAX_TEXT_TOKENS, SANA_MAX_TEXT_TOKENS)  # [0] + last 299 / first 300


def test_the_text_key_holds_a_negative_prompt_longer_than_the_prompt(pipe):
    # "blurry" is 5 tokens as a negative prompt and 4 as a prompt (the instruction changes its tokenization).
    req = GenerationRequest(prompt="a cat", n=1, width=512, height=512, num_inference_steps=1, guidance_scale=4.5,
                            negative_prompt="blurry", seed=0)
    assert pipe.model.count_tokens("a cat") <= 4
    assert pipe.validator.validate(req).lookup.query.text_tokens == 5


def test_generation_size_is_the_nearest_aspect_ratio_bin_of_the_sample_size(pipe):
    assert sana_bins(16) == {k: list(v) for k, v in ASPECT_RATIO_512_BIN.items()}
    fam = pipe.model
    assert fam.spec.generation_size(512, 512) == (512, 512)
    assert fam.spec.generation_size(64, 64) == (512, 512)  # the bin, whatever the requested scale
    assert fam.spec.generation_size(1024, 256) == (1024, 256)  # ratio 0.25: [256, 1024] (height, width)
    for h, w in ASPECT_RATIO_512_BIN.values():
        assert h % 32 == 0 and w % 32 == 0
    with pytest.raises(ValueError, match="Invalid sample size"):
        sana_bins(48)


def test_a_small_request_is_generated_at_its_bin_and_resized_back_as_diffusers(pipe, folder):
    req = GenerationRequest(prompt="a red chair", n=1, width=96, height=64, num_inference_steps=2, guidance_scale=1.0,
                            seed=4)
    ours = bcg_run(pipe, req)
    assert ours.latents.shape == (1, 32, 13, 19)  # the 0.68 bin, 608x416
    assert_same(ours, _ref(folder, req))


def test_true_cfg_scale_is_refused_with_its_field(pipe):
    req = GenerationRequest(prompt="a cat", width=512, height=512, num_inference_steps=2, guidance_scale=4.5, seed=0,
                            true_cfg_scale=4.0)
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(req)
    assert e.value.field == "true_cfg_scale"
    with pytest.raises(RequestError) as e:
        pipe.model.spec.check(req)
    assert e.value.field == "true_cfg_scale"


def _configs_only(folder: Path, dest: Path, sub: str, **overrides) -> Path:
    """A copy of ``folder``'s JSON configs (what ``describe`` reads) with overrides in ``sub``/config."""
    for part in ("transformer", "vae", "scheduler"):
        (dest / part).mkdir(parents=True)
        name = "scheduler_config.json" if part == "scheduler" else "config.json"
        shutil.copy(folder / part / name, dest / part / name)
    path = dest / sub / ("scheduler_config.json" if sub == "scheduler" else "config.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **overrides}))
    return dest


@pytest.mark.parametrize("sub, overrides, match", [
    ("transformer", {"guidance_embeds": True}, "SANA-Sprint"),
    ("transformer", {"sample_size": 48}, "sample_size 48"),
    ("scheduler", {"use_dynamic_shifting": True}, "use_dynamic_shifting"),
])
def test_checkpoints_sanapipeline_cannot_run_are_refused(folder, tmp_path, sub, overrides, match):
    index = {"_class_name": "SanaPipeline"}
    with pytest.raises(ValueError, match=match):
        SanaFamily.describe(_configs_only(folder, tmp_path / "ckpt", sub, **overrides), index)
    spec = SanaFamily.describe(folder, index)
    assert spec.cfg_rule == "guidance_scale" and spec.default_true_cfg_scale is None


# -- the bucket adapter on a bare transformer (docs/DESIGN.md section 4) --------------------------------------


@pytest.fixture(scope="module")
def adapter():
    torch.manual_seed(0)
    model = SanaTransformer2DModel(
        in_channels=32, out_channels=32, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=24,
        sample_size=16, patch_size=1, interpolation_scale=1,
    ).eval()
    return SanaAdapter(model)


@pytest.fixture(scope="module")
def table(adapter):
    cfg = BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "512x768"], text_lengths=[32, 128])
    return BucketTable(cfg, adapter.rules)


@pytest.fixture(scope="module")
def runner(adapter, table):
    r = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    r.prepare()
    return r


def _inputs(adapter: SanaAdapter, rows: int, grid: tuple[int, int], text: int, seed: int = 0) -> DenoiseInputs:
    g = torch.Generator().manual_seed(seed)
    return DenoiseInputs(
        latents=adapter.example_latents(rows, grid, g), text=torch.randn(rows, text, adapter.seq_dim, generator=g),
        pooled=torch.zeros(rows, 0), timestep=torch.randint(0, 1000, (rows,), generator=g).float(), grid=grid,
    )


def _key(table: BucketTable, rows: int, grid: tuple[int, int], text: int):
    return table.lookup(ShapeQuery(rows, grid[0] * grid[1], text, grid)).key


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(adapter, table, runner):
    cases = boundary_cases(table, LimitsConfig())
    assert {c.key for c in cases} == set(table.keys)
    assert {c.text_tokens for c in cases} == {1, 31, 32, 33, 127, 128}
    verdicts = verify_runner(adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert [v.key for v in verdicts] == table.keys
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_text_padded_77_to_128_with_the_mask_equals_unpadded_and_without_it_does_not(adapter, table):
    x = _inputs(adapter, 1, (8, 8), text=77, seed=4)
    key = _key(table, 1, (8, 8), 77)
    assert key.text_tokens == 128
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        ref = adapter.forward_eager(x)
        adapter.fill(buf, x)
        assert buf["text_mask"].sum().item() == 77
        assert_close(adapter.unpad(adapter.forward(buf), x), ref)
        buf["text"][:, 77:] = torch.randn(1, 51, adapter.seq_dim, generator=torch.Generator().manual_seed(1))
        buf["text_mask"].fill_(True)
        assert rel_err(adapter.unpad(adapter.forward(buf), x), ref) > 1e-3


def test_the_forward_depends_on_the_grid_so_grids_of_equal_tokens_are_different_keys(adapter, table):
    # The same 384 tokens as a 16x24 and a 24x16 image: GLUMBConv's 3x3 conv sees other neighbours.
    x = _inputs(adapter, 1, (24, 16), text=20, seed=5)
    flat = x.latents.flatten(2)
    y = DenoiseInputs(flat.unflatten(2, (16, 24)), x.text, x.pooled, x.timestep, (16, 24))
    with torch.inference_mode():
        a = adapter.forward_eager(x).flatten(2)
        b = adapter.forward_eager(y).flatten(2)
    assert rel_err(a, b) > 1e-2
    assert table.lookup(ShapeQuery(1, 384, 20, (16, 24))).key is None  # 768x512 is not a served grid
    assert _key(table, 1, (24, 16), 20).latent_hw == (24, 16)


def test_prompts_of_different_lengths_in_one_batch_equal_each_prompt_alone_unpadded(adapter, table, runner):
    grid, lengths = (8, 8), [20, 77, 50]
    batch = _inputs(adapter, 3, grid, text=77, seed=9)
    batch.text_mask = torch.arange(77)[None, :] < torch.tensor(lengths)[:, None]
    together = runner.run(_key(table, 3, grid, 77), batch)
    for i, n in enumerate(lengths):
        row = batch.select([i])
        alone = DenoiseInputs(row.latents, row.text[:, :n], row.pooled, row.timestep, grid)
        with torch.inference_mode():
            assert_close(together[i : i + 1], adapter.forward_eager(alone))


def test_garbage_in_pad_rows_and_pad_text_tokens_changes_nothing(adapter, table):
    grid = (8, 8)
    x = _inputs(adapter, 3, grid, text=40, seed=3)
    key = _key(table, 3, grid, 40)
    assert (key.batch, key.text_tokens) == (4, 128)
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        clean = adapter.unpad(adapter.forward(buf), x).clone()
        g = torch.Generator().manual_seed(99)
        buf["text"][:, 40:] = 1e4 * torch.randn(buf["text"][:, 40:].shape, generator=g)
        for name in ("latents", "text", "timestep"):
            buf[name][3:] = 1e3 * torch.randn(buf[name][3:].shape, generator=g)
        dirty = adapter.unpad(adapter.forward(buf), x)
    assert_close(dirty, clean)


def test_stale_data_from_a_larger_request_does_not_leak(adapter, table, runner):
    grid = (8, 8)
    key = _key(table, 4, grid, 128)
    runner.run(key, _inputs(adapter, 4, grid, text=128, seed=11))
    small = _inputs(adapter, 3, grid, text=40, seed=12)
    after_big = runner.run(key, small)
    fresh = EagerBucketRunner(adapter, [key], runner.metrics, CPU, torch.float32)
    fresh.prepare()
    assert_close(after_big, fresh.run(key, small))


def test_inputs_that_do_not_fit_and_buckets_beyond_300_tokens_are_refused(adapter, table, runner):
    key = _key(table, 1, (24, 16), 32)
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 2, (24, 16), text=32))
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 1, (24, 16), text=33))
    big = BucketTable(BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[512]), adapter.rules)
    with pytest.raises(ValueError, match="300"):
        adapter.allocate(big.keys[0], CPU, torch.float32)
