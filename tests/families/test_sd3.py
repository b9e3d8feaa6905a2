"""SD3 / SD3.5 family: bcg-serve's step-level loop against ``StableDiffusion3Pipeline`` itself, and its bucket
adapter.

Tiny pipelines in the real layout (``tests/tiny/sd3.py``: SD3 and SD3.5 with RMS qk-norm and dual attention,
and one with ``use_dynamic_shifting``), fp32 on CPU. The reference gate (``tests/reference_gate.py``): same
folder, prompt, negative prompt, seed, steps, guidance and size -> final latents within 1e-5 relative of
diffusers' ``output_type="latent"`` and PNG bytes equal to its ``output_type="pil"`` images.

Rows that share a forward with other rows (a pad row, another request) go through batched kernels whose float
reduction order depends on the batch size: diffusers' own transformer gives ~4e-7 different outputs for a
row in a batch of 3 and of 4. Those cases must still be within 1e-5 on the latents, and their images within
one 8-bit level on a few pixels (:func:`_assert_batched`); bit-equal PNGs are asserted where bcg-serve's
forward has exactly diffusers' batch (one request alone in an exact bucket).

The bucket adapter on a bare tiny ``SD3Transformer2DModel`` (two joint blocks, two heads, fp32 on CPU), as
diffusers' own ``tests/models/transformers/test_models_transformer_sd3.py``: keyed on the latent grid,
native-length unmasked text, pad rows copied from row 0. Every bucket's padded forward must equal the unpadded
eager forward at its boundary shapes; a row alone must equal the same row in a batch; garbage in pad rows changes
nothing. The family facts behind the key are checked too: the forward depends on the grid (so 512x768 and 768x512
are two buckets and a grid not in the table is a miss), and padding the text changes the output (so text stays at
its native length).
"""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from PIL import Image

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
    SD3Adapter,
    ShapeQuery,
)
from bcg_core.families.sd3 import SD3Family
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases
from closeness import RTOL, assert_close, rel_err
from reference_gate import assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run
from tiny.sd3 import build

BUCKETS = dict(batch_sizes=[1, 2, 4, 8], resolutions=["64x64", "64x96", "96x64"], text_lengths=[333])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd3")
    return {
        "sd3": build(root / "sd3", variant="sd3"),
        "sd35": build(root / "sd35", variant="sd35"),
        "dynamic": build(root / "dynamic", variant="sd3", dynamic_shifting=True),
        "no_t5": build(root / "no_t5", variant="sd3", t5=False),
    }


@pytest.fixture(scope="module")
def pipes(folders):
    return {name: bcg_pipeline(folder, BUCKETS) for name, folder in folders.items()}


def _ref(folder, request):
    return diffusers_run(StableDiffusion3Pipeline, folder, request)


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)


def _assert_batched(ours, ref) -> None:
    """Latents within 1e-5 relative; images within one 8-bit level, on at most 1% of the values."""
    assert ours.latents.shape == ref.latents.shape and not torch.isnan(ours.latents).any()
    err = ((ours.latents - ref.latents).abs().max() / ref.latents.abs().max()).item()
    assert err < RTOL, f"final latents differ from diffusers' by {err:.2e} relative"
    assert len(ours.pngs) == len(ref.pngs)
    for a, b in zip(ours.pngs, ref.pngs, strict=True):
        diff = np.abs(_pixels(a) - _pixels(b))
        assert diff.max() <= 1 and (diff > 0).mean() <= 0.01, (int(diff.max()), float((diff > 0).mean()))


def _run_alone(pipe, request):
    """``request`` through ``pipe.step`` alone; returns (final state, the forwards of every step)."""
    state = pipe.start(pipe.validator.validate(request))
    forwards = []
    while not state.done:
        forwards.append(pipe.step([state], pipe.decider.for_states([state])))
    return state, forwards


@pytest.mark.parametrize("variant", ["sd3", "sd35"])
def test_a_request_alone_in_an_exact_bucket_equals_diffusers_bit_for_bit(folders, pipes, variant):
    req = GenerationRequest("a photo of a cat sitting on a red chair", n=1, width=64, height=96,
                            num_inference_steps=3, guidance_scale=4.5, seed=5)
    state, lookups = _run_alone(pipes[variant], req)
    assert {(c.key.batch, c.rows) for f in lookups for c in f.chunks} == {(2, 2)}  # cond + uncond, exact
    assert state.latents.shape == (1, 16, 12, 8)
    ours = bcg_run(pipes[variant], req)
    ref = _ref(folders[variant], req)
    assert torch.equal(ours.latents, ref.latents)
    assert_same(ours, ref)


def test_no_cfg_at_guidance_one_runs_cond_rows_only_and_equals_diffusers(folders, pipes):
    req = GenerationRequest("an astronaut riding a horse on the moon", n=2, width=96, height=64,
                            num_inference_steps=2, guidance_scale=1.0, negative_prompt="ignored without CFG",
                            seed=3)
    state, lookups = _run_alone(pipes["sd3"], req)
    assert state.uncond is None and lookups[0].rows == 2
    assert_same(bcg_run(pipes["sd3"], req), _ref(folders["sd3"], req))


@pytest.mark.parametrize("n, guidance, rows, bucket", [(3, 1.0, 3, 4), (3, 7.0, 6, 8)])
def test_rows_padded_up_to_the_batch_bucket_equal_diffusers(folders, pipes, n, guidance, rows, bucket):
    req = GenerationRequest("A watercolor painting of a lighthouse at dusk", n=n, width=96, height=64,
                            num_inference_steps=2, guidance_scale=guidance,
                            negative_prompt="blurry, low quality", seed=2)
    _, lookups = _run_alone(pipes["sd35"], req)
    assert {(f.rows, f.chunks[0].key.batch) for f in lookups} == {(rows, bucket)}
    _assert_batched(bcg_run(pipes["sd35"], req), _ref(folders["sd35"], req))


def test_a_request_joining_another_at_a_later_step_equals_diffusers_for_both(folders, pipes):
    a = GenerationRequest("an astronaut riding a horse", n=1, width=64, height=96, num_inference_steps=3,
                          guidance_scale=5.0, seed=7)
    b = GenerationRequest("portrait of an old man, studio lighting, 85mm", n=2, width=64, height=96,
                          num_inference_steps=4, guidance_scale=3.0, negative_prompt="text", seed=11)
    ra, rb = bcg_run_joined(pipes["sd3"], a, b, head_start=2)  # 2 + 4 rows share each forward, padded to 8
    _assert_batched(ra, _ref(folders["sd3"], a))
    _assert_batched(rb, _ref(folders["sd3"], b))


def test_dynamic_shifting_takes_mu_from_the_latent_size_as_diffusers(folders, pipes):
    pipe = pipes["dynamic"]
    small = GenerationRequest("a photo of a cat", n=1, width=64, height=64, num_inference_steps=3,
                              guidance_scale=4.0, seed=1)
    large = GenerationRequest("a photo of a cat", n=1, width=64, height=96, num_inference_steps=3,
                              guidance_scale=4.0, seed=1)
    t_small = pipe.start(pipe.validator.validate(small)).timesteps
    t_large = pipe.start(pipe.validator.validate(large)).timesteps
    assert t_small[0] == t_large[0] == 1000 and t_large[1] > t_small[1]  # more tokens: larger mu
    assert_same(bcg_run(pipe, large), _ref(folders["dynamic"], large))


def test_text_is_clip_padded_to_the_t5_width_then_t5_and_the_empty_negative_prompt_is_encoded(pipes):
    pipe = pipes["sd3"]
    cfg = pipe.start(pipe.validator.validate(GenerationRequest("a photo of a cat", width=64, height=64,
                                                         guidance_scale=2.0, seed=0)))
    assert cfg.cond.text.shape == (1, 77 + 256, 48) and cfg.cond.pooled.shape == (1, 32)
    assert cfg.cond.mask is None
    assert torch.count_nonzero(cfg.cond.text[:, :77, 32:]) == 0  # CLIP-L + CLIP-G = 32 channels, zero-padded
    assert cfg.uncond is not None and not torch.equal(cfg.uncond.text, cfg.cond.text)  # "" encoded
    rows = pipe.model.model_rows(cfg)
    assert torch.equal(rows.text[0], cfg.uncond.text[0]) and torch.equal(rows.text[1], cfg.cond.text[0])
    assert torch.equal(rows.timestep, torch.full((2,), 1000.0))  # undivided, the scheduler's 0-1000 scale
    plain = pipe.start(pipe.validator.validate(GenerationRequest("a photo of a cat", width=64, height=64,
                                                           guidance_scale=1.0, seed=0)))
    assert plain.uncond is None and pipe.model.model_rows(plain).rows == 1


def test_true_cfg_scale_is_refused_naming_the_field(pipes):
    req = GenerationRequest("a photo of a cat", width=64, height=64, guidance_scale=4.0, true_cfg_scale=2.0)
    with pytest.raises(RequestError) as e:
        pipes["sd3"].validator.validate(req)
    assert e.value.field == "true_cfg_scale" and "guidance_scale" in e.value.message
    with pytest.raises(RequestError) as e:
        pipes["sd3"].model.spec.check(req)
    assert e.value.field == "true_cfg_scale"


def test_a_size_beyond_the_position_table_is_refused_naming_the_size(pipes):
    # 33 tokens wide: beyond the tiny model's 32-position table
    req = GenerationRequest("a photo of a cat", width=528, height=64, guidance_scale=4.0, seed=0)
    with pytest.raises(RequestError) as e:  # refused when validated (the ingress validates alike), not served eager
        pipes["sd3"].validator.validate(req)
    assert e.value.field == "size" and "32 tokens a side" in e.value.message and "512" in e.value.message


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_text_longer_than_t5_reads_is_refused_instead_of_truncated(pipes, field):
    pipe = pipes["sd3"]
    long = " ".join(["a photo of a cat"] * 200)
    words = long.split()
    while pipe.model.count_tokens(" ".join(words)) > 300:  # above T5's 256, within the key's 333
        words = words[:-4]
    text = " ".join(words)
    assert 256 < pipe.model.count_tokens(text) <= 333
    kw = {"prompt": text} if field == "prompt" else {"prompt": "a cat", "negative_prompt": text}
    with pytest.raises(RequestError) as e:  # refused when validated (ModelSpec.max_prompt_tokens), never cut
        pipe.validator.validate(GenerationRequest(**kw, width=64, height=64, guidance_scale=4.0, seed=0))
    assert e.value.field == field and "at most 256" in e.value.message


@pytest.mark.parametrize("change, match", [
    ({"stochastic_sampling": True}, "stochastic_sampling"),
    ({"_class_name": "FlowMatchHeunDiscreteScheduler"}, "FlowMatchHeunDiscreteScheduler"),
])
def test_a_scheduler_the_family_cannot_reproduce_is_a_load_error(folders, tmp_path, change, match):
    folder = tmp_path / "ckpt"
    shutil.copytree(folders["sd3"], folder, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((folder / "model_index.json").read_text())
    sched_file = folder / "scheduler" / "scheduler_config.json"
    sched = json.loads(sched_file.read_text())
    sched.update(change)
    sched_file.write_text(json.dumps(sched))
    index["scheduler"] = ["diffusers", sched["_class_name"]]
    with pytest.raises(ValueError, match=match):
        SD3Family.describe(folder, index)
    spec = SD3Family.describe(folders["sd3"], json.loads((folders["sd3"] / "model_index.json").read_text()))
    assert spec.family == "sd3" and spec.rules.native_text_tokens == 333 and spec.rules.grid_keyed
    assert spec.rules.pixels_per_token == 16 and spec.default_true_cfg_scale is None


def test_a_resolution_beyond_the_position_table_is_refused_before_loading(folders):
    from bcg_core import BucketConfig, ModelConfig, RequestValidator
    from bcg_core.config import EngineConfig

    cfg = EngineConfig(model=ModelConfig(path=str(folders["sd3"])), limits={"min_side_px": 16},
                      buckets=BucketConfig(**{**BUCKETS, "resolutions": ["64x64", "1024x1024"]}))
    with pytest.raises(ValueError,
                       match=r"buckets.resolutions: 1024x1024 exceeds .* \(32 tokens a side\): sides up to 512"):
        RequestValidator.from_config(cfg)


def test_an_fp32_checkpoint_served_in_bf16_runs_every_component_in_bf16(folders):
    from bcg_core import BucketConfig, DiTPipeline, LimitsConfig, ModelConfig
    from deployments.settings import EngineConfig

    pipe = DiTPipeline.from_config(EngineConfig(
        model=ModelConfig(path=str(folders["sd3"]), device="cpu", dtype="bfloat16"),
        buckets=BucketConfig(batch_sizes=[2], resolutions=["64x64"], text_lengths=[333]),
        limits=LimitsConfig(min_side_px=16)))
    p = pipe.model.pipe
    components = (p.transformer, p.vae, p.text_encoder, p.text_encoder_2, p.text_encoder_3)
    assert {m.dtype for m in components} == {torch.bfloat16}
    out = pipe.generate(pipe.validator.validate(GenerationRequest("a cat", width=64, height=64, num_inference_steps=1,
                                                                  guidance_scale=4.0, seed=1)))
    assert str(out.bucket) == "b2_i16_t333_g4x4" and len(out.image_bytes) == 1


# -- a checkpoint saved without T5 (text_encoder_3: null) ------------------------------------------------------

NO_T5 = {"text_encoder_3": None, "tokenizer_3": None}
"""How diffusers' SD3 docs load a pipeline without T5; its ``from_pretrained`` refuses the folder without them."""


def test_a_checkpoint_without_t5_is_served_as_diffusers_serves_it(folders, pipes):
    folder = folders["no_t5"]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["text_encoder_3"] == [None, None] and index["tokenizer_3"] == [None, None]
    with pytest.raises(ValueError, match="expected"):  # diffusers' own load error without the None components
        StableDiffusion3Pipeline.from_pretrained(str(folder), local_files_only=True)
    pipe = pipes["no_t5"]
    assert pipe.model.pipe.text_encoder_3 is None
    req = GenerationRequest("a photo of a cat sitting on a red chair", n=1, width=64, height=96,
                            num_inference_steps=3, guidance_scale=4.5, negative_prompt="blurry", seed=5)
    state = pipe.start(pipe.validator.validate(req))
    assert state.cond.text.shape == (1, 77 + 256, 48)
    assert torch.count_nonzero(state.cond.text[:, 77:]) == 0  # the T5 part: zeros, as the pipeline's
    ours = bcg_run(pipe, req)
    ref = diffusers_run(StableDiffusion3Pipeline, folder, req, load_kwargs=NO_T5)
    assert torch.equal(ours.latents, ref.latents)
    assert_same(ours, ref, exact=True)
    batched = GenerationRequest("an astronaut riding a horse", n=3, width=96, height=64, num_inference_steps=2,
                                guidance_scale=7.0, seed=2)  # 6 rows padded to the bucket of 8
    _assert_batched(bcg_run(pipe, batched), diffusers_run(StableDiffusion3Pipeline, folder, batched,
                                                          load_kwargs=NO_T5))


def test_without_t5_prompts_are_counted_and_limited_by_clip(folders, pipes):
    spec = SD3Family.describe(folders["no_t5"], json.loads((folders["no_t5"] / "model_index.json").read_text()))
    assert spec.max_prompt_tokens == 77 and spec.rules.native_text_tokens == 333
    pipe = pipes["no_t5"]
    long = " ".join(["a photo of a cat"] * 40)
    assert pipe.model.count_tokens(long) > 77
    from bcg_core import ModelConfig, RequestValidator
    from bcg_core.config import EngineConfig

    ingress = RequestValidator.from_config(EngineConfig(model=ModelConfig(path=str(folders["no_t5"])),
                                               limits={"min_side_px": 16}, buckets=BucketConfig(**BUCKETS)))
    for validator in (pipe.validator, ingress):  # the ingress validates from the tokenizers alone, the same way
        with pytest.raises(RequestError) as e:  # CLIP would cut it: refused, never truncated
            validator.validate(GenerationRequest(long, width=64, height=64, guidance_scale=4.0, seed=0))
        assert e.value.field == "prompt" and "at most 77" in e.value.message


def test_a_t5_encoder_without_its_tokenizer_is_a_load_error_naming_both(folders):
    index = json.loads((folders["sd3"] / "model_index.json").read_text())
    index["tokenizer_3"] = [None, None]
    with pytest.raises(ValueError, match="text_encoder_3 but tokenizer_3 is null"):
        SD3Family.describe(folders["sd3"], index)


# -- the bucket adapter on a bare transformer (docs/DESIGN.md section 4) --------------------------------------


TEXT = 12
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def adapter():
    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=20,
        out_channels=4, pos_embed_max_size=64,
    ).eval()
    return SD3Adapter(model, native_text_tokens=TEXT)


@pytest.fixture(scope="module")
def table(adapter):
    sizes = ["256x256", "512x768", "768x512"]
    cfg = BucketConfig(batch_sizes=[1, 2, 4], resolutions=sizes, text_lengths=[TEXT])
    return BucketTable(cfg, adapter.rules)


@pytest.fixture(scope="module")
def runner(adapter, table):
    r = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    r.prepare()
    return r


def _inputs(adapter: SD3Adapter, rows: int, grid: tuple[int, int], seed: int = 0,
            text: int = TEXT) -> DenoiseInputs:
    g = torch.Generator().manual_seed(seed)
    return DenoiseInputs(
        latents=adapter.example_latents(rows, grid, g),
        text=torch.randn(rows, text, adapter.seq_dim, generator=g),
        pooled=torch.randn(rows, adapter.pooled_dim, generator=g),
        timestep=1000 * torch.rand(rows, generator=g),
        grid=grid,
    )


def _query(rows: int, grid: tuple[int, int]) -> ShapeQuery:
    return ShapeQuery(rows, grid[0] * grid[1], TEXT, grid)


def test_portrait_and_landscape_are_different_buckets_and_an_unlisted_grid_misses(adapter, table):
    portrait, landscape = adapter.rules.grid(512, 768), adapter.rules.grid(768, 512)
    assert portrait == (48, 32) and landscape == (32, 48)
    a, b = table.lookup(_query(1, portrait)).key, table.lookup(_query(1, landscape)).key
    assert a.image_tokens == b.image_tokens == 1536
    assert a != b and a.latent_hw == portrait and b.latent_hw == landscape
    square = adapter.rules.grid(512, 512)  # 32 x 32: fewer tokens than both tiers, but not a listed grid
    miss = table.lookup(_query(1, square))
    assert not miss.hit and miss.missed == (Dim.IMAGE,)
    assert len(table) == 9 and all(k.latent_hw is not None and not k.image_mask for k in table.keys)


def test_text_buckets_other_than_the_native_length_are_a_start_up_error(adapter):
    cfg = BucketConfig(batch_sizes=[1], resolutions=["256x256"], text_lengths=[8, TEXT])
    with pytest.raises(ValueError, match=f"text_lengths: \\[{TEXT}\\]"):
        BucketTable(cfg, adapter.rules)


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(adapter, table, runner):
    cases = boundary_cases(table, LimitsConfig())
    assert {c.key for c in cases} == set(table.keys)
    assert {c.key for c in cases if c.rows < c.key.batch} == {k for k in table.keys if k.batch == 4}  # 3 -> 4
    verdicts = verify_runner(adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert [v.key for v in verdicts] == table.keys
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_a_prompt_alone_equals_the_same_prompt_inside_a_batch(adapter, table, runner):
    grid = (48, 32)
    batch = _inputs(adapter, 3, grid, seed=7)  # three different prompts, noises and timesteps
    together = runner.run(table.lookup(_query(3, grid)).key, batch)
    assert together.shape == (3, 4, 96, 64)
    for i in range(3):
        alone = runner.run(table.lookup(_query(1, grid)).key, batch.select([i]))
        assert_close(together[i : i + 1], alone)
    assert not torch.allclose(together[0], together[1])


def test_garbage_in_pad_rows_changes_nothing(adapter, table):
    grid = (32, 48)
    x = _inputs(adapter, 3, grid, seed=3)
    key = table.lookup(_query(3, grid)).key
    assert key.batch == 4
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        clean = adapter.unpad(adapter.forward(buf), x).clone()
        g = torch.Generator().manual_seed(99)
        for name, scale in (("latents", 1e3), ("text", 1e3), ("pooled", 50.0), ("timestep", 1e3)):
            buf[name][3:] = scale * torch.randn(buf[name][3:].shape, generator=g)
        dirty = adapter.unpad(adapter.forward(buf), x)
    assert_close(dirty, clean)


def test_the_forward_depends_on_the_grid_so_the_key_must_carry_it(adapter):
    """The same latent transposed is not the transposed output: positions are cropped per axis."""
    x = _inputs(adapter, 1, (32, 48), seed=5)
    xt = DenoiseInputs(x.latents.transpose(-1, -2).contiguous(), x.text, x.pooled, x.timestep, (48, 32))
    with torch.inference_mode():
        out, out_t = adapter.forward_eager(x), adapter.forward_eager(xt)
    assert rel_err(out_t.transpose(-1, -2), out) > 1e-3


def test_padding_the_text_changes_the_output_so_text_keeps_its_native_length(adapter):
    short = _inputs(adapter, 1, (16, 16), seed=6, text=TEXT - 4)
    padded = DenoiseInputs(short.latents, torch.cat([short.text, torch.zeros(1, 4, adapter.seq_dim)], dim=1),
                           short.pooled, short.timestep, short.grid)
    with torch.inference_mode():
        assert rel_err(adapter.forward_eager(padded), adapter.forward_eager(short)) > 1e-3


def test_stale_data_from_a_larger_request_does_not_leak(adapter, table, runner):
    grid = (16, 16)
    key = table.lookup(_query(4, grid)).key
    runner.run(key, _inputs(adapter, 4, grid, seed=11))
    small = _inputs(adapter, 3, grid, seed=12)
    after_big = runner.run(key, small)
    fresh = EagerBucketRunner(adapter, [key], runner.metrics, CPU, torch.float32)
    fresh.prepare()
    assert_close(after_big, fresh.run(key, small))


def test_inputs_that_do_not_fit_the_bucket_are_refused(adapter, table, runner):
    key = table.lookup(_query(1, (48, 32))).key
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 2, (48, 32)))
    with pytest.raises(ValueError, match="do not fit"):  # same token count, other grid
        runner.run(key, _inputs(adapter, 1, (32, 48)))
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(key, _inputs(adapter, 1, (48, 32), text=TEXT - 1))
    x = _inputs(adapter, 1, (48, 32))
    x.text_mask = torch.ones(1, TEXT, dtype=torch.bool)
    with pytest.raises(ValueError, match="unmasked"):
        runner.run(key, x)


def test_a_grid_beyond_the_position_table_is_a_start_up_error(adapter):
    cfg = BucketConfig(batch_sizes=[1], resolutions=["1280x256"], text_lengths=[TEXT])  # 80 tokens wide > 64
    key = BucketTable(cfg, adapter.rules).keys[0]
    with pytest.raises(ValueError, match="pos_embed_max_size 64"):
        adapter.allocate(key, CPU, torch.float32)
