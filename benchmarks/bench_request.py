"""Whole-request benchmark: text encode, every denoising step, VAE decode; eager buckets vs CUDA graphs.

The pipeline is bcg-serve's own (``DiTPipeline``), built from random weights so that it runs where no
checkpoint can be downloaded:

- transformer: ``tiny`` (the embedded default's config) or ``flux-dev`` (FLUX.1-dev's config from
  ``benchmarks/bench_graphs.py``, guidance-distilled: one row per image, no uncond rows), with
  ``pooled_projection_dim`` set to ``joint_attention_dim`` because one sentence encoder gives both;
- VAE: ``tiny`` (the default's) or ``flux`` (FLUX.1's ``AutoencoderKL`` layout: 128/256/512/512 channels);
- text encoder: a one-layer BERT with random weights and a WordPiece tokenizer trained on the prompts of
  ``bcg_core/data/krea_open_prompts_1k_flat.csv`` (the embedded all-MiniLM-L6-v2, 88 MB, cannot travel to
  the GPU machine beside the site pack).

``--save DIR`` writes the assembled model as a checkpoint folder (``bcg_core.save_pipeline``) that
``bcg serve``, ``bcg demo`` and ``bcg verify`` load through ``model.path``.

Usage::

    python benchmarks/bench_request.py --transformer flux-dev --vae flux --size 512x512 --steps 28
"""

from __future__ import annotations

import argparse
import csv
import importlib.resources
import json
import statistics
import tempfile
import time

import torch

from bcg_core import BucketConfig, DiTPipeline, GenerationRequest, parse_size, save_pipeline
from bcg_core.config import LimitsConfig, ModelConfig, RunnerConfig
from bcg_core.families.tiny import assemble_flux, tiny_transformer_config, tiny_vae_config
from bcg_core.text import SentenceTextEncoder
from deployments.settings import ServeConfig

FLUX_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
)  # black-forest-labs/FLUX.1-dev vae/config.json


def krea_tokenizer(vocab_size: int = 4000):
    """A BERT WordPiece tokenizer trained (deterministically) on the krea prompts kept in the package."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    data = importlib.resources.files("bcg_core") / "data" / "krea_open_prompts_1k_flat.csv"
    with data.open(newline="", encoding="utf-8") as f:
        prompts = [r["prompt"] for r in csv.DictReader(f) if r["prompt"].strip()]
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(prompts, vocab_size=vocab_size, min_frequency=1, show_progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(f"{tmp}/tokenizer.json")
        return BertTokenizerFast(tokenizer_file=f"{tmp}/tokenizer.json", unk_token="[UNK]", sep_token="[SEP]",
                                 pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]", model_max_length=512)


def build(transformer: str, vae: str, text_tokens: int, device: torch.device, dtype: torch.dtype,
          layers: tuple[int, int] | None = None):
    """The assembled random-weight model (see the module docstring); ``layers`` overrides the transformer's
    (double-stream, single-stream) block counts, e.g. FLUX.1-dev's width with fewer blocks."""
    import importlib.util
    import sys
    from pathlib import Path

    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    tok = krea_tokenizer()
    if transformer == "tiny":
        cfg = tiny_transformer_config(384)
    else:
        path = Path(__file__).with_name("bench_graphs.py")
        spec = importlib.util.spec_from_file_location("bench_graphs", path)
        bench = sys.modules.setdefault("bench_graphs", importlib.util.module_from_spec(spec))
        spec.loader.exec_module(bench)
        cfg = dict(bench.MODELS[transformer].config)
    if layers is not None:
        cfg["num_layers"], cfg["num_single_layers"] = layers
    cfg["pooled_projection_dim"] = cfg["joint_attention_dim"]
    hidden = cfg["joint_attention_dim"]
    bert = BertModel(BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=1,
                                num_attention_heads=max(1, hidden // 128), intermediate_size=4 * hidden,
                                max_position_embeddings=512))
    text = SentenceTextEncoder(tok, bert.to(device))
    with torch.device(device):
        tr = FluxTransformer2DModel(**cfg).to(dtype)
        ae = AutoencoderKL(**(FLUX_VAE if vae == "flux" else tiny_vae_config())).to(dtype)
    return assemble_flux(f"random-{transformer}", tr, ae, text, text_tokens, device, dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transformer", choices=("tiny", "flux-dev"), default="tiny")
    ap.add_argument("--vae", choices=("tiny", "flux"), default="tiny")
    ap.add_argument("--text-tokens", type=int, default=256)
    ap.add_argument("--size", default="512x512")
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--save", help="also write the model as a checkpoint folder here")
    ap.add_argument("--layers", help="DOUBLE,SINGLE block counts overriding the transformer's (e.g. 2,4)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
    model = build(args.transformer, args.vae, args.text_tokens, dev, dtype, layers)
    if args.save:
        save_pipeline(model, args.save)
        print(f"saved {args.save}")
        if args.iters == 0:
            return
    w, h = parse_size(args.size)
    buckets = BucketConfig(batch_sizes=[1, 2, 4, 8], resolutions=[args.size], text_lengths=[args.text_tokens])
    limits = LimitsConfig(max_steps=max(50, args.steps))
    req = GenerationRequest("a corgi astronaut on the moon, award-winning photograph", n=args.n, width=w, height=h,
                            num_inference_steps=args.steps, guidance_scale=3.5, seed=1)
    result = dict(transformer=args.transformer, vae=args.vae, size=args.size, n=args.n, steps=args.steps,
                  device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")
    images = {}
    for mode in ("eager", "graph") if dev.type == "cuda" else ("eager",):
        cfg = ServeConfig(model=ModelConfig(dtype=str(dtype).removeprefix("torch.")), buckets=buckets, limits=limits,
                          runner=RunnerConfig(mode=mode, kernels="eager"))
        t0 = time.perf_counter()
        pipe = DiTPipeline(cfg, model)
        prepare_s = time.perf_counter() - t0
        totals, parts = [], []
        for _ in range(args.iters + 1):  # the first run warms up
            out = pipe.generate(pipe.validator.validate(req))
            totals.append(out.timings_ms["total"])
            parts.append(out.timings_ms)
        images[mode] = out.image_bytes
        result[mode] = dict(prepare_s=round(prepare_s, 2), bucket=None if out.bucket is None else str(out.bucket),
                            total_ms=round(statistics.median(totals[1:]), 1),
                            **{k + "_ms": round(statistics.median(p[k] for p in parts[1:]), 1)
                               for k in ("encode", "denoise", "decode")})
        print(mode, json.dumps(result[mode]))
        del pipe
    if "graph" in result:
        result["speedup"] = round(result["eager"]["total_ms"] / result["graph"]["total_ms"], 2)
        result["same_png"] = images["eager"] == images["graph"]
        print(f"whole request: eager {result['eager']['total_ms']} ms, bcg {result['graph']['total_ms']} ms "
              f"({result['speedup']}x); identical PNGs: {result['same_png']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
