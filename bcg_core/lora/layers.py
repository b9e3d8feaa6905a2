"""Batched LoRA inside the transformer: every row of a forward adds its own adapters' deltas.

Each targeted ``nn.Linear`` is wrapped by :class:`LoRALinear` (the original layer kept as ``.base``, as peft
keeps ``base_layer``), which holds the stacked weights of every slot in one static buffer::

    AB: (slots + 1, max_rank, in_features + out_features)
        AB[s, :, :in]  = A_s            lora_A of slot s's adapter, rank zero-padded
        AB[s, :, in:]  = scaling_s B_s^T   lora_B transposed, times peft's lora_alpha / r of that adapter's layer

Slot 0 is "no adapter" and stays zero. A forward's rows carry ``slots`` (rows, K) int64 and ``scales`` (rows, K)
float32 (K = ``lora.max_per_request``; an unused entry is slot 0 with scale 0): row ``i`` computes::

    y_i = W x_i + b + sum_k scales[i, k] * scaling_s * B_s (A_s x_i),   s = slots[i, k]

which is peft's ``base_layer(x) + lora_B(lora_A(x)) * scaling`` summed over the active adapters, with
``set_adapters``' weight as ``scales[i, k]``. Zero-padding a rank is exact (the padded products are zeros).

The deltas are added in place to the base layer's output by four kernels per layer on CUDA, whatever K and the
ranks, where the layer's input and output are contiguous (as in every served family): one gather of the rows'
``AB`` entries (both halves at once), one product of the ``B`` half with the rows' scales (cast to the model's
dtype in the same kernel), and two batched matmuls (``x A^T``, then ``y += h (scale B^T)``). Folding each layer's
``scaling`` into its ``B`` half when the adapter is written, instead of gathering and multiplying it per layer
and forward, is what makes it four (it was eight: separate gathers of ``A``, ``B^T`` and ``scaling``, their
product with the scales and its cast, the scaled ``h`` and an out-of-place sum). In a CUDA graph each small
kernel still costs microseconds, times the 340 wrapped layers of SD3-medium: measured on an H200 with eager
kernels, a SD3-medium bucket's forward with adapter rows took 1.11-1.27x its plain forward at 4,096 image tokens
and 1.32-1.78x at 256, where the base matmuls are smallest (docs/BENCHMARKS.md, 2026-12-05). In float16 a
folded entry below 6.1e-5 (a small ``scaling`` times a small ``B``) is subnormal and keeps fewer bits; its share of
the output is far below the output's own rounding, so the result is unchanged at the model's precision.

The rows reach the layers as a thread-local (:meth:`LoRALayers.rows`), set around each forward by the padding
wrapper (:class:`~bcg_core.lora.rows.LoRAAdapter`) to that bucket's own static buffers; the delta is one
custom operator (``bcg::lora_add_``, mutating the base output), opaque to dynamo and inductor, that reads them
when it runs. So a CUDA graph captured over a bucket reads that bucket's row buffers at fixed addresses, a
compiled block (traced or precompiled) needs no guard on them, and a capture on another thread never sees this
thread's rows. Without rows the operator does nothing: a compiled block's forward for rows without adapters
pays no copy of each layer's output (inductor writes the in-place update back into the base output's buffer
rather than cloning it). Loading an adapter copies into the buffer in place (:meth:`LoRALayers.write`): no
graph is captured again.
"""

from __future__ import annotations

import contextlib
import fnmatch
import threading
from collections.abc import Iterator

import torch

__all__ = ["LoRALayers", "LoRALinear", "check_targets", "lora_add_", "targeted_layers"]

_ROWS = threading.local()


@torch.library.custom_op("bcg::lora_add_", mutates_args=("y",))
def lora_add_(y: torch.Tensor, x: torch.Tensor, AB: torch.Tensor) -> None:
    """Add each row's LoRA deltas (module docstring) to ``y`` in place, rows from this thread's
    :meth:`LoRALayers.rows`.

    Args:
        y: (n, ..., out) the base layer's output; updated in place.
        x: (n, ..., in) its input; ``n`` is the forward's rows (every layer of the DiTs served here keeps the
            batch first: (n, tokens, features) or (n, features)).
        AB: (slots + 1, max_rank, in + out) the layer's slot buffer (module docstring).

    Without rows set (a forward outside the padding wrapper: checks, tests, a compiled forward for rows without
    adapters), ``y`` is left as it is. Rows set for one row apply to the whole of ``x``, whatever its first
    dimension: every token of the forward is that row's (an unpadded forward whose rows all carry the same
    adapters, :meth:`~bcg_core.lora.rows.LoRAAdapter.forward_eager`, through a transformer that flattens its rows'
    tokens into one sequence before a linear layer, as Z-Image's embedders do).

    Raises:
        ValueError: rows set for more than one row and another number of rows than ``x`` has.
    """
    rows = getattr(_ROWS, "current", None)
    if rows is None:
        return
    slots, scales = rows
    n, d_in = slots.shape[0], x.shape[-1]
    if x.shape[0] != n and n != 1:  # a layer fed something other than one entry per row would mix up adapters
        raise ValueError(f"LoRA rows set for {n} rows, the layer's input has {x.shape[0]} in its first dimension")
    ab = AB[slots]  # (n, K, r, in + out): one gather for both halves
    a = ab[..., :d_in].flatten(1, 2)  # (n, K*r, in), a view (the row stride of A is in + out)
    bt = torch.empty((*ab.shape[:3], ab.shape[3] - d_in), dtype=y.dtype, device=y.device)
    torch.mul(ab[..., d_in:], scales[:, :, None, None], out=bt)  # scale * scaling * B^T, rounded once to y's dtype
    h = torch.bmm(x.reshape(n, -1, d_in), a.transpose(1, 2))  # (n, T, K*r)
    if y.is_contiguous():
        y.view(n, -1, y.shape[-1]).baddbmm_(h, bt.flatten(1, 2))
    else:  # not met in the served families (a linear layer's output is contiguous); kept correct all the same
        y.add_(torch.bmm(h, bt.flatten(1, 2)).view(y.shape))


@lora_add_.register_fake
def _(y, x, AB):
    return None


class LoRALinear(torch.nn.Module):
    """An ``nn.Linear`` with batched per-row LoRA (module docstring). ``in_features`` and ``out_features`` are the
    base layer's; ``weight`` and ``bias`` are its parameters (so code reading them sees the layer unchanged)."""

    def __init__(self, base: torch.nn.Linear, slots: int, max_rank: int):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        w = base.weight
        self.register_buffer("AB", torch.zeros(slots + 1, max_rank, base.in_features + base.out_features,
                                               device=w.device, dtype=w.dtype), persistent=False)

    @property
    def A(self) -> torch.Tensor:
        """(slots + 1, max_rank, in) the slots' ``lora_A``: a view of ``AB``."""
        return self.AB[..., :self.in_features]

    @property
    def Bt(self) -> torch.Tensor:
        """(slots + 1, max_rank, out) the slots' ``scaling * lora_B^T``: a view of ``AB``."""
        return self.AB[..., self.in_features:]

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (out, in)."""
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        """The base layer's bias (out,) or None."""
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base(x)`` plus this thread's rows' deltas (:func:`lora_add_`). Outside a compile trace, with no rows
        set, the base layer alone: the graph a bucket captures for forwards without adapter rows
        (:meth:`~bcg_core.lora.rows.LoRAAdapter.forward_plain`) then holds no LoRA kernels. Compiled code always
        calls the operator (its rows are read when it runs, so a trace never depends on them; without rows it
        does nothing)."""
        if not torch.compiler.is_compiling() and getattr(_ROWS, "current", None) is None:
            return self.base(x)
        y = self.base(x)
        lora_add_(y, x, self.AB)
        return y


def targeted_layers(transformer: torch.nn.Module, targets: list[str] | None) -> list[str]:
    """Names of ``transformer``'s ``nn.Linear`` modules that ``lora.targets`` picks (``fnmatch`` patterns of module
    names; None: every linear layer), in ``named_modules`` order.

    Raises:
        ValueError: no linear layer matches, naming the patterns and the transformer's class.
    """
    wanted = lambda name: targets is None or any(fnmatch.fnmatchcase(name, p) for p in targets)  # noqa: E731
    names = [n for n, m in transformer.named_modules() if type(m) is torch.nn.Linear and wanted(n)]
    if not names:
        raise ValueError(f"lora.targets {targets} match no linear layer of {type(transformer).__name__}")
    return names


def check_targets(model_config, targets: list[str] | None) -> None:
    """Check ``lora.targets`` against the configured transformer before any replica loads it: the transformer is
    built on the meta device from its JSON config (no weights, no memory), as :func:`targeted_layers` would see it.
    The tiny default (``model.path`` None) is FLUX's tiny transformer. A transformer whose constructor cannot run on
    the meta device is not checked here; the replica checks it when it wraps the layers.

    Raises:
        ValueError: ``targets`` match no linear layer (:func:`targeted_layers`).
    """
    if targets is None:
        return
    import json
    from pathlib import Path

    import diffusers

    try:
        with torch.device("meta"):
            if model_config.path is None:
                from bcg_core.families.tiny import tiny_transformer_config

                # 384: MiniLM's width, the tiny text encoder's (the layers' names do not depend on it)
                transformer = diffusers.FluxTransformer2DModel(**tiny_transformer_config(384))
            else:
                cfg = json.loads((Path(model_config.path) / "transformer" / "config.json").read_text())
                transformer = getattr(diffusers, cfg["_class_name"]).from_config(cfg)
    except Exception:  # noqa: BLE001 - not checkable here; LoRALayers checks at the replica
        return
    targeted_layers(transformer, targets)


class LoRALayers:
    """The targeted linear layers of one transformer, wrapped in place, and their slot buffers.

    Args:
        transformer: the family's transformer, on its device and dtype (layers are replaced in it).
        slots: ``lora.slots`` (adapters resident at once; slot 0, "no adapter", comes on top).
        max_rank: ``lora.max_rank``.
        max_per_request: ``lora.max_per_request`` (K, the adapters one row may carry).
        targets: ``lora.targets``: module-name patterns (``fnmatch``) of the linear layers to wrap; None: every
            linear layer of the transformer (LoRA trainers put theirs in the blocks' attention, MLP and
            modulation layers, some also in the embedders and the final projection; the layers outside the
            blocks hold a few percent of the slot memory).

    Raises:
        ValueError: no linear layer matches.
    """

    def __init__(self, transformer: torch.nn.Module, slots: int, max_rank: int, max_per_request: int,
                 targets: list[str] | None = None):
        self.slots, self.max_rank, self.max_per_request = slots, max_rank, max_per_request
        self.layers: dict[str, LoRALinear] = {}
        for name in targeted_layers(transformer, targets):
            parent_name, _, child = name.rpartition(".")
            parent = transformer.get_submodule(parent_name) if parent_name else transformer
            wrapped = LoRALinear(getattr(parent, child), slots, max_rank)
            setattr(parent, child, wrapped)
            self.layers[name] = wrapped
        self.device = next(iter(self.layers.values())).AB.device

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Module name -> ``(in_features, out_features)`` of every wrapped layer (what an adapter may change)."""
        return {n: (m.in_features, m.out_features) for n, m in self.layers.items()}

    @property
    def delta_share(self) -> float:
        """The work a forward with adapter rows adds to the wrapped layers, as a share of their own matmuls:
        ``sum (in + out) x K x max_rank / sum in x out`` over the wrapped layers. Per token, each wrapped layer
        multiplies ``in x out`` for its weight and ``(in + out) x K x max_rank`` for the rows' deltas (every row
        computes K entries of ``max_rank``, zero-padded ones too). So ``lora.max_rank`` 64 and
        ``lora.max_per_request`` 4 add 17% at FLUX.1's 3,072-wide layers and 33% at SD3-medium's 1,536-wide
        ones; 16 and 2 add 2% and 4%. Multiply-adds only: the deltas' extra passes over the activations, which
        do not grow with K or the rank, are not in it (:data:`~bcg_core.lora.slots.DELTA_SHARE_WARN`)."""
        k_r = self.max_per_request * self.max_rank
        delta = sum((m.in_features + m.out_features) * k_r for m in self.layers.values())
        return delta / sum(m.in_features * m.out_features for m in self.layers.values())

    @property
    def nbytes(self) -> int:
        """Device bytes of the slot buffers."""
        return sum(m.AB.numel() * m.AB.element_size() for m in self.layers.values())

    def write(self, slot: int, adapter) -> None:
        """Copy ``adapter`` (:class:`~bcg_core.lora.files.AdapterWeights`) into ``slot`` of every layer, in place
        (a layer it does not change gets zeros). Runs on the current CUDA stream: the caller (the loader thread)
        runs it on its own stream and synchronizes it before any row uses the slot.

        Raises:
            ValueError: slot 0 or one out of range, or an adapter layer that is not wrapped here.
        """
        if not 1 <= slot <= self.slots:
            raise ValueError(f"slot {slot} is not one of 1..{self.slots}")
        stray = set(adapter.layers) - set(self.layers)
        if stray:
            raise ValueError(f"adapter {adapter.name!r} changes layers not wrapped here: {sorted(stray)[:3]}")
        for name, layer in self.layers.items():
            delta = adapter.layers.get(name)
            layer.AB[slot].zero_()
            if delta is None:
                continue
            r = delta.rank
            layer.A[slot, :r].copy_(delta.A, non_blocking=True)
            b = delta.B.to(layer.AB.device, torch.float32, non_blocking=True)  # (out, r) as read: one async copy
            layer.Bt[slot, :r].copy_(b.t() * delta.scaling)  # scaling folded in at float32, rounded once

    @staticmethod
    @contextlib.contextmanager
    def rows(slots: torch.Tensor | None, scales: torch.Tensor | None) -> Iterator[None]:
        """Forwards on this thread inside the block use ``slots`` (n, K) int64 and ``scales`` (n, K) float32 on
        the layers' device (None: no rows, every delta skipped), restoring the previous rows after."""
        before = getattr(_ROWS, "current", None)
        _ROWS.current = None if slots is None else (slots, scales)
        try:
            yield
        finally:
            _ROWS.current = before

    @staticmethod
    @contextlib.contextmanager
    def stacked(times: int) -> Iterator[None]:
        """Forwards on this thread inside the block take inputs that hold the forward's n rows ``times`` over, stacked
        along the first dimension (``torch.cat`` of ``times`` tensors of one entry per row): entry ``j`` of such an
        input is row ``j % n``'s, and gets that row's adapters. Qwen-Image 2.1's bucket forward embeds each row's
        timestep and its own t = 0 (``times`` 2) this way (:meth:`~bcg_core.families.qwenimage21_adapter.
        QwenImage21Adapter.forward`). Without rows set, nothing changes; the previous rows are restored after."""
        before = getattr(_ROWS, "current", None)
        if before is not None:
            slots, scales = before
            _ROWS.current = (slots.repeat(times, 1), scales.repeat(times, 1))
        try:
            yield
        finally:
            _ROWS.current = before
