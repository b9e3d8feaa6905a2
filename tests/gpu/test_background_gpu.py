"""Ready first, compiled later on a real GPU (``bcg_core/runners/background.py``): buckets captured with eager
kernels for want of a cached compile serve at once, compile on the background thread while forwards replay, and are
swapped in as graphs of compiled kernels that replay within the bf16 tolerance of the unpadded eager forward; a warm
cache captures compiled kernels at once."""

import threading

import pytest
import torch

from bcg_core import BucketMetrics, LimitsConfig
from bcg_core.runners.background import BackgroundCompiles
from bcg_core.runners.base import RunMode
from bcg_core.runners.cuda_graph import CudaGraphRunner
from bcg_core.runners.kernels import CompiledKernels
from bcg_core.runners.precompiled import available
from bcg_core.verify import verify_runner
from bcg_core.verify_inputs import boundary_cases

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not available(torch.compile), reason="torch without ahead-of-time compile")]

BF16_RTOL = 2e-2
CUDA = torch.device("cuda")


def test_eager_graphs_serve_while_compiling_then_compiled_graphs_are_swapped_in(table, new_adapter, tmp_path):
    adapter = new_adapter()
    kernels = CompiledKernels(adapter.model, rtol=0.1, cache_dir=str(tmp_path))
    runner = CudaGraphRunner(adapter, table.keys, BucketMetrics(table.keys), CUDA, torch.bfloat16, kernels=kernels,
                             fused=True)
    runner.prepare(defer_compiles=True)
    assert runner.graph_count == len(table.keys) and runner.pending_compiles() == runner.keys
    assert {(d["mode"], d["kernels"], d["pending"]) for d in runner.describe()} == {("graph", "eager", True)}
    cases = boundary_cases(table, LimitsConfig())
    stop, served, errors = threading.Event(), [0], []

    def serve():  # replays of every bucket, back to back, while the compiles run
        try:
            while not stop.is_set():
                verdicts = verify_runner(adapter, runner, cases[:4], CUDA, torch.bfloat16, rtol=BF16_RTOL)
                assert all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts]
                served[0] += 1
        except Exception as e:  # noqa: BLE001 - recorded for the assertion below
            errors.append(e)

    factors = []
    compiles = BackgroundCompiles(runner, on_swap=lambda key, f: factors.append(f))
    client = threading.Thread(target=serve)
    client.start()
    assert compiles.start() and compiles.wait(timeout_s=900)
    stop.set()
    client.join(300)
    assert not errors and served[0] > 0, errors
    state = compiles.describe()
    assert (state["pending"], state["swapped"], state["failed"]) == (0, len(table.keys), 0), state
    assert runner.stats.swaps == len(table.keys) and len(factors) == len(table.keys) and all(f > 0 for f in factors)
    assert all(e.mode is RunMode.GRAPH and e.kernels.value == "compiled" and runner.fuses(e.key)
               for e in runner.entries.values())
    verdicts = verify_runner(adapter, runner, cases, CUDA, torch.bfloat16, rtol=BF16_RTOL)
    assert all(v.passed for v in verdicts), [(str(v.key), v.max_rel_err) for v in verdicts if not v.passed]

    # a restart (fresh compiled kernels on a fresh model, same cache folder): compiled graphs at once
    again = new_adapter()
    warm = CudaGraphRunner(again, table.keys, BucketMetrics(table.keys), CUDA, torch.bfloat16,
                           kernels=CompiledKernels(again.model, rtol=0.1, cache_dir=str(tmp_path)))
    warm.prepare(defer_compiles=True)
    assert warm.pending_compiles() == [] and {d["kernels"] for d in warm.describe()} == {"compiled"}


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
def test_a_vae_decode_does_not_depend_on_a_compiles_sdpa_order(backend):
    """The VAE's mid-block attention (one head of 512 channels, FLUX's and SDXL's VAEs) calls SDPA outside the runner's
    ``ORDER_LOCK``: a decode while a background compile holds another priority order must give the same bits."""
    from diffusers import AutoencoderKL

    from bcg_core.runners.attention import attention_backend

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        block_out_channels=(128, 256, 512, 512), layers_per_block=2).to(CUDA, torch.bfloat16).eval()
    latents = torch.randn(2, 16, 64, 64, device=CUDA, dtype=torch.bfloat16)
    with torch.inference_mode():
        default = vae.decode(latents).sample
        with attention_backend(backend):
            other = vae.decode(latents).sample
    assert torch.equal(default, other)
