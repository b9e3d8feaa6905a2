"""PixArt-Sigma family against ``PixArtSigmaPipeline`` itself (the reference gate, fp32 on CPU), and its
bucket adapter.

A tiny random-weight PixArt-Sigma (``tests/tiny/pixart.py``, ``sample_size`` 32 -> ``ASPECT_RATIO_256_BIN``)
is served through :class:`~bcg_core.DiTPipeline` and compared with diffusers on the same folder, request and
generators: final latents within 1e-5 relative and byte-equal PNGs. Cases: an exact bin size at an exact text
bucket; rows and text padded up to a bucket at a size that is generated at its aspect-ratio bin and resized
back; a request joining another that started steps earlier (one forward per step, each at its own step).
Plus the validation rules: token counts after the pipeline's caption preprocessing, the bin table, and the
refused options.

Text buckets here are multiples of 16: on an AVX-512 CPU the masked cross-attention over 8 (or 24 with more than
16 real) keys takes a tail path whose sums differ from diffusers' 300-key run in the last bit (~5e-7), which
can flip a pixel of the PNG; with whole 16-key chunks the padded forward is bit-identical to diffusers'.

The bucket adapter on a bare tiny ``PixArtTransformer2DModel`` (two blocks, two heads, fp32 on CPU), as
diffusers' own ``tests/models/transformers/test_models_transformer_pixart.py``: keyed on the latent grid, text
rounded up to a bucket and masked, pad rows from row 0. Every bucket's padded forward (text padded with masked
zeros) must equal the unpadded eager forward at its boundary shapes; a row alone must equal the same row in a
batch; garbage in pad rows and pad text tokens changes nothing. The mask is what makes text buckets valid: 77
tokens padded to 128 with it equal the unpadded run, without it they do not.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import PixArtSigmaPipeline, PixArtTransformer2DModel
from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_256_BIN
from PIL import Image

from bcg_core import (
    BucketConfig,
    BucketMetrics,
    BucketMissError,
    BucketTable,
    DenoiseInputs,
    Dim,
    EagerBucketRunner,
    GenerationRequest,
    LimitsConfig,
    ModelSpec,
    PixArtAdapter,
    RequestError,
    RequestValidator,
    ShapeQuery,
    ShapeRules,
)
from bcg_core.families import family_class
from bcg_core.families.pixart import PIXART_SIGMA_MAX_TEXT_TOKENS, PixArtSigmaFamily, aspect_ratio_bins
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases
from closeness import RTOL, assert_close, rel_err
from reference_gate import assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run
from tiny.pixart import build

BUCKETS = {"batch_sizes": [1, 2, 4, 8], "resolutions": ["256x256", "304x208", "208x304"], "text_lengths": [16, 32, 64]}
PROMPT = "a photo of a cat sitting on a red chair"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("pixart") / "tiny-pixart-sigma")


@pytest.fixture(scope="module")
def pipe(folder):
    return bcg_pipeline(folder, BUCKETS)


def _tokens(pipe, prompt: str) -> int:
    return pipe.model.count_tokens(prompt)


def _encode_prompt_mask(pipe, prompt: str) -> int:
    """Real tokens of ``prompt`` as ``PixArtSigmaPipeline.__call__`` encodes it (the mask's count)."""
    _, mask, _, _ = pipe.model.pipe.encode_prompt(prompt, False, clean_caption=True, max_sequence_length=300,
                                                  device=torch.device("cpu"))
    return int(mask.sum())


def test_the_family_loads_from_the_registry_with_grid_keys_and_masked_text(pipe, folder):
    assert family_class("PixArtSigmaPipeline") is PixArtSigmaFamily
    fam = pipe.model
    assert isinstance(fam, PixArtSigmaFamily) and fam.name == "pixart"
    assert fam.rules.grid_keyed and fam.rules.native_text_tokens is None and fam.rules.pixels_per_token == 16
    assert fam.spec.size_bins == {k: list(v) for k, v in ASPECT_RATIO_256_BIN.items()}


def test_an_exact_bin_size_at_an_exact_text_bucket_equals_diffusers(pipe, folder):
    prompt = "a photo of a red cat on a chair."
    assert _tokens(pipe, prompt) == 16  # exactly the text bucket
    req = GenerationRequest(prompt=prompt, n=1, width=256, height=256, num_inference_steps=3, guidance_scale=4.5,
                            seed=1)
    validated = pipe.validator.validate(req)
    assert str(validated.lookup.key) == "b2_i256_t16_g16x16"  # [uncond, cond] rows, exact: nothing padded
    assert_same(bcg_run(pipe, req), diffusers_run(PixArtSigmaPipeline, folder, req))


def test_padded_rows_and_text_at_a_binned_size_equal_diffusers(pipe, folder):
    # 300x200 is generated at the 0.68 bin (304x208) and resized back; 3 images x [uncond, cond] = 6 rows in
    # the batch-8 bucket; prompt and negative prompt of different lengths, below the text bucket.
    req = GenerationRequest(prompt="A Watercolor painting of a lighthouse at dusk", n=3, width=300, height=200,
                            num_inference_steps=4, guidance_scale=4.5, negative_prompt="blurry", seed=7)
    assert pipe.model.spec.generation_size(300, 200) == (304, 208)
    key = pipe.validator.validate(req).lookup.key
    # the ingress: configs and tokenizer only
    assert RequestValidator.from_config(pipe.config).validate(req).lookup.key == key
    assert key.batch == 8 and key.latent_hw == (13, 19)
    assert max(_tokens(pipe, req.prompt), _tokens(pipe, "blurry")) < key.text_tokens
    ours = bcg_run(pipe, req)
    assert len(ours.pngs) == 3
    assert_same(ours, diffusers_run(PixArtSigmaPipeline, folder, req))


def test_a_request_joining_one_that_started_earlier_equals_diffusers_for_both(pipe, folder):
    # Both at the 1.46 bin (208x304 pixels, grid 19x13): A with CFG and 2 images, B without CFG and 2 images,
    # 2 steps ahead; A's and B's rows (4 + 2, bucket 8) share one forward at different timesteps.
    a = GenerationRequest(prompt="portrait of an old man, studio lighting, 85mm", n=2, width=208, height=304,
                          num_inference_steps=4, guidance_scale=3.0, seed=11)
    b = GenerationRequest(prompt="an astronaut riding a horse", n=2, width=200, height=300, num_inference_steps=5,
                          guidance_scale=1.0, seed=5)
    assert pipe.model.spec.generation_size(200, 300) == (208, 304)
    ours_a, ours_b = bcg_run_joined(pipe, a, b, head_start=2)
    assert_same(ours_a, diffusers_run(PixArtSigmaPipeline, folder, a))
    assert_same(ours_b, diffusers_run(PixArtSigmaPipeline, folder, b))


def test_a_one_row_request_inside_a_batch_matches_diffusers_latents_within_tolerance(pipe, folder):
    # A request of one row (n=1, no CFG) that diffusers runs at batch 1. On CPU the patch embedding's Conv2d
    # takes another oneDNN path at batch 1 than at batch >= 2 (row 0 differs by ~5e-7), so inside a bigger
    # forward its latents equal diffusers' only within the tolerance, and a few pixels of its PNG may round
    # to the next level. Alone (bucket b1) it is bit-identical.
    a = GenerationRequest(prompt="portrait of an old man", n=2, width=208, height=304, num_inference_steps=3,
                          guidance_scale=3.0, seed=11)
    b = GenerationRequest(prompt="an astronaut riding a horse", n=1, width=200, height=300, num_inference_steps=4,
                          guidance_scale=1.0, seed=5)
    ref_b = diffusers_run(PixArtSigmaPipeline, folder, b)
    _, joined_b = bcg_run_joined(pipe, a, b, head_start=1)
    err = ((joined_b.latents - ref_b.latents).abs().max() / ref_b.latents.abs().max()).item()
    assert err < RTOL
    ours, ref = (np.asarray(Image.open(io.BytesIO(x.pngs[0])), dtype=np.int16) for x in (joined_b, ref_b))
    assert ours.shape == ref.shape == (300, 200, 3) and np.abs(ours - ref).max() <= 1
    assert_same(bcg_run(pipe, b), ref_b)


def test_token_counts_are_what_encode_prompt_keeps_after_caption_preprocessing(pipe, folder):
    index = json.loads((folder / "model_index.json").read_text())
    ingress = PixArtSigmaFamily.token_counter(folder, index)
    long = " ".join(["a watercolor painting of a lighthouse"] * 80)
    for prompt in ["a photo of a cat", "  A PHOTO OF A CAT  ", "blurry, low quality, watermark, text", "", long]:
        kept = _encode_prompt_mask(pipe, prompt)
        assert pipe.model.count_tokens(prompt) == ingress(prompt) == kept
    # The pipeline lower-cases and strips (clean_caption falls back to it without bs4/ftfy), so do we.
    assert ingress("  A PHOTO OF A CAT  ") == ingress("a photo of a cat")
    assert ingress(long) == PIXART_SIGMA_MAX_TEXT_TOKENS  # truncated at 300 as encode_prompt truncates


def test_generation_size_is_the_nearest_aspect_ratio_bin_of_the_sample_size():
    assert aspect_ratio_bins(32) is ASPECT_RATIO_256_BIN
    spec_bins = {k: list(v) for k, v in ASPECT_RATIO_256_BIN.items()}
    spec = ModelSpec("m", "pixart", "PixArtSigmaPipeline", ShapeRules(16, True, None), size_bins=spec_bins)
    assert spec.generation_size(256, 256) == (256, 256)
    assert spec.generation_size(512, 128) == (512, 128)  # ratio 0.25: [128, 512] (height, width)
    assert spec.generation_size(1000, 1000) == (256, 256)  # the bin, whatever the requested scale
    for h, w in ASPECT_RATIO_256_BIN.values():
        assert h % 16 == 0 and w % 16 == 0
    with pytest.raises(ValueError, match="Invalid sample size"):
        aspect_ratio_bins(48)


def test_true_cfg_scale_is_refused_with_its_field(pipe):
    req = GenerationRequest(prompt=PROMPT, width=256, height=256, num_inference_steps=2, guidance_scale=4.5,
                            seed=0, true_cfg_scale=4.0)
    with pytest.raises(RequestError) as e:
        pipe.validator.validate(req)
    assert e.value.field == "true_cfg_scale"
    with pytest.raises(RequestError) as e:
        pipe.model.spec.check(req)
    assert e.value.field == "true_cfg_scale"


def _configs_only(folder: Path, dest: Path, **transformer) -> Path:
    """A copy of ``folder``'s JSON configs (what ``describe`` reads) with transformer config overrides."""
    for sub in ("transformer", "vae"):
        (dest / sub).mkdir(parents=True)
        shutil.copy(folder / sub / "config.json", dest / sub / "config.json")
    cfg = json.loads((dest / "transformer" / "config.json").read_text())
    (dest / "transformer" / "config.json").write_text(json.dumps({**cfg, **transformer}))
    return dest


def test_checkpoints_without_text_encoder_micro_conditions_or_a_bin_table_are_refused(folder, tmp_path):
    index = json.loads((folder / "model_index.json").read_text())
    with pytest.raises(ValueError, match="no text_encoder"):
        PixArtSigmaFamily.describe(folder, {**index, "text_encoder": [None, None]})
    micro = _configs_only(folder, tmp_path / "micro", use_additional_conditions=True)
    with pytest.raises(ValueError, match="use_additional_conditions"):
        PixArtSigmaFamily.describe(micro, index)
    implicit = _configs_only(folder, tmp_path / "implicit", use_additional_conditions=None, sample_size=128)
    with pytest.raises(ValueError, match="use_additional_conditions"):  # None means sample_size == 128
        PixArtSigmaFamily.describe(implicit, index)
    odd = _configs_only(folder, tmp_path / "odd", sample_size=48)
    with pytest.raises(ValueError, match="sample_size 48"):
        PixArtSigmaFamily.describe(odd, index)
    sigma_1024 = _configs_only(folder, tmp_path / "sigma1024", use_additional_conditions=False, sample_size=128)
    assert PixArtSigmaFamily.describe(sigma_1024, index).generation_size(1024, 1024) == (1024, 1024)


def test_a_text_bucket_above_what_the_pipeline_feeds_is_refused_before_loading(folder):
    from bcg_core import BucketConfig, ModelConfig, RequestValidator
    from bcg_core.config import EngineConfig

    cfg = EngineConfig(model=ModelConfig(path=str(folder)), limits={"min_side_px": 16},
                      buckets=BucketConfig(**{**BUCKETS, "text_lengths": [16, 512]}))
    with pytest.raises(ValueError, match=r"feeds at most 300 text tokens, .* use text_lengths up to 300"):
        RequestValidator.from_config(cfg)  # the ingress's validator: tokenizer and JSON configs only


def test_a_prompt_longer_than_the_largest_text_bucket_is_a_text_miss_that_equals_diffusers(pipe, folder):
    """``miss_policy: eager`` (the default): a prompt above the largest text bucket (64) is a text miss served
    unpadded on eager kernels, cut at 300 tokens as diffusers cuts it; the image equals diffusers'. A planned
    table sized on short prompts therefore never refuses a longer one (a GPU replay of krea prompts against a
    table planned on GenTD26's prompt lengths refused 17 of 32 requests before)."""
    long = " ".join(["a red cat"] * 60)
    assert _tokens(pipe, long) > 64
    req = GenerationRequest(long, n=1, width=256, height=256, num_inference_steps=2, guidance_scale=4.5, seed=0)
    validated = pipe.validator.validate(req)
    assert not validated.lookup.hit and Dim.TEXT in validated.lookup.missed
    assert_same(bcg_run(pipe, req), diffusers_run(PixArtSigmaPipeline, folder, req))


def test_under_miss_policy_reject_a_prompt_longer_than_the_largest_text_bucket_is_a_refused_text_miss(folder):
    """Refused as a miss of the text dimension (counted in ``misses.rejected_by_dim``), as a prompt above its
    resolution tier's own text buckets is."""
    reject = bcg_pipeline(folder, {**BUCKETS, "miss_policy": "reject"})
    with pytest.raises(BucketMissError) as e:
        reject.validator.validate(GenerationRequest(" ".join(["a red cat"] * 60), width=256, height=256, seed=0))
    assert e.value.field == "prompt" and e.value.missed == ("text_tokens",)
    assert "above the largest text bucket 64 (buckets.miss_policy is reject" in e.value.message


def test_per_tier_text_buckets_pad_each_tier_to_its_own_buckets_and_equal_diffusers(folder):
    """``text_lengths_by_resolution``: the 256x256 bin has text buckets 16, 32 and 64, the other bins only 64. A
    short prompt pads to 16 at 256x256 and to 64 at the 304x208 bin; both images equal diffusers', and every
    bucket of the table passes ``bcg verify`` (padded against unpadded forwards, CPU static eager)."""
    from deployments.cli.commands import run_verify

    pipe = bcg_pipeline(folder, {**BUCKETS, "batch_sizes": [2], "text_lengths": [64],
                                 "text_lengths_by_resolution": {"256x256": [16, 32, 64]}})
    assert len(pipe.table) == 3 + 1 + 1
    for (w, h), want in (((256, 256), 16), ((300, 200), 64)):
        req = GenerationRequest(prompt="a red cube", n=1, width=w, height=h, num_inference_steps=2,
                                guidance_scale=4.5, seed=3)
        assert pipe.validator.validate(req).lookup.key.text_tokens == want
        assert_same(bcg_run(pipe, req), diffusers_run(PixArtSigmaPipeline, folder, req))
    assert run_verify(pipe.config)


# -- the bucket adapter on a bare transformer (docs/DESIGN.md section 4) --------------------------------------


CPU = torch.device("cpu")
TEXTS = [32, 128]


def _model(**overrides) -> PixArtTransformer2DModel:
    cfg = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
               cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=24,
               use_additional_conditions=False)
    return PixArtTransformer2DModel(**{**cfg, **overrides}).eval()


@pytest.fixture(scope="module")
def adapter():
    torch.manual_seed(0)
    return PixArtAdapter(_model())


@pytest.fixture(scope="module")
def table(adapter):
    cfg = BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "512x768"], text_lengths=TEXTS)
    return BucketTable(cfg, adapter.rules)


@pytest.fixture(scope="module")
def runner(adapter, table):
    r = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    r.prepare()
    return r


def _inputs(adapter: PixArtAdapter, rows: int, grid: tuple[int, int], text: int,
            seed: int = 0) -> DenoiseInputs:
    g = torch.Generator().manual_seed(seed)
    return DenoiseInputs(
        latents=adapter.example_latents(rows, grid, g),
        text=torch.randn(rows, text, adapter.seq_dim, generator=g),
        pooled=torch.zeros(rows, 0),
        timestep=torch.randint(0, 1000, (rows,), generator=g).float(),
        grid=grid,
    )


def _key(table: BucketTable, rows: int, grid: tuple[int, int], text: int):
    return table.lookup(ShapeQuery(rows, grid[0] * grid[1], text, grid)).key


def test_text_rounds_up_to_a_bucket_and_the_grid_is_keyed(adapter, table):
    assert adapter.rules.native_text_tokens is None and adapter.rules.grid_keyed
    assert _key(table, 1, (16, 16), 77).text_tokens == 128
    assert _key(table, 1, (16, 16), 32).text_tokens == 32
    assert _key(table, 1, (48, 32), 1).latent_hw == (48, 32)
    over = table.lookup(ShapeQuery(1, 256, 129, (16, 16)))
    assert over.missed == (Dim.TEXT,)
    landscape = table.lookup(ShapeQuery(1, 1536, 32, (32, 48)))  # same tokens as 512x768, other grid
    assert landscape.missed == (Dim.IMAGE,)


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(adapter, table, runner):
    cases = boundary_cases(table, LimitsConfig())
    assert {c.key for c in cases} == set(table.keys)
    # Every text bucket is checked with requests that pad text: one below it and the smallest that maps to it.
    assert {c.text_tokens for c in cases} == {1, 31, 32, 33, 127, 128}
    verdicts = verify_runner(adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert [v.key for v in verdicts] == table.keys
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_text_padded_77_to_128_with_the_mask_equals_unpadded_and_without_it_does_not(adapter, table):
    x = _inputs(adapter, 1, (16, 16), text=77, seed=4)
    key = _key(table, 1, (16, 16), 77)
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


def test_no_mask_and_an_all_true_mask_are_the_same_forward_on_cpu(adapter):
    x = _inputs(adapter, 2, (16, 16), text=20, seed=8)
    with torch.inference_mode():
        masked = adapter.forward_eager(x)
        unmasked = adapter.model(x.latents, encoder_hidden_states=x.text, timestep=x.timestep,
                                 added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                                 return_dict=False)[0]
    assert torch.equal(masked, unmasked)


def test_a_prompt_alone_equals_the_same_prompt_inside_a_batch(adapter, table, runner):
    grid = (48, 32)
    batch = _inputs(adapter, 3, grid, text=77, seed=7)  # three prompts of 77 tokens, other noises and times
    together = runner.run(_key(table, 3, grid, 77), batch)
    assert together.shape == (3, 8, 96, 64)
    for i in range(3):
        alone = runner.run(_key(table, 1, grid, 77), batch.select([i]))
        assert_close(together[i : i + 1], alone)
    assert not torch.allclose(together[0], together[1])


def test_prompts_of_different_lengths_in_one_batch_equal_each_prompt_alone_unpadded(adapter, table, runner):
    """Rows carry their own text masks (as the pipeline's tokenizer mask): each row sees only its tokens."""
    grid, lengths = (16, 16), [20, 77, 50]
    batch = _inputs(adapter, 3, grid, text=77, seed=9)
    batch.text_mask = torch.arange(77)[None, :] < torch.tensor(lengths)[:, None]
    together = runner.run(_key(table, 3, grid, 77), batch)
    for i, n in enumerate(lengths):
        row = batch.select([i])
        alone = DenoiseInputs(row.latents, row.text[:, :n], row.pooled, row.timestep, grid)
        with torch.inference_mode():
            assert_close(together[i : i + 1], adapter.forward_eager(alone))


def test_garbage_in_pad_rows_and_pad_text_tokens_changes_nothing(adapter, table):
    grid = (16, 16)
    x = _inputs(adapter, 3, grid, text=40, seed=3)
    key = _key(table, 3, grid, 40)
    assert (key.batch, key.text_tokens) == (4, 128)
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        clean = adapter.unpad(adapter.forward(buf), x).clone()
        g = torch.Generator().manual_seed(99)
        buf["text"][:, 40:] = 1e4 * torch.randn(buf["text"][:, 40:].shape, generator=g)
        for name, scale in (("latents", 1e3), ("text", 1e3), ("timestep", 1e3)):
            buf[name][3:] = scale * torch.randn(buf[name][3:].shape, generator=g)
        dirty = adapter.unpad(adapter.forward(buf), x)
    assert_close(dirty, clean)


def test_stale_data_from_a_larger_request_does_not_leak(adapter, table, runner):
    grid = (16, 16)
    key = _key(table, 4, grid, 128)
    runner.run(key, _inputs(adapter, 4, grid, text=128, seed=11))
    small = _inputs(adapter, 3, grid, text=40, seed=12)
    after_big = runner.run(key, small)
    fresh = EagerBucketRunner(adapter, [key], runner.metrics, CPU, torch.float32)
    fresh.prepare()
    assert_close(after_big, fresh.run(key, small))


def test_inputs_that_do_not_fit_the_bucket_are_refused(adapter, table, runner):
    key = _key(table, 1, (48, 32), 32)
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 2, (48, 32), text=32))
    with pytest.raises(ValueError, match="do not fit"):  # same token count, other grid
        runner.run(key, _inputs(adapter, 1, (32, 48), text=32))
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 1, (48, 32), text=33))


def test_text_buckets_beyond_the_trained_length_and_micro_conditioned_models_are_refused(adapter):
    cfg = BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[512])
    key = BucketTable(cfg, adapter.rules).keys[0]
    with pytest.raises(ValueError, match="300"):
        adapter.allocate(key, CPU, torch.float32)
    with pytest.raises(ValueError, match="use_additional_conditions"):
        PixArtAdapter(_model(use_additional_conditions=True))
