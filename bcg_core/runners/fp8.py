"""The ``fp8`` kernel tier (:attr:`~bcg_core.runners.kernels.KernelTier.FP8`): ``compiled``
(:class:`~bcg_core.runners.kernels.CompiledKernels`) with the linear layers of the repeated blocks in float8.

- :func:`check_fp8`: where the tier can run (a CUDA GPU of compute capability :data:`FP8_MIN_CAPABILITY` or newer,
  8.9: Ada, Hopper; and torchao); anything else is a start-up error.
- :func:`fp8_layers`: which linear layers turn to float8 (inside :func:`~bcg_core.runners.kernels.repeated_blocks`;
  modulation, embedders and the final projection stay in bf16).
- :func:`quantize_fp8`: the turning, in place, by torchao's ``Float8DynamicActivationFloat8WeightConfig`` with
  per-row scales (each activation row and each weight output channel scaled on its own), an activation row's
  absolute maximum at least :data:`FP8_AMAX_LB`.

Apart from :mod:`bcg_core.runners.kernels` (the tiers and the compiled blocks' switch) because only this tier needs
torchao and a float8 GPU. Called once per transformer where the kernels are built
(:func:`~bcg_core.runners.build.compiled_kernels`). The tier's compile check bound, :data:`FP8_RTOL`, is here too;
it is read with the other tiers' tolerances (:func:`~bcg_core.verify.kernel_tolerance`). What the tier guarantees
and what was measured: docs/OPERATIONS.md ("Kernel tiers") and docs/BENCHMARKS.md.
"""

from __future__ import annotations

import torch

from bcg_core.runners.kernels import repeated_blocks

__all__ = ["FP8_AMAX_LB", "FP8_MIN_CAPABILITY", "FP8_RTOL", "check_fp8", "fp8_layers", "quantize_fp8"]


FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with float8 tensor cores (Ada Lovelace 8.9; Hopper is 9.0)."""


def check_fp8(device: torch.device) -> None:
    """Refuse the ``fp8`` tier where it cannot run.

    Raises:
        ValueError: ``device`` is not a CUDA GPU of compute capability :data:`FP8_MIN_CAPABILITY` or newer, or
            torchao is not installed; the message names the device and the fix.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"runner.kernels 'fp8' needs a CUDA GPU with float8 matmuls (compute capability "
                         f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer: Ada, Hopper); the model runs on "
                         f"{device.type}: use 'compiled' or 'eager'")
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        raise ValueError(f"runner.kernels 'fp8' needs compute capability {FP8_MIN_CAPABILITY[0]}."
                         f"{FP8_MIN_CAPABILITY[1]} or newer (float8 matmuls); {torch.cuda.get_device_name(device)} "
                         f"has {cap[0]}.{cap[1]}: use 'compiled' or 'eager'")
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ValueError("runner.kernels 'fp8' needs torchao (pip install torchao): its float8 linear layers "
                         "are what the tier runs")


FP8_AMAX_LB = 1e-12
"""Lower bound of an activation row's absolute maximum when its float8 scale is chosen (torchao's
``activation_value_lb``; the value is torchao float8 training's ``EPS`` in ``torchao/float8/float8_utils.py``).
Without it an all-zero row gets scale ``0 / 448`` and quantizes to ``0 / 0 = NaN``: padded text tokens of
PixArt-Sigma and SANA reach the cross-attention's ``to_k`` / ``to_v`` as zero rows where the caption projection
has zero biases, and NaN keys and values masked out of attention still poison every row (``0 x NaN``); measured
on an H200, every fp8 image of both families was NaN with random weights (docs/BENCHMARKS.md, 2026-12-04). With
it a zero row quantizes to zeros and gives the layer's bias, exactly as in bf16."""


FP8_RTOL = 0.25
"""Stated bound of the ``fp8`` tier's check: a bucket's compiled forward may deviate from the eager forward of the
same float8 model (whose linear layers quantize too, through torchao's eager path) by this much relative to its
largest value: two float8 e4m3 steps (3 mantissa bits, so one step is 2^-3 = 12.5% of a value), since the two
paths quantize activations on their own and may round a value one step apart. Measured: 5-8e-3 on the tiny test
model, 0.11 and 0.12 on the full FLUX.1-dev transformer at 1 x 4096 image tokens (random weights, H200,
docs/BENCHMARKS.md), where 0.1 failed both buckets. A broken compile deviates by O(1) or NaN. The deviation of fp8
images from bf16 ones is the bf16 gate's to report, not this check's."""


def fp8_layers(transformer: torch.nn.Module) -> list[str]:
    """Names of the linear layers :func:`quantize_fp8` turns to float8: those inside the repeated blocks
    (:func:`repeated_blocks`), except the adaptive norms' modulation layers (a name with ``norm``) and any layer
    with an all-zero weight row (its per-channel float8 scale would be 0, and the row ``0 / 0 = NaN``: such a
    layer stays in bf16)."""
    blocks = {id(b) for b in repeated_blocks(transformer)}
    prefixes = [name + "." for name, m in transformer.named_modules() if id(m) in blocks]
    return [name for name, m in transformer.named_modules()
            if isinstance(m, torch.nn.Linear) and any(name.startswith(p) for p in prefixes) and "norm" not in name
            and m.weight.device.type != "meta" and bool(m.weight.detach().abs().amax(dim=1).gt(0).all())]


def quantize_fp8(transformer: torch.nn.Module) -> int:
    """Turn :func:`fp8_layers` of ``transformer`` to float8, in place (torchao ``quantize_`` with
    ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``: weights stored in float8_e4m3fn with one
    scale per output channel, activations quantized per row at run time, each row's absolute maximum at least
    :data:`FP8_AMAX_LB` so that a zero row stays zero). Returns the layers changed."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    names = set(fp8_layers(transformer))
    # set_inductor_config=False: torchao's default turns on inductor's coordinate-descent tuning process-wide
    # (torchao.quantization.utils.recommended_inductor_config_setter), which changes every other compile in the
    # process and, on an H200 with torch 2.11, crashed Triton while tuning FLUX blocks (docs/BENCHMARKS.md).
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), activation_value_lb=FP8_AMAX_LB,
                                                       set_inductor_config=False)
    quantize_(transformer, config, filter_fn=lambda module, fqn: fqn in names)
    return len(names)
