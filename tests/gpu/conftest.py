"""Fixtures of the GPU tests (each test module skips itself without CUDA)."""

import pytest
import torch

from bcg_core import BucketConfig, BucketMetrics, BucketTable, FluxAdapter


def make_flux_adapter(dtype=torch.bfloat16, text_tokens=64, guidance_embeds=False) -> FluxAdapter:
    """A small FLUX-architecture transformer (2 double + 2 single blocks, 4 heads x 64) on CUDA."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=64,
        num_attention_heads=4, joint_attention_dim=128, pooled_projection_dim=96, guidance_embeds=guidance_embeds,
        axes_dims_rope=(16, 24, 24),
    )
    return FluxAdapter(model.to("cuda", dtype).eval(), native_text_tokens=text_tokens)


@pytest.fixture(scope="module")
def no_tf32():
    """TF32 off for the module's tests (cuDNN turns it on for convolutions by default; the VAE then amplifies a
    1e-7 difference of the latents into one-level pixel flips), restored after."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def adapter():
    return make_flux_adapter()


@pytest.fixture()
def new_adapter():
    """:func:`make_flux_adapter`, for a test that changes its model (compiled blocks, say)."""
    return make_flux_adapter


@pytest.fixture(scope="module")
def table(adapter):
    cfg = BucketConfig(batch_sizes=[1, 2, 4], resolutions=["256x256", "512x512"], text_lengths=[64])
    return BucketTable(cfg, adapter.rules, min_image_tokens=256)


@pytest.fixture()
def metrics(table):
    return BucketMetrics(table.keys)
