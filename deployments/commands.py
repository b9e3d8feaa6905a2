"""``bcg verify`` and ``bcg profile``: correctness and speed of every bucket of a config, as tables.

Both load the configured model and build the runner the config asks for (CUDA graphs on a GPU, static
eager buffers on a CPU), exactly as a replica does, then:

- ``verify`` runs every bucket's boundary shapes (:func:`bcg_core.verify.boundary_cases`) padded
  through the runner and unpadded through the adapter's eager forward, and prints the worst relative
  error and pass or fail per bucket (tolerance from the dtype: docs/DESIGN.md section 4);
- ``profile`` times each bucket at its exact size: kernels per step, eager ms, graph ms, kernel-busy ms,
  and a verdict on whether graphs pay (:mod:`bcg_core.planning.profile`). It needs CUDA.
"""

from __future__ import annotations

import torch

from bcg_core.keys import BucketKey
from deployments.settings import ServeConfig
from bcg_core.pipeline import DiTPipeline
from bcg_core.verify import RTOL, BoundaryCase, boundary_cases, verify_runner

__all__ = ["RTOL", "load_plan_traffic", "measure_plan_costs", "plot_plan", "run_plan", "run_profile", "run_verify",
           "verify_case_tokens", "verify_estimate", "current_is_better", "whole_count"]


def _select(keys: list[BucketKey], wanted: list[str] | None) -> list[BucketKey]:
    if not wanted:
        return keys
    by_name = {str(k): k for k in keys}
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        raise ValueError(f"bucket {unknown[0]!r} is not in the table; buckets: {', '.join(by_name)}")
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
    return case.key.tokens + case.rows * (case.grid[0] * case.grid[1] + case.text_tokens)


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
    Checking the whole table, it first names ``--bucket KEY`` for a quick check.

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
    print("bcg verify: loading the model and building the runner (on a GPU: capturing "
          f"{'the graphs of the buckets asked for' if buckets else 'every bucket graph'}) ...", file=progress, flush=True)
    from bcg_core.planner import Planner

    _select(Planner.from_config(config).table.keys, buckets)  # an unknown key fails before the model loads
    pipe = _pipeline(config, prepare=False)
    model = pipe.model
    keys = set(_select(pipe.table.keys, buckets))
    pipe.prepare(sorted(keys))  # --bucket: capture only those (the whole table's capture takes a while on a GPU)
    cases = [c for c in boundary_cases(pipe.table, config.limits) if c.key in keys]
    tol = rtol if rtol is not None else RTOL[model.dtype]
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
    modes = {d["key"]: d["mode"] for d in pipe.runner.describe()}
    table = Table(title=f"bcg verify: {model.model_name} on {model.device} ({str(model.dtype).removeprefix('torch.')}), "
                        f"rtol {tol:g}")
    for col in ("bucket", "mode", "cases", "shapes (rows x grid + text)", "max rel err", "result"):
        table.add_column(col, justify="right" if col in ("cases", "max rel err") else "left")
    for v in verdicts:
        table.add_row(str(v.key), modes.get(str(v.key), "?"), str(v.cases), ", ".join(v.shapes[:4]) +
                      (" ..." if len(v.shapes) > 4 else ""), f"{v.max_rel_err:.2e}",
                      "[green]pass[/]" if v.passed else "[red]FAIL[/]" + (" (NaN)" if v.nan else ""))
    console.print(table)
    unreached = sorted(str(k) for k in keys - {v.key for v in verdicts})
    if unreached:
        console.print(f"no valid request size maps to: {', '.join(unreached)}")
    failed = [v for v in verdicts if not v.passed]
    console.print(f"{len(verdicts) - len(failed)} of {len(verdicts)} buckets passed")
    return not failed


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
        grid = key.latent_hw or _square_grid(key.image_tokens)
        if grid is None:
            continue
        rows.append(profile_case(model.adapter, pipe.runner, BoundaryCase(key, key.batch, grid, key.text_tokens),
                                 model.device, model.dtype, iters))
    table = Table(title=f"bcg profile: {model.model_name} on {torch.cuda.get_device_name()}")
    for col in ("bucket", "kernels", "eager ms", "graph ms", "kernel-busy ms", "eager/graph", "verdict"):
        table.add_column(col, justify="left" if col in ("bucket", "verdict") else "right")
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


def _square_grid(tokens: int) -> tuple[int, int] | None:
    """A grid with ``tokens`` tokens, as square as possible (FLUX buckets key on the count only)."""
    for h in range(int(tokens**0.5), 0, -1):
        if tokens % h == 0:
            return (h, tokens // h)
    return None


GENTD26_CSV = "alibaba_gentd26_burst_2024-12-06.csv"
"""The packaged GenTD26 burst (``bcg_core/data/README.md``): image counts, steps and prompt lengths, no sizes."""


def load_plan_traffic(config: ServeConfig, source: str, steps: int | None = None, krea: str | None = None,
                      api_key: str | None = None):
    """The traffic sample ``bcg plan`` plans for (:mod:`bcg_core.planning.samples`).

    Args:
        config: model and limits.
        source: ``"krea"`` (the packaged krea CSV), ``"gentd26"`` (the packaged GenTD26 burst, its rows joined in
            order with the krea requests' sizes) or ``"gentd26:PATH"`` (a GenTD26-style CSV), a recorded shape
            histogram: a JSON file (a :meth:`~bcg_core.planning.traffic.TrafficHistogram.snapshot` or a saved
            ``/v1/buckets`` answer) or the ``http://`` URL of a running server.
        steps: every request's steps instead of the sample's.
        krea: another krea-format CSV instead of the packaged one.
        api_key: the key of a server with API keys (``source`` a URL).

    Raises:
        ValueError, OSError: a source that cannot be read or holds nothing to plan for (naming it).
    """
    import csv
    from importlib import resources

    from bcg_core.planning.samples import (krea_rows, traffic_from_gentd26, traffic_from_histogram,
                                           traffic_from_rows)

    if source == "krea":
        return traffic_from_rows(config, krea_rows(krea), steps=steps)
    if source == "gentd26" or source.startswith("gentd26:"):
        path = source.partition(":")[2]
        text = (resources.files("bcg_core").joinpath("data", GENTD26_CSV).read_text(encoding="utf-8") if not path
                else open(path, encoding="utf-8").read())
        sizes = [(int(r["width"]), int(r["height"])) for r in krea_rows(krea) if r.get("width") and r.get("height")]
        import io

        reader = csv.DictReader(io.StringIO(text))
        need = {"num_images_per_prompt", "num_inference_steps", "prompt_length"}
        missing = sorted(need - set(reader.fieldnames or ()))
        if missing:
            raise ValueError(f"{path or GENTD26_CSV}: a GenTD26-style trace needs the columns {sorted(need)}; "
                             f"missing {missing}")
        return traffic_from_gentd26(config, reader, sizes, steps=steps)
    import dataclasses
    import os

    from bcg_core.planning.traffic import load_traffic

    if "://" not in source and not os.path.exists(source):
        raise ValueError(f"--from {source}: no such file; for a running server give its URL, e.g. http://{source}"
                         if ":" in source else f"--from {source}: no such file")
    traffic = traffic_from_histogram(config, load_traffic(source, api_key=api_key).snapshot())
    if steps is not None:
        traffic.demands = [dataclasses.replace(d, steps=steps) for d in traffic.demands]
    return traffic


def measure_plan_costs(config: ServeConfig, traffic, iters: int = 5, console=None):
    """The planner's own profile on a GPU (``bcg plan --measure``): capture and time the few buckets of
    :func:`bcg_core.planning.table_search.profile_buckets` (the sample's smallest, most requested and largest tier, its
    median text, 1 row and the most rows), then fit the plan's cost lines to them
    (:func:`bcg_core.planning.costs.costs_from_profile`: replay and eager milliseconds per token, pool bytes per token).

    Returns:
        A :class:`~bcg_core.planning.costs.PlanCosts` whose ``source`` names the GPU.

    Raises:
        RuntimeError: without CUDA (the plan then uses the token-count model, or ``--profile`` output measured
            elsewhere).
    """
    import dataclasses
    import gc

    from bcg_core.planning.costs import PlanCosts, costs_from_profile
    from bcg_core.planning.table_search import profile_buckets

    if not torch.cuda.is_available():
        raise RuntimeError("bcg plan --measure needs a CUDA GPU to time bucket replays; without one leave --measure "
                           "out (the token-count model stands in) or give --profile with `bcg profile --json` output "
                           "measured on the serving GPU")
    measured = config.model_copy(update={"buckets": profile_buckets(config, traffic)})
    rows = run_profile(measured, iters=iters, console=console)
    gc.collect()
    torch.cuda.empty_cache()  # the profile's pipeline and pool are gone: give the memory back
    costs = costs_from_profile([dataclasses.asdict(r) for r in rows], PlanCosts.token_count(config))
    gpu = torch.cuda.get_device_name()
    return dataclasses.replace(costs, source=f"profile (measured by bcg plan --measure on {gpu}, {len(rows)} buckets)")


def whole_count(value: float) -> str:
    """A request count of a traffic sample as a whole number: rounded half up (``182.9`` -> ``"183"``), and
    ``"<1"`` for a count between 0 and one half. Samples weigh requests in fractions (a krea row is ``1 /
    num_generations`` of a request, and a sample cut mid-request leaves a part), so ``bcg plan`` prints them so."""
    if value != value or value < 0:
        raise ValueError(f"a request count must be a number >= 0, not {value}")
    if 0 < value < 0.5:
        return "<1"
    return str(int(value + 0.5))


def current_is_better(plan, current) -> bool:
    """True when the current table's expected cost per image is lower than or equal to the planned table's
    (``bcg plan`` then says so and ``--write`` needs ``--force``).

    Args:
        plan: the search's :class:`~bcg_core.planning.table_search.TableChoice` (its ``score``).
        current: the current table's :class:`~bcg_core.planning.costs.TableScore` on the same traffic and costs.
    """
    return current.ms_per_image <= plan.score.ms_per_image * (1 + 1e-9)


def run_plan(config: ServeConfig, source: str = "krea", budget_mib: float | None = None, max_graphs: int = 12,
             profile: str | None = None, steps: int | None = None, krea: str | None = None, console=None,
             measure: bool = False, api_key: str | None = None):
    """Plan the bucket table for a traffic sample and print it (``bcg plan``).

    Costs: ``measure`` profiles buckets on this machine's GPU (:func:`measure_plan_costs`); ``profile`` reads
    ``bcg profile --json`` output; otherwise the token-count model stands in. The report names which.

    The report prints request counts whole (:func:`whole_count`) and compares the chosen table's expected cost per
    image with the current table's; when the current one is as good or better (:func:`current_is_better`) it
    says so.

    Returns:
        ``(plan, current)``: the :class:`~bcg_core.planning.table_search.TableChoice` and the current table's
        :class:`~bcg_core.planning.costs.TableScore` on the same traffic and costs.

    Raises:
        ValueError, OSError: see :func:`load_plan_traffic` and :func:`bcg_core.planning.table_search.search_table`.
    """
    import json

    from rich.console import Console
    from rich.table import Table

    from bcg_core.planning.costs import PlanCosts, costs_from_profile, evaluate
    from bcg_core.planning.samples import planning_table
    from bcg_core.planning.table_search import search_table

    console = console or Console()
    traffic = load_plan_traffic(config, source, steps, krea, api_key)
    costs = PlanCosts.token_count(config)
    if measure and profile:
        raise ValueError("--measure profiles buckets itself: give it or --profile, not both")
    if measure:
        costs = measure_plan_costs(config, traffic, console=console)
    if profile:
        try:
            with open(profile, encoding="utf-8") as f:
                rows = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--profile {profile}: cannot read it as JSON ({e})") from None
        rows = rows.get("buckets") if isinstance(rows, dict) else rows
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"--profile {profile}: expected `bcg profile --json` output (an object with a "
                             f"'buckets' list of rows)")
        try:
            costs = costs_from_profile(rows, costs)
        except ValueError as e:
            raise ValueError(f"--profile {profile}: {e}") from None
    plan = search_table(config, traffic, costs, budget_mib=budget_mib, max_graphs=max_graphs)
    default = evaluate(planning_table(config), traffic, costs)
    s = plan.score
    table = Table(title=f"bcg plan: {traffic.source} traffic, {whole_count(traffic.requests)} requests, costs: "
                        f"{costs.source}")
    for col in ("bucket shape", "share of requests", "padded-token waste"):
        table.add_column(col, justify="left" if col == "bucket shape" else "right")
    for shape, v in s.shares.items():
        table.add_row(shape if shape != "miss" else "miss (unpadded eager)", f"{v['share']:.1%}", f"{v['waste']:.1%}")
    console.print(table)
    b = plan.buckets
    console.print(f"chosen: {s.graphs} graphs, {s.ms_per_image:.2f} ms per image (expected), waste {s.waste:.1%}, "
                  f"pool ~{s.pool_bytes / 2**20:.0f} MiB, misses {s.miss_share:.1%}")
    console.print(f"  batch_sizes: {b.batch_sizes}\n  resolutions: {b.resolutions}\n  text_lengths: {b.text_lengths}")
    if b.text_lengths_by_resolution:
        console.print(f"  text_lengths_by_resolution: {b.text_lengths_by_resolution}")
    console.print(f"current table: {default.graphs} graphs, {default.ms_per_image:.2f} ms per image, waste "
                  f"{default.waste:.1%}, misses {default.miss_share:.1%}")
    if current_is_better(plan, default):
        fewer = (f"; the planned table has fewer graphs ({s.graphs} against {default.graphs})"
                 if s.graphs < default.graphs else "")
        same = default.ms_per_image >= s.ms_per_image * (1 - 1e-9)
        console.print(f"[bold]the current table is already {'as good' if same else 'better'}: "
                      f"{default.ms_per_image:.2f} ms per image expected against {s.ms_per_image:.2f} for the "
                      f"planned one{fewer}. Keep it; --write writes the planned table only with --force[/bold]")
    else:
        console.print(f"the planned table is expected {1 - s.ms_per_image / default.ms_per_image:.1%} faster than the "
                      f"current one ({s.ms_per_image:.2f} against {default.ms_per_image:.2f} ms per image)")
    if traffic.refused:
        console.print("refused by the limits (requests): "
                      + ", ".join(f"{k} {whole_count(v)}" for k, v in sorted(traffic.refused.items())))
    return plan, default


def plot_plan(plan, path: str) -> None:
    """One matplotlib figure: expected GPU ms per image and padded-token waste against graph count along the
    search path, the chosen table marked; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.score.graphs for p in plan.curve]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(xs, [p.score.ms_per_image for p in plan.curve], "o-", color="tab:blue", label="GPU ms per image")
    ax.set_xlabel("graphs per replica")
    ax.set_ylabel("expected GPU ms per image", color="tab:blue")
    twin = ax.twinx()
    twin.plot(xs, [100 * p.score.waste for p in plan.curve], "s--", color="tab:orange", label="padded-token waste")
    twin.set_ylabel("padded-token waste (%)", color="tab:orange")
    c = plan.curve[plan.chosen]
    ax.axvline(c.score.graphs, color="grey", linestyle=":")
    ax.annotate("chosen", (c.score.graphs, c.score.ms_per_image), textcoords="offset points", xytext=(5, 8))
    ax.set_title(f"bcg plan ({plan.traffic['source']}, costs: {plan.costs['source']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
