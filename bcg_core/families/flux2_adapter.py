"""FLUX.2's padding adapter (:class:`Flux2Adapter`) and its position ids (:func:`flux2_latent_ids`,
:func:`flux2_reference_ids`, :func:`flux2_text_ids`), for both FLUX.2 pipelines (:mod:`bcg_core.families.flux2`).
Line numbers cite diffusers 0.42.1: ``pipelines/flux2/pipeline_flux2.py``, D; ``pipeline_flux2_klein.py``, K;
``models/transformers/transformer_flux2.py``, T.

Padding contract (:class:`Flux2Adapter`, the FLUX.1 contract of
:class:`~bcg_core.families.flux_adapter.FluxAdapter`):

- batch: pad rows copy real row 0 and are dropped after the forward.
- text: its native length only (the key's text dimension is ``max_sequence_length``, from ``bcg_text_tokens`` in
  ``model_index.json`` or the pipeline's default 512), unmasked, as the pipeline feeds it; nothing is padded by
  bcg-serve. A prompt whose templated tokens exceed it is refused (the pipeline would cut it silently).
- image tokens: positions come in as id tensors, so a tier holds any grid of its token count unmasked; a masked
  tier (``key.image_mask``) also holds smaller grids: pad tokens are zero latents with zero ids, and a boolean
  key-padding mask (B, 1, 1, T + S) goes through ``joint_attention_kwargs`` to every attention (T's double- and
  single-stream processors take ``attention_mask``); every other op is per token (norms, MLPs) or per row
  (modulation), so real tokens are unchanged.
- ids stay int64 as diffusers passes them (T casts them to float32 for the RoPE); in the model dtype bf16 would
  round positions above 256.

A reference edit's tokens follow the target's in the image stream and count as real image tokens
(:meth:`Flux2Adapter.stream_ids`; the rules of reference edits are :mod:`bcg_core.families.flux2`'s docstring).
"""

from __future__ import annotations

import functools

import torch

from bcg_core.families.flux_adapter import FluxAdapter
from bcg_core.keys import BucketKey
from bcg_core.padding import DenoiseInputs
from bcg_core.table import ShapeRules

__all__ = ["IDS_CACHE_GRIDS", "Flux2Adapter", "flux2_latent_ids", "flux2_reference_ids", "flux2_text_ids"]

IDS_CACHE_GRIDS = 64
"""Most latent-id tables kept per process (one per grid and device), as FLUX.1's adapter keeps."""


@functools.lru_cache(maxsize=IDS_CACHE_GRIDS)
def flux2_latent_ids(grid: tuple[int, int], device: str = "cpu") -> torch.Tensor:
    """FLUX.2 image position ids of token grid ``grid`` = (h, w), from ``Flux2Pipeline._prepare_latent_ids``.

    Returns:
        (h * w, 4) int64 on ``device``: (0, row, column, 0) per token; shared (cached), not to be written to.
    """
    from diffusers import Flux2Pipeline

    h, w = grid
    return Flux2Pipeline._prepare_latent_ids(torch.empty(1, 0, h, w))[0].to(device)


@functools.lru_cache(maxsize=IDS_CACHE_GRIDS)
def flux2_reference_ids(grids: tuple[tuple[int, int], ...], device: str = "cpu") -> torch.Tensor:
    """FLUX.2 position ids of reference images of token grids ``grids`` (in order), from
    ``Flux2Pipeline._prepare_image_ids`` (D:407-454; ``prepare_image_latents`` calls it, D:668).

    Returns:
        (sum of h * w, 4) int64 on ``device``: (10 + 10 * i, row, column, 0) for the tokens of reference ``i``, one
        time index per reference (distinct from the target's 0); shared (cached), not to be written to.
    """
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._prepare_image_ids([torch.empty(1, 0, h, w) for h, w in grids])[0].to(device)


@functools.lru_cache(maxsize=8)
def flux2_text_ids(tokens: int, device: str = "cpu") -> torch.Tensor:
    """FLUX.2 text position ids of ``tokens`` text tokens, from ``Flux2Pipeline._prepare_text_ids``.

    Returns:
        (tokens, 4) int64 on ``device``: (0, 0, 0, i) for token i; shared (cached), not to be written to.
    """
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._prepare_text_ids(torch.empty(1, tokens, 0))[0].to(device)


class Flux2Adapter(FluxAdapter):
    """FLUX.2 architecture (``Flux2Transformer2DModel``): FLUX.1's padding (module docstring) with FLUX.2's inputs.

    Differences from :class:`~bcg_core.families.flux.FluxAdapter`, whose row, token and mask handling it keeps: no
    pooled projection (``DenoiseInputs.pooled`` is (rows, 0)); 4-axis int64 ids ((S, 4) image, (T, 4) text);
    ``guidance`` only where the pipeline passes it ([dev]).

    Layout: ``latents`` (rows, h * w, in_channels) packed tokens; ``text`` (rows, T, joint_attention_dim) at the
    native length; ``timestep`` (rows,) ``t / 1000`` in the latents' dtype; ``guidance`` (rows,) or None. Output:
    (rows, h * w, out_channels).

    Args:
        model: a ``Flux2Transformer2DModel``.
        native_text_tokens: the text length the pipeline feeds (``max_sequence_length``).
        vae_scale_factor: pixels per latent pixel (8 for ``AutoencoderKLFlux2``).
        guidance: the pipeline passes ``guidance`` (``Flux2Pipeline``; ``Flux2KleinPipeline`` passes None).
    """

    family = "flux2"
    timestep_max = 1.0
    pooled_dim = 0

    def __init__(self, model: torch.nn.Module, native_text_tokens: int, vae_scale_factor: int = 8,
                 guidance: bool = True):
        cfg = model.config
        self.model = model
        # The pipelines pack 2x2 latent pixels into one token (prepare_latents), then patch_size=1.
        self.rules = ShapeRules(pixels_per_token=vae_scale_factor * 2 * int(cfg.patch_size), grid_keyed=False,
                                native_text_tokens=native_text_tokens)
        self.in_channels = int(cfg.in_channels)
        self.out_channels = int(cfg.out_channels or cfg.in_channels)
        self.seq_dim = int(cfg.joint_attention_dim)
        self.guidance_embeds = bool(guidance)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """FLUX.1's static buffers (:meth:`FluxAdapter.allocate`) with FLUX.2's ids: ``img_ids`` (S, 4) and
        ``txt_ids`` (T, 4), int64; ``pooled`` is (B, 0)."""
        buf = super().allocate(key, device, dtype)
        buf["img_ids"] = torch.zeros(key.image_tokens, 4, device=device, dtype=torch.int64)  # (S, 4)
        buf["txt_ids"] = torch.zeros(key.text_tokens, 4, device=device, dtype=torch.int64)  # (T, 4)
        return buf

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """:meth:`FluxAdapter.fill` (rows, masked image tokens, zero pad ids), then the text ids.

        Raises:
            ValueError: the inputs do not fit the buffers (as :meth:`FluxAdapter.fill`).
        """
        super().fill(buffers, inputs)
        ids = buffers["txt_ids"]
        ids.copy_(flux2_text_ids(ids.shape[0], str(ids.device)))

    def image_ids(self, grid: tuple[int, int], device, dtype=None) -> torch.Tensor:
        """:func:`flux2_latent_ids` on ``device`` (``dtype`` is ignored: ids stay int64, as diffusers passes them)."""
        return flux2_latent_ids(tuple(grid), str(device))

    def stream_ids(self, inputs: DenoiseInputs, device, dtype=None) -> torch.Tensor:
        """Ids of ``inputs``' image stream: the grid's (:meth:`image_ids`), then its reference images'
        (:func:`flux2_reference_ids`), as the pipelines concatenate them (``torch.cat([latent_ids,
        image_latent_ids], dim=1)``, D:972, K:848): (image_tokens, 4) int64."""
        ids = self.image_ids(inputs.grid, device)
        if not inputs.references:
            return ids
        return torch.cat([ids, flux2_reference_ids(tuple(inputs.references), str(device))])

    def _call(self, latents, text, pooled, timestep, img_ids, txt_ids, guidance, attention_kwargs):
        # As Flux2Pipeline.__call__ / Flux2KleinPipeline.__call__ call the transformer (no pooled projection).
        return self.model(
            hidden_states=latents, timestep=timestep, guidance=guidance, encoder_hidden_states=text,
            txt_ids=txt_ids, img_ids=img_ids, joint_attention_kwargs=attention_kwargs, return_dict=False,
        )[0]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded, unmasked reference forward, exactly as the pipelines call the transformer."""
        p = next(self.model.parameters())
        cast = lambda x: x.to(device=p.device, dtype=p.dtype)  # noqa: E731
        guidance = cast(inputs.guidance) if self.guidance_embeds and inputs.guidance is not None else None
        return self._call(cast(inputs.latents), cast(inputs.text), None, cast(inputs.timestep),
                          self.stream_ids(inputs, p.device), flux2_text_ids(inputs.text_tokens, str(p.device)),
                          guidance, None)
