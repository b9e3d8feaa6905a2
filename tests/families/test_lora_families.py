"""LoRA reference gate: bcg-serve's per-row adapters give what diffusers' pipeline gives after
``load_lora_weights`` and ``set_adapters`` with the same names and weights, for every family whose diffusers
pipeline loads LoRA.

Per family (FLUX.1-dev; SD3.5 with RMS qk-norm and SD3.5-medium's dual attention; SANA; Qwen-Image) one tiny
random-weight checkpoint (``tests/tiny/<family>.py``) and two tiny adapters (``tests/tiny/lora.py``: peft
``LoraConfig`` layers with random A and B, saved with the pipeline class's ``save_lora_weights``):

- ``style-a``: a folder ``style-a/pytorch_lora_weights.safetensors`` with its ``LoraConfig`` saved as
  metadata, rank 4 and alpha 8 with a ``rank_pattern`` (``to_q``: 2) and an ``alpha_pattern`` (``to_k``: 3),
  on the attention projections, the MLP projections and the blocks' AdaLN modulation layers.
- ``style-b``: one file ``style-b.safetensors`` without metadata (diffusers infers each layer's rank from its
  shapes, 8 and 3 on ``to_v``, and takes alpha = rank: scaling 1 whatever alpha it was trained with), on other
  projections, the other stream's or the output norm's modulation, the embedders and the final projection.

Between them the two adapters change every linear layer of each transformer (all are wrapped by default).
SANA's feed-forward is a GLUMBConv of convolutions, not linear layers: an adapter on them is refused, naming
the layer.

Gates (:func:`reference_gate.assert_same`: final latents within 1e-5 relative, images equal up to one level on
at most 0.1% of the pixel values): one adapter at 0.8 on two images (with their CFG rows where the family uses
CFG); two adapters at 0.8 and -0.5; a two-adapter request joining a running request that carries one adapter
at another scale, their rows and a pad row sharing each padded forward. So that the gates cannot pass with
adapters ignored, each adapter, and the request's scale, must move the final latents by a thousand times
that tolerance. PixArt-Sigma, whose diffusers pipeline has no LoRA loader, refuses ``lora.dir`` in ``bcg config
--check`` and when the pipeline is built.

FLUX.2 [dev] and [klein], Z-Image and Qwen-Image 2.1 (:data:`NEWER`) have one combined gate each, two steps at the
smallest shapes: ``style-a`` as above, and ``style-b`` written in a published non-diffusers layout that diffusers'
``lora_state_dict`` converts (``tiny.lora.make_published``: FLUX.2's original names with the fused ``qkv``, kohya's
for Z-Image, ``diffusion_model.`` for Qwen-Image 2.1), on every linear layer; a two-adapter request with CFG rows
joins a running one-adapter request, through padded bucket forwards and, where the family's unpadded forward
does not keep one entry per row (``eager_mixes_rows``), through unpadded ones too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from diffusers import (
    Flux2KleinPipeline,
    Flux2Pipeline,
    FluxPipeline,
    QwenImage21Pipeline,
    QwenImagePipeline,
    SanaPipeline,
    StableDiffusion3Pipeline,
    ZImagePipeline,
)

from bcg_core import DiTPipeline, GenerationRequest, RequestError
from reference_gate import RTOL, GateRun, assert_same, bcg_pipeline, bcg_run, bcg_run_joined, bcg_state, diffusers_run
from tiny import flux, flux2, pixart, qwenimage, qwenimage21, sana, sd3, zimage
from tiny.lora import make_adapter, make_published

LORA = {"slots": 2, "max_rank": 8, "max_per_request": 2}
"""The ``lora`` section (``dir`` added per family): two resident adapters, both at once in one request."""

CHANGED = 1e3 * RTOL
"""Least relative change of the final latents an adapter must make (a thousand times the gate's tolerance)."""

ONE = (("style-a", 0.8),)
TWO = (("style-a", 0.8), ("style-b", -0.5))

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
JOINT = ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
PROMPT = "a photo of a cat sitting on a red chair"


@dataclass(frozen=True)
class Family:
    """How one family is built, served and called in diffusers.

    Attributes:
        pipeline_cls: its diffusers pipeline class (the LoRA loader of both sides).
        build: checkpoint folder -> the folder, built (a ``tests/tiny`` builder).
        buckets: the bucket table (batch 1, 2 and 4 at one resolution).
        request: the requests' prompt, size and guidance (CFG rows where the family uses CFG).
        no_cfg: what turns CFG off, for the request another one joins.
        targets_a, targets_b: peft ``target_modules`` of ``style-a`` and ``style-b`` (name suffixes).
        limits: more ``limits`` of the pipeline.
        call: more keyword arguments of diffusers' call (as the family's own gate passes them).
    """

    pipeline_cls: type
    build: Callable[[Path], Path]
    buckets: dict
    request: dict
    no_cfg: dict
    targets_a: list[str]
    targets_b: list[str]
    limits: dict = field(default_factory=dict)
    call: dict = field(default_factory=dict)


FAMILIES = {
    "flux": Family(
        FluxPipeline, lambda folder: flux.build(folder, "dev"),
        dict(batch_sizes=[1, 2, 4], resolutions=["32x32"], text_lengths=[flux.TEXT_TOKENS]),
        dict(prompt=PROMPT, width=32, height=32, guidance_scale=3.5),
        dict(guidance_scale=5.0),  # guidance is an embedding: no CFG rows either way
        # both streams' attention and MLPs, the single blocks' MLP and output projections (proj_out also
        # matches the final projection), the image stream's and the single blocks' AdaLN modulation
        targets_a=[*ATTENTION, *JOINT, "ff.net.0.proj", "ff.net.2", "ff_context.net.2", "proj_mlp",
                   "proj_out", "norm1.linear", "norm.linear"],
        # the text stream's and the output norm's modulation; the timestep, guidance and pooled-text
        # embedders; the image and text embedders
        targets_b=["to_q", "to_v", "ff_context.net.0.proj", "norm1_context.linear", "norm_out.linear",
                   "linear_1", "linear_2", "x_embedder", "context_embedder"],
        call=dict(max_sequence_length=flux.TEXT_TOKENS),
    ),
    "sd3": Family(
        StableDiffusion3Pipeline, lambda folder: sd3.build(folder, "sd35"),
        dict(batch_sizes=[1, 2, 4], resolutions=["64x64"], text_lengths=[333]),
        dict(prompt=PROMPT, width=64, height=64, guidance_scale=4.5),
        dict(guidance_scale=1.0),
        # joint attention (and block 0's second self-attention, attn2), both MLPs, the image modulation
        targets_a=[*ATTENTION, *JOINT, "ff.net.0.proj", "ff.net.2", "ff_context.net.2", "norm1.linear"],
        targets_b=["to_q", "to_v", "ff_context.net.0.proj", "norm1_context.linear", "norm_out.linear",
                   "linear_1", "linear_2", "context_embedder", "proj_out"],
    ),
    "sana": Family(
        SanaPipeline, lambda folder: sana.build(folder),
        dict(batch_sizes=[1, 2, 4], resolutions=["512x512"], text_lengths=[16, 32]),
        dict(prompt=PROMPT, width=512, height=512, guidance_scale=4.5),
        dict(guidance_scale=1.0),
        # self- and cross-attention, and the AdaLN-single modulation every block reads (no linear MLP)
        targets_a=[*ATTENTION, "time_embed.linear"],
        targets_b=["to_q", "to_v", "linear_1", "linear_2", "caption_projection.linear_1", "proj_out"],
    ),
    "qwenimage": Family(
        QwenImagePipeline, lambda folder: qwenimage.build(folder),
        dict(batch_sizes=[1, 2, 4], resolutions=["64x64"], text_lengths=[16, 32]),
        dict(prompt=PROMPT, width=64, height=64, negative_prompt="blurry"),
        dict(negative_prompt=None),  # true CFG only with a negative prompt
        targets_a=[*ATTENTION, *JOINT, "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.2", "img_mod.1"],
        targets_b=["to_q", "to_v", "txt_mlp.net.0.proj", "txt_mod.1", "norm_out.linear", "linear_1",
                   "linear_2", "img_in", "txt_in", "proj_out"],
        limits=dict(min_side_px=16),
    ),
}


@dataclass
class Served:
    """One family's checkpoint, adapters and bcg-serve pipeline (``lora.dir`` = ``loras``)."""

    name: str
    family: Family
    folder: Path
    loras: Path
    pipe: DiTPipeline

    def req(self, lora=(), **kw) -> GenerationRequest:
        """The family's request (one image, two steps unless ``kw`` says otherwise) with ``lora``."""
        base = {**self.family.request, "n": 1, "num_inference_steps": 2, "seed": 0}
        return GenerationRequest(**{**base, **kw}, lora=tuple(lora))

    def ref(self, request: GenerationRequest) -> GateRun:
        """diffusers' pipeline on ``request``, its adapters loaded and weighted as a diffusers user does."""
        return diffusers_run(self.family.pipeline_cls, self.folder, request, lora_dir=self.loras,
                             **self.family.call)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory) -> Served:
    """One family's tiny checkpoint, ``style-a`` and ``style-b``, and a bcg-serve pipeline serving them."""
    fam = FAMILIES[request.param]
    folder = fam.build(tmp_path_factory.mktemp(f"lora-{request.param}") / "ckpt")
    loras = make_adapter(fam.pipeline_cls, folder, "style-a", fam.targets_a, rank=4, alpha=8, seed=0,
                         rank_pattern={"to_q": 2}, alpha_pattern={"to_k": 3})
    make_adapter(fam.pipeline_cls, folder, "style-b", fam.targets_b, rank=8, alpha=4, seed=1, metadata=False,
                 as_file=True, rank_pattern={"to_v": 3})
    assert (loras / "style-a" / "pytorch_lora_weights.safetensors").is_file()
    assert (loras / "style-b.safetensors").is_file()
    pipe = bcg_pipeline(folder, fam.buckets, lora={"dir": str(loras), **LORA}, **fam.limits)
    return Served(request.param, fam, folder, loras, pipe)


def _latents(pipe: DiTPipeline, request: GenerationRequest) -> torch.Tensor:
    """bcg-serve's final latents of ``request`` (:func:`reference_gate.bcg_state`: no decode)."""
    return bcg_state(pipe, request).latents.float().cpu()


def _changed(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest change of latents ``a`` from ``b``, relative to ``b``'s largest value (the gate's measure)."""
    return ((a - b).abs().max() / b.abs().max()).item()


def test_one_adapter_equals_diffusers(served):
    req = served.req(ONE, n=2, seed=11)  # two images; with CFG the uncond rows carry the adapter too
    assert_same(bcg_run(served.pipe, req), served.ref(req))
    a = served.pipe.lora.files.read("style-a")
    # the metadata's patterns: to_q rank 2 (alpha 8), to_k alpha 3 (rank 4), the rest rank 4 and alpha 8
    assert {(d.rank, d.scaling) for n, d in a.layers.items() if n.endswith(".to_q")} == {(2, 8 / 2)}
    assert {(d.rank, d.scaling) for n, d in a.layers.items() if n.endswith(".to_k")} == {(4, 3 / 4)}
    assert {(d.rank, d.scaling) for n, d in a.layers.items() if n.endswith(".to_v")} == {(4, 8 / 4)}


def test_two_adapters_at_different_scales_equal_diffusers(served):
    req = served.req(TWO, seed=5)
    assert_same(bcg_run(served.pipe, req), served.ref(req))
    b = served.pipe.lora.files.read("style-b")  # no metadata: ranks from the shapes, alpha = rank (scaling 1)
    assert {(d.rank, d.scaling) for n, d in b.layers.items() if n.endswith(".to_v")} == {(3, 1.0)}
    assert {(d.rank, d.scaling) for n, d in b.layers.items() if not n.endswith(".to_v")} == {(8, 1.0)}
    # between them the two adapters change every linear layer of the transformer (all are wrapped)
    a = served.pipe.lora.files.read("style-a")
    assert set(a.layers) | set(b.layers) == set(served.pipe.lora.layers.layers)


def test_rows_with_other_adapters_in_one_forward_equal_diffusers_for_both(served):
    # ``other`` (one adapter at another scale, no CFG: 1 row) runs a step alone, then ``req`` (two adapters, 2
    # rows) joins: both requests' rows and a pad row share each forward of the 4-row bucket.
    other = served.req((("style-b", 1.2),), num_inference_steps=3, seed=3, **served.family.no_cfg)
    req = served.req(TWO, seed=7)
    if served.pipe.validator.validate(req).rows == 1:  # FLUX: no CFG rows, so two images
        req = dataclasses.replace(req, n=2)
    assert [served.pipe.validator.validate(r).rows for r in (req, other)] == [2, 1]
    ours_req, ours_other = bcg_run_joined(served.pipe, req, other, head_start=1)
    assert_same(ours_req, served.ref(req))
    assert_same(ours_other, served.ref(other))


def test_each_adapter_and_its_scale_change_the_image(served):
    none, one, two, neg = (_latents(served.pipe, served.req(lora, seed=11))
                           for lora in ((), ONE, TWO, (("style-a", -0.8),)))
    assert _changed(one, none) > CHANGED, f"style-a changed the latents by {_changed(one, none):.1e} only"
    assert _changed(two, one) > CHANGED, f"style-b changed the latents by {_changed(two, one):.1e} only"
    assert _changed(neg, one) > CHANGED, f"the scale changed the latents by {_changed(neg, one):.1e} only"
    assert served.pipe.lora.describe()["resident"].keys() == {"style-a", "style-b"}


@pytest.mark.parametrize("served", ["sana"], indirect=True)
def test_an_adapter_on_sanas_convolutions_is_refused_naming_the_layer(served):
    make_adapter(SanaPipeline, served.folder, "conv", ["conv_inverted"], rank=2, alpha=2)
    validated = served.pipe.validator.validate(served.req((("conv", 1.0),)))
    with pytest.raises(RequestError) as e:
        served.pipe.lease(validated)
    assert e.value.field == "lora"
    assert "transformer_blocks.0.ff.conv_inverted" in e.value.message
    assert "not a linear layer" in e.value.message


def test_pixart_sigma_refuses_lora_dir_before_ray_starts_and_at_start(tmp_path):
    folder = pixart.build(tmp_path / "pixart")
    (tmp_path / "loras").mkdir()
    buckets = {"batch_sizes": [1], "resolutions": ["256x256"], "text_lengths": [16]}
    with pytest.raises(ValueError, match=r"PixArtSigmaPipeline \(family pixart\) has no LoRA loader in diffusers"):
        _check_config(tmp_path, folder, buckets, tmp_path / "loras")  # bcg config --check, bcg serve
    with pytest.raises(ValueError, match="PixArtSigmaPipeline .*has no LoRA loader in diffusers"):
        bcg_pipeline(folder, buckets, lora={"dir": str(tmp_path / "loras")})
    assert bcg_pipeline(folder, buckets).lora is None  # without lora.dir it is served as before


def _check_config(tmp_path: Path, folder: Path, buckets: dict, loras: Path) -> None:
    """``bcg config --check`` (``check_config``) of a config serving ``folder`` with ``lora.dir`` = ``loras``."""
    from deployments.cli.local import check_config

    config = tmp_path / f"{folder.name}.yaml"
    config.write_text(f"model: {{path: {folder}, device: cpu}}\nlimits: {{min_side_px: 16}}\n"
                      f"buckets: {dict(buckets)}\nlora: {{dir: {loras}}}\n")
    check_config(config)


def test_a_family_without_a_diffusers_loader_is_told_apart_from_one_bcg_serve_does_not_serve():
    """:func:`~bcg_core.lora.slots.unserved` names the diffusers loader where the pipeline has one (a family that
    sets no ``lora_loader`` although diffusers loads its adapters) and says there is none otherwise; a family
    that names its loader is served."""
    from bcg_core.lora.slots import unserved

    told = unserved(None, "Flux2KleinPipeline", "flux2")
    assert "bcg-serve does not serve LoRA adapters for this family yet" in told and "Flux2LoraLoaderMixin" in told
    assert "has no LoRA loader in diffusers" in unserved(None, "PixArtSigmaPipeline", "pixart")
    assert unserved("Flux2Pipeline", "Flux2KleinPipeline", "flux2") is None


def test_a_cached_request_with_adapters_equals_diffusers_with_its_cache(served):
    from bcg_core.step_cache import FirstBlockCache, request_cache, to_diffusers

    if not served.pipe.model.spec.cache_methods:
        pytest.skip(f"{served.name}'s transformer takes no step cache")
    # 0.8: the first block's relative change here runs 0.58-1.9 a step and moves by a few hundredths between
    # processes (not traced: the tiny checkpoint and adapters are seeded), so 0.6 reused no step in some runs
    cache = FirstBlockCache(threshold=0.8)
    req = served.req(TWO, seed=7, num_inference_steps=10, cache=cache)
    ref = diffusers_run(served.family.pipeline_cls, served.folder, dataclasses.replace(req, cache=None),
                        lora_dir=served.loras, setup=lambda p: p.transformer.enable_cache(to_diffusers(cache)),
                        **served.family.call)
    state = bcg_state(served.pipe, req)
    steps = request_cache(state).describe()["steps"]
    assert sum(s["reused"] for s in steps.values()) > 0  # the case reuses steps
    assert_same(GateRun(state.latents.float().cpu(), served.pipe.finish(state)), ref)


@dataclass(frozen=True)
class Newer(Family):
    """A family served since FLUX.2, Z-Image and Qwen-Image 2.1 took adapters: ``style-b`` is written in ``layout``
    (:func:`tiny.lora.make_published`: a published non-diffusers layout diffusers' ``lora_state_dict`` converts, on
    every linear layer of the transformer) instead of diffusers' own."""

    layout: str = ""


NEWER = {
    "flux2-dev": Newer(
        Flux2Pipeline, lambda folder: flux2.build(folder, "dev"),
        dict(batch_sizes=[1, 2, 4], resolutions=["32x32"], text_lengths=[flux2.TEXT_TOKENS]),
        dict(prompt=PROMPT, width=32, height=32, guidance_scale=4.0), dict(guidance_scale=5.0),  # an embedding
        targets_a=[*ATTENTION, "add_k_proj", "ff.linear_in", "to_qkv_mlp_proj", "double_stream_modulation_img.linear",
                   "guidance_embedder.linear_1"],
        targets_b=[], call=dict(max_sequence_length=flux2.TEXT_TOKENS), layout="flux2-bfl"),
    "flux2-klein": Newer(
        Flux2KleinPipeline, lambda folder: flux2.build(folder, "klein"),
        dict(batch_sizes=[1, 2, 4], resolutions=["32x32"], text_lengths=[flux2.TEXT_TOKENS]),
        dict(prompt=PROMPT, width=32, height=32, guidance_scale=4.0), dict(guidance_scale=1.0),  # CFG above 1
        targets_a=[*ATTENTION, "add_v_proj", "ff_context.linear_out", "single_transformer_blocks.0.attn.to_out",
                   "single_stream_modulation.linear", "timestep_embedder.linear_2"],
        targets_b=[], call=dict(max_sequence_length=flux2.TEXT_TOKENS), layout="flux2-bfl"),
    "zimage": Newer(
        ZImagePipeline, lambda folder: zimage.build(folder),
        dict(batch_sizes=[1, 2, 4], resolutions=["32x32"], text_lengths=[32]),
        dict(prompt=PROMPT, width=32, height=32, negative_prompt="blurry"), dict(guidance_scale=0.0),  # CFG above 0
        # the embedders T feeds every row's tokens as one flat sequence, the blocks' AdaLN and MLP
        targets_a=[*ATTENTION, "w1", "w3", "0.adaLN_modulation.0", "all_x_embedder.2-1", "cap_embedder.1", "mlp.0"],
        targets_b=[], layout="kohya"),
    "qwenimage21": Newer(
        QwenImage21Pipeline, lambda folder: qwenimage21.build(folder),
        dict(batch_sizes=[1, 2, 4], resolutions=["64x64"], text_lengths=[32]),
        dict(prompt=PROMPT, width=64, height=64, negative_prompt="blurry", true_cfg_scale=4.0),
        dict(negative_prompt=None, true_cfg_scale=None),
        # the time embedding and the shared modulation (each row's own t = 0 row), text and image inputs, the MLP
        targets_a=[*ATTENTION, "gate_layer", "modulation.1", "timestep_embedder.linear_1", "txt_in.in_layer", "img_in"],
        targets_b=[], limits=dict(min_side_px=32), layout="diffusion-model"),
}


def _diffusers_layout(pipe: DiTPipeline, run: GateRun, request: GenerationRequest) -> GateRun:
    """bcg-serve's final latents in diffusers' ``output_type="latent"`` layout: FLUX.2 [klein]'s unpacked and
    un-normalised (:meth:`~bcg_core.families.flux2.Flux2Family.unpacked_latents`), every other's as they are."""
    if pipe.model.spec.pipeline_class != "Flux2KleinPipeline":
        return run
    ids = Flux2Pipeline._prepare_latent_ids(torch.empty(request.n, 0, *pipe.model.rules.grid(request.width,
                                                                                            request.height)))
    return GateRun(pipe.model.unpacked_latents(run.latents, ids), run.pngs)


def _all_eager(pipe: DiTPipeline):
    """Costs under which every forward runs unpadded and eager (:meth:`~bcg_core.lora.rows.LoRAAdapter.
    forward_eager`), rows of several requests together."""
    from bcg_core.costs import CostModel

    keys = pipe.table.keys
    return CostModel({k: 1e3 for k in keys}, {k.shape: {1: 1e-3, 8: 8e-3} for k in keys}, eager=True)


@pytest.mark.parametrize("name", list(NEWER))
def test_newer_family_adapters_equal_diffusers_alone_beside_other_rows_and_unpadded(name, tmp_path, monkeypatch):
    """FLUX.2 [dev] and [klein], Z-Image and Qwen-Image 2.1: ``lora.dir`` passes the check before Ray starts;
    ``style-a`` (diffusers' layout, rank and alpha patterns) and ``style-b`` (a published layout, converted by
    diffusers' loader, on every linear layer) at 0.8 and -0.5 on a request with CFG rows (two images on [dev]) that
    joins a running request carrying ``style-b`` at 1.2: both requests' final latents equal diffusers' with
    ``load_lora_weights`` and ``set_adapters``, their rows and a pad row sharing padded bucket forwards. Where the
    family's unpadded forward does not keep one entry per row in every linear layer (``eager_mixes_rows``: Z-Image's
    embedders take every row's tokens as one sequence, Qwen-Image 2.1's time embedding adds a t = 0 row), the same
    again through unpadded eager forwards of both requests' rows."""
    from bcg_core.config import ModelConfig
    from bcg_core.lora.slots import check_served

    if name == "qwenimage21":
        qwenimage21.without_torchvision(monkeypatch)
    fam = NEWER[name]
    folder = fam.build(tmp_path / "ckpt")
    loras = make_adapter(fam.pipeline_cls, folder, "style-a", fam.targets_a, rank=4, alpha=8, seed=0,
                         rank_pattern={"to_q": 2}, alpha_pattern={"to_k": 3})
    make_published(folder, "style-b", fam.layout, rank=8, alpha=4, seed=1)
    check_served(ModelConfig(path=str(folder)))  # bcg config --check and bcg serve take lora.dir for it
    pipe = bcg_pipeline(folder, fam.buckets, lora={"dir": str(loras), **LORA}, **fam.limits)

    a, b = (pipe.lora.files.read(n) for n in ("style-a", "style-b"))
    assert {(d.rank, d.scaling) for n, d in a.layers.items() if n.endswith(".to_q")} == {(2, 8 / 2)}
    assert {(d.rank, d.scaling) for n, d in a.layers.items() if n.endswith(".to_k")} == {(4, 3 / 4)}
    assert set(b.layers) == set(pipe.lora.layers.layers)  # converted onto every linear layer, none dropped
    assert {(d.rank, d.scaling) for d in b.layers.values()} == {(8, 1.0)}  # alphas folded into the weights

    other = GenerationRequest(**{**fam.request, **fam.no_cfg}, n=1, num_inference_steps=3, seed=3,
                              lora=(("style-b", 1.2),))
    req = GenerationRequest(**fam.request, n=1, num_inference_steps=2, seed=7, lora=TWO)
    if pipe.validator.validate(req).rows == 1:  # [dev]: no CFG rows, so two images
        req = dataclasses.replace(req, n=2)
    assert [pipe.validator.validate(r).rows for r in (req, other)] == [2, 1]
    refs = [diffusers_run(fam.pipeline_cls, folder, r, lora_dir=loras, images=False, **fam.call) for r in (req, other)]
    inner, eager_rows = pipe.model.adapter.inner, []  # the rows of each unpadded forward of the family
    monkeypatch.setattr(inner, "forward_eager", lambda x, f=inner.forward_eager: eager_rows.append(x.rows) or f(x))
    mixes = getattr(inner, "eager_mixes_rows", False)
    for costs in (None, _all_eager(pipe)) if mixes else (None,):  # padded bucket forwards, then unpadded eager ones
        if costs is not None:
            pipe.decider.set_costs(costs, merge=False)
        ours = bcg_run_joined(pipe, req, other, head_start=1, images=False)
        for run, r, ref in zip(ours, (req, other), refs, strict=True):
            assert_same(_diffusers_layout(pipe, run, r), ref)
        if costs is None:
            assert eager_rows == [], "a bucket forward failed and ran unpadded"
    if mixes:  # other alone, then both requests' rows in one step: one forward per request's entries
        assert eager_rows[0] == 1 and sorted(eager_rows[1:3]) == [1, 2], eager_rows
    plain = _latents(pipe, dataclasses.replace(req, lora=()))
    assert _changed(ours[0].latents, plain) > CHANGED, "the adapters left the latents as they were"
