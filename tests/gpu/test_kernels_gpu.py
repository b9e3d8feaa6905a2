"""Compiled kernels captured in the bucket graphs (``runner.kernels: compiled``) on a real GPU: every bucket is
captured with its compiled blocks, replays within the bf16 tolerance of the unpadded eager forward, and a compile
that fails leaves its bucket on eager kernels under its graph."""

import pytest
import torch

from bcg_core import BucketMetrics, LimitsConfig
from bcg_core.runners.cuda_graph import CudaGraphRunner
from bcg_core.runners.kernels import CompiledKernels, KernelTier
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16_RTOL = 2e-2
CUDA = torch.device("cuda")


def test_compiled_kernels_are_captured_in_every_bucket_graph_and_replay_within_tolerance(table, new_adapter):
    adapter = new_adapter()
    kernels = CompiledKernels(adapter.model)
    runner = CudaGraphRunner(adapter, table.keys, BucketMetrics(table.keys), CUDA, torch.bfloat16, kernels=kernels)
    runner.prepare()
    assert runner.graph_count == len(table.keys) and runner.stats.compile_failed == 0
    assert {d["kernels"] for d in runner.describe()} == {"compiled"} and kernels.compile_s > 0
    verdicts = verify_runner(adapter, runner, boundary_cases(table, LimitsConfig()), CUDA, torch.bfloat16,
                             rtol=BF16_RTOL)
    assert all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]
    assert not kernels.on  # the compiled blocks are switched on only inside bucket forwards


def test_a_shared_batch_compile_is_captured_in_every_bucket_graph_and_replays_within_tolerance(table, new_adapter):
    """``runner.compile_batch_dynamic``: buckets of one token shape share one compile with a dynamic batch
    (:func:`~bcg_core.runners.kernels.shared_batch`). Every bucket captures it, nothing compiles inside a capture
    (the in-memory key holds the bucket's SDPA backend) and each replays within the bf16 tolerance."""
    adapter = new_adapter()
    kernels = CompiledKernels(adapter.model, batch_dynamic=True)
    runner = CudaGraphRunner(adapter, table.keys, BucketMetrics(table.keys), CUDA, torch.bfloat16, kernels=kernels)
    runner.prepare()
    assert runner.graph_count == len(table.keys) and runner.stats.compile_failed == 0, runner.stats
    assert {d["kernels"] for d in runner.describe()} == {"compiled"}
    verdicts = verify_runner(adapter, runner, boundary_cases(table, LimitsConfig()), CUDA, torch.bfloat16,
                             rtol=BF16_RTOL)
    assert all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_with_the_compile_check_one_warm_up_forward_precedes_the_capture(table, new_adapter, monkeypatch):
    """With the check on (``rtol``), a bucket runs ``warmup_iters - 1`` side-stream warm-ups: the check runs the
    compiled forward once more (then the eager one) before the capture. Every bucket still captures its compiled
    kernels and replays within tolerance; a bucket of eager kernels keeps ``warmup_iters``."""
    adapter = new_adapter()
    kernels = CompiledKernels(adapter.model, rtol=0.1)
    runner = CudaGraphRunner(adapter, table.keys, BucketMetrics(table.keys), CUDA, torch.bfloat16, kernels=kernels)
    forwards = []
    real = CudaGraphRunner._forward
    monkeypatch.setattr(CudaGraphRunner, "_forward",
                        lambda self, b, f, plain=False: forwards.append(torch.cuda.is_current_stream_capturing())
                        or real(self, b, f, plain))
    runner.prepare()
    assert runner.graph_count == len(table.keys) and runner.stats.compile_failed == 0
    assert all(e.compile_rel_err is not None for e in runner.entries.values())
    assert forwards == [False, True] * len(table.keys)  # one warm-up, then the capture, per bucket
    verdicts = verify_runner(adapter, runner, boundary_cases(table, LimitsConfig()), CUDA, torch.bfloat16,
                             rtol=BF16_RTOL)
    assert all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]
    forwards.clear()
    eager = CudaGraphRunner(adapter, table.keys[:1], BucketMetrics(table.keys[:1]), CUDA, torch.bfloat16)
    eager.prepare()
    assert forwards == [False, False, True]


def test_a_failed_compile_keeps_eager_kernels_under_the_graph(table, new_adapter):
    def broken(fn, **options):
        def compiled(*args, **kwargs):
            raise RuntimeError("inductor: triton compile failed (simulated)")
        return compiled

    adapter = new_adapter()
    runner = CudaGraphRunner(adapter, table.keys, BucketMetrics(table.keys), CUDA, torch.bfloat16,
                             kernels=CompiledKernels(adapter.model, compile_fn=broken))
    runner.prepare()
    assert runner.graph_count == len(table.keys) and runner.stats.compile_failed == len(table.keys)
    assert all(e.kernels is KernelTier.EAGER and e.note.startswith("compile_failed: RuntimeError")
               for e in runner.entries.values())
    verdicts = verify_runner(adapter, runner, boundary_cases(table, LimitsConfig()), CUDA, torch.bfloat16,
                             rtol=BF16_RTOL)
    assert all(v.passed for v in verdicts)


def test_fp8_kernels_capture_and_leave_inductor_settings_alone(table, new_adapter):
    """The fp8 tier turns the repeated blocks' linear layers to float8 (torchao), compiles and captures them; it
    does not switch on torchao's process-wide inductor tuning (coordinate descent crashed Triton on FLUX blocks)."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9")
    from bcg_core.runners.fp8 import quantize_fp8

    before = torch._inductor.config.coordinate_descent_tuning
    adapter = new_adapter()
    assert quantize_fp8(adapter.model) > 0
    assert torch._inductor.config.coordinate_descent_tuning == before
    kernels = CompiledKernels(adapter.model)
    runner = CudaGraphRunner(adapter, table.keys, BucketMetrics(table.keys), CUDA, torch.bfloat16, kernels=kernels)
    runner.prepare()
    assert runner.graph_count == len(table.keys) and runner.stats.compile_failed == 0
    verdicts = verify_runner(adapter, runner, boundary_cases(table, LimitsConfig()), CUDA, torch.bfloat16, rtol=0.1)
    print({str(v.key): round(v.max_rel_err, 4) for v in verdicts})
    assert all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]


def test_the_vae_decode_compiles_in_the_background_within_its_tolerance_and_serves_meanwhile():
    from diffusers import AutoencoderKL

    from bcg_core.families.tiny import tiny_vae_config
    from bcg_core.runners.decode import CompiledDecode

    torch.manual_seed(0)
    vae = AutoencoderKL(**tiny_vae_config()).to(CUDA, torch.bfloat16).eval()
    # a real inductor compile, kept whatever its time (the timer says so), so that the compiled path surely runs
    decoder = CompiledDecode(vae, timer=lambda path, call: (call(), 0.0 if path == "compiled" else 1.0)[1])
    vae.decode = decoder
    side = torch.cuda.Stream()  # the families decode on the decode thread's own stream
    with torch.inference_mode(), torch.cuda.stream(side):
        z = torch.randn(2, vae.config.latent_channels, 32, 32, device=CUDA, dtype=torch.bfloat16)
        ref = vae.decode(z, return_dict=False)[0]
        for _ in range(20):  # decodes go on while the background thread compiles, checks and times
            assert torch.equal(vae.decode(z, return_dict=False)[0], ref)
        assert decoder.wait(240)
        shape = decoder.describe()["shapes"]["2x16x32x32 bfloat16"]
        # within the bf16 rounding-derived tolerance, and kept
        assert shape["state"] == "compiled" and shape["rel_err"] <= shape["rtol"], shape
        out = vae.decode(z, return_dict=False)[0]
    assert (out.float() - ref.float()).abs().max() <= shape["rtol"] * ref.float().abs().max()
    assert decoder.describe()["compiled_calls"] == 1
    decoder.close()


def test_fp8_keeps_a_zero_activation_row_zero_so_padded_text_cannot_poison_the_image():
    """PixArt-Sigma's padded text tokens reach the cross-attention's ``to_k`` / ``to_v`` as zero rows where the
    caption projection's biases are zero (random weights). Without a lower bound on a row's absolute maximum the
    row's float8 scale is 0 and it quantizes to NaN, which masked attention spreads to every image token
    (``fp8.FP8_AMAX_LB``). A layer with an all-zero weight row stays in bf16."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9")
    from diffusers import PixArtTransformer2DModel

    from bcg_core.runners.fp8 import FP8_RTOL, fp8_layers, quantize_fp8

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8,
                                     num_layers=2, cross_attention_dim=64, sample_size=32, patch_size=2,
                                     caption_channels=64, norm_type="ada_norm_single", use_additional_conditions=False)
    model = model.to(CUDA, torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("caption_projection") and name.endswith("bias"):
                p.zero_()
        model.transformer_blocks[1].ff.net[2].weight[3].zero_()  # an all-zero weight row
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 32, 32, generator=g).to(CUDA, torch.bfloat16)
    text = torch.randn(2, 32, 64, generator=g).to(CUDA, torch.bfloat16)
    text[:, 20:] = 0  # 12 padded tokens
    mask = torch.ones(2, 32, device=CUDA, dtype=torch.bfloat16)
    mask[:, 20:] = 0
    kw = dict(encoder_hidden_states=text, encoder_attention_mask=mask, timestep=torch.tensor([500, 500], device=CUDA),
              added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)
    with torch.inference_mode():
        ref = model(latents, **kw)[0].float()
    names = fp8_layers(model)
    assert "transformer_blocks.1.ff.net.2" not in names and "transformer_blocks.1.attn2.to_k" in names
    assert quantize_fp8(model) == len(names)
    with torch.inference_mode():
        out = model(latents, **kw)[0].float()
    assert torch.isfinite(out).all()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= FP8_RTOL, err
