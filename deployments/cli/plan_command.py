"""``bcg plan``: choose the bucket table from traffic (a packaged sample, a CSV, or a server's recorded shapes),
print it against the current one, and optionally write it (bcg_core/planning/)."""

from __future__ import annotations

import torch

from ..settings import ServeConfig
from .commands import run_profile

__all__ = ["GENTD26_CSV", "current_is_better", "load_plan_traffic", "measure_plan_costs", "output_problem", "plot_plan",
           "run_plan", "whole_count"]


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

    from bcg_core.planning.samples import krea_rows, traffic_from_gentd26, traffic_from_histogram, traffic_from_rows

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

    if "://" in source and not source.startswith(("http://", "https://")):
        raise ValueError(f"--from {source}: an http:// or https:// URL of a server, or a JSON file")
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
    (:func:`bcg_core.planning.plan_costs.costs_from_profile`: replay and eager milliseconds per token, pool bytes per
    token).

    Returns:
        A :class:`~bcg_core.planning.plan_costs.PlanCosts` whose ``source`` names the GPU.

    Raises:
        RuntimeError: without CUDA (the plan then uses the token-count model, or ``--profile`` output measured
            elsewhere).
    """
    import dataclasses
    import gc

    from bcg_core.planning.plan_costs import PlanCosts, costs_from_profile
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
        current: the current table's :class:`~bcg_core.planning.plan_costs.TableScore` on the same traffic and costs.
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
        :class:`~bcg_core.planning.plan_costs.TableScore` on the same traffic and costs.

    Raises:
        ValueError, OSError: see :func:`load_plan_traffic` and :func:`bcg_core.planning.table_search.search_table`.
    """
    import json

    from rich.console import Console
    from rich.table import Table

    from bcg_core.planning.plan_costs import PlanCosts, costs_from_profile, evaluate
    from bcg_core.planning.samples import planning_table
    from bcg_core.planning.table_search import search_table

    console = console or Console()
    if steps is not None and not 1 <= steps <= config.limits.max_steps:
        most = config.limits.max_steps
        raise ValueError(f"--steps {steps} is outside the config's limits (limits.max_steps {most}); use --steps 1 "
                         f"to {most}, or raise limits.max_steps")
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
    device = config.model.device
    where = ("" if measure or profile or device == "cpu" else
             f" (planned for a GPU: model.device {device}; model.device: cpu plans for a CPU)")
    table = Table(title=f"bcg plan: {traffic.source} traffic, {whole_count(traffic.requests)} requests, costs: "
                        f"{costs.source}{where}")
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


def output_problem(flag: str, path: str) -> str | None:
    """Why ``bcg plan``'s output ``path`` of ``flag`` (``--write``, ``--json``, ``--plot``) cannot be written, or None:
    checked before the search, not after it. Its folder must exist; a ``--plot`` file's extension must be one of
    the formats matplotlib writes (``FigureCanvasBase.get_supported_filetypes``)."""
    from pathlib import Path

    folder = Path(path).resolve().parent
    if not folder.is_dir():
        return f"{flag} {path}: its folder {str(folder)!r} does not exist"
    if flag == "--plot":
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            return f"--plot {path}: plotting needs matplotlib (pip install matplotlib)"
        formats = sorted(FigureCanvasBase.get_supported_filetypes())
        suffix = Path(path).suffix.lstrip(".").lower()
        if suffix not in formats:
            what = f".{suffix} is not an image format matplotlib writes" if suffix else "has no extension"
            return f"--plot {path}: {what}; allowed: {', '.join(formats)}"
    return None


def plot_plan(plan, path: str) -> None:
    """One matplotlib figure: expected GPU ms per image and padded-token waste against graph count along the
    search path, the chosen table marked; written to ``path`` (the format its extension names, checked by
    :func:`output_problem`)."""
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
