"""Held-out evaluation of the bucket planner (bcg_core/planning/table_search.py) on real traffic, on the CPU.

Two evaluations per model, each against the model's default table (``bcg_core.config.BucketConfig``):

- ``krea-halves``: plan on the first half of the packaged krea rows, evaluate on the second half;
- ``krea-to-gentd26``: plan on all krea rows, evaluate on the GenTD26 trace (image counts, steps and prompt
  lengths; the packaged 2024-12-06 burst, or ``--trace`` for the full trace) joined in order with krea sizes.

Reported per evaluation and table: graphs, expected GPU ms per image, padded-token waste, share of requests
no bucket holds (planned eager misses), from the planner's cost model (``--costs``: the token-count model of
a graph-replaying replica unless a ``bcg profile --json`` file is given). Models (``--models``):

- ``tiny``: the embedded default (FLUX layout: token-count keyed, unmasked 256-token text);
- ``pixart``: the tests/tiny PixArt-Sigma checkpoint (aspect-ratio bins of its 256 px size, masked text up to
  300 tokens; its stand-in T5 tokenizer counts more tokens than the real one), against the table the tests
  give it (bins 256x256, 304x208, 208x304; text 16, 32, 64, 300);
- ``pixart-512``: the same tiny checkpoint with ``sample_size`` 64, so that its aspect-ratio bins are those of
  PixArt-Sigma-XL-2-512-MS (what ``bench_saturation.py --model pixart-512`` serves), against the GPU benchmark's
  table: the default tiers at their bins (512x512, 416x608, 608x416), one 256-token text bucket.

Run: ``python benchmarks/plan_heldout.py --out docs/bench/<date>_plan_heldout_cpu.json`` (a few seconds).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bcg_core.planning.plan_costs import PlanCosts, TableScore, evaluate  # noqa: E402
from bcg_core.planning.samples import Traffic, krea_rows, planning_table, traffic_from_gentd26, traffic_from_rows  # noqa: E402
from bcg_core.planning.table_search import search_table  # noqa: E402
from deployments.cli.plan_command import GENTD26_CSV  # noqa: E402
from deployments.settings import ServeConfig  # noqa: E402


def _config(name: str, folder: Path) -> ServeConfig:
    if name == "tiny":
        return ServeConfig.model_validate({"model": {"device": "cuda"}})  # planned for a GPU replica
    from tiny.pixart import build

    if name == "pixart-512":  # the 512 px aspect-ratio bins of PixArt-Sigma-XL-2-512-MS; the GPU benchmark's table
        path = build(folder / name, sample_size=64)
        return ServeConfig.model_validate({"model": {"path": str(path), "device": "cuda"},
                                           "buckets": {"resolutions": ["512x512", "416x608", "608x416"],
                                                       "text_lengths": [256]}})
    path = build(folder / "pixart")
    return ServeConfig.model_validate({"model": {"path": str(path), "device": "cuda"}, "limits": {"min_side_px": 128},
                                       "buckets": {"resolutions": ["256x256", "304x208", "208x304"],
                                                   "text_lengths": [16, 32, 64, 300]}})


def _row(score: TableScore) -> dict:
    return {"graphs": score.graphs, "ms_per_image": round(score.ms_per_image, 3), "waste": round(score.waste, 4),
            "miss_share": round(score.miss_share, 4), "pool_mib": round(score.pool_bytes / 2**20, 1)}


def evaluate_pair(config: ServeConfig, train: Traffic, test: Traffic, costs: PlanCosts,
                  max_graphs: int) -> dict:
    """Plan on ``train``; score the plan and the default table on ``test``."""
    plan = search_table(config, train, costs, max_graphs=max_graphs)
    planned = planning_table(config.model_copy(update={"buckets": plan.buckets}))
    default = planning_table(config)
    return {"train": {"source": train.source, "requests": round(train.requests, 1), "score": _row(plan.score)},
            "test": {"source": test.source, "requests": round(test.requests, 1),
                     "planned": _row(evaluate(planned, test, costs)),
                     "default": _row(evaluate(default, test, costs))},
            "buckets": plan.buckets.model_dump(mode="json")}


def run(models: list[str], max_graphs: int, steps: int, trace: str | None) -> dict:
    out = {"max_graphs": max_graphs, "steps": steps, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            config = _config(name, Path(tmp))
            costs = PlanCosts.token_count(config)
            rows = krea_rows()
            half = len(rows) // 2
            first = traffic_from_rows(config, rows[:half], source="krea first half", steps=steps)
            second = traffic_from_rows(config, rows[half:], source="krea second half", steps=steps)
            text = (resources.files("bcg_core").joinpath("data", GENTD26_CSV).read_text(encoding="utf-8")
                    if trace is None else Path(trace).read_text(encoding="utf-8"))
            sizes = [(int(r["width"]), int(r["height"])) for r in rows]
            gentd = traffic_from_gentd26(config, csv.DictReader(io.StringIO(text)), sizes, steps=steps)
            everything = traffic_from_rows(config, rows, source="krea", steps=steps)
            out["models"][name] = {"costs": costs.describe(),
                                   "krea-halves": evaluate_pair(config, first, second, costs, max_graphs),
                                   "krea-to-gentd26": evaluate_pair(config, everything, gentd, costs, max_graphs)}
    return out


def render(result: dict) -> str:
    lines = ["| model | evaluation | table | graphs | GPU ms / image | padded-token waste | eager misses |",
             "|---|---|---|---|---|---|---|"]
    for model, ev in result["models"].items():
        for name in ("krea-halves", "krea-to-gentd26"):
            for table in ("planned", "default"):
                r = ev[name]["test"][table]
                lines.append(f"| {model} | {name} | {table} | {r['graphs']} | {r['ms_per_image']:.2f} | "
                             f"{100 * r['waste']:.2f}% | {100 * r['miss_share']:.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,pixart,pixart-512")
    ap.add_argument("--max-graphs", type=int, default=12)
    ap.add_argument("--steps", type=int, default=20, help="every request's steps (krea's are SD 1.x steps)")
    ap.add_argument("--trace", help="a GenTD26-style CSV (default: the packaged burst)")
    ap.add_argument("--out", help="JSON result")
    args = ap.parse_args(argv)
    result = run([m for m in args.models.split(",") if m], args.max_graphs, args.steps, args.trace)
    print(render(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
