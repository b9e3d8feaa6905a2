"""Saturation benchmark: three servers, one replay of real requests, side by side in one process run.

For one model per invocation, the first ``--requests`` (default 32) requests of the real krea sample
(``deployments.cli.demo.load_requests``: each its own width x height and image count, the data's seeds; a row
without a seed gets ``seed = its request number``, so every server draws the same noise) are replayed over
HTTP (``deployments.cli.demo.replay``, ``--concurrency`` in flight, ``--steps`` denoising steps) against each of
three servers, started one after another in this process with ``deployments.cli.local.start_local`` (Ray and Serve
on 127.0.0.1) and stopped with ``deployments.cli.local.stop_local`` before the next one starts:

- ``naive``: unpadded per-request eager, no batching across requests. The same application (the step
  scheduler) with the config override ``runner: {mode: eager}`` and a bucket table that
  every request misses: ``buckets: {batch_sizes: [1], resolutions: [T], image_padding: exact,
  miss_policy: eager}`` (text buckets as the other servers'), where the one tier ``T`` is a size no request of
  the run (warm-up, replay, concurrency-1 phase) is generated at: for token-count keyed models (FLUX, the tiny
  default) the smallest size whose token count no request has (``exact`` padding, so a smaller request does
  not fit it either); for PixArt-Sigma an aspect-ratio bin no request is binned to. The miss policy ``eager``
  runs every miss unpadded and eagerly (``bcg_core.pipeline.DiTPipeline.step``: ``runner.run(None, ...)``),
  alone (the step scheduler never shares a miss's forward with another request), each step as ONE forward holding
  all the request's rows, uncond rows included, as a user's own server runs it: the eager runner measures no
  activation bytes, so nothing cuts a miss into chunks (``bcg_core/costs/miss_memory.py``;
  ``tests/engine/test_bench_saturation_naive.py`` fails if a naive request step runs more than one forward;
  from e0529e4 until the memory bound, a miss was cut into chunks no larger than the one-row table's forward, so
  every row of every naive request ran alone). Before anything starts, every request
  is planned with the real ``bcg_core.validation.RequestValidator`` of that config, and the run stops if one would hit a
  bucket. Its replica admits as many requests as the others (``routing.max_ongoing_requests`` and
  ``max_queued_requests`` = ``--naive-max-ongoing``, default ``--concurrency``, instead of the 2 that a
  one-row table would derive), so no request is refused with 503; in flight they interleave step by step
  (the runner serialises forwards). ``--naive-max-ongoing 1`` serves them strictly one at a time instead.
- ``planned`` (only when asked for in ``--servers``): the step scheduler on the table ``bcg plan`` chooses for the
  same model and limits from the packaged krea sample at ``--steps`` steps, at most ``--plan-max-graphs`` graphs
  (:func:`planned_buckets`; ``--plan-costs measure``: on costs the planner measures on this GPU itself, ``bcg plan
  --measure``). Each server's entry records its table's graphs, capture seconds and pool MiB.
- ``cached`` (only when asked for, with ``--cache``): ``step`` with ``cache.default`` set to ``--cache`` (e.g.
  First Block Cache at one threshold), so every request of the replay caches (``bcg_core/step_cache``); compare it
  with ``step`` in the same run.
- ``half-cached`` (only when asked for, with ``--cache``): ``step`` (no ``cache.default``) where every
  even-numbered request of the replay carries ``--cache`` in its body and the odd-numbered ones ask for none
  (:func:`half_cached`; its warm-up requests all cache, so every bucket's piecewise graphs are captured before the
  replay). Every server reports the latency of the odd-numbered requests (``others_latency_ms``), so
  ``ratios.others_latency_vs_step`` says what sharing steps with caching requests costs the requests that do not
  cache.
- ``step``: bcg-serve as configured, the step scheduler on the default table (``bcg_core/scheduler/step_scheduler.py``).
  If ``GET /v1/buckets`` then has no top-level ``scheduler`` section, the replica did not report a step
  scheduler: a warning is printed and the JSON says so (``scheduler_reported: false``).

Every server gets the same model, limits and (but for naive) bucket table; only the overrides above differ
(all in the JSON, with each server's full config).

Image counts (``--mix``): ``krea`` (default) keeps krea's own, 25 of the first 32 requests at n=9;
``gentd26`` draws each request's count from a GenTD26 trace's text-to-image requests (``--trace``; the packaged
burst slice by default, ``../shared/data/alibaba_gentd26_lora_request_trace.csv`` for the whole trace's 58% n=1,
8% n=2, 19% n=4, 14% n=8), the production-like mix: krea's prompts, sizes and seeds, production's counts
(:func:`replay_requests`); the ``planned`` server then plans for the trace joined with krea's sizes.

Models (``--model``):

- ``tiny``: the embedded tiny default (``ServeConfig()``, ``model.path`` None; fp32): the CPU smoke (it needs
  the embedded all-MiniLM tokenizer package, which the ``.gpu`` site pack does not carry).
- ``flux-dev-width``: FLUX.1-dev's published transformer config (width 3072) with 2 double- and 4 single-stream
  blocks, random weights, FLUX's VAE, bf16, 512 native T5 tokens (stand-in text encoders): a compute-bound
  stand-in. Built with ``benchmarks/bench_families.py``'s ``build_checkpoint`` under ``--scratch``.
  Bucket table: the defaults (``bcg_core.config.BucketConfig``, from the krea mix), ``text_lengths: [512]``.
- ``pixart-512``: PixArt-Sigma-XL-2-512-MS (``bench_families``' ``pixart-sigma-512``: the published 1024
  transformer config with ``sample_size: 64``), SDXL VAE, random weights, bf16: launch-bound.
  PixArt-Sigma generates every size at its aspect-ratio bin (``ModelSpec.generation_size``, as diffusers'
  resolution binning) and resizes back, so every krea size is a valid request (none is refused; the validator
  decides, and the run counts any 4xx anyway). Its bucket resolutions must be bins: the table lists exactly
  the bins the run's requests are binned to (7 for the first 32 krea requests: 512x512, 416x608, 608x416,
  576x416, 448x544, 704x352, 800x320), with one text bucket, the smallest of 32/64/128/256/300 that holds
  the run's longest prompt (the stand-in T5 tokenizer of tests/tiny counts more tokens than the real one).
  ``--size 512x512`` instead sends every request at 512x512 (one bin), for all three servers;
  ``--batch-sizes`` / ``--text-lengths`` replace the table's batch / text buckets (every model).

``--tiny`` (CPU smoke of the two named models) uses the tests/tiny configs instead (as ``bench_families
--tiny``), fp32.

Run on the GPU machine (one H200), after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site &&
export PYTHONPATH=$HOME/site:$PWD`` (``--scratch`` needs ~3 GB free for flux-dev-width, ~2 GB for pixart-512)::

    python benchmarks/bench_saturation.py --model flux-dev-width --scratch /dev/shm --commit <sha>
    python benchmarks/bench_saturation.py --model pixart-512 --scratch /dev/shm --commit <sha>

(defaults: 32 requests, 20 steps, concurrency 16, servers naive,request,step; JSON to
``docs/bench/<date>_saturation_<model>_<gpu>.json``; roughly 10 minutes each: a server's start with its graph
captures takes 0.5-2 minutes, the step server's cost measurement included). CPU smoke
(tests/serve/test_bench_saturation_serve.py runs it with ``--c1-requests 2 --warmup none``)::

    OMP_NUM_THREADS=1 python benchmarks/bench_saturation.py --model tiny --requests 2 --steps 1 \\
        --concurrency 2 --servers naive,request --out /tmp/saturation.json

Per server, in order: start (``start_s``: start_local until healthy, graph capture included), warm-up (not
counted: ``--warmup shapes`` sends one request of each distinct (size, n) of the replay, sequentially, at
``--warmup-steps``), the replay, then the concurrency-1 phase. Reported figures:

- ``wall_s``: seconds from the first request sent to the last answer of the replay (``replay`` call).
- ``images_per_s``: images returned (requests answered 200 with all their PNGs) / ``wall_s``.
- ``latency_ms.p50`` / ``p99`` / ``mean`` / ``max``: per-request latency in milliseconds as ``send_request``
  measures it (first POST sent to the final answer received, waits for ``Retry-After`` included), over the
  requests that succeeded; percentiles are linear between order statistics (numpy's default). Raw
  per-request values are in ``requests``.
- ``failures``: requests that did not succeed; ``http_4xx``: those answered 400-499 (refused by the
  family or the limits); ``http_5xx``; ``no_answer`` (timeout, refused connection); ``retries``: the sum of
  ``DemoResult.retries`` (resends after a 503 with ``Retry-After``) when demo reports it (None when it does
  not; ``retry_wait_s`` per request in the raw rows).
- ``padded_token_waste``: fraction (0..1) of computed transformer tokens that were padding, from
  ``GET /v1/buckets``: when the replica reports a top-level ``scheduler`` section (the step scheduler), its
  ``padded_token_waste``, taken over the replay as ``1 - real/computed`` of the change of its
  ``real_tokens`` and ``computed_tokens`` during the replay (summed over every forward; if those counters are
  absent, the reported fraction since the server started, warm-up included: ``waste_window`` says which);
  else ``1 - real/padded`` over ``real_tokens`` and ``padded_tokens`` summed over ``buckets`` and ``misses``,
  over the replay only (the counters after the replay minus those before it). ``waste_buckets_replay`` is
  always the latter. Naive is 0 by construction (every forward unpadded).
- ``gpu_busy``: mean over the replay of the GPU's ``utilization.gpu`` (percent of time one or more kernels
  ran, over the driver's sample period), sampled every 100 ms from pynvml or ``nvidia-smi
  --query-gpu=utilization.gpu --format=csv,noheader,nounits -i <--gpu-index>`` in a background thread,
  divided by 100 (fraction); None without CUDA.
- ``floor_s``: the replay's GPU floor in seconds, the kernel time of its unpadded work: for each distinct
  (width, height, n, guidance, text tokens where text is masked) of the replay, one request run unpadded and
  eagerly in this process (a ``DiTPipeline`` with the naive config: ``runner.mode: eager``, the table it
  misses; text tokens are part of the key only for masked-text families, PixArt-Sigma, whose unpadded
  forward depends on the prompt's length, so there nearly every request is its own shape) under
  ``torch.profiler`` (CUDA activity), summing every CUDA kernel's (and memcpy's) device time
  (``bench_families.request_floor``: text encode, every step and the VAE decode), after one warm-up; the
  floor is the sum over the replay's requests of their shape's kernel time. With ``--floor-steps K`` (K <
  ``--steps``) each shape is profiled at 1 and K steps and extrapolated linearly to ``--steps`` (the JSON
  says so); by default it is profiled at ``--steps`` itself. None on a CPU or with ``--no-floor``.
- ``wall_over_floor``: ``wall_s / floor_s`` (1.0 would be every kernel back to back with no padding, no idle
  GPU time and no launch gaps); ``floor_share`` = its inverse.
- ``c1_p50_ms``: the concurrency-1 phase: ``--c1-requests`` (default 5) copies of the first krea request
  (its size, n and seed), sent one after another at concurrency 1; p50 of their latencies (ms).
- ratios: ``images_per_s_vs_naive`` (step and planned images/s over naive's; None where either server failed
  requests), ``c1_vs_naive`` (each server's ``c1_p50_ms`` / naive's).

Kernel tiers (``--kernels``): ``runner.kernels`` of the step and planned servers (naive: always eager). A list
(``--kernels eager,compiled,fp8``) runs the step (and planned) server once per tier, named ``step-eager``,
``step-compiled`` and so on, all against the one naive server in one run; with one tier the names stay ``step`` and
``planned``. A server on compiled kernels (``compiled``, ``fp8``) waits after its warm-up until its background
compiles are done (``GET /v1/buckets``: ``scheduler.background_compiles.pending`` 0, at most
``--compile-wait-s``; ``compile_wait_s`` and ``pending_at_replay`` in its entry), so the replay times compiled
graphs, not buckets still on eager kernels.

With ``--compile-decode`` the step and planned servers run ``runner.compile_decode``: after the warm-up each waits
(up to ``--decode-wait-s``) until its background decode compiles are done (``decode_wait_s``), so the replay
decodes with what was kept; each server's entry has its ``decode`` section of ``/v1/buckets``.

The JSON (``--out``) holds: date (UTC), GPU name (``torch.cuda.get_device_name``), torch version, the
``--commit`` value, the full command line, each server's config overrides and full config, per-request raw
latencies, the floor per shape, and the summary; it is rewritten after each server.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "benchmarks", ROOT / "tests", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

SERVERS = ("naive", "step", "planned", "cached", "half-cached")
KERNELS = ("eager", "compiled", "fp8")
MODELS = ("tiny", "flux-dev-width", "pixart-512")
FLUX_DEV_WIDTH_LAYERS = (2, 4)
"""(double-stream, single-stream) blocks of the ``flux-dev-width`` stand-in."""
TEXT_BUCKETS = (32, 64, 128, 256, 300)
"""Candidate single text buckets for masked-text families (PixArt-Sigma: at most 300)."""
RUNNER_OVERRIDES = {
    "naive": {"mode": "eager", "kernels": "eager"},
    "step": {},
    "planned": {},
    "cached": {},
    "half-cached": {},
}
"""``runner`` overrides of each server (naive also gets its bucket table and admission limits; ``step``, ``planned``
and ``cached`` get ``runner.kernels`` from ``--kernels``; ``cached`` is ``step`` with ``cache.default`` set to
``--cache``, so every request of the replay caches)."""


# -- pure parts ------------------------------------------------------------------------------------------------


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``, linear between order statistics (numpy's default).

    Returns:
        None for no values.

    Raises:
        ValueError: ``q`` outside 0..100.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} must be from 0 to 100")
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def token_totals(stats: dict) -> tuple[int, int]:
    """``(real, padded)`` transformer tokens of a ``GET /v1/buckets`` answer: ``real_tokens`` and
    ``padded_tokens`` summed over ``buckets`` and ``misses``."""
    parts = list(stats.get("buckets") or []) + [stats.get("misses") or {}]
    return (sum(int(p.get("real_tokens") or 0) for p in parts), sum(int(p.get("padded_tokens") or 0) for p in parts))


def padded_token_waste(stats: dict, baseline: dict | None = None) -> dict:
    """Padded-token waste of a ``GET /v1/buckets`` answer (see the module docstring).

    Args:
        stats: the answer after the replay.
        baseline: the answer before it (its token counters are subtracted); None counts since the start.

    Returns:
        ``{"waste": fraction or None, "source": "scheduler" | "buckets", "window": "since_start" | "replay",
        "buckets_replay": fraction or None, "real_tokens", "padded_tokens"}``: ``waste`` is the top-level
        ``scheduler.padded_token_waste`` when present (over the replay, ``1 - real/computed`` of the differences
        of its ``real_tokens`` and ``computed_tokens``, when both answers have them; else as reported, since the
        start), else ``1 - real/padded`` of the bucket and miss counters (``buckets_replay``, with the token
        counts); None when no token was counted.
    """
    real, padded = token_totals(stats)
    if baseline is not None:
        r0, p0 = token_totals(baseline)
        real, padded = real - r0, padded - p0
    from_buckets = 1.0 - real / padded if padded > 0 else None
    out = {"waste": from_buckets, "source": "buckets", "window": "replay" if baseline is not None else "since_start",
           "buckets_replay": from_buckets, "real_tokens": real, "padded_tokens": padded}
    sched = stats.get("scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("padded_token_waste"), (int, float)):
        out.update(waste=float(sched["padded_token_waste"]), source="scheduler", window="since_start")
        base = (baseline or {}).get("scheduler")
        keys = ("real_tokens", "computed_tokens")
        if isinstance(base, dict) and all(isinstance(d.get(k), int) for d in (sched, base) for k in keys):
            real_s = sched["real_tokens"] - base["real_tokens"]
            computed = sched["computed_tokens"] - base["computed_tokens"]
            if computed > 0:
                out.update(waste=1.0 - real_s / computed, window="replay")
    return out


def busy_fraction(samples: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """Mean GPU utilisation (fraction 0..1) of the ``(time, percent)`` samples taken from ``t0`` to ``t1``;
    None without samples in that window."""
    inside = [u for t, u in samples if t0 <= t <= t1]
    return sum(inside) / len(inside) / 100.0 if inside else None


def result_row(result) -> dict:
    """One ``deployments.cli.demo.DemoResult`` as a JSON-ready dict (request fields, outcome, latency in ms)."""
    r = result.request
    return {"number": r.number, "row": r.row, "size": f"{r.width}x{r.height}", "n": r.n, "seed": r.seed,
            "ok": bool(result.ok), "status": result.status, "latency_ms": round(float(result.latency_ms), 2),
            "images": len(result.files), "bucket": result.bucket, "hit": result.hit, "error": result.error,
            "retries": getattr(result, "retries", None), "retry_wait_s": getattr(result, "retry_wait_s", None)}


def summarize(rows: list[dict], wall_s: float, floor_s: float | None = None) -> dict:
    """Throughput, latency and failure figures of one replay (see the module docstring).

    Args:
        rows: :func:`result_row` of every request.
        wall_s: wall seconds of the replay.
        floor_s: the replay's GPU floor in seconds, or None.
    """
    ok = [r for r in rows if r["ok"]]
    lat = [r["latency_ms"] for r in ok]
    status = [r["status"] for r in rows if not r["ok"]]
    images = sum(r["images"] for r in ok)
    retries = [r.get("retries") for r in rows]

    def rnd(x, d=1):
        return None if x is None else round(x, d)

    return {
        "requests": len(rows), "ok": len(ok), "failures": len(rows) - len(ok),
        "http_4xx": sum(1 for s in status if s is not None and 400 <= s < 500),
        "http_5xx": sum(1 for s in status if s is not None and s >= 500),
        "no_answer": sum(1 for s in status if s is None),
        "retries": None if all(x is None for x in retries) else sum(int(x or 0) for x in retries),
        "images": images, "wall_s": round(wall_s, 3),
        "images_per_s": round(images / wall_s, 4) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
        "latency_ms": {"p50": rnd(percentile(lat, 50)), "p99": rnd(percentile(lat, 99)),
                       "mean": rnd(sum(lat) / len(lat) if lat else None), "max": rnd(max(lat) if lat else None)},
        "hits": sum(1 for r in ok if r.get("hit")), "misses": sum(1 for r in ok if r.get("hit") is False),
        "floor_s": rnd(floor_s, 3),
        "wall_over_floor": round(wall_s / floor_s, 3) if floor_s else None,
        "floor_share": round(floor_s / wall_s, 4) if floor_s and wall_s > 0 else None,
    }


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def half_cached(requests: list, cache: dict, every: bool = False) -> list:
    """``requests`` with ``cache`` in the body of each even-numbered one (``DemoRequest.number``), or of every one
    (``every``: the half-cached server's warm-up); the odd-numbered ones ask for no cache."""
    return [dataclasses.replace(r, cache=cache) if every or r.number % 2 == 0 else r for r in requests]


def others_latency(rows: list[dict]) -> dict:
    """p50 / p99 / mean latency (ms) of the odd-numbered requests that succeeded (those the half-cached server
    sends without a cache), from :func:`result_row` rows."""
    lat = [r["latency_ms"] for r in rows if r["ok"] and r["number"] % 2 == 1]
    return {"requests": len(lat), "p50": _round(percentile(lat, 50), 1), "p99": _round(percentile(lat, 99), 1),
            "mean": _round(sum(lat) / len(lat), 1) if lat else None}


def ratios(summaries: dict[str, dict]) -> dict:
    """Cross-server ratios of the per-server summaries (``{server: summary}``; a summary may lack fields when
    its server failed): ``images_per_s_vs_naive`` (each other server: step, planned, or ``step-<tier>`` and
    ``planned-<tier>`` with several tiers), ``c1_vs_naive`` (each server's
    ``c1_p50_ms`` / naive's), ``cached_vs_step`` (images/s), ``others_latency_vs_step`` (the half-cached server's
    :func:`others_latency` p50 and p99 over the step server's, of the same requests). None where a side is
    missing, and an images/s ratio None where a side failed
    requests (its images/s counts only the served ones, a different workload: a planned table that refused 17 of
    32 prompts once read 2.8x)."""
    ips = {k: (v or {}).get("images_per_s") if not (v or {}).get("failures") else None
           for k, v in summaries.items()}
    c1 = {k: (v or {}).get("c1_p50_ms") for k, v in summaries.items()}

    def not_cached(summary: dict | None) -> dict:
        return (summary or {}).get("others_latency_ms") or {}
    others = [k for k in summaries if k != "naive"]
    others = others if any(k.startswith("step") for k in others) else ["step", *others]  # step: always reported
    return {
        "images_per_s_vs_naive": {k: _ratio(ips.get(k), ips.get("naive")) for k in others},
        "c1_vs_naive": {k: _ratio(c1.get(k), c1.get("naive")) for k in others if k in summaries},
        **({"planned_vs_step": _ratio(ips.get("planned"), ips.get("step"))} if "planned" in summaries else {}),
        **({"cached_vs_step": _ratio(ips.get("cached"), ips.get("step"))} if "cached" in summaries else {}),
        **({"others_latency_vs_step": {q: _ratio(not_cached(summaries["half-cached"]).get(q),
                                                 not_cached(summaries.get("step")).get(q)) for q in ("p50", "p99")}}
           if "half-cached" in summaries else {}),
    }


def merge(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in, recursively for nested mappings (``over`` wins; inputs unchanged)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_kernels(text: str) -> list[str]:
    """``"eager,compiled"`` -> ``["eager", "compiled"]`` (in the given order, no repeats).

    Raises:
        ValueError: a name that is not a kernel tier, or an empty list.
    """
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in KERNELS]
    if bad or not names:
        raise ValueError(f"kernels must be a comma-separated subset of {','.join(KERNELS)}, got {text!r}")
    return list(dict.fromkeys(names))


def server_runs(servers: list[str], kernels: list[str]) -> list[tuple[str, str, str]]:
    """``(name, server, tier)`` of each server to start, in order: naive once (eager kernels), step and planned
    once per tier, named ``<server>-<tier>`` when more than one tier is asked for."""
    out = []
    for server in servers:
        tiers = ["eager"] if server == "naive" else kernels
        out += [(server if server == "naive" or len(kernels) == 1 else f"{server}-{t}", server, t) for t in tiers]
    return out


def parse_servers(text: str) -> list[str]:
    """``"naive,step"`` -> ``["naive", "step"]`` (in the given order, no repeats).

    Raises:
        ValueError: an unknown server name or an empty list.
    """
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SERVERS]
    if bad or not names:
        raise ValueError(f"servers must be a comma-separated subset of {','.join(SERVERS)}, got {text!r}")
    return list(dict.fromkeys(names))


def gpu_label(name: str | None) -> str:
    """Short GPU label for file names: ``"NVIDIA H200"`` -> ``"h200"``; ``"cpu"`` for None."""
    if not name:
        return "cpu"
    words = [w for w in name.lower().replace("nvidia", " ").split() if any(c.isdigit() for c in w)]
    word = words[0] if words else name.lower().split()[-1]
    return "".join(c for c in word if c.isalnum()) or "gpu"


# -- the replay ------------------------------------------------------------------------------------------------


def quota_counts(counts: list[int], n: int, rng) -> list[int]:
    """``n`` image counts in the proportions of ``counts`` (a trace's, one per request): each distinct count gets
    the floor of its share of ``n``, the counts with the largest remainders one more (Hamilton's largest-remainder
    method) until there are ``n``, in an order shuffled by ``rng`` (a ``random.Random``). Unlike ``n`` draws with
    replacement, the mix then is the trace's up to rounding: 32 requests of the whole GenTD26 trace give 18 n=1,
    3 n=2, 6 n=4 and 5 n=8 (88 images), where seeded draws gave 68-111 images for seeds 0-5."""
    from collections import Counter

    share = {c: k * n / len(counts) for c, k in sorted(Counter(counts).items())}
    quota = {c: int(s) for c, s in share.items()}
    for c in sorted(share, key=lambda c: quota[c] - share[c])[: n - sum(quota.values())]:
        quota[c] += 1
    out = [c for c, k in quota.items() for _ in range(k)]
    rng.shuffle(out)
    return out


def replay_requests(count: int, size: str | None = None, path: str | None = None, mix: str = "krea",
                    trace: str | None = None, mix_seed: int = 0, mix_draw: str = "random") -> list:
    """The first ``count`` krea requests (``deployments.cli.demo.load_requests``) with a seed each (the data's, else
    the request's number) and, with ``size`` (``"WxH"``), every request at that size.

    ``mix``: ``krea`` keeps krea's image counts (25 of the first 32 requests ask for 9 images: already batched);
    ``gentd26`` replaces each request's image count with the ``num_images_per_prompt`` of a text-to-image request
    drawn (``random.Random(mix_seed)``, with replacement) from a GenTD26 trace, ``trace`` (a CSV with the
    trace's columns; None: the packaged burst slice ``bcg_core/data/alibaba_gentd26_burst_2024-12-06.csv``, 88%
    n=1). The whole trace (``../shared/data/alibaba_gentd26_lora_request_trace.csv``: 53% n=1, 8% n=2, 18% n=4,
    13% n=8 of all its requests; 58/8/19/14% of its text-to-image ones) is the production-like mix of the
    compiled-buckets issue: krea's prompts, sizes and seeds with production's image counts. ``mix_draw``:
    ``random`` draws each count alone, so 32 requests can stray far from the trace's shares (seed 0 gives 109
    images); ``quota`` gives the trace's shares up to rounding (:func:`quota_counts`), shuffled by the seed.

    Raises:
        ValueError: an unknown ``mix`` or ``mix_draw``, or a trace with no text-to-image row that has an image
            count.
    """
    import csv
    import random
    from importlib import resources

    from bcg_core.config import parse_size
    from deployments.cli.demo import load_requests
    from deployments.cli.plan_command import GENTD26_CSV

    reqs = load_requests(count, path)
    if mix not in ("krea", "gentd26"):
        raise ValueError(f"mix must be 'krea' or 'gentd26', got {mix!r}")
    if mix_draw not in ("random", "quota"):
        raise ValueError(f"mix_draw must be 'random' or 'quota', got {mix_draw!r}")
    counts: list[int] = []
    if mix == "gentd26":
        source = resources.files("bcg_core") / "data" / GENTD26_CSV if trace is None else Path(trace)
        with source.open("r", encoding="utf-8", newline="") as f:
            counts = [int(float(r["num_images_per_prompt"])) for r in csv.DictReader(f)
                      if r.get("predict_type") == "TXT_2_IMG" and (r.get("num_images_per_prompt") or "").strip()]
        if not counts:
            raise ValueError(f"the trace {source} has no TXT_2_IMG row with num_images_per_prompt")
        rng = random.Random(mix_seed)
        counts = quota_counts(counts, len(reqs), rng) if mix_draw == "quota" else [rng.choice(counts) for _ in reqs]
    out = []
    for i, r in enumerate(reqs):
        r = dataclasses.replace(r, seed=r.seed if r.seed is not None else r.number)
        if size:
            w, h = parse_size(size)
            r = dataclasses.replace(r, width=w, height=h)
        if counts:
            r = dataclasses.replace(r, n=counts[i])
        out.append(r)
    return out


def warmup_requests(requests: list, mode: str) -> list:
    """Warm-up requests (numbered from 10001): ``shapes``: the first request of each distinct (size, n);
    ``first``: the first request; ``none``: none."""
    if mode == "none" or not requests:
        return []
    picked = list({(r.width, r.height, r.n): r for r in reversed(requests)}.values())[::-1] if mode == "shapes" \
        else requests[:1]
    return [dataclasses.replace(r, number=10001 + i) for i, r in enumerate(picked)]


def c1_requests(requests: list, count: int) -> list:
    """``count`` copies of the first request (numbered from 20001), for the concurrency-1 phase."""
    return [dataclasses.replace(requests[0], number=20001 + i) for i in range(count)] if requests else []


def generation_request(demo_request, steps: int):
    """The :class:`bcg_core.request.GenerationRequest` the ingress makes of a replayed request's body."""
    from bcg_core.request import GenerationRequest

    r = demo_request
    return GenerationRequest(r.prompt, n=r.n, width=r.width, height=r.height, num_inference_steps=steps, seed=r.seed)


# -- bucket tables ---------------------------------------------------------------------------------------------


def served_sizes(spec, sizes) -> list[tuple[int, int]]:
    """Distinct ``(width, height)`` the model generates ``sizes`` at (aspect-ratio bins for PixArt), by area."""
    gen = {tuple(int(x) for x in spec.generation_size(w, h)) for w, h in sizes}
    return sorted(gen, key=lambda wh: (wh[0] * wh[1], wh))


def naive_tier(spec, limits, sizes) -> str:
    """The one resolution tier of the naive table: a size no request in ``sizes`` is generated at.

    For models with resolution binning (PixArt-Sigma) the smallest aspect-ratio bin within the limits that no
    request is binned to; otherwise the smallest size (min side x growing width, multiples of the token size)
    whose token grid (grid-keyed models) or token count (FLUX) no request has.

    Args:
        spec: the model's :class:`bcg_core.families.ModelSpec`.
        limits: the :class:`bcg_core.config.LimitsConfig` (the tier must be a reachable size).
        sizes: ``(width, height)`` of every request that will be sent.

    Raises:
        ValueError: no such size within the limits.
    """
    rules = spec.rules
    lo, hi = limits.min_side_px, limits.max_side_px
    if spec.size_bins:
        used = set(served_sizes(spec, sizes))
        bins = sorted({(int(w), int(h)) for h, w in spec.size_bins.values()}, key=lambda wh: (wh[0] * wh[1], wh))
        for w, h in bins:
            if (w, h) not in used and lo <= w <= hi and lo <= h <= hi:
                return f"{w}x{h}"
        raise ValueError("every aspect-ratio bin within the limits is used by some request: no naive tier")
    m = rules.pixels_per_token
    grids = {rules.grid(w, h) for w, h in sizes}
    tokens = {gh * gw for gh, gw in grids}
    side = -(-lo // m) * m
    for w in range(side, hi + 1, m):
        g = rules.grid(w, side)
        if (g not in grids) if rules.grid_keyed else (g[0] * g[1] not in tokens):
            return f"{w}x{side}"
    raise ValueError("every size within the limits is some request's: no naive tier")


def text_bucket(spec, count_tokens, prompts) -> list[int]:
    """Text buckets for the model: ``[native]`` for fixed-length text; else one bucket, the smallest of
    :data:`TEXT_BUCKETS` (at most the family's ``max_text_tokens``) holding every prompt and the empty
    negative prompt."""
    native = spec.rules.native_text_tokens
    if native is not None:
        return [native]
    need = max([count_tokens(p) for p in prompts] + [count_tokens("", negative=True)])
    cands = [t for t in TEXT_BUCKETS if spec.max_text_tokens is None or t <= spec.max_text_tokens]
    return [next((t for t in cands if t >= need), cands[-1])]


def base_config(model_config: dict, spec, count_tokens, requests: list, steps: int,
                batch_sizes: list[int] | None = None, text_lengths: list[int] | None = None) -> dict:
    """The config mapping shared by the request and step servers (naive starts from it too).

    Defaults of :class:`deployments.settings.ServeConfig`, ``limits.max_steps`` raised to ``steps`` if needed, the
    model's text bucket (:func:`text_bucket`); for models with resolution binning the table's resolutions are
    the bins the requests are generated at, and ``limits.min_side_px`` is lowered to the smallest of their sides
    if needed (tiny bins). ``batch_sizes`` / ``text_lengths`` replace the table's batch and text buckets.
    """
    from bcg_core.config import BucketConfig, LimitsConfig

    limits = LimitsConfig()
    buckets: dict[str, Any] = {"text_lengths": text_bucket(spec, count_tokens, [r.prompt for r in requests])}
    lim: dict[str, Any] = {"max_steps": max(limits.max_steps, steps)}
    if spec.size_bins:
        sizes = served_sizes(spec, [(r.width, r.height) for r in requests])
        buckets["resolutions"] = [f"{w}x{h}" for w, h in sizes]
        smallest = min(min(wh) for wh in sizes)
        if smallest < limits.min_side_px:
            lim["min_side_px"] = max(16, smallest)
    if batch_sizes:
        buckets["batch_sizes"] = list(batch_sizes)
    if text_lengths:
        buckets["text_lengths"] = list(text_lengths)
    cfg = {"model": model_config, "limits": lim, "buckets": {**BucketConfig().model_dump(mode="json"), **buckets}}
    return cfg


def planned_buckets(base: dict, steps: int, max_graphs: int, measure: bool = False, source: str = "krea") -> dict:
    """The ``buckets`` that ``bcg plan`` chooses for ``base``'s model and limits on the traffic ``source`` at
    ``steps`` steps with at most ``max_graphs`` graphs (``bcg_core/planning/table_search.py``): ``source`` as
    ``bcg plan --traffic`` takes it (``deployments.cli.plan_command.load_plan_traffic``: ``krea``, the packaged krea
    sample; ``gentd26`` or ``gentd26:PATH``, a GenTD26 trace joined with krea's sizes, for ``--mix gentd26``);
    with ``measure`` on costs the planner measures on this GPU (``bcg plan --measure``), else on the token-count
    model. The plan's cost source is in ``buckets.plan.costs``."""
    from bcg_core.planning.table_search import search_table
    from deployments.cli.plan_command import load_plan_traffic, measure_plan_costs
    from deployments.settings import ServeConfig

    config = ServeConfig.model_validate(base)
    traffic = load_plan_traffic(config, source, steps=steps)
    costs = measure_plan_costs(config, traffic) if measure else None
    plan = search_table(config, traffic, costs, max_graphs=max_graphs)
    return plan.buckets.model_dump(mode="json")


def server_overrides(server: str, base: dict, spec, requests: list, concurrency: int,
                     naive_max_ongoing: int | None = None, planned: dict | None = None,
                     kernels: str = "eager", compile_decode: bool = False, cache: dict | None = None) -> dict:
    """The config overrides of ``server`` on ``base`` (see the module docstring); ``planned``: the ``planned``
    server's buckets (:func:`planned_buckets`); ``kernels``: ``runner.kernels`` of the ``step`` and ``planned``
    servers (the naive server always runs eager kernels: what a user's own server runs); ``compile_decode``:
    ``runner.compile_decode`` of those two (``--compile-decode``); ``cache``: the ``cached`` server's
    ``cache.default`` (``--cache``).

    Raises:
        ValueError: the ``cached`` server without ``cache``."""
    over: dict[str, Any] = {"runner": {"kernels": kernels, **RUNNER_OVERRIDES[server]}}
    if compile_decode and server != "naive":
        over["runner"]["compile_decode"] = True
    if server == "planned" and planned is not None:
        over["buckets"] = planned
    if server in ("cached", "half-cached"):
        if cache is None:
            raise ValueError(f"the {server} server needs --cache, e.g. "
                             "'{\"method\": \"first_block\", \"threshold\": 0.4}'")
        if server == "cached":
            over["cache"] = {"default": cache}
    if server == "naive":
        from deployments.settings import ServeConfig

        limits = ServeConfig.model_validate(base).limits
        tier = naive_tier(spec, limits, [(r.width, r.height) for r in requests])
        ongoing = naive_max_ongoing or concurrency
        over["buckets"] = {"batch_sizes": [1], "resolutions": [tier], "text_lengths": base["buckets"]["text_lengths"],
                           "image_padding": "exact", "miss_policy": "eager"}
        over["routing"] = {"max_ongoing_requests": ongoing, "max_queued_requests": max(ongoing, concurrency)}
    return over


def validate_all(validator, requests: list, steps: int) -> tuple[list, list[tuple[Any, str]]]:
    """Validate every request as the ingress would: ``(validated, refused)``, ``refused`` as
    ``(request, message)``."""
    from bcg_core.errors import RequestError

    validated, refused = [], []
    for r in requests:
        try:
            validated.append(validator.validate(generation_request(r, steps)))
        except RequestError as e:
            refused.append((r, e.message))
    return validated, refused


def check_all_miss(validator, requests: list, steps: int) -> list:
    """The requests that would HIT a bucket of ``validator``'s table (the naive table must leave none)."""
    validated, _ = validate_all(validator, requests, steps)
    return [p for p in validated if p.lookup.hit]


# -- GPU sampling ----------------------------------------------------------------------------------------------


class GpuSampler:
    """Samples one GPU's ``utilization.gpu`` (percent) every ``period_s`` in a background thread: pynvml when
    it imports, else ``nvidia-smi``. Inactive (no samples) without CUDA or without either tool.

    Args:
        index: the GPU's index (as nvidia-smi numbers it).
        period_s: seconds between samples.
    """

    def __init__(self, index: int = 0, period_s: float = 0.1):
        self.index = index
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self.source: str | None = None
        self.failed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read = self._reader()

    def _reader(self):
        try:
            import torch

            if not torch.cuda.is_available():
                return None
        except ImportError:
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception:  # noqa: BLE001 - pynvml absent or failing: fall back to nvidia-smi
            handle = None
        if handle is not None:
            self.source = "pynvml"
            return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
        cmd = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", str(self.index)]
        self.source = "nvidia-smi"

        def read() -> float:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout
            return float(out.strip().splitlines()[0])

        return read

    @property
    def active(self) -> bool:
        """True when a sampling tool was found (CUDA visible)."""
        return self._read is not None

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                self.samples.append((t, self._read()))
            except Exception:  # noqa: BLE001 - a failed sample is skipped (counted)
                self.failed += 1
            self._stop.wait(max(0.0, self.period_s - (time.perf_counter() - t)))

    def start(self) -> None:
        """Start sampling (no-op when inactive)."""
        if self.active and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop sampling and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None


def default_gpu_index() -> int:
    """The first entry of ``CUDA_VISIBLE_DEVICES`` when it is a number (the GPU Ray hands the replica), else 0."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


# -- model and floor -------------------------------------------------------------------------------------------


def _bench_families():
    import bench_families

    return bench_families


def build_model(name: str, tiny: bool, scratch: str | None, device: str) -> tuple[dict, Path | None, dict]:
    """The served model: ``(model config mapping, checkpoint folder or None, build info)``.

    ``tiny``: the embedded default (no folder). ``flux-dev-width`` / ``pixart-512``: built with
    ``bench_families.build_checkpoint`` into a new folder under ``scratch`` (published configs, random weights,
    bf16 on CUDA; with ``tiny`` the tests/tiny configs in fp32).
    """
    if name == "tiny":
        return {"path": None, "dtype": "float32", "device": device}, None, {"model": "bcg-tiny-flux (embedded)"}
    import torch

    bf = _bench_families()
    models = bf.bench_models(tiny)
    if name == "flux-dev-width":
        spec = models["flux-dev"]
        if not tiny:
            double, single = FLUX_DEV_WIDTH_LAYERS
            spec = spec._replace(transformer=dict(spec.transformer, num_layers=double, num_single_layers=single))
    else:
        spec = models["pixart-sigma-512"]
    dtype = "float32" if tiny else "bfloat16"
    folder = Path(tempfile.mkdtemp(prefix=f"bcg-sat-{name}-", dir=scratch)).resolve()
    t0 = time.perf_counter()
    info = bf.build_checkpoint(spec, folder, torch.device(device), getattr(torch, dtype))
    info.update(build_save_s=round(time.perf_counter() - t0, 1), tiny_configs=tiny,
                transformer_config={k: v for k, v in spec.transformer.items() if not isinstance(v, (list, tuple))})
    return {"path": str(folder), "dtype": dtype, "device": device}, folder, info


def floor_key(validated, spec) -> tuple:
    """The floor's shape key of a validated request: (width, height, n, guidance, text tokens or None)."""
    r = validated.request
    text = validated.lookup.query.text_tokens if spec.rules.native_text_tokens is None else None
    return (r.width, r.height, r.n, r.guidance_scale, text)


def gpu_floor(config, requests: list, steps: int, floor_steps: int | None = None) -> dict:
    """The replay's GPU floor (see the module docstring), profiled in this process on CUDA.

    Args:
        config: the naive :class:`~deployments.settings.ServeConfig` (eager runner, a table every request misses).
        requests: the replay's requests.
        steps: their denoising steps.
        floor_steps: profile at 1 and this many steps and extrapolate to ``steps`` (None or >= ``steps``:
            profile at ``steps``).

    Returns:
        ``{"floor_s", "shapes": [{size, n, guidance_scale, text_tokens, requests, kernel_ms, events}],
        "profiled_steps", "extrapolated"}``.
    """
    import torch

    from bcg_core import DiTPipeline, load_model

    bf = _bench_families()
    model = load_model(config.model)
    pipe = DiTPipeline(config, model)
    try:
        validated, refused = validate_all(pipe.validator, requests, steps)
        groups: dict[tuple, list] = {}
        for p in validated:
            groups.setdefault(floor_key(p, pipe.validator.spec), []).append(p)
        k = floor_steps if floor_steps is not None and 2 <= floor_steps < steps else None
        shapes = []
        for key, ps in groups.items():
            req = ps[0].request
            pipe.generate(pipe.validator.validate(dataclasses.replace(req, num_inference_steps=1)))  # warm-up
            if k is None:
                ms, events = bf.request_floor(pipe, req)
            else:
                ms1, _ = bf.request_floor(pipe, dataclasses.replace(req, num_inference_steps=1))
                msk, events = bf.request_floor(pipe, dataclasses.replace(req, num_inference_steps=k))
                ms = msk + (steps - k) * (msk - ms1) / (k - 1)
            w, h, n, g, text = key
            shapes.append({"size": f"{w}x{h}", "n": n, "guidance_scale": g, "text_tokens": text,
                           "requests": len(ps), "kernel_ms": round(ms, 2), "events": events})
            print(f"floor {w}x{h} n={n}: {ms:.1f} ms kernel time x {len(ps)} requests", flush=True)
        total_ms = sum(s["kernel_ms"] * s["requests"] for s in shapes)
        return {"floor_s": round(total_ms / 1e3, 3), "shapes": shapes, "profiled_steps": k or steps,
                "extrapolated": k is not None, "refused": len(refused)}
    finally:
        del pipe, model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# -- one server ------------------------------------------------------------------------------------------------


def _get_stats(url: str) -> dict:
    import httpx

    r = httpx.get(f"{url}/v1/buckets", timeout=60.0, trust_env=False)
    r.raise_for_status()
    return r.json()


def _wait_stats(url: str, left: Callable[[dict], Any], timeout_s: float, poll_s: float) -> tuple[float, Any]:
    """Poll ``GET /v1/buckets`` every ``poll_s`` until ``left(answer)`` is falsy, at most ``timeout_s``;
    ``(seconds waited, left's last value)``."""
    t0 = time.perf_counter()
    value = left(_get_stats(url))
    while value and time.perf_counter() - t0 < timeout_s:
        time.sleep(poll_s)
        value = left(_get_stats(url))
    return round(time.perf_counter() - t0, 1), value


def _decode_pending(stats: dict) -> bool:
    shapes = ((stats.get("kernels") or {}).get("decode") or {}).get("shapes") or {}
    return any(s.get("state") == "pending" for s in shapes.values())


def wait_decode_compiles(url: str, timeout_s: float) -> float:
    """Poll ``GET /v1/buckets`` every 2 s until no latent shape of ``kernels.decode`` is ``pending`` (the warm-up's
    decodes queued them), at most ``timeout_s``; the seconds waited."""
    return _wait_stats(url, _decode_pending, timeout_s, 2.0)[0]


def background_compiles(stats: dict) -> dict:
    """The ``scheduler.background_compiles`` section of a ``GET /v1/buckets`` answer (``{}`` where it is absent)."""
    return (stats.get("scheduler") or {}).get("background_compiles") or {}


def background_pending(stats: dict) -> int:
    """Buckets still waiting for their background compile in a ``GET /v1/buckets`` answer
    (``scheduler.background_compiles.pending``; 0 where the section is absent: nothing compiles)."""
    return int(background_compiles(stats).get("pending") or 0)


def wait_compiles(url: str, timeout_s: float, poll_s: float = 2.0) -> tuple[float, int]:
    """Poll ``GET /v1/buckets`` every ``poll_s`` until no bucket waits for its background compile, at most
    ``timeout_s``; ``(seconds waited, buckets still pending)``."""
    return _wait_stats(url, background_pending, timeout_s, poll_s)


def trim_stats(stats: dict) -> dict:
    """The parts of a ``GET /v1/buckets`` answer kept in the JSON: totals, scheduler, fused step, misses, the
    runner's capture totals (``capture``: step-cache halves captured and failed, replay errors) and the buckets that
    served requests (without their step-latency histograms; with their runner ``mode``, ``note``, step-cache rows
    and whether their step-cache halves are graphs)."""
    keep = ("key", "requests", "hits", "forwards", "forwards_by_mode", "real_tokens",
            "padded_tokens", "padding_waste_pct", "mean_latency_ms", "mode", "note", "step_cache_graphs",
            "cache_reused_rows", "cache_computed_rows")
    misses = {k: v for k, v in (stats.get("misses") or {}).items() if k != "step_latency_ms"}
    return {"totals": stats.get("totals"), "capture": stats.get("capture"),
            "scheduler": stats.get("scheduler"), "fused_step": stats.get("fused_step"), "misses": misses,
            "buckets": [{k: b.get(k) for k in keep} for b in stats.get("buckets") or [] if b.get("requests")]}


def run_server(name: str, config, replay_reqs: list, warmups: list, c1: list, args, floor_s: float | None) -> dict:
    """Start one server, warm it up, replay, run the concurrency-1 phase, stop it; its JSON entry."""
    from deployments.cli.demo import replay
    from deployments.cli.local import start_local, stop_local, wait_captured, wait_healthy

    entry: dict[str, Any] = {"server": name}
    png_dir = Path(tempfile.mkdtemp(prefix=f"bcg-sat-png-{name}-", dir=args.scratch))
    sampler = GpuSampler(args.gpu_index)
    try:
        t0 = time.perf_counter()
        url = start_local(config, args.port, args.num_cpus, quiet=not args.verbose)
        wait_healthy(url, timeout_s=600)
        wait_captured(url, timeout_s=900)  # runner.ready_after_s: graphs, not shapes still capturing, are timed
        entry["start_s"] = round(time.perf_counter() - t0, 1)
        print(f"[{name}] up at {url} after {entry['start_s']} s", flush=True)
        kw = {"out_dir": png_dir, "timeout_s": args.timeout_s}
        if warmups:
            t0 = time.perf_counter()
            w = replay(url, warmups, steps=args.warmup_steps, concurrency=1, **kw)
            entry["warmup"] = {"requests": len(w), "failures": sum(not r.ok for r in w),
                               "seconds": round(time.perf_counter() - t0, 1)}
        if config.runner.compile_decode:
            entry["decode_wait_s"] = wait_decode_compiles(url, args.decode_wait_s)
        if config.runner.kernels != "eager":
            entry["compile_wait_s"], entry["pending_at_replay"] = wait_compiles(url, args.compile_wait_s)
            print(f"[{name}] compiles done after {entry['compile_wait_s']} s more; "
                  f"{entry['pending_at_replay']} bucket(s) still pending", flush=True)
        before = _get_stats(url)
        sampler.start()
        time.sleep(0.3 if sampler.active else 0)
        t0 = time.perf_counter()
        results = replay(url, replay_reqs, steps=args.steps, concurrency=args.concurrency, **kw)
        t1 = time.perf_counter()
        sampler.stop()
        after = _get_stats(url)
        rows = [result_row(r) for r in results]
        summary = summarize(rows, t1 - t0, floor_s)
        summary["others_latency_ms"] = others_latency(rows)
        waste = padded_token_waste(after, before)
        summary.update(padded_token_waste=None if waste["waste"] is None else round(waste["waste"], 4),
                       waste_source=waste["source"], waste_window=waste["window"],
                       waste_buckets_replay=(None if waste["buckets_replay"] is None
                                             else round(waste["buckets_replay"], 4)),
                       gpu_busy=None if not sampler.active else _round(busy_fraction(sampler.samples, t0, t1), 4),
                       gpu_samples=sum(1 for t, _ in sampler.samples if t0 <= t <= t1) if sampler.active else 0,
                       gpu_sampler=sampler.source)
        entry["requests"] = rows
        entry["stats"] = trim_stats(after)
        entry["decode"] = (after.get("kernels") or {}).get("decode")
        buckets = after.get("buckets") or []
        graphs = [b for b in buckets if b.get("mode") == "graph"]
        entry["graphs"] = {"count": len(buckets), "captured": len(graphs),
                           "capture_s": round(sum(float(b.get("capture_s") or 0) for b in buckets), 2),
                           "pool_mib": round(sum(int(b.get("pool_bytes") or 0) for b in buckets) / 2**20, 1)}
        entry["scheduler_reported"] = isinstance(after.get("scheduler"), dict)
        if name.startswith("step") and not entry["scheduler_reported"]:
            print(f"[{name}] WARNING: GET /v1/buckets has no 'scheduler' section: the replica did not report its step "
                  "scheduler", flush=True)
        if c1:
            c = replay(url, c1, steps=args.steps, concurrency=1, **kw)
            entry["c1_requests"] = [result_row(r) for r in c]
            summary["c1_p50_ms"] = _round(percentile([r.latency_ms for r in c if r.ok], 50), 1)
            summary["c1_failures"] = sum(not r.ok for r in c)
        entry["summary"] = summary
    finally:
        sampler.stop()
        try:
            stop_local()
        finally:
            shutil.rmtree(png_dir, ignore_errors=True)
    return entry


def _round(x, d):
    return None if x is None else round(x, d)


# -- main ------------------------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list]) -> str:
    """``bench_families.format_table``: the same column layout as the other GPU benchmarks."""
    return _bench_families().format_table(header, rows)


def render(result: dict) -> str:
    """The plain-text table of a result (one row per server, then the ratios)."""

    def pct(x):
        return None if x is None else 100.0 * x

    rows = []
    for s in result["servers"]:
        m = s.get("summary") or {}
        lat = m.get("latency_ms") or {}
        rows.append([s["server"], f"{m.get('ok', '-')}/{m.get('requests', '-')}", m.get("http_4xx"), m.get("wall_s"),
                     m.get("images_per_s"), lat.get("p50"), lat.get("p99"), m.get("c1_p50_ms"),
                     pct(m.get("padded_token_waste")), pct(m.get("gpu_busy")), m.get("wall_over_floor"),
                     s.get("error", "")[:60] or None])
    table = _table(["server", "ok/req", "4xx", "wall s", "img/s", "p50 ms", "p99 ms", "c1 p50 ms", "waste %",
                    "GPU busy %", "wall/floor", "error"], rows)
    r = result["ratios"]
    extra = "".join(f"; {k.replace('_', ' ')}: {r[k]}" for k in ("cached_vs_step", "others_latency_vs_step") if k in r)
    return (f"{table}\nimages/s vs naive: {r['images_per_s_vs_naive']}; c1 vs naive: {r['c1_vs_naive']}{extra}; "
            f"floor: {(result.get('floor') or {}).get('floor_s')} s")


def _env(args, device: str) -> dict:
    import torch

    def version(mod: str) -> str | None:
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001
            return None

    head = None
    if shutil.which("git"):
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
        head = p.stdout.strip() or None
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": args.commit, "git_head": head,
            "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": version("diffusers"),
            "transformers": version("transformers"), "ray": version("ray"), "device": device,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see ``--help``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="tiny")
    ap.add_argument("--tiny", action="store_true", help="tests/tiny configs for flux-dev-width / pixart-512 (CPU)")
    ap.add_argument("--scratch", help="folder for the checkpoint and PNGs (default: a temp dir; /dev/shm on a GPU)")
    ap.add_argument("--out", help="JSON result (default docs/bench/<date>_saturation_<model>_<gpu>.json)")
    ap.add_argument("--commit", help="git commit to record")
    ap.add_argument("--requests", type=int, default=32, help="first N krea requests")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (1..16)")
    ap.add_argument("--servers", type=parse_servers, default=["naive", "step"],
                    help="subset of naive,step,planned,cached,half-cached (planned: the step scheduler on the table "
                    "bcg plan chooses from the packaged krea sample; cached: step with --cache as every request's "
                    "cache; half-cached: step with --cache in every even-numbered request)")
    ap.add_argument("--plan-max-graphs", type=int, default=12, help="graph cap of the planned table (default 12)")
    ap.add_argument("--plan-costs", choices=("measure", "token-count"), default="token-count",
                    help="costs of the planned table: measured on this GPU (bcg plan --measure) or the token-count "
                    "model (default)")
    ap.add_argument("--kernels", type=parse_kernels, default=["eager"],
                    help="runner.kernels of the step and planned servers, one tier or a list (eager,compiled,fp8: "
                    "one step server per tier); naive: always eager")
    ap.add_argument("--compile-wait-s", type=float, default=900.0,
                    help="most seconds a compiled-kernel server waits for its background compiles before the replay")
    ap.add_argument("--compile-decode", action="store_true",
                    help="runner.compile_decode on the step and planned servers; after the warm-up each waits for "
                    "its decode compiles (up to --decode-wait-s) before the replay")
    ap.add_argument("--decode-wait-s", type=float, default=300.0)
    ap.add_argument("--cache", type=json.loads, default=None,
                    help="the cached server's cache.default, as JSON: e.g. '{\"method\": \"first_block\", "
                    "\"threshold\": 0.4}' (every request of its replay caches)")
    ap.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (0: a free one)")
    ap.add_argument("--size", help="send every request at this WxH size instead of its own")
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                    help="batch buckets of the request/step table (default: BucketConfig's)")
    ap.add_argument("--text-lengths", type=lambda s: [int(x) for x in s.split(",")],
                    help="text buckets of every table (default: [native], or one bucket, see TEXT_BUCKETS)")
    ap.add_argument("--warmup", choices=("shapes", "first", "none"), default="shapes")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--c1-requests", type=int, default=5, help="requests of the concurrency-1 phase (0: skip)")
    ap.add_argument("--naive-max-ongoing", type=int, help="requests naive's replica admits (default: concurrency)")
    ap.add_argument("--no-floor", action="store_true", help="skip the GPU floor")
    ap.add_argument("--floor-steps", type=int, help="profile the floor at 1 and K steps, extrapolate to --steps")
    ap.add_argument("--gpu-index", type=int, default=default_gpu_index(), help="GPU sampled for GPU-busy")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="bound on each HTTP request")
    ap.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray instance")
    ap.add_argument("--data", help="CSV with the krea columns instead of the packaged sample")
    ap.add_argument("--mix", choices=("krea", "gentd26"), default="krea",
                    help="image counts: krea's own, or drawn from a GenTD26 trace's text-to-image requests "
                         "(the production-like mix; replay_requests)")
    ap.add_argument("--trace", help="GenTD26 CSV for --mix gentd26 (default: the packaged burst slice)")
    ap.add_argument("--mix-seed", type=int, default=0, help="seed of the --mix gentd26 draw")
    ap.add_argument("--mix-draw", choices=("random", "quota"), default="random",
                    help="--mix gentd26: each count drawn alone, or the trace's shares up to rounding (quota_counts)")
    ap.add_argument("--keep-checkpoint", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="show Ray's logs")
    args = ap.parse_args(argv)
    if not 1 <= args.concurrency <= 16:
        ap.error("--concurrency must be from 1 to 16 (deployments.cli.demo.MAX_CONCURRENCY)")
    if args.requests < 1 or args.steps < 1 or args.warmup_steps < 1 or args.c1_requests < 0:
        ap.error("--requests, --steps and --warmup-steps must be >= 1, --c1-requests >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 0 when every server ran and every request succeeded."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    import torch

    from bcg_core.models import describe_model, load_tokenizer_counter
    from bcg_core.validation import RequestValidator
    from deployments.settings import ServeConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and args.model != "tiny" and not args.tiny:
        raise SystemExit(f"--model {args.model} at its published size needs CUDA; on a CPU use --tiny or --model tiny")
    env = _env(args, device)
    out = Path(args.out) if args.out else (
        ROOT / "docs" / "bench" / f"{env['date'][:10]}_saturation_{args.model}_{gpu_label(env['gpu'])}.json")
    reqs = replay_requests(args.requests, args.size, args.data, args.mix, args.trace, args.mix_seed, args.mix_draw)
    warm, c1 = warmup_requests(reqs, args.warmup), c1_requests(reqs, args.c1_requests)
    result: dict[str, Any] = {
        "benchmark": "saturation", **env, "command": shlex.join(["python", "benchmarks/bench_saturation.py", *raw]),
        "argv": raw, "model": args.model, "tiny": args.tiny,
        "kernels": args.kernels[0] if len(args.kernels) == 1 else args.kernels,
        "replay": {"requests": len(reqs), "images": sum(r.n for r in reqs), "steps": args.steps,
                   "concurrency": args.concurrency, "size": args.size or "as in the data", "warmup": args.warmup,
                   "mix": args.mix, "trace": args.trace, "mix_seed": args.mix_seed, "mix_draw": args.mix_draw,
                   "warmup_requests": len(warm), "warmup_steps": args.warmup_steps, "c1_requests": len(c1)},
        "servers": [], "errors": [],
    }

    def save() -> None:
        result["ratios"] = ratios({s["server"]: s.get("summary") for s in result["servers"]})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))

    model_cfg, folder, info = build_model(args.model, args.tiny, args.scratch, device)
    try:
        result["model_info"] = info
        mc = ServeConfig.model_validate({"model": model_cfg}).model
        spec, counter = describe_model(mc), load_tokenizer_counter(mc)
        sent = reqs + warm + c1
        base = base_config(model_cfg, spec, counter, sent, args.steps, args.batch_sizes, args.text_lengths)
        configs, overrides = {}, {}
        source = "krea" if args.mix == "krea" else f"gentd26:{args.trace}" if args.trace else "gentd26"
        planned = (planned_buckets(base, args.steps, args.plan_max_graphs, args.plan_costs == "measure", source)
                   if "planned" in args.servers else None)
        runs = server_runs(args.servers, args.kernels)
        for name, server, tier in runs if "naive" in args.servers else [*runs, *server_runs(["naive"], ["eager"])]:
            overrides[name] = server_overrides(server, base, spec, sent, args.concurrency, args.naive_max_ongoing,
                                               planned, tier, args.compile_decode, args.cache)
            configs[name] = ServeConfig.model_validate(merge(base, overrides[name]))
        naive_validator = RequestValidator(configs["naive"], spec, counter)
        hits = check_all_miss(naive_validator, sent, args.steps)
        if hits:
            raise SystemExit(f"the naive table {configs['naive'].buckets.resolutions} holds {len(hits)} requests "
                             f"(e.g. {hits[0].lookup.key}): it must miss every one")
        _, refused = validate_all(RequestValidator(configs[runs[0][0]], spec, counter), reqs, args.steps)
        result.update(base_config=base, planned_refusals=[f"{r.describe()}: {m}" for r, m in refused],
                      naive_tier=configs["naive"].buckets.resolutions[0])
        save()
        floor = None
        if device == "cuda" and not args.no_floor:
            floor = gpu_floor(configs["naive"], reqs, args.steps, args.floor_steps)
            result["floor"] = floor
            save()
        for name, _, _ in runs:
            entry: dict[str, Any] = {"server": name, "overrides": overrides[name],
                                     "config": configs[name].model_dump(mode="json")}
            try:
                sent_reqs, sent_warm = ((half_cached(reqs, args.cache), half_cached(warm, args.cache, every=True))
                                        if name.startswith("half-cached") else (reqs, warm))
                entry.update(run_server(name, configs[name], sent_reqs, sent_warm, c1, args,
                                        floor and floor["floor_s"]))
            except Exception as e:  # noqa: BLE001 - one failing server must not lose the others' results
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
                result["errors"].append(f"{name}: {entry['error']}")
                print(f"[{name}] FAILED: {entry['error']}", flush=True)
            result["servers"].append(entry)
            save()
    finally:
        if folder is not None and not args.keep_checkpoint:
            shutil.rmtree(folder, ignore_errors=True)
    save()
    print("\n" + render(result))
    print(f"\nwrote {out}")
    failed = any((s.get("summary") or {}).get("failures", 1) for s in result["servers"])
    return 1 if result["errors"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
