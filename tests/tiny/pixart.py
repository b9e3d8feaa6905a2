"""A tiny PixArt-Sigma pipeline in the real layout, built offline with seeded random weights.

``PixArtSigmaPipeline`` with its real components at toy size: a ``T5EncoderModel`` (one layer, 32 channels)
with the tiny ``T5Tokenizer`` of :mod:`tests.tiny.tokenizers`, a ``PixArtTransformer2DModel`` (patch 2,
4 latent channels in, 8 out: noise and learned sigma, as PixArt-Sigma), an SDXL-layout ``AutoencoderKL``
(4 latent channels, 8x downsampling, scaling factor 0.13025) and PixArt-Sigma's DPM-Solver++ 2M scheduler
config. ``pipe.save_pretrained(folder)`` writes ``model_index.json`` with ``_class_name``
``PixArtSigmaPipeline``; ``PixArtSigmaPipeline.from_pretrained(folder, local_files_only=True)`` reads it
back.

The transformer's ``sample_size`` picks the aspect-ratio bin table of resolution binning
(``PixArtSigmaPipeline.__call__``): 32 -> ``ASPECT_RATIO_256_BIN`` (bins of about 256x256 pixels, the
default here, so that CPU tests run at 256x256 and below), 64 -> ``ASPECT_RATIO_512_BIN``, 128 ->
``ASPECT_RATIO_1024_BIN``, 256 -> ``ASPECT_RATIO_2048_BIN``; any other value makes diffusers raise
"Invalid sample size".
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tokenizers import t5_tokenizer

__all__ = ["PIXART_SIGMA_SCHEDULER", "build"]

PIXART_SIGMA_SCHEDULER = dict(
    algorithm_type="dpmsolver++", beta_end=0.02, beta_schedule="linear", beta_start=0.0001,
    dynamic_thresholding_ratio=0.995, euler_at_final=False, lower_order_final=True, num_train_timesteps=1000,
    prediction_type="epsilon", sample_max_value=1.0, solver_order=2, solver_type="midpoint", steps_offset=0,
    thresholding=False, timestep_spacing="linspace", use_karras_sigmas=False, use_lu_lambdas=False,
)
"""``scheduler/scheduler_config.json`` of PixArt-alpha/PixArt-Sigma-XL-2-1024-MS (DPM-Solver++ 2M, first-order
last step)."""


def build(folder: Path, *, sample_size: int = 32, num_layers: int = 1, seed: int = 0) -> Path:
    """Build and save a tiny random-weight PixArt-Sigma pipeline.

    Args:
        folder: where to write the pipeline (created).
        sample_size: the transformer's ``sample_size`` in latent pixels; selects the resolution-binning table
            (32 -> ``ASPECT_RATIO_256_BIN``, 64 -> 512, 128 -> 1024, 256 -> 2048 bins).
        num_layers: transformer blocks.
        seed: ``torch.manual_seed`` of the weights (same seed, same folder contents).

    Returns:
        ``folder``.
    """
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    folder = Path(folder)
    tokenizer = t5_tokenizer(max_length=300)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        text_encoder = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.1, feed_forward_proj="gated-gelu",
            is_encoder_decoder=False, pad_token_id=0, eos_token_id=1,
        )).eval()
        transformer = PixArtTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=num_layers,
            cross_attention_dim=16, sample_size=sample_size, patch_size=2, caption_channels=32,
            use_additional_conditions=False, norm_type="ada_norm_single", interpolation_scale=None,
        ).eval()
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16, 16),
            layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=4, scaling_factor=0.13025,
            sample_size=sample_size * 8,
        ).eval()
    finally:
        torch.random.set_rng_state(state)
    scheduler = DPMSolverMultistepScheduler(**PIXART_SIGMA_SCHEDULER)
    pipe = PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                               scheduler=scheduler)
    pipe.save_pretrained(folder)
    return folder
