"""FLUX.1's padding adapter (:class:`FluxAdapter`, diffusers ``FluxTransformer2DModel``) and its image position ids
(:func:`flux_image_ids`): the bucket forward of FLUX.1 checkpoints and the tiny default (:mod:`bcg_core.families.flux`),
and the base of FLUX.2's adapter (:mod:`bcg_core.families.flux2_adapter`).
"""

from __future__ import annotations

import collections
import threading

import torch

from bcg_core.keys import BucketKey
from bcg_core.padding import DenoiseInputs, copy_rows
from bcg_core.table import ShapeRules

__all__ = ["IDS_CACHE_GRIDS", "FluxAdapter", "flux_image_ids"]

IDS_CACHE_GRIDS = 64
"""Most image-id tables :class:`FluxAdapter` keeps (one per grid, device and dtype; LRU). 64 holds every grid of a
bucket table of a few dozen resolutions plus the requests' own sizes in flight; a miss recomputes one table, a few
microseconds."""


def flux_image_ids(grid: tuple[int, int], device=None, dtype=torch.float32) -> torch.Tensor:
    """FLUX image position ids, as ``FluxPipeline._prepare_latent_image_ids``.

    Args:
        grid: (h, w) token grid.

    Returns:
        (h * w, 3): channel 0 zero, channel 1 the row, channel 2 the column.
    """
    h, w = grid
    ids = torch.zeros(h, w, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w, device=device, dtype=dtype)[None, :]
    return ids.reshape(h * w, 3)


class FluxAdapter:
    """FLUX architecture (diffusers ``FluxTransformer2DModel``): double-stream then single-stream blocks.

    Padding semantics:

    - batch: pad rows copy real row 0 and are dropped after the forward.
    - image tokens: the forward depends only on the token count (positions come in as ``img_ids``
      tensors), so a tier holds any grid with its token count (512x768 and 768x512 share a graph)
      unmasked. A masked bucket (``key.image_mask``) also holds grids with fewer tokens: pad tokens are
      zero latents with zero position ids, and a boolean key-padding mask ``(batch, 1, 1, text + image)``
      (passed through ``joint_attention_kwargs`` to every attention) keeps real tokens from attending to
      them; every other op of the model is per token or per row, so real tokens are unchanged.
    - text tokens: FLUX was trained on unmasked fixed-length T5 text (512 tokens for FLUX.1-dev); text
      keeps its native length and is never masked (docs/DESIGN.md section 2: a mask changes the output).

    Args:
        model: a ``FluxTransformer2DModel``.
        native_text_tokens: the text length the model was trained with.
        vae_scale_factor: pixels per latent pixel (8 for FLUX's VAE).
    """

    family = "flux"
    timestep_max = 1.0

    def __init__(self, model: torch.nn.Module, native_text_tokens: int, vae_scale_factor: int = 8):
        self.model = model
        patch = int(getattr(model.config, "patch_size", 1))
        # FLUX packs 2x2 latent pixels into one token (FluxPipeline._pack_latents), then patch_size=1.
        self.rules = ShapeRules(
            pixels_per_token=vae_scale_factor * 2 * patch, grid_keyed=False, native_text_tokens=native_text_tokens
        )
        self.in_channels = int(model.config.in_channels)
        self.out_channels = int(model.config.out_channels or model.config.in_channels)
        self.seq_dim = int(model.config.joint_attention_dim)
        self.pooled_dim = int(model.config.pooled_projection_dim)
        self.guidance_embeds = bool(model.config.guidance_embeds)
        self._ids_cache: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
        self._ids_lock = threading.Lock()

    def example_latents(self, rows: int, grid: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """Packed latents (rows, h * w, in_channels), standard normal, CPU fp32."""
        return torch.randn(rows, grid[0] * grid[1], self.in_channels, generator=generator)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Static buffers of ``key`` (shapes in the comments)."""
        b, s, t = key.batch, key.image_tokens, key.text_tokens
        buf = {
            "latents": torch.zeros(b, s, self.in_channels, device=device, dtype=dtype),  # (B, S, C_in)
            "text": torch.zeros(b, t, self.seq_dim, device=device, dtype=dtype),  # (B, T, D_text)
            "pooled": torch.zeros(b, self.pooled_dim, device=device, dtype=dtype),  # (B, D_pooled)
            "timestep": torch.zeros(b, device=device, dtype=dtype),  # (B,)
            "img_ids": torch.zeros(s, 3, device=device, dtype=dtype),  # (S, 3)
            "txt_ids": torch.zeros(t, 3, device=device, dtype=dtype),  # (T, 3)
        }
        if key.image_mask:
            buf["attn_mask"] = torch.ones(b, 1, 1, t + s, device=device, dtype=torch.bool)  # (B, 1, 1, T + S)
        if self.guidance_embeds:
            buf["guidance"] = torch.zeros(b, device=device, dtype=dtype)  # (B,)
        return buf

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """Copy ``inputs`` into the buffers, padding rows with row 0 and image tokens with masked zeros.

        Raises:
            ValueError: if the inputs do not fit the buffers (more rows, tokens or a different text length), or their
                image tokens are not their image stream's (:meth:`stream_ids`).
        """
        lat = buffers["latents"]
        b, s, _ = lat.shape
        t = buffers["text"].shape[1]
        n, k = inputs.rows, inputs.image_tokens
        masked = "attn_mask" in buffers
        if inputs.text_mask is not None:
            raise ValueError("FLUX was trained on unmasked fixed-length text: inputs.text_mask must be None")
        ids = buffers["img_ids"]
        stream = self.stream_ids(inputs, ids.device, ids.dtype)
        if n > b or k > s or (k < s and not masked) or inputs.text_tokens != t or stream.shape[0] != k:
            raise ValueError(
                f"inputs of {n} rows x {k} image tokens x {inputs.text_tokens} text tokens (grid {inputs.grid}) "
                f"do not fit bucket buffers of {b} rows x {s} image tokens x {t} text tokens"
            )
        copy_rows(lat[:, :k], inputs.latents)
        if k < s:
            lat[:, k:].zero_()
        copy_rows(buffers["text"], inputs.text)
        copy_rows(buffers["pooled"], inputs.pooled)
        copy_rows(buffers["timestep"], inputs.timestep)
        if self.guidance_embeds:
            if inputs.guidance is None:
                raise ValueError("this FLUX model is guidance-distilled: inputs.guidance is required")
            copy_rows(buffers["guidance"], inputs.guidance)
        ids[:k].copy_(stream)
        if k < s:
            ids[k:].zero_()
        buffers["txt_ids"].zero_()
        if masked:
            mask = buffers["attn_mask"]
            mask[..., : t + k].fill_(True)
            if k < s:
                mask[..., t + k :].fill_(False)

    def stream_ids(self, inputs: DenoiseInputs, device, dtype) -> torch.Tensor:
        """Position ids of ``inputs``' image stream: its grid's (:meth:`image_ids`; FLUX.1 takes no reference images).

        Raises:
            ValueError: ``inputs.references`` set.
        """
        if inputs.references:
            raise ValueError(f"{type(self.model).__name__} takes no reference images (inputs.references "
                             f"{inputs.references})")
        return self.image_ids(inputs.grid, device, dtype)

    def image_ids(self, grid: tuple[int, int], device, dtype) -> torch.Tensor:
        """Cached :func:`flux_image_ids` (one small tensor per grid and device): the last :data:`IDS_CACHE_GRIDS`
        used are kept (a grid is a request's size, which a client picks freely within the limits: up to 4,096 grids
        of up to 4,096 tokens at 1024 px, 48 KiB each), the least recently used dropped first.

        Args:
            grid: the image's token grid ``(h, w)``, as :func:`flux_image_ids` takes it.
            device, dtype: where and in what type the table is wanted.

        Returns:
            The ``(h * w, 3)`` ids; shared, not to be written to.
        """
        key = (grid, str(device), dtype)
        with self._ids_lock:  # the step thread and the edit-start thread (an edit's first step)
            ids = self._ids_cache.get(key)
            if ids is not None:
                self._ids_cache.move_to_end(key)
                return ids
        ids = flux_image_ids(grid, device=device, dtype=dtype)
        with self._ids_lock:
            self._ids_cache[key] = ids
            while len(self._ids_cache) > IDS_CACHE_GRIDS:
                self._ids_cache.popitem(last=False)
        return ids

    def _call(self, latents, text, pooled, timestep, img_ids, txt_ids, guidance, attention_kwargs):
        return self.model(
            hidden_states=latents,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            joint_attention_kwargs=attention_kwargs,
            return_dict=False,
        )[0]

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded forward over the static buffers: (B, S, C_out)."""
        return self._call(
            buffers["latents"], buffers["text"], buffers["pooled"], buffers["timestep"], buffers["img_ids"],
            buffers["txt_ids"], buffers.get("guidance"),
            {"attention_mask": buffers["attn_mask"]} if "attn_mask" in buffers else None,
        )

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """Rows ``[0, inputs.rows)`` and image tokens ``[0, inputs.image_tokens)`` of ``output``."""
        return output[: inputs.rows, : inputs.image_tokens]

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """Unpadded, unmasked reference forward, exactly as ``FluxPipeline`` calls the transformer."""
        p = next(self.model.parameters())
        cast = lambda x: None if x is None else x.to(device=p.device, dtype=p.dtype)  # noqa: E731
        return self._call(
            cast(inputs.latents), cast(inputs.text), cast(inputs.pooled), cast(inputs.timestep),
            flux_image_ids(inputs.grid, device=p.device, dtype=p.dtype),
            torch.zeros(inputs.text_tokens, 3, device=p.device, dtype=p.dtype),
            cast(inputs.guidance) if self.guidance_embeds else None, None,
        )
