"""Each row's adapters through padding, capture and replay: the family's padding adapter with LoRA rows.

:class:`LoRAAdapter` wraps a family's :class:`~bcg_core.padding.DiTAdapter`. A bucket's static buffers gain
``lora_slots`` (B, K) int64 and ``lora_scales`` (B, K) float32; :meth:`LoRAAdapter.fill` writes the real rows'
entries and slot 0 with scale 0 on pad rows (their output is dropped); :meth:`LoRAAdapter.forward` runs the
family's forward with those buffers as this thread's rows (:meth:`~bcg_core.lora.layers.LoRALayers.rows`), so a
graph captured over the bucket reads them where they live; :meth:`LoRAAdapter.forward_plain` is the same forward
without rows, which the CUDA graph runner captures as the bucket's second graph and replays when no row of a
forward has an adapter. Everything else is the family's own.
"""

from __future__ import annotations

import dataclasses

import torch

from bcg_core.capabilities import PlainForward, eager_mixes_rows
from bcg_core.keys import BucketKey
from bcg_core.lora.layers import LoRALayers
from bcg_core.padding import DenoiseInputs

__all__ = ["LoRAAdapter", "request_rows"]


def request_rows(slots: tuple[int, ...], scales: tuple[float, ...], rows: int, k: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's LoRA entries on each of its ``rows`` rows (cond and uncond rows alike: diffusers' pipeline
    runs both through the adapted transformer), padded to ``k`` entries with slot 0 and scale 0.

    Returns:
        ``(slots (rows, k) int64, scales (rows, k) float32)`` on ``device``.
    """
    s = list(slots) + [0] * (k - len(slots))
    w = list(scales) + [0.0] * (k - len(scales))
    return (torch.tensor([s], dtype=torch.int64).expand(rows, k).to(device),
            torch.tensor([w], dtype=torch.float32).expand(rows, k).to(device))


class LoRAAdapter(PlainForward):
    """A family's padding adapter whose forwards carry per-row LoRA entries (module docstring).

    Args:
        inner: the family's adapter.
        layers: the transformer's wrapped layers.
    """

    def __init__(self, inner, layers: LoRALayers):
        self.inner = inner
        self.layers = layers
        self.k = layers.max_per_request
        self._mixes_rows = eager_mixes_rows(inner)

    def __getattr__(self, name):  # family, rules, model, timestep_max, example_latents ... are the family's
        return getattr(self.inner, name)

    def allocate(self, key: BucketKey, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The family's buffers of ``key`` plus ``lora_slots`` (B, K) int64 and ``lora_scales`` (B, K) float32."""
        buffers = self.inner.allocate(key, device, dtype)
        b = key.batch
        buffers["lora_slots"] = torch.zeros(b, self.k, device=device, dtype=torch.int64)
        buffers["lora_scales"] = torch.zeros(b, self.k, device=device, dtype=torch.float32)
        return buffers

    def fill(self, buffers: dict[str, torch.Tensor], inputs: DenoiseInputs) -> None:
        """The family's fill, then each real row's entries (none: slot 0) and slot 0 on pad rows.

        Raises:
            ValueError: as the family's fill, or entries wider than K.
        """
        self.inner.fill(buffers, inputs)
        slots, scales = buffers["lora_slots"], buffers["lora_scales"]
        n = inputs.rows
        if inputs.lora_slots is None:
            slots.zero_()
            scales.zero_()
            return
        if inputs.lora_slots.shape[1] != self.k:
            raise ValueError(f"rows carry {inputs.lora_slots.shape[1]} LoRA entries, the layers take {self.k}")
        slots[:n].copy_(inputs.lora_slots)
        scales[:n].copy_(inputs.lora_scales)
        slots[n:].zero_()
        scales[n:].zero_()

    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """The family's padded forward with the buffers' rows as this thread's LoRA rows."""
        with self.layers.rows(buffers["lora_slots"], buffers["lora_scales"]):
            return self.inner.forward(buffers)

    def on_slot_zero(self, inputs: DenoiseInputs) -> DenoiseInputs:
        """``inputs`` with every row on slot 0 at scale 0 (:func:`request_rows` of no adapter): through a bucket,
        the graph that serves adapter rows, adding every row's deltas (zeros) at a real adapter's cost; what the
        bucket checks (:func:`~bcg_core.verify.verify_runner`) and the cost model
        (:func:`~bcg_core.costs.measure_costs`) run it with."""
        slots, scales = request_rows((), (), inputs.rows, self.k, inputs.latents.device)
        return dataclasses.replace(inputs, lora_slots=slots, lora_scales=scales)

    def forward_plain(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """The family's padded forward with no LoRA rows: what a bucket's second graph captures, replayed for
        forwards in which no row has an adapter (``lora_slots`` None), so those rows pay nothing for the
        deltas (eager kernels: no LoRA kernel at all; compiled blocks: a call of the operator that does nothing
        without rows)."""
        with self.layers.rows(None, None):
            return self.inner.forward(buffers)

    def unpad(self, output: torch.Tensor, inputs: DenoiseInputs) -> torch.Tensor:
        """The family's unpad."""
        return self.inner.unpad(output, inputs)

    def forward_eager(self, inputs: DenoiseInputs) -> torch.Tensor:
        """The family's unpadded forward with ``inputs``' entries as this thread's LoRA rows (none: no deltas).

        A family whose unpadded forward feeds a linear layer something other than one entry per row
        (:class:`~bcg_core.capabilities.EagerMixesRows`: Z-Image's transformer embeds every row's tokens as one flat
        sequence, Qwen-Image 2.1's runs each row alone with an extra t = 0 row) runs once per set of rows that carry the
        same entries, with those entries as one row (:func:`~bcg_core.lora.layers.lora_add_` applies one row's entries
        to all of a layer's input); the rows' outputs are put back in their order. Rows of one request share their
        entries, so a request alone is one forward, as diffusers runs it.
        """
        if inputs.lora_slots is None:
            return self.inner.forward_eager(inputs)
        device = self.layers.device
        slots, scales = inputs.lora_slots.to(device), inputs.lora_scales.to(device)
        if not self._mixes_rows:
            with self.layers.rows(slots, scales):
                return self.inner.forward_eager(inputs)
        groups: dict[tuple, list[int]] = {}
        for i, entry in enumerate(zip(inputs.lora_slots.tolist(), inputs.lora_scales.tolist(), strict=True)):
            groups.setdefault(repr(entry), []).append(i)
        if len(groups) == 1:
            with self.layers.rows(slots[:1], scales[:1]):
                return self.inner.forward_eager(inputs)
        out = None
        for rows in groups.values():
            with self.layers.rows(slots[rows[:1]], scales[rows[:1]]):
                part = self.inner.forward_eager(inputs.select(rows))
            if out is None:
                out = part.new_empty((inputs.rows, *part.shape[1:]))
            out[rows] = part
        return out
