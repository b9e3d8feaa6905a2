"""A tiny random-weight ``WanPipeline`` (Wan 2.1 text to video) in the real checkpoint layout, built offline.

Layout of ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` with toy widths (every model ``.eval()``, seeded):

- ``tokenizer``: the tiny ``T5Tokenizer`` of :mod:`tests.tiny.tokenizers` (Unigram; the real checkpoint's is
  UMT5's), ``model_max_length`` 512 as ``max_sequence_length``.
- ``text_encoder``: ``UMT5EncoderModel`` (the published class; 1 layer, width 32).
- ``transformer``: ``WanTransformer3DModel`` (patch (1, 2, 2), 16 latent channels in and out, 2 heads of 8, 1
  block, text width 32, ``rope_max_seq_len`` 64: grids up to 64 tokens a side, 832x480 included).
- ``vae``: ``AutoencoderKLWan`` (``base_dim`` 8, ``dim_mult`` [1, 1, 1, 1]: 8x spatial and, with
  ``temperal_downsample`` [False, True, True], 4x temporal compression, as the real VAE; 16 latent channels with
  its default ``latents_mean`` / ``latents_std``), so 16 pixels per token side and ``(num_frames - 1) / 4 + 1``
  latent frames.
- ``scheduler``: ``UniPCMultistepScheduler`` with Wan 2.1's ``scheduler_config.json`` (flow prediction, flow
  sigmas, ``flow_shift`` 3.0: the 480p value).

``boundary_ratio`` set builds Wan 2.2's layout instead: a second expert ``transformer_2`` (other weights) that
``WanPipeline`` runs below ``boundary_ratio x 1000``.

A 2-step run of 5 frames at 48x32 takes a few hundredths of a second on a CPU.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["WAN_SCHEDULER_CONFIG", "build"]

WAN_SCHEDULER_CONFIG = dict(
    beta_end=0.02, beta_schedule="linear", beta_start=0.0001, disable_corrector=[], dynamic_thresholding_ratio=0.995,
    final_sigmas_type="zero", flow_shift=3.0, lower_order_final=True, num_train_timesteps=1000, predict_x0=True,
    prediction_type="flow_prediction", rescale_betas_zero_snr=False, sample_max_value=1.0, solver_order=2,
    solver_p=None, solver_type="bh2", steps_offset=0, thresholding=False, timestep_spacing="linspace",
    trained_betas=None, use_beta_sigmas=False, use_exponential_sigmas=False, use_flow_sigmas=True,
    use_karras_sigmas=False,
)
"""``scheduler/scheduler_config.json`` of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (UniPC, flow sigmas, shift 3.0)."""


def _transformer(seed: int, layers: int = 1):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    ).eval()


def _common():
    """Tokenizer, text encoder, VAE and scheduler (seeded)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from .tokenizers import t5_tokenizer

    tokenizer = t5_tokenizer(max_length=512)
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )).eval()
    torch.manual_seed(2)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG))


def build(folder: Path, boundary_ratio: float | None = None, layers: int = 1) -> Path:
    """Write the tiny Wan pipeline to ``folder`` (created); returns it.

    Args:
        folder: where to write the pipeline.
        boundary_ratio: None: Wan 2.1 (one transformer). A ratio in (0, 1): Wan 2.2's two experts, ``transformer``
            for timesteps at or above ``boundary_ratio x 1000``, ``transformer_2`` below.
        layers: transformer blocks (a step cache's tests need a head block, blocks after it and a tail: 3).
    """
    from diffusers import WanPipeline

    common = _common()
    transformer = _transformer(1, layers)
    transformer_2 = _transformer(3, layers) if boundary_ratio is not None else None
    pipe = WanPipeline(**common, transformer=transformer, transformer_2=transformer_2, boundary_ratio=boundary_ratio)
    folder = Path(folder)
    pipe.save_pretrained(folder)
    return folder

