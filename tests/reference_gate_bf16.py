"""The bf16 gate: bcg-serve's bf16 images against diffusers' own bf16 pipeline, within diffusers' own deviations.

bf16 is what users run; the reference gate (:mod:`reference_gate`) runs fp32 only. In bf16 a padded or shared
forward can reach the real tokens through another kernel, or through the same kernel along another path (on a
CPU, PyTorch's flash-attention kernel computes ``exp`` of the first ``16 * floor(L / 16)`` keys of a key block
with a vectorised approximation and the rest with ``std::exp``, so the key length ``L`` decides how a real key is
rounded), so bit-exactness is not a given. The bounds are what diffusers itself does with the same request, seed,
dtype and device:

- ``batch``: the image generated alone against the same image in a batch of two beside another, longer prompt
  (masked-text pipelines then pad its text, as a text bucket does; every pipeline runs its GEMMs and decode on two
  rows);
- ``kernel``: the image with PyTorch's SDPA left to its default backend against the math backend
  (``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``): what a change of attention kernel alone does;
- ``fp32``: the bf16 image against diffusers' fp32 image (the scale of bf16 itself; the bound of compiled kernels).

Per family (the tiny checkpoints of ``tests/tiny/``, random weights, bf16, 4 steps), :func:`measure_family` serves
through bcg-serve (``runner.kernels`` as given, ``"eager"`` by default) and compares with diffusers alone:

- ``exact``: a request alone at an exact bucket;
- ``image_padded``: sizes padded into a masked image tier (FLUX only: the other families key buckets on the grid);
- ``text_padded``: prompts shorter than their text bucket, padded by counts that are not multiples of 16 (the
  masked-text families PixArt-Sigma, SANA and Qwen-Image; FLUX and SD3 keep their native unmasked text length);
- ``batched``: a request that shares every forward with a two-image request that started a step earlier
  (:func:`reference_gate.bcg_run_joined`; 3 images' rows in a 4-row bucket, or 6 CFG rows in an 8-row one).

:func:`check` is the gate (see there): bit-identical latents where diffusers' own are batch-exact, else within
:data:`MARGIN` times diffusers' own deviations. Each comparison is a :class:`Deviation`: the largest difference of a
pixel value in levels (0-255, the images as PIL gives them), the share of pixel values that differ, and the relative
error ``max|a - b| / max|b|`` of the final latents (diffusers' from its step-end callback at the last step: the tensor
it decodes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bcg_core import GenerationRequest
from bcg_core.runners.fp8 import FP8_RTOL
from reference_gate import bcg_pipeline, bcg_run, bcg_run_joined, pixels

__all__ = ["BOUNDS", "CASES", "Deviation", "FAMILIES", "FamilyCase", "MARGIN", "allowance", "bcg_image",
           "case_requests", "FP8_LATENT_CAP", "FP8_SCALE", "FP32_ROUNDING_MAX", "check", "compare", "diffusers_images",
           "fp32_is_rounding", "initial_noise", "load_diffusers", "longest_prompt", "measure_family",
           "prompt_with_tokens"]

CASES = ("exact", "image_padded", "text_padded", "batched")
"""The bcg-serve request cases, in report order."""

BOUNDS = ("batch", "kernel", "fp32")
"""Diffusers' own deviations, in report order (module docstring)."""

WORDS = ("a photo of a cat sitting on a red chair in the garden under the blue sky with white clouds and small "
         "birds flying over the old stone house near the quiet river at dusk while the children play").split()
"""Prompts of a chosen token count are prefixes of these words (:func:`prompt_with_tokens`)."""

WORDS_PROMPT = "a photo of a cat sitting on a red chair"
"""The prompt of families whose text has one native length (FLUX, SD3)."""

OTHER = ("an astronaut riding a horse on the moon, detailed oil painting with dramatic lighting, deep shadows, "
         "craters and distant stars").split()
"""The company: the other prompt of a batch of two is the longest prefix of these words that the family's largest
text bucket holds (longer than every case's prompt, :func:`longest_prompt`)."""


@dataclass(frozen=True)
class FamilyCase:
    """One family's tiny checkpoint, buckets and requests.

    Attributes:
        builder: module of ``tests/tiny`` whose ``build(folder, **build_kwargs)`` writes the checkpoint.
        pipeline: the diffusers pipeline class name (the reference).
        buckets: ``BucketConfig`` fields.
        fields: request fields shared by every case (size, guidance).
        call_kwargs: extra keyword arguments of the diffusers call (e.g. FLUX's ``max_sequence_length``).
        masked_text: text lengths are bucketed with masked padding (PixArt-Sigma, SANA, Qwen-Image): the ``exact``
            case's prompt has exactly a text bucket's token count, and a ``text_padded`` case has a prompt of at
            least ``text_padded_min`` tokens padded by a count that is not a multiple of 16. False: the text has one
            native length (FLUX, SD3), every prompt is exact in text.
        text_padded_min, text_padded_prompts: the ``text_padded`` case's prompts have at least this many tokens, and
            there are at most that many of them (:func:`case_requests`).
        image_padded_sizes: ``(width, height)`` of each ``image_padded`` request (empty: buckets hold exact grids).
        noise_input: ``(pipeline, noise, request) -> latents`` for the ``fp32`` run where the pipeline's ``latents=``
            takes another layout than its ``prepare_latents`` returns (:func:`flux2_noise`); None: the noise as
            recorded.
        loading: ``() -> context manager`` within which the checkpoint loads (Qwen-Image 2.1's processor needs
            torchvision, else :func:`tiny.qwenimage21.loadable`); None: no context.
    """

    builder: str
    pipeline: str
    buckets: dict
    fields: dict
    build_kwargs: dict = field(default_factory=dict)
    call_kwargs: dict = field(default_factory=dict)
    masked_text: bool = False
    text_padded_min: int = 9
    text_padded_prompts: int = 4
    image_padded_sizes: tuple[tuple[int, int], ...] = ()
    noise_input: Callable[..., torch.Tensor] | None = None
    loading: Callable[[], contextlib.AbstractContextManager] | None = None

    def load_context(self) -> contextlib.AbstractContextManager:
        """:attr:`loading`'s context, or a context that does nothing."""
        return self.loading() if self.loading is not None else contextlib.nullcontext()


def flux2_noise(pipe, noise: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
    """FLUX.2's recorded noise as its pipelines' ``latents=`` takes it: ``prepare_latents`` returns packed tokens
    (n, h * w, 128) but reads a given ``latents`` as (n, 128, h, w) (it builds the ids from that shape), so the tokens
    go back through the pipeline's own ``_unpack_latents_with_ids`` (the token grid as ``prepare_latents`` takes it
    from the size: ``pipe.vae_scale_factor * 2`` pixels a token)."""
    px = pipe.vae_scale_factor * 2
    ids = pipe._prepare_latent_ids(torch.empty(noise.shape[0], 0, request.height // px, request.width // px))
    return pipe._unpack_latents_with_ids(noise, ids.to(noise.device))  # the ids are built on the CPU


FAMILIES: dict[str, FamilyCase] = {
    "flux": FamilyCase("flux", "FluxPipeline",
                       {"batch_sizes": [1, 2, 4], "resolutions": ["32x32", "64x64"], "text_lengths": [32]},
                       {"width": 64, "height": 64, "guidance_scale": 3.5}, {"variant": "dev"},
                       {"max_sequence_length": 32},
                       image_padded_sizes=((64, 60), (52, 44), (48, 48), (36, 36), (60, 60))),
    "sd3": FamilyCase("sd3", "StableDiffusion3Pipeline",
                      {"batch_sizes": [1, 2, 4, 8], "resolutions": ["64x64"], "text_lengths": [333]},
                      {"width": 64, "height": 64, "guidance_scale": 5.0}, {"variant": "sd35"}),
    "pixart": FamilyCase("pixart", "PixArtSigmaPipeline",
                         {"batch_sizes": [1, 2, 4, 8], "resolutions": ["256x256"], "text_lengths": [32, 64]},
                         {"width": 256, "height": 256, "guidance_scale": 4.5}, masked_text=True),
    "sana": FamilyCase("sana", "SanaPipeline",
                       {"batch_sizes": [1, 2, 4, 8], "resolutions": ["512x512"], "text_lengths": [16, 32]},
                       {"width": 512, "height": 512, "guidance_scale": 4.5}, masked_text=True),
    "flux2": FamilyCase("flux2", "Flux2Pipeline",
                        {"batch_sizes": [1, 2, 4], "resolutions": ["32x32", "64x64"], "text_lengths": [96]},
                        {"width": 64, "height": 64, "guidance_scale": 4.0}, {"variant": "dev"},
                        {"max_sequence_length": 96}, image_padded_sizes=((64, 60), (52, 44), (48, 48)),
                        noise_input=flux2_noise),
    "flux2-klein": FamilyCase("flux2", "Flux2KleinPipeline",
                              {"batch_sizes": [1, 2, 4], "resolutions": ["32x32", "64x64"], "text_lengths": [96]},
                              {"width": 64, "height": 64, "guidance_scale": 4.0}, {"variant": "klein"},
                              {"max_sequence_length": 96}, noise_input=flux2_noise),
    "qwenimage": FamilyCase("qwenimage", "QwenImagePipeline",
                            {"batch_sizes": [1, 2, 4], "resolutions": ["64x64"], "text_lengths": [16, 32]},
                            {"width": 64, "height": 64}, masked_text=True),
    # Z-Image rounds each caption up to 32 slots itself: bucket 48 holds 64 slots, so a 17-32 token caption leaves 32
    # of them to bcg-serve's mask; 16 holds 32, the model's own (an exact fit)
    "zimage": FamilyCase("zimage", "ZImagePipeline",
                         {"batch_sizes": [1, 2, 4], "resolutions": ["32x32"], "text_lengths": [16, 48]},
                         {"width": 32, "height": 32, "guidance_scale": 4.0}, masked_text=True, text_padded_min=17),
    "qwenimage21": FamilyCase("qwenimage21", "QwenImage21Pipeline",
                              {"batch_sizes": [1, 2, 4], "resolutions": ["64x64"], "text_lengths": [16, 32]},
                              {"width": 64, "height": 64}, masked_text=True,
                              loading=lambda: importlib.import_module("tiny.qwenimage21").loadable()),
}
"""The families as the gate runs them (tiny checkpoints of ``tests/tiny/``; FLUX.2 twice: [dev], and [klein] with
its CFG)."""


@dataclass
class Deviation:
    """How far one image (and its final latents) is from the reference.

    Attributes:
        max_levels: largest absolute difference of one pixel value, in levels of 0-255.
        share: fraction of pixel values (height x width x 3) that differ at all.
        latent_rel: ``max|a - b| / max|b|`` of the final latents (0.0: bit-identical), None where not compared.
        psnr_db: peak signal-to-noise ratio of the image against the reference, ``10 log10(255² / MSE)`` in dB over
            every pixel value (None: identical images, an infinite ratio); reported, not gated.
    """

    max_levels: int
    share: float
    latent_rel: float | None = None
    psnr_db: float | None = None

    @property
    def exact(self) -> bool:
        """Same pixels and bit-identical latents."""
        return self.max_levels == 0 and not self.latent_rel

    def worst(self, other: Deviation) -> Deviation:
        """The larger of each field of ``self`` and ``other``."""
        rel = [r for r in (self.latent_rel, other.latent_rel) if r is not None]
        psnr = [p for p in (self.psnr_db, other.psnr_db) if p is not None]
        return Deviation(max(self.max_levels, other.max_levels), max(self.share, other.share),
                         max(rel) if rel else None, min(psnr) if psnr else None)

    def to_json(self) -> dict:
        """JSON fields: ``max_levels``, ``share``, ``latent_rel``, ``psnr_db``."""
        return dataclasses.asdict(self)


def compare(image: np.ndarray, ref: np.ndarray, latents: torch.Tensor | None = None,
            ref_latents: torch.Tensor | None = None) -> Deviation:
    """:class:`Deviation` of ``image`` from ``ref`` ((H, W, 3) uint8 or int arrays) and, where both are given, of
    ``latents`` from ``ref_latents`` (same shape)."""
    a, b = np.asarray(image).astype(np.int16), np.asarray(ref).astype(np.int16)
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = np.abs(a - b)
    mse = float((diff.astype(np.float64) ** 2).mean())
    psnr = round(10 * np.log10(255.0 ** 2 / mse), 2) if mse else None
    rel = None
    if latents is not None and ref_latents is not None:
        assert latents.shape == ref_latents.shape, (latents.shape, ref_latents.shape)
        x, y = latents.float().cpu(), ref_latents.float().cpu()
        rel = ((x - y).abs().max() / y.abs().max()).item()
    return Deviation(int(diff.max()), float((diff > 0).mean()), rel, psnr)


def prompt_with_tokens(count, wanted) -> str:
    """The shortest prefix of :data:`WORDS` whose token count ``count(prompt)`` is in ``wanted`` (a container of
    ints, or a predicate ``int -> bool``).

    Raises:
        ValueError: no prefix has such a count.
    """
    ok = wanted if callable(wanted) else (lambda n: n in wanted)
    for n in range(1, len(WORDS) + 1):
        prompt = " ".join(WORDS[:n])
        if ok(count(prompt)):
            return prompt
    raise ValueError(f"no prefix of the gate's words has a token count the case wants ({wanted})")


def longest_prompt(count, limit: int) -> str:
    """The longest prefix of :data:`OTHER` that ``count(prompt)`` counts as at most ``limit`` tokens."""
    best = OTHER[0]
    for n in range(1, len(OTHER) + 1):
        if count(" ".join(OTHER[:n])) > limit:
            break
        best = " ".join(OTHER[:n])
    return best


def case_requests(case: FamilyCase, count, req) -> dict[str, list[GenerationRequest]]:
    """The requests of each case of ``case`` (module docstring), built by ``req(prompt, seed, **fields)``;
    ``count(prompt)`` is the family's token count.

    ``exact``: one prompt whose token count is a text bucket's (any prompt for native-length text). ``image_padded``:
    the exact prompt at each of ``case.image_padded_sizes``. ``text_padded``: up to ``case.text_padded_prompts``
    prompts of distinct token counts, each padded to its text bucket by a count that is not a multiple of 16 (in
    bf16 on a CPU a multiple of 16 keeps the attention kernel's vector lanes, docs/CORRECTNESS.md). ``batched``:
    the exact prompt; :func:`measure_family` serves it sharing its forwards with a two-image request of the
    company's prompt.
    """
    lengths = sorted(case.buckets["text_lengths"])
    exact = prompt_with_tokens(count, lengths) if case.masked_text else WORDS_PROMPT
    out = {"exact": [req(exact, 3)]}
    if case.image_padded_sizes:
        out["image_padded"] = [req(exact, 5 + i, width=w, height=h) for i, (w, h) in enumerate(case.image_padded_sizes)]
    if case.masked_text:
        seen: set[int] = set()
        prompts = []
        for n in range(1, len(WORDS) + 1):
            prompt = " ".join(WORDS[:n])
            c = count(prompt)
            if c > lengths[-1] or len(prompts) == case.text_padded_prompts:
                break
            if c < case.text_padded_min or c in seen or (min(t for t in lengths if t >= c) - c) % 16 == 0:
                continue
            seen.add(c)
            prompts.append(prompt)
        out["text_padded"] = [req(p, 7 + i) for i, p in enumerate(prompts)]
    out["batched"] = [req(exact, 9)]
    return out


def load_diffusers(case: FamilyCase, folder: Path, device: str, dtype: torch.dtype):
    """The diffusers pipeline ``case.pipeline`` from ``folder`` in ``dtype`` on ``device``, as a user loads it.

    Without ``accelerate``, diffusers 0.42.1 leaves an fp32-saved SD3 transformer in fp32 although the other
    components get ``torch_dtype``; such a transformer is cast, as with ``accelerate`` (and as bcg-serve loads it).
    """
    cls = getattr(importlib.import_module("diffusers"), case.pipeline)
    with case.load_context():
        pipe = cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
    if pipe.transformer.dtype != dtype:
        pipe.transformer.to(dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_images(pipe, requests: list[GenerationRequest], attention=None,
                     **call_kwargs) -> tuple[list[np.ndarray], torch.Tensor]:
    """One diffusers call for ``requests`` (one image each; size, steps, guidance and negative prompt of the first;
    the prompts as a list, one CPU generator per image seeded ``request.seed``), as a diffusers user batches prompts.

    Args:
        attention: None (SDPA picks its backend), or a ``torch.nn.attention.SDPBackend`` that every attention of
            the call is forced onto.
        call_kwargs: passed to the call (e.g. ``max_sequence_length``).

    Returns:
        The images as (H, W, 3) uint8 arrays, and the final latents (rows in request order, fp32 on the CPU) as
        the step-end callback sees them at the last step: the tensor the pipeline then decodes.
    """
    r0 = requests[0]
    kwargs = dict(prompt=[r.prompt for r in requests], num_images_per_prompt=1, width=r0.width, height=r0.height,
                  **call_kwargs)
    for name in ("num_inference_steps", "guidance_scale", "true_cfg_scale"):
        if getattr(r0, name) is not None and name not in kwargs:
            kwargs[name] = getattr(r0, name)
    if r0.negative_prompt is not None:
        kwargs["negative_prompt"] = [r0.negative_prompt] * len(requests)
    last = {}

    def grab(p, i, t, tensors):  # callback_on_step_end(pipe, step, timestep, tensors)
        last["latents"] = tensors["latents"]
        return tensors

    def grab_old(i, t, latents):  # the older callback(step, timestep, latents) of PixArt-Sigma's pipeline
        last["latents"] = latents

    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
        kwargs["callback_on_step_end"] = grab
    else:
        kwargs.update(callback=grab_old, callback_steps=1)
    gens = [torch.Generator("cpu").manual_seed(r.seed) for r in requests]
    backend = (torch.nn.attention.sdpa_kernel(attention) if attention is not None else contextlib.nullcontext())
    with torch.inference_mode(), backend:
        images = pipe(**kwargs, generator=gens, output_type="pil").images
    return [np.asarray(im) for im in images], last["latents"].float().cpu()


@contextlib.contextmanager
def initial_noise(pipe):
    """Within the block, the initial latents of each call of diffusers pipeline ``pipe`` (what its
    ``prepare_latents`` returns: the noise, packed where the family packs it) into the yielded list.

    The ``fp32`` bound runs diffusers' fp32 pipeline from its bf16 run's noise (``latents=``), so that it measures
    rounding alone: ``torch.randn`` with a CPU generator draws other numbers in bf16 than in fp32 for some sizes
    (torch 2.11: every size from 16 values; torch 2.13: sizes from 16 values that are not a multiple of 16), and
    diffusers draws its noise in the pipeline's dtype, so the same seed is another image in bf16 than in fp32 there
    (docs/BENCHMARKS.md, 2026-12-04).
    """
    found = []
    original = pipe.prepare_latents

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        found.append((out[0] if isinstance(out, tuple) else out).detach().clone())
        return out

    pipe.prepare_latents = recording
    try:
        yield found
    finally:
        del pipe.prepare_latents  # the class's method again


def bcg_image(pipe, request: GenerationRequest,
              other: GenerationRequest | None = None) -> tuple[np.ndarray, torch.Tensor]:
    """``request`` served by bcg-serve (``pipe``, a :class:`~bcg_core.DiTPipeline`): alone, or sharing its forwards
    with ``other``, which starts one step earlier.

    Returns:
        Its first image, (H, W, 3) uint8 (decoded from its PNG), and its final latents (fp32, CPU).
    """
    if other is None:
        ours = bcg_run(pipe, request)
    else:
        ours, _ = bcg_run_joined(pipe, request, other, head_start=1)
    return pixels(ours.pngs[0]), ours.latents


def measure_family(name: str, device: str = "cpu", kernels: str = "eager", steps: int = 4,
                   cases: tuple[str, ...] = CASES, per_case: int | None = None, folder: Path | None = None) -> dict:
    """The gate's numbers for family ``name`` of :data:`FAMILIES` in bf16 on ``device``.

    Args:
        name: a key of :data:`FAMILIES`.
        device: ``"cpu"`` or ``"cuda"`` (there the runner captures CUDA graphs).
        kernels: ``runner.kernels`` of bcg-serve (``"eager"``, ``"compiled"``, ``"fp8"``).
        steps: denoising steps of every request.
        cases: which of :data:`CASES` to run (those the family has requests for).
        per_case: at most this many requests per case (None: all of :func:`case_requests`).
        folder: where to build the tiny checkpoint (None: a temporary folder, removed after).

    Returns:
        A JSON-ready dict: ``family``, ``device``, ``kernels``, ``steps``; ``bounds`` (for each of :data:`BOUNDS`,
        the worst :class:`Deviation` over every request measured, as a dict), ``cases`` (for each case run, the
        worst deviation of bcg-serve from diffusers alone over its requests) and ``requests`` (one row per request:
        ``case``, ``key`` (its bucket alone), ``tokens``, ``size``, ``bcg`` and each bound's deviation).
    """
    case = FAMILIES[name]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(folder) if folder is not None else Path(tmp)
        built = importlib.import_module(f"tiny.{case.builder}").build(root / name, **case.build_kwargs)
        with case.load_context():
            pipe = bcg_pipeline(built, case.buckets, device=device, dtype="bfloat16", kernels=kernels)
        ref = load_diffusers(case, built, device, torch.bfloat16)
        ref32 = load_diffusers(case, built, device, torch.float32)
        count = pipe.model.count_tokens

        def req(prompt: str, seed: int, **kw) -> GenerationRequest:
            r = GenerationRequest(prompt=prompt, n=1, seed=seed, num_inference_steps=steps, **{**case.fields, **kw})
            return pipe.validator.validate(r).request

        requests = case_requests(case, count, req)
        other = req(longest_prompt(count, max(case.buckets["text_lengths"])), 40)
        pair = dataclasses.replace(other, n=2)  # the request a ``batched`` one shares its forwards with
        rows, worst, bounds = [], {}, {}
        kw = case.call_kwargs
        for label in (c for c in CASES if c in cases and c in requests):
            for r in requests[label][:per_case]:
                with initial_noise(ref) as noise:
                    alone, lat = diffusers_images(ref, [r], **kw)
                beside, lat_beside = diffusers_images(ref, [r, other], **kw)
                math, lat_math = diffusers_images(ref, [r], attention=torch.nn.attention.SDPBackend.MATH, **kw)
                # the bf16 run's own noise: a CPU generator draws other numbers in bf16 than in fp32 (initial_noise)
                with initial_noise(ref32) as noise32:
                    start = noise[0] if case.noise_input is None else case.noise_input(ref32, noise[0], r)
                    full, lat_full = diffusers_images(ref32, [r], latents=start.float(), **kw)
                if not torch.equal(noise32[0].float().cpu(), noise[0].float().cpu()):
                    raise RuntimeError(f"{name}: diffusers' fp32 run did not start from the bf16 run's noise")
                image, ours = bcg_image(pipe, r, pair if label == "batched" else None)
                devs = {"bcg": compare(image, alone[0], ours, lat),
                        "batch": compare(beside[0], alone[0], lat_beside[:1], lat),
                        "kernel": compare(math[0], alone[0], lat_math, lat),
                        "fp32": compare(alone[0], full[0], lat, lat_full)}
                worst[label] = worst[label].worst(devs["bcg"]) if label in worst else devs["bcg"]
                for b in BOUNDS:
                    bounds[b] = bounds[b].worst(devs[b]) if b in bounds else devs[b]
                rows.append({"case": label, "key": str(pipe.validator.validate(r).lookup.key),
                             "tokens": count(r.prompt), "size": f"{r.width}x{r.height}",
                             **{k: d.to_json() for k, d in devs.items()}})
        return {"family": name, "device": device, "kernels": kernels, "steps": steps,
                "bounds": {b: d.to_json() for b, d in bounds.items()},
                "cases": {c: d.to_json() for c, d in worst.items()}, "requests": rows}


FP8_SCALE = 16.0
"""Factor of the ``fp8`` tier's latent bound on diffusers' own bf16 rounding deviation (``kernel``, and ``fp32``
where it is a rounding; :func:`allowance`): float8 e4m3 keeps 3
mantissa bits and bf16 7, so one float8 rounding is 2**4 = 16 times one bf16 rounding (unit roundoff 2**-4 against
2**-8); the fp8 tier rounds its linear layers' inputs and weights so, and the rest as bf16."""

MARGIN = 2.0
"""Factor on diffusers' own deviations that :func:`check` allows where it demands no bit-exactness. In bf16 these
deviations are one rounding flip carried through the steps: the latents' ``max|a - b| / max|b|`` is about one bf16
unit of the largest latent (2**-7 relative, 7.8e-3, or a few units less), and the level and share figures follow
from it, so which request and which tiny checkpoint build (its tokenizers are trained at build time) gives the
largest moves each of them by up to a factor of about 2 from run to run (docs/BENCHMARKS.md, 2026-12-03). A broken
padding (an unmasked pad token, a wrong position) moves the latents by tenths, far beyond."""


FP32_ROUNDING_MAX = 0.05
"""The largest relative error of diffusers' bf16 final latents against its fp32 ones that :func:`fp32_is_rounding`
takes for rounding: twice the largest measured, 0.025 (0.0087-0.025 on a CPU with torch 2.13 and 2.11 for the five
tiny checkpoints, 0.0099 for SANA on an H200; docs/BENCHMARKS.md, 2026-12-03 and 2026-12-04), each about one bf16
unit (2**-7, 7.8e-3) carried through the steps. Both runs start from the same noise (:func:`initial_noise`); before
they did, four families' fp32 images on the H200 machine (torch 2.11) were other images (latents 1.2-1.7 relative,
PSNR 13-23 dB: another noise), and a bound built on that admitted any image. The check stays as a guard: a bound is
only ever a rounding."""


FP8_LATENT_CAP = FP8_RTOL / MARGIN
"""The most the ``fp8`` tier's latent allowance may be before :data:`MARGIN` (so at most ``FP8_RTOL``, 0.25, after
it: two float8 e4m3 steps, the bound each fp8 bucket forward is checked to when it is prepared,
``bcg_core/runners/fp8.py``). Without it, 16 x a large rounding deviation (0.025 x 16 x 2 = 0.8) would come
near admitting another image (1.2-1.7 relative)."""


def fp32_is_rounding(result: dict) -> bool:
    """Whether the ``fp32`` bound of a :func:`measure_family` result is a rounding deviation (its final latents
    within :data:`FP32_ROUNDING_MAX`) that :func:`allowance` may build on."""
    rel = result["bounds"].get("fp32", {}).get("latent_rel")
    return rel is not None and rel <= FP32_ROUNDING_MAX


def allowance(result: dict, case: str) -> tuple[Deviation, bool]:
    """What :func:`check` allows case ``case`` of a :func:`measure_family` result (before :data:`MARGIN`).

    - ``kernels: eager``, cases ``exact``, ``text_padded`` and ``batched``: where diffusers' latents are batch-exact
      (``batch`` relative error 0), bcg-serve's final latents must be bit-identical (returned flag True), and then
      only the decode may differ, as far as diffusers' own batched decode does (``batch``'s levels); elsewhere
      diffusers' own deviations, ``batch`` and ``kernel`` together.
    - ``kernels: eager``, ``image_padded``: a masked tier runs an attention that no diffusers call runs (a key mask
      over the tier's longer key sequence), so diffusers' batch bound does not cover it; its bound is ``batch`` and
      ``kernel`` together (what diffusers' own image moves by when its attention runs another SDPA backend).
    - ``kernels: compiled``: ``batch``, ``kernel`` and ``fp32`` together, never bit-exactness (compiled kernels
      change rounding; the bound is the scale of bf16 itself against fp32).
    - ``kernels: fp8``: the final latents within :data:`FP8_SCALE` times the larger of the ``kernel`` and ``fp32``
      latent bounds (one bf16 rounding carried through the steps, two measures of it), at most
      :data:`FP8_LATENT_CAP`; pixels are not bounded (any level, any share), since a float8 image is another image at
      the pixel scale; their largest level difference and PSNR are reported.

    ``fp32`` counts only where it is a rounding (:func:`fp32_is_rounding`); where diffusers' own fp32 image is
    another image, it would admit any image, so the bound is then the others alone.

    Returns:
        ``(allowed deviation, latents must be bit-identical)``.
    """
    b = {k: Deviation(**v) for k, v in result["bounds"].items()}
    fp32 = b["fp32"] if fp32_is_rounding(result) else Deviation(0, 0.0, 0.0)
    if result["kernels"] == "fp8":
        scale = max(b["kernel"].latent_rel or 0, fp32.latent_rel or 0)
        return Deviation(255, 1.0, min(FP8_SCALE * scale, FP8_LATENT_CAP)), False
    if result["kernels"] != "eager":
        return b["batch"].worst(b["kernel"]).worst(fp32), False
    if case == "image_padded":
        return b["batch"].worst(b["kernel"]), False
    if b["batch"].latent_rel == 0:
        return Deviation(b["batch"].max_levels, b["batch"].share, 0.0), True
    return b["batch"].worst(b["kernel"]), False


def check(result: dict, margin: float = MARGIN) -> list[str]:
    """The gate on a :func:`measure_family` result: for each case, bcg-serve's worst deviation from diffusers alone
    against :func:`allowance`. Where bit-identical latents are demanded: the latents exactly, and the largest level
    difference of the decoded pixels at most ``margin`` times diffusers' batched decode's (0 stays 0). Elsewhere:
    the largest level difference and the latents' relative error each at most ``margin`` times the allowance's.
    The share of differing pixel values is reported, not bounded: once final latents differ at all, about a third
    of the pixel values move by a level or more, in diffusers' own deviations too.

    Returns:
        One line per violation (empty: the gate passes).
    """
    out = []
    for c, d in result["cases"].items():
        dev = Deviation(**d)
        allowed, exact = allowance(result, c)
        what = f"{result['family']} {c} ({result['kernels']}, {result['device']})"
        if exact:
            if dev.latent_rel != 0:
                out.append(f"{what}: final latents differ from diffusers' ({dev.latent_rel:.2e} relative) although "
                           f"diffusers' own are batch-exact")
            elif dev.max_levels > margin * allowed.max_levels:
                out.append(f"{what}: identical latents decode {dev.max_levels} levels away, beyond {margin:g} x "
                           f"diffusers' batched decode ({allowed.max_levels} levels)")
            continue
        if dev.max_levels > margin * allowed.max_levels or (dev.latent_rel or 0) > margin * (allowed.latent_rel or 0):
            out.append(f"{what}: {dev.max_levels} levels, latents {dev.latent_rel or 0:.2e} relative, "
                       f"beyond {margin:g} x diffusers' own {allowed.max_levels} levels, "
                       f"{allowed.latent_rel or 0:.2e}")
    return out
