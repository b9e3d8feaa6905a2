"""``bcg verify``, ``bcg warm`` and ``bcg profile``: correctness, compiled kernels and speed of every bucket of a
config, as tables (``bcg plan`` is in :mod:`deployments.cli.plan_command`).

Both load the configured model and build the runner the config asks for (CUDA graphs on a GPU, static
eager buffers on a CPU), exactly as a replica does, then:

- ``verify`` runs every bucket's boundary shapes (:func:`bcg_core.verify_inputs.boundary_cases`) padded
  through the runner and unpadded through the adapter's eager forward, and prints the worst relative
  error and pass or fail per bucket (tolerance from the dtype: docs/DESIGN.md section 4);
- ``warm`` compiles every bucket with the config's compiled kernels ahead of a start, filling the compile cache;
- ``profile`` times each bucket at its exact size: kernels per step, eager ms, graph ms, kernel-busy ms,
  and a verdict on whether graphs pay (:mod:`bcg_core.planning.profile`). It needs CUDA.
"""

from __future__ import annotations

import math

import torch

from bcg_core.experts import component
from bcg_core.keys import BucketKey
from bcg_core.pipeline import DiTPipeline
from bcg_core.verify import RTOL, verify_runner
from bcg_core.verify_inputs import BoundaryCase, boundary_cases, square_grid

from ..settings import ServeConfig

__all__ = ["RTOL", "cache_dir_arg", "run_profile", "run_verify", "run_warm", "verify_case_tokens", "verify_estimate"]


def _select(keys: list[BucketKey], wanted: list[str] | None) -> list[BucketKey]:
    if not wanted:
        return keys
    by_name = {str(k): k for k in keys}
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], list(by_name), n=3, cutoff=0.5)
        shown = ", ".join(list(by_name)[:12]) + (f" and {len(by_name) - 12} more" if len(by_name) > 12 else "")
        raise ValueError(f"bucket {unknown[0]!r} is not in the table"
                         + (f" (closest: {', '.join(close)})" if close else "") + f"; its {len(by_name)} buckets: "
                         f"{shown} (GET /v1/buckets or bcg profile lists them with their shapes)")
    return [by_name[w] for w in wanted]


def _pipeline(config: ServeConfig, prepare: bool = True) -> DiTPipeline:
    """The configured pipeline; ``prepare=False`` leaves every bucket unprepared (no graph captured), for a
    command that prepares only the buckets it was asked for."""
    from bcg_core.models import load_model

    return DiTPipeline(config, load_model(config.model), prepare=prepare)


def verify_case_tokens(case: BoundaryCase) -> int:
    """Tokens one ``bcg verify`` case computes: its bucket's padded forward (:attr:`BucketKey.tokens`) plus the
    unpadded eager forward of its rows (``rows x (image + text tokens)``). ``bcg verify`` weighs its progress and
    time estimate by this count, as the token-count cost model does (a forward's time grows with its tokens)."""
    return case.key.tokens + case.rows * (math.prod(case.grid) + case.text_tokens)


def verify_estimate(small: tuple[int, float], large: tuple[int, float], tokens: list[int]) -> tuple[float, str]:
    """The seconds ``bcg verify`` will take for cases of ``tokens``, from two cases timed before it starts, and a
    line saying how.

    ``small`` and ``large`` are ``(tokens, seconds)`` of the smallest and the largest case (the smallest timed after
    a first run of it, which warms up: kernel selection, allocations). Each case is priced on the line through
    the two points, ``a + b x tokens`` (:func:`verify_case_tokens`), as the token-count cost model prices a forward
    by its tokens; a fixed cost per case (``a``) keeps many small cases from being underestimated. Where attention
    dominates (it grows with the square of the tokens) the line lies above the mid-size cases, so the estimate
    errs long.

    Args:
        small, large: ``(tokens, seconds)`` of the smallest and the largest case.
        tokens: tokens of every case to check.

    Returns:
        ``(seconds, text)``.
    """
    (t0, s0), (t1, s1) = small, large
    slope = (s1 - s0) / (t1 - t0) if t1 > t0 else (s1 / t1 if t1 else 0.0)
    slope = max(slope, 0.0)
    fixed = max(s0 - slope * t0, 0.0)
    seconds = sum(fixed + slope * t for t in tokens)
    text = (f"estimate: ~{_duration(seconds)} for {len(tokens)} cases (measured before starting: the smallest case "
            f"{s0:.2f} s for {t0:,} tokens, the largest {s1:.2f} s for {t1:,}; the others priced on the line "
            f"between, which errs long where attention dominates)")
    return seconds, text


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def run_verify(config: ServeConfig, buckets: list[str] | None = None, rtol: float | None = None,
               console=None, progress=None) -> bool:
    """Verify buckets of ``config`` against unpadded eager runs and print a table.

    Before it starts it times the smallest and the largest case and prints an estimate of the total time
    (:func:`verify_estimate`); while it runs it shows a tqdm bar per bucket (``bucket i/N: KEY``, weighted by each
    case's tokens, with the remaining time) on ``progress``. Buckets run in table order (fewest rows first).
    Checking the whole table, it first names ``--bucket KEY`` for a quick check. A model of several experts (Wan 2.2)
    has each other expert's runner checked on the same cases after the bar (rows ``KEY (transformer_2)``).

    Args:
        config: the serve config (model, table, runner).
        buckets: bucket keys to check (as ``str(BucketKey)``); None checks every bucket.
        rtol: relative tolerance; None picks it from the model dtype (:data:`RTOL`).
        console: a ``rich.console.Console`` for the table (a new one when None).
        progress: a text file for the progress bar and the estimate (``sys.stderr`` when None).

    Returns:
        True when every checked bucket passed.

    Raises:
        ValueError: an unknown bucket key.
    """
    import sys
    import time

    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    console = console or Console()
    progress = progress or sys.stderr
    from bcg_core.validation import RequestValidator

    _select(RequestValidator.from_config(config).table.keys, buckets)  # an unknown key fails before the model loads
    print("bcg verify: loading the model and building the runner (on a GPU: capturing "
          f"{'the graphs of the buckets asked for' if buckets else 'every bucket graph'}) ...",
          file=progress, flush=True)
    pipe = _pipeline(config, prepare=False)
    model = pipe.model
    keys = set(_select(pipe.table.keys, buckets))
    pipe.prepare(sorted(keys))  # --bucket: capture only those (the whole table's capture takes a while on a GPU)
    cases = [c for c in boundary_cases(pipe.table, config.limits) if c.key in keys]
    compiled = pipe.runner.kernels
    tier = pipe.stats()["kernels"]["tier"]
    if rtol is not None:
        tol, tol_from = rtol, "--rtol"
    elif compiled is not None and compiled.rtol is not None:
        # the tier's tolerance against the unpadded eager forward: padding's own (RTOL) plus what the compiled
        # kernels may add (kernel_tolerance), since a masked bucket carries both
        tol, tol_from = RTOL[model.dtype] + compiled.rtol, f"{RTOL[model.dtype]:g} padding + {compiled.rtol_note}"
    else:
        tol, tol_from = RTOL[model.dtype], f"{str(model.dtype).removeprefix('torch.')} padding tolerance"
    order = list(dict.fromkeys(c.key for c in cases))  # buckets in the order they run (table order)
    last_case = {c.key: i for i, c in enumerate(cases)}
    if not buckets and len(order) > 1:
        print(f"checking all {len(order)} buckets ({len(cases)} cases); for a quick check give one or more: "
              f"bcg verify --bucket {order[0]}", file=progress, flush=True)
    case_tokens = [verify_case_tokens(c) for c in cases]
    started = time.perf_counter()
    if len(cases) > 1:  # time the smallest case (twice: the first run warms up) and the largest, then estimate
        small = min(range(len(cases)), key=case_tokens.__getitem__)
        large = max(range(len(cases)), key=case_tokens.__getitem__)
        timed: list[float] = []
        verify_runner(model.adapter, pipe.runner, [cases[small], cases[small], cases[large]], model.device,
                      model.dtype, rtol=tol, on_case=lambda case, seconds: timed.append(seconds))
        print(verify_estimate((case_tokens[small], timed[1]), (case_tokens[large], timed[2]), case_tokens)[1],
              file=progress, flush=True)
    samples: list[tuple[int, float]] = []
    done = {"buckets": 0}
    bar_format = "{desc}: {percentage:3.0f}%|{bar}| {postfix} [{elapsed}<{remaining}]"
    with tqdm(total=sum(case_tokens), file=progress, unit="tok", unit_scale=True, desc="bcg verify",
              disable=not cases, bar_format=bar_format) as bar:
        if order:
            bar.set_postfix_str(f"bucket 1/{len(order)}: {order[0]}")

        def on_case(case: BoundaryCase, seconds: float) -> None:
            samples.append((case_tokens[len(samples)], seconds))
            bar.update(samples[-1][0])
            if last_case[case.key] != len(samples) - 1:
                return
            done["buckets"] += 1
            finished = done["buckets"]
            if finished < len(order):
                bar.set_postfix_str(f"bucket {finished + 1}/{len(order)}: {order[finished]}")
            else:
                bar.set_postfix_str(f"{len(order)} buckets checked")

        verdicts = verify_runner(model.adapter, pipe.runner, cases, model.device, model.dtype, rtol=tol,
                                 on_case=on_case)
    if cases:
        plural = "s" if len(order) != 1 else "", "s" if len(cases) != 1 else ""
        print(f"checked {len(order)} bucket{plural[0]} ({len(cases)} case{plural[1]}) in "
              f"{_duration(time.perf_counter() - started)}", file=progress, flush=True)
    described = {d["key"]: d for d in pipe.runner.describe()}
    rows = [(str(v.key), v, described) for v in verdicts]
    for e in range(1, len(pipe.runners)):  # another expert's runner (Wan 2.2's transformer_2): the same cases
        found = verify_runner(model.experts[e], pipe.runners[e], cases, model.device, model.dtype, rtol=tol)
        kept = {d["key"]: d for d in pipe.runners[e].describe()}
        rows += [(f"{v.key} ({component(e)})", v, kept) for v in found]
    table = Table(title=f"bcg verify: {model.model_name} on {model.device} "
                        f"({str(model.dtype).removeprefix('torch.')}), rtol {tol:.3g}")
    cols = ("bucket", "mode") + (("kernels",) if compiled is not None else ()) + (
        "cases", "shapes (rows x grid + text)", "max rel err", "result")
    _key_column(table, [label for label, _, _ in rows])
    for col in cols[1:]:
        table.add_column(col, justify="right" if col in ("cases", "max rel err") else "left")
    for label, v, state in rows:
        d = state.get(str(v.key), {})
        table.add_row(label, d.get("mode", "?"), *((d.get("kernels", "?"),) if compiled is not None else ()),
                      str(v.cases), ", ".join(v.shapes[:4]) + (" ..." if len(v.shapes) > 4 else ""),
                      f"{v.max_rel_err:.2e}",
                      "[green]pass[/]" if v.passed else "[red]FAIL[/]" + (" (NaN)" if v.nan else ""))
    console.print(table)
    console.print(f"kernels {tier}; rtol {tol:.3g}: {tol_from}")
    for key, d in described.items():
        if key in {str(k) for k in keys} and d.get("kernels") == "eager" and compiled is not None:
            console.print(f"{key} runs eager kernels: {d.get('note', '')}")
    unreached = sorted(str(k) for k in keys - {v.key for v in verdicts})
    if unreached:
        console.print(f"no valid request size maps to: {', '.join(unreached)}")
    failed = [v for _, v, _ in rows if not v.passed]
    console.print(f"{len(rows) - len(failed)} of {len(rows)} buckets passed"
                  + (f" ({len(pipe.runners)} experts' runners)" if len(pipe.runners) > 1 else ""))
    return not failed


def _key_column(table, keys: list[str]) -> None:
    """Add the ``bucket`` column to a ``rich`` table, as wide as its longest key and never cut or wrapped: the keys
    are what ``--buckets`` takes, so they must read whole on a narrow terminal (the other columns wrap instead)."""
    table.add_column("bucket", no_wrap=True, min_width=max(map(len, keys), default=6))


def cache_dir_arg(text: str) -> str:
    """The argparse type of ``bcg warm --cache-dir``: ``text`` as an absolute path (``~`` expanded) when it names a
    folder, or a new one inside a folder that exists, so that a mistyped path is refused rather than made with all
    its parents.

    Raises:
        argparse.ArgumentTypeError: ``text`` is a file, or its parent folder does not exist.
    """
    import argparse
    from pathlib import Path

    folder = Path(text).expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    if not folder.exists() and not folder.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {str(folder.parent)!r} does not exist (make it "
                                         f"first, or give a folder inside one that does)")
    return str(folder)  # '~' expanded here: the cache would take it as a folder of that name


def run_warm(config: ServeConfig, console=None, progress=None) -> dict:
    """``bcg warm``: compile every bucket of ``config`` with its compiled kernels, filling the on-disk compile cache
    (``runner.compile_cache_dir``, else inductor's default folder) so that a replica that starts later with the
    same model, table, torch and GPU reads its kernels back instead of compiling them. Each bucket is prepared as a
    replica prepares it (compile, check against eager, capture on a GPU), one after another in the runner's order
    (largest first) under a tqdm bar on ``progress`` (``sys.stderr`` when None; a cold FLUX.1-dev bucket compiles
    for 5-15 s on an H200), and a table says what each got.

    Returns:
        ``/v1/buckets``' ``kernels`` section of the warmed pipeline (compile seconds, cache hits and misses).

    Raises:
        ValueError: ``runner.kernels`` resolves to eager kernels on this device (nothing to compile).
    """
    import os
    import sys
    import time

    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from bcg_core.devices import resolve_device
    from bcg_core.pipeline import kernel_tier

    console = console or Console()
    tier = kernel_tier(config, resolve_device(config.model.device))
    if tier.value == "eager":
        where = "" if config.runner.kernels == "eager" else ", which means eager kernels on this device"
        raise ValueError(f"runner.kernels is {config.runner.kernels!r}{where}: nothing to compile; pass "
                         f"--kernels compiled (or fp8 on a GPU), or set runner.kernels, to warm its cache")
    t0 = time.perf_counter()
    progress = progress or sys.stderr
    print("bcg warm: loading the model ...", file=progress, flush=True)
    pipe = _pipeline(config, prepare=False)
    keys = list(pipe.runner.keys)  # the runner's own order: largest first, as a replica prepares them
    with tqdm(total=len(keys), file=progress, desc="bcg warm", unit="bucket") as bar:
        for key in keys:  # every bucket, also under runner.lazy_capture (a replica would compile them later)
            bar.set_postfix_str(f"compiling {key}")
            pipe.runner.prepare([key])
            bar.update(1)
    pipe.prepare()  # nothing left to compile: the fused step's check, once every bucket is ready
    stats = pipe.stats()
    k = stats["kernels"]
    table = Table(title=f"bcg warm: {pipe.model.model_name}, kernels {k['tier']}, check rtol {k['rtol']:.3g}")
    _key_column(table, [b["key"] for b in stats["buckets"]])
    for col in ("mode", "kernels", "compile check", "note"):
        table.add_column(col, justify="right" if col == "compile check" else "left")
    for b in stats["buckets"]:
        err = b.get("compile_rel_err")
        table.add_row(b["key"], str(b.get("mode")), str(b.get("kernels")), "-" if err is None else f"{err:.2e}",
                      b.get("note", "")[:80])
    console.print(table)
    where = k["cache_dir"] or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "inductor's default folder"
    console.print(f"{len(stats['buckets'])} buckets prepared in {time.perf_counter() - t0:.1f} s (compiling "
                  f"{k['compile_s']:.1f} s; compile caches {k['cache_hits']} hits, {k['cache_misses']} misses, "
                  f"{k['compile_failed']} buckets on eager kernels); cache: {where}")
    return k


def run_profile(config: ServeConfig, buckets: list[str] | None = None, iters: int = 10, console=None,
                json_path: str | None = None) -> list:
    """Time buckets of ``config`` at their exact sizes and print a table with a verdict per bucket.

    With ``json_path`` the rows are also written as JSON (``{"model", "gpu", "buckets": [{"key", "kernels",
    "eager_ms", "graph_ms", "floor_ms", "pool_bytes"}]}``), the measured costs ``bcg plan --profile`` fits its
    cost lines to.

    Returns:
        The :class:`~bcg_core.planning.profile.ProfileRow` list.

    Raises:
        RuntimeError: without CUDA.
        ValueError: an unknown bucket key.
    """
    from rich.console import Console
    from rich.table import Table

    from bcg_core.planning.profile import profile_case

    if not torch.cuda.is_available():
        raise RuntimeError("bcg profile needs a CUDA GPU: it times CUDA kernels and graph replay")
    console = console or Console()
    pipe = _pipeline(config)
    model = pipe.model
    rows = []
    for key in _select(pipe.table.keys, buckets):
        if key.image_mask:
            continue  # a masked bucket's exact fit is its unmasked twin
        grid = key.grid or square_grid(key.image_tokens)
        rows.append(profile_case(model.adapter, pipe.runner, BoundaryCase(key, key.batch, grid, key.text_tokens),
                                 model.device, model.dtype, iters))
    table = Table(title=f"bcg profile: {model.model_name} on {torch.cuda.get_device_name()}")
    _key_column(table, [r.key for r in rows])
    for col in ("kernels", "eager ms", "graph ms", "kernel-busy ms", "eager/graph", "verdict"):
        table.add_column(col, justify="left" if col == "verdict" else "right")
    for r in rows:
        table.add_row(r.key, str(r.kernels), f"{r.eager_ms:.2f}", f"{r.graph_ms:.2f}", f"{r.floor_ms:.2f}",
                      f"{r.speedup:.2f}", r.verdict)
    console.print(table)
    pools = {d["key"]: d.get("pool_bytes", 0) for d in pipe.runner.describe()}
    for r in rows:
        r.pool_bytes = int(pools.get(r.key) or 0)
    if json_path:
        import dataclasses
        import json

        out = {"model": model.model_name, "gpu": torch.cuda.get_device_name(),
               "buckets": [dataclasses.asdict(r) for r in rows]}
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        console.print(f"wrote {json_path}")
    return rows
