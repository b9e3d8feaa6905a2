"""Measuring the cost model: each bucket's forward through its runner and each shape's unpadded eager forward
against row count, timed on the model's device (:class:`~.model.CostModel`, source ``measured``)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

from bcg_core.costs.miss_memory import ActivationPeaks
from bcg_core.costs.model import CostModel
from bcg_core.keys import BucketKey

__all__ = ["eager_row_counts", "measure_costs"]

log = logging.getLogger(__name__)


def _timer(device) -> Callable[[Callable[[], object], int], float]:
    """``time(fn, iters) -> median ms`` on ``device`` after one warm-up call: CUDA events on CUDA
    (:func:`bcg_core.planning.profile.cuda_ms`), the host clock elsewhere."""
    import torch

    if torch.device(device).type == "cuda":
        from bcg_core.devices import cuda_ms

        return lambda fn, iters: cuda_ms(fn, iters, warmup=1)

    def host_ms(fn: Callable[[], object], iters: int) -> float:
        fn()  # warm-up (allocator, kernels selected)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return float(statistics.median(times))

    return host_ms


def eager_row_counts(batch_sizes: Sequence[int]) -> list[int]:
    """Row counts an eager shape is measured at: 1, 2, 4, ... up to the largest batch, and every batch size."""
    largest = max(batch_sizes)
    rows = {b for b in batch_sizes}
    r = 1
    while r <= largest:
        rows.add(r)
        r *= 2
    return sorted(rows)


def measure_costs(runner, adapter, keys: Sequence[BucketKey], inputs_for: Callable[[BucketKey, int], object],
                  device, iters: int = 2, slot_zero: Callable[[object], object] | None = None) -> CostModel:
    """Measure the forward times of ``keys`` and, per shape, the unpadded eager forward against row count.

    Args:
        runner: the bucket runner (``runner.run(key, inputs)``), its buckets prepared.
        adapter: the family's adapter (``adapter.forward_eager(inputs)``).
        keys: buckets to measure (those of the shapes this replica owns).
        inputs_for: ``(key, rows) -> DenoiseInputs``: real inputs of ``rows`` rows at the size of ``key``'s
            exact tier (a request that fills the tier, so eager and bucket forwards compute the same tokens).
        device: the model's device (CUDA events there, the host clock elsewhere).
        iters: timed calls per point (median), after one warm-up call.
        slot_zero: with LoRA adapters, the adapter's :meth:`~bcg_core.lora.rows.LoRAAdapter.on_slot_zero` (the
            :class:`~bcg_core.capabilities.PlainForward` capability, answered where the pipeline is built); None
            without adapters.

    Returns:
        A ``measured`` :class:`CostModel`. The forwards go through the runner, so they count as forwards of
        their buckets in the metrics (``forwards_by_mode``). With ``slot_zero`` (LoRA adapters) ``bucket_ms``
        times each bucket's plain graph (no row has an adapter) and ``lora_ms`` its LoRA graph: the same inputs
        with every row on slot 0, which computes every row's deltas as a real adapter does (zeros, at the same cost). On
        CUDA its ``eager_bytes_per_row_token`` is the eager forwards' most peak bytes per row-token
        (:class:`ActivationPeaks`).
    """
    import torch

    time_ms = _timer(device)
    bucket: dict[BucketKey, float] = {}
    lora: dict[BucketKey, float] = {}
    eager: dict[str, dict[int, float]] = {}
    by_shape: dict[str, list[BucketKey]] = {}
    for k in keys:
        by_shape.setdefault(k.shape, []).append(k)
    seen: dict[tuple, float] = {}
    peaks = ActivationPeaks(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for shape, ks in sorted(by_shape.items()):
            for k in sorted(ks, key=lambda k: k.batch):
                x = inputs_for(k, k.batch)
                bucket[k] = time_ms(lambda k=k, x=x: runner.run(k, x), iters)
                if slot_zero is not None:
                    xl = slot_zero(x)
                    lora[k] = time_ms(lambda k=k, xl=xl: runner.run(k, xl), iters)
            ref = max(ks, key=lambda k: k.batch)
            for rows in eager_row_counts([k.batch for k in ks]):
                # an exact tier and its masked twin run the same unpadded eager forward: measured once
                same = (ref.image_tokens, ref.text_tokens, ref.latent_hw, rows)
                if same not in seen:
                    x = inputs_for(ref, rows)
                    # a replica times these after ready, in a worker thread, while the denoising thread may capture
                    # (a lazy bucket, a bucket's step-cache halves): ActivationPeaks synchronizes the whole device,
                    # which would invalidate that capture, so they wait for each other on the runner's gate (never
                    # held with runner.run's lock here: the denoising thread takes that lock first, then the gate)
                    with runner.gate:
                        seen[same] = peaks.measure(x, lambda x=x: time_ms(lambda: adapter.forward_eager(x), iters))
                eager.setdefault(shape, {})[rows] = seen[same]
    log.info("measured %d bucket forwards and %d eager points in %.1f s", len(bucket),
             sum(len(p) for p in eager.values()), time.perf_counter() - t0)
    return CostModel(bucket, eager, source="measured", lora_ms=lora, eager_bytes_per_row_token=peaks.most)
