"""Qwen-Image family against ``QwenImagePipeline`` itself (the reference gate), and its bucket equivalence.

A tiny random-weight Qwen-Image (``tests/tiny/qwenimage.py``: Qwen2.5-VL text encoder, byte-level BPE
tokenizer whose chat-template prefix is the real 34 tokens, real latent channels and VAE statistics, the
real scheduler config) is served through :class:`~bcg_core.DiTPipeline` and compared with diffusers on the
same folder, request and generators: final latents within 1e-5 relative, and PNG bytes equal where the
latents are bit-identical (``reference_gate.assert_same``; batched forwards move a rare pixel value by one
level). Gate cases: an exact bucket alone (no CFG: no negative prompt, although ``true_cfg_scale`` defaults to
4.0; bit-identical, byte-equal PNG); rows and text padded with true CFG (norm-rescaled) at an odd grid, with
the decode alone byte-exact on diffusers' own latents; a request joining another that started steps earlier.

Bucket equivalence (``QwenImageAdapter``, as ``families/test_pixart.py``): every bucket's padded, masked forward
equals the unpadded forward at its boundary shapes; text RoPE positions do not depend on the padded length;
the mask is what makes text padding exact; the grid (not the token count) is what the RoPE depends on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline

from bcg_core import (
    BucketConfig,
    BucketMetrics,
    BucketTable,
    DenoiseInputs,
    Dim,
    EagerBucketRunner,
    GenerationRequest,
    LimitsConfig,
    ShapeQuery,
)
from bcg_core.families import family_class
from bcg_core.families.qwenimage import (
    QWEN_MAX_TEXT_TOKENS,
    QwenImageAdapter,
    QwenImageFamily,
    TextMaskAttnProcessor,
)
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases
from closeness import RTOL, assert_close, rel_err
from reference_gate import assert_same, bcg_pipeline, bcg_run, bcg_run_joined, diffusers_run
from tiny.qwenimage import build

BUCKETS = {"batch_sizes": [1, 2, 4, 8], "resolutions": ["64x64", "208x144", "144x208"],
           "text_lengths": [8, 16, 32]}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("qwenimage") / "tiny-qwen-image")


@pytest.fixture(scope="module")
def pipe(folder):
    return bcg_pipeline(folder, BUCKETS, min_side_px=16)


def _req(prompt: str, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, **{"n": 1, "width": 64, "height": 64, "num_inference_steps": 3,
                                               "seed": 0, **kw})


# -- the reference gate -------------------------------------------------------------------------------


def test_the_family_loads_from_the_registry_keyed_on_the_grid_with_masked_text(pipe):
    assert family_class("QwenImagePipeline") is QwenImageFamily
    fam = pipe.model
    assert isinstance(fam, QwenImageFamily) and fam.name == "qwenimage" and not fam.guidance_embeds
    assert fam.rules.grid_keyed and fam.rules.native_text_tokens is None and fam.rules.pixels_per_token == 16
    assert (fam.spec.cfg_rule, fam.spec.default_true_cfg_scale) == ("true_cfg", 4.0)
    assert isinstance(fam.adapter, QwenImageAdapter) and fam.adapter.out_channels == 64


def test_an_exact_bucket_without_a_negative_prompt_runs_no_cfg_and_equals_diffusers(pipe, folder):
    req = _req("a photo of a cat on a red chair", guidance_scale=7.0, seed=1)  # guidance_scale: ignored
    assert pipe.model.count_tokens(req.prompt) == 16  # exactly the text bucket
    validated = pipe.validator.validate(req)
    assert not pipe.model.spec.uses_cfg(validated.request)  # true_cfg_scale defaults to 4.0, but no negative prompt
    assert str(validated.lookup.key) == "b1_i16_t16_g4x4"
    assert_same(bcg_run(pipe, req), diffusers_run(QwenImagePipeline, folder, req), exact=True)


def test_padded_rows_and_text_with_true_cfg_at_an_odd_grid_equal_diffusers(pipe, folder):
    # 3 images x [cond, uncond] = 6 rows in the batch-8 bucket; prompt (21) and negative (9) tokens padded
    # to 32 with masked zeros; 208x144 is a 9x13 grid (odd sides: the centred RoPE's asymmetric case).
    req = _req("A watercolor painting of a lighthouse at dusk", n=3, width=208, height=144, num_inference_steps=4,
               negative_prompt="blurry", seed=7)
    key = pipe.validator.validate(req).lookup.key
    assert (key.batch, key.text_tokens, key.latent_hw) == (8, 32, (9, 13))
    ours, ref = bcg_run(pipe, req), diffusers_run(QwenImagePipeline, folder, req)
    assert len(ours.pngs) == 3
    assert_same(ours, ref)
    # The decode alone is exact: diffusers' own final latents through our decode give its PNG bytes.
    state = pipe.start(pipe.validator.validate(req))
    state.latents = ref.latents
    assert pipe.finish(state) == ref.pngs


def test_a_prompt_longer_than_the_largest_text_bucket_is_a_text_miss_that_equals_diffusers(pipe, folder):
    # miss_policy eager (the default): above the 32-token bucket, served unpadded on eager kernels
    req = _req(", ".join(["a lighthouse on a cliff at dusk"] * 6), seed=2)
    assert pipe.model.count_tokens(req.prompt) > 32
    validated = pipe.validator.validate(req)
    assert not validated.lookup.hit and Dim.TEXT in validated.lookup.missed
    assert_same(bcg_run(pipe, req), diffusers_run(QwenImagePipeline, folder, req))


def test_a_request_joining_one_that_started_earlier_equals_diffusers_for_both(pipe, folder):
    # A: true CFG at 2.5 with the empty negative prompt (still CFG, as in diffusers), 2 images; B: no CFG,
    # 2 steps ahead. A's 4 rows and B's 1 share one forward (bucket 8) at different timesteps.
    a = _req("portrait of an old man, studio lighting, 85mm", n=2, width=144, height=208, num_inference_steps=4,
             negative_prompt="", true_cfg_scale=2.5, seed=11)
    b = _req("an astronaut riding a horse", width=144, height=208, num_inference_steps=5, seed=5)
    ours_a, ours_b = bcg_run_joined(pipe, a, b, head_start=2)
    assert_same(ours_a, diffusers_run(QwenImagePipeline, folder, a, true_cfg_scale=2.5))
    assert_same(ours_b, diffusers_run(QwenImagePipeline, folder, b))


def test_cfg_runs_only_with_a_negative_prompt_and_true_cfg_scale_above_one(pipe):
    fam, p = pipe.model, "a photo of a cat"
    cases = [(None, None, False), (None, 5.0, False), ("", None, True), ("blurry", None, True),
             ("blurry", 1.0, False), ("blurry", 1.5, True)]
    for neg, scale, cfg in cases:
        validated = pipe.validator.validate(_req(p, negative_prompt=neg, true_cfg_scale=scale))
        assert fam.spec.uses_cfg(validated.request) is cfg, (neg, scale)
        assert validated.lookup.key.batch == (2 if cfg else 1)
        fam.spec.check(validated.request)  # nothing refused: every combination is a diffusers option
    assert fam.spec.cfg_scale(_req(p, negative_prompt="x")) == 4.0


def test_token_counts_are_what_encode_prompt_keeps_after_the_34_template_tokens(pipe, folder):
    fam = pipe.model
    tok = fam.pipe.tokenizer
    prefix = fam.pipe.prompt_template_encode.split("{}")[0]
    assert fam.pipe.prompt_template_encode_start_idx == 34 and len(tok(prefix)["input_ids"]) == 34
    ingress = QwenImageFamily.token_counter(folder, {"_class_name": "QwenImagePipeline"})
    long = " ".join(["a watercolor painting of a lighthouse"] * 120)
    for prompt in ["a photo of a cat", "", "blurry, low quality, watermark, text", "  spaced  ", long]:
        with torch.inference_mode():
            embeds, _ = fam.pipe.encode_prompt(prompt, device=CPU, max_sequence_length=QWEN_MAX_TEXT_TOKENS)
        assert fam.count_tokens(prompt) == ingress(prompt) == embeds.shape[1] == fam.encode(prompt).tokens
    assert ingress("") == 5  # the template's end: <|im_end|> \n <|im_start|> assistant \n
    assert ingress(long) == QWEN_MAX_TEXT_TOKENS  # cut at max_sequence_length, as __call__ cuts


def _configs_only(folder: Path, dest: Path, transformer: dict | None = None,
                  scheduler: dict | None = None) -> Path:
    """A copy of ``folder``'s JSON configs (what ``describe`` reads) with overrides."""
    for sub, name, over in (("transformer", "config.json", transformer), ("vae", "config.json", None),
                            ("scheduler", "scheduler_config.json", scheduler)):
        (dest / sub).mkdir(parents=True)
        cfg = json.loads((folder / sub / name).read_text())
        (dest / sub / name).write_text(json.dumps({**cfg, **(over or {})}))
    shutil.copy(folder / "model_index.json", dest / "model_index.json")
    return dest


@pytest.mark.parametrize("transformer, scheduler, match", [
    ({"guidance_embeds": True}, None, "guidance_embeds"),
    ({"zero_cond_t": True}, None, "zero_cond_t"),
    ({"use_additional_t_cond": True}, None, "use_additional_t_cond"),
    ({"use_layer3d_rope": True}, None, "use_layer3d_rope"),
    (None, {"stochastic_sampling": True}, "stochastic_sampling"),
])
def test_configurations_diffusers_cannot_run_as_qwenimagepipeline_are_refused(folder, tmp_path, transformer,
                                                                               scheduler, match):
    index = {"_class_name": "QwenImagePipeline"}
    QwenImageFamily.describe(_configs_only(folder, tmp_path / "ok"), index)
    with pytest.raises(ValueError, match=match):
        QwenImageFamily.describe(_configs_only(folder, tmp_path / "bad", transformer, scheduler), index)


# -- bucket equivalence of the adapter ------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter(pipe) -> QwenImageAdapter:
    return pipe.model.adapter


@pytest.fixture(scope="module")
def table(adapter):
    cfg = BucketConfig(batch_sizes=[1, 2, 4], resolutions=["64x64", "208x144"], text_lengths=[8, 32])
    return BucketTable(cfg, adapter.rules)


@pytest.fixture(scope="module")
def runner(adapter, table):
    r = EagerBucketRunner(adapter, table.keys, BucketMetrics(table.keys), CPU, torch.float32)
    r.prepare()
    return r


def _inputs(adapter, rows: int, grid: tuple[int, int], text: int, seed: int = 0) -> DenoiseInputs:
    g = torch.Generator().manual_seed(seed)
    latents = adapter.example_latents(rows, grid, g)
    return DenoiseInputs(latents, torch.randn(rows, text, adapter.seq_dim, generator=g), torch.zeros(rows, 0),
                         torch.rand(rows, generator=g), grid)


def _key(table, rows: int, grid: tuple[int, int], text: int):
    return table.lookup(ShapeQuery(rows, grid[0] * grid[1], text, grid)).key


def test_padded_bucket_run_equals_unpadded_eager_run_at_every_boundary(adapter, table, runner):
    cases = boundary_cases(table, LimitsConfig(min_side_px=16))
    assert {c.key for c in cases} == set(table.keys)
    assert {c.text_tokens for c in cases} == {1, 7, 8, 9, 31, 32}  # text padded in every text bucket
    verdicts = verify_runner(adapter, runner, cases, CPU, torch.float32, rtol=RTOL)
    assert [v.key for v in verdicts] == table.keys
    assert not [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_text_rope_positions_do_not_depend_on_the_padded_text_length(adapter):
    rope = adapter.model.pos_embed
    for grid in [(4, 4), (9, 13)]:
        img_a, txt_a = rope([[(1, *grid)]], max_txt_seq_len=20, device=CPU)
        img_b, txt_b = rope([[(1, *grid)]], max_txt_seq_len=32, device=CPU)
        assert torch.equal(img_a, img_b) and torch.equal(txt_a, txt_b[:20])


def test_text_padded_20_to_32_with_the_mask_equals_unpadded_and_without_it_does_not(adapter, table):
    x = _inputs(adapter, 1, (9, 13), text=20, seed=4)
    key = _key(table, 1, (9, 13), 20)
    assert key.text_tokens == 32
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        ref = adapter.forward_eager(x)
        adapter.fill(buf, x)
        assert buf["text_mask"].sum().item() == 20
        assert_close(adapter.unpad(adapter.forward(buf), x), ref)
        buf["text_mask"].fill_(True)  # zero pad tokens, but attended to
        assert rel_err(adapter.unpad(adapter.forward(buf), x), ref) > 1e-3


def test_the_mask_given_to_the_attention_processors_is_the_forwards_own_mask_path_bit_for_bit(adapter, table):
    """The padded forward bypasses ``compute_text_seq_len_from_mask`` (its host copy breaks CUDA graph capture)
    by handing the mask to the processors: the same computation as passing ``encoder_hidden_states_mask``."""
    x = _inputs(adapter, 3, (9, 13), text=20, seed=6)
    buf = adapter.allocate(_key(table, 3, (9, 13), 20), CPU, torch.float32)
    adapter.fill(buf, x)
    assert all(isinstance(b.attn.processor, TextMaskAttnProcessor) for b in adapter.model.transformer_blocks)
    with torch.inference_mode():
        via_processors = adapter.forward(buf)
        via_forward = adapter.model(hidden_states=buf["latents"].flatten(1, 2), encoder_hidden_states=buf["text"],
                                    encoder_hidden_states_mask=buf["text_mask"], timestep=buf["timestep"],
                                    img_shapes=[[(1, 9, 13)]] * 4, return_dict=False)[0]
    assert torch.equal(via_processors, via_forward)


def test_the_rope_depends_on_the_grid_so_grids_of_equal_tokens_are_different_keys(adapter, table):
    x = _inputs(adapter, 1, (9, 13), text=8, seed=5)
    flipped = DenoiseInputs(x.latents, x.text, x.pooled, x.timestep, (13, 9))
    with torch.inference_mode():
        assert rel_err(adapter.forward_eager(flipped), adapter.forward_eager(x)) > 1e-3
    assert table.lookup(ShapeQuery(1, 117, 8, (13, 9))).missed == (Dim.IMAGE,)


def test_rows_of_different_text_lengths_in_one_batch_equal_each_row_alone_unpadded(adapter, table, runner):
    """As cond and uncond rows of different lengths share a forward: each row sees only its own tokens."""
    grid, lengths = (4, 4), [20, 5, 32]
    batch = _inputs(adapter, 3, grid, text=32, seed=9)
    batch.text_mask = torch.arange(32)[None, :] < torch.tensor(lengths)[:, None]
    together = runner.run(_key(table, 3, grid, 32), batch)
    for i, n in enumerate(lengths):
        row = batch.select([i])
        alone = DenoiseInputs(row.latents, row.text[:, :n], row.pooled, row.timestep, grid)
        with torch.inference_mode():
            assert_close(together[i : i + 1], adapter.forward_eager(alone))


def test_garbage_in_pad_rows_and_pad_text_tokens_changes_nothing(adapter, table):
    grid = (9, 13)
    x = _inputs(adapter, 3, grid, text=10, seed=3)
    key = _key(table, 3, grid, 10)
    assert (key.batch, key.text_tokens) == (4, 32)
    buf = adapter.allocate(key, CPU, torch.float32)
    with torch.inference_mode():
        adapter.fill(buf, x)
        clean = adapter.unpad(adapter.forward(buf), x).clone()
        g = torch.Generator().manual_seed(99)
        buf["text"][:, 10:] = 1e4 * torch.randn(buf["text"][:, 10:].shape, generator=g)
        for name in ("latents", "text", "timestep"):
            buf[name][3:] = 1e3 * torch.randn(buf[name][3:].shape, generator=g)
        dirty = adapter.unpad(adapter.forward(buf), x)
    assert_close(dirty, clean)


def test_inputs_that_do_not_fit_and_text_buckets_beyond_512_are_refused(adapter, table, runner):
    key = _key(table, 1, (9, 13), 8)
    for bad in (_inputs(adapter, 2, (9, 13), 8), _inputs(adapter, 1, (13, 9), 8), _inputs(adapter, 1, (9, 13), 9)):
        with pytest.raises(ValueError, match="do not fit"):
            runner.run(key, bad)
    big = BucketTable(BucketConfig(batch_sizes=[1], resolutions=["64x64"], text_lengths=[1024]), adapter.rules)
    with pytest.raises(ValueError, match="512"):
        adapter.allocate(big.keys[0], CPU, torch.float32)


def test_the_vae_keeps_one_call_at_a_time_so_threads_never_mix_their_caches(pipe):
    """``AutoencoderKLQwenImage`` keeps its causal-convolution caches on the module (``clear_cache``), and the decode
    thread, edits' encode thread and previews call it at once: the loaded VAE serializes ``encode`` and ``decode``
    (``bcg_core/families/vae.py`` ``serialize_stateful_vae``). Without the lock this loop gave tens of wrong
    decodes in a few seconds."""
    import sys
    import threading
    import time

    vae = pipe.model.pipe.vae
    assert "_bcg_lock" in vae.__dict__
    c = vae.config.z_dim
    za, zb = torch.randn(1, c, 1, 8, 8), torch.randn(1, c, 2, 8, 8)  # two shapes: a mixed cache also raises
    image = torch.rand(1, 3, 1, 32, 32) * 2 - 1
    with torch.inference_mode():
        ra, rb = vae.decode(za, return_dict=False)[0], vae.decode(zb, return_dict=False)[0]
        re = vae.encode(image).latent_dist.mode()
    wrong, errors, stop = [0, 0, 0], [], time.monotonic() + 2.0

    def loop(i, call, ref):
        with torch.inference_mode():
            while time.monotonic() < stop:
                try:
                    wrong[i] += not torch.equal(call(), ref)
                except Exception as e:  # noqa: BLE001 - counted: a mixed cache raises size mismatches
                    errors.append(repr(e)[:200])
    calls = ((lambda: vae.decode(za, return_dict=False)[0], ra), (lambda: vae.decode(zb, return_dict=False)[0], rb),
             (lambda: vae.encode(image).latent_dist.mode(), re))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=loop, args=(i, *c_r)) for i, c_r in enumerate(calls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == [0, 0, 0] and errors == [], (wrong, errors[:3])
