"""LoRA operator benchmark: what adapter rows cost each bucket's forward, for checkouts side by side.

For every bucket of the table ``bench_lora.py`` serves (the production-like mix's text bucket, the default batch
sizes and resolutions), the runner's forward (a CUDA graph replay on CUDA) is timed three ways:

- ``base``: a deployment without ``lora.dir`` (no layer wrapped);
- ``plain``: a deployment with ``lora.dir``, no row with an adapter (the bucket's plain graph);
- ``lora``: the same deployment, every row on slot 0 (the bucket's LoRA graph; slot 0 holds zeros and costs what
  a real adapter of ``--rank`` does, as the step scheduler's measured costs assume, ``bcg_core/costs/measure.py``).

Each of ``--trees`` (checkouts of this repository, default this one) runs ``plain`` and ``lora`` in a process of
its own that imports that checkout's ``bcg_core``; ``base`` runs once, from this checkout (the LoRA code is not
on its path). So an operator change is measured against the commit before it in one run, as the benchmarks here
compare (GPU timings swing between runs; ratios hold)::

    git worktree add .gpu/old <commit before>
    python benchmarks/bench_lora_op.py --model sd3-medium --rank 16 --trees .,.gpu/old --scratch /dev/shm \\
        --commit <sha>

Per bucket and tree: the median of ``--iters`` timed calls, plain and lora alternated, and ``lora / base``,
``plain / base``. ``--rounds N`` repeats every process N times in turn (base, tree 1, tree 2, base, ...); the
ratios are the rounds' medians. Models as ``bench_lora.py`` (random weights, bf16); ``--tiny`` is the CPU smoke
(tests/tiny configs, fp32, eager forwards).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def measure(tree: str, config_path: str, iters: int) -> dict[str, dict[str, float]]:
    """In this process, with ``tree``'s ``bcg_core`` first on the path: start the pipeline of the config at
    ``config_path`` and time each bucket. Returns ``{bucket: {"plain": ms, "lora": ms}}`` (``lora`` only with
    ``lora.dir`` set)."""
    sys.path[:0] = [tree]
    import dataclasses

    import torch

    from bcg_core.pipeline import DiTPipeline
    from deployments.settings import ServeConfig

    config = ServeConfig.model_validate(json.loads(Path(config_path).read_text()))
    pipe = DiTPipeline.from_config(config)
    device = pipe.model.device
    k_lora = getattr(pipe.model.adapter, "k", 0) if config.lora.dir else 0
    cuda = device.type == "cuda"

    def ms(fn) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for key in sorted(pipe.table.keys, key=str):
            x = pipe.example_inputs(key, key.batch)
            ways = {"plain": x}
            if k_lora:  # slot-0 rows built here, not by LoRAAdapter.on_slot_zero: older checkouts lack it
                dev = x.latents.device
                ways["lora"] = dataclasses.replace(
                    x, lora_slots=torch.zeros(key.batch, k_lora, dtype=torch.int64, device=dev),
                    lora_scales=torch.zeros(key.batch, k_lora, device=dev))
            times: dict[str, list[float]] = {w: [] for w in ways}
            for xi in ways.values():  # warm-up: a replay's first call pays its lazy setup
                pipe.runner.run(key, xi)
            for _ in range(iters):
                for w, xi in ways.items():
                    times[w].append(ms(lambda key=key, xi=xi: pipe.runner.run(key, xi)))
            out[str(key)] = {w: round(statistics.median(t), 4) for w, t in times.items()}
    return out


def run_child(tree: Path, config: dict, iters: int, scratch: Path) -> dict:
    """:func:`measure` in a fresh process (``--child``): one checkout's ``bcg_core`` per process."""
    path = scratch / f"config-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(config))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(tree), "--config", str(path),
           "--iters", str(iters)]
    proc = subprocess.run(cmd, cwd=str(tree), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict[str, dict]], trees: list[str]) -> dict[str, dict[str, Any]]:
    """Per bucket: base ms and, per tree, plain and lora ms and their ratios to base, medians over ``rounds``
    (each ``{"base": {bucket: {...}}, tree: {bucket: {...}}}``)."""
    buckets = sorted(rounds[0]["base"])
    out: dict[str, dict[str, Any]] = {}
    for b in buckets:
        row: dict[str, Any] = {"base_ms": statistics.median(r["base"][b]["plain"] for r in rounds)}
        for t in trees:
            for w in ("plain", "lora"):
                row[f"{w}_ms@{t}"] = statistics.median(r[t][b][w] for r in rounds)
                row[f"{w}_vs_base@{t}"] = round(statistics.median(r[t][b][w] / r["base"][b]["plain"]
                                                                  for r in rounds), 3)
        out[b] = row
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("flux-dev-width", "sd3-medium"), default="sd3-medium")
    ap.add_argument("--tiny", action="store_true", help="tests/tiny configs, fp32 (CPU smoke)")
    ap.add_argument("--rank", type=int, default=16, help="lora.max_rank")
    ap.add_argument("--max-per-request", type=int, default=2, help="lora.max_per_request (bench_lora.py's)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--kernels", choices=("eager", "compiled", "fp8"), default="eager")
    ap.add_argument("--trees", default=".", help="comma-separated checkouts to compare (default this one)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per bucket and way (median)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch-sizes", help="comma-separated batch sizes of the table (default the config's)")
    ap.add_argument("--resolutions", help="comma-separated WxH resolutions of the table (default the config's; "
                                          "256x256 with --tiny)")
    ap.add_argument("--scratch", help="folder for the checkpoint (default a temp dir)")
    ap.add_argument("--out", help="JSON result (default docs/bench/<date>_lora_op_<model>_r<rank>.json)")
    ap.add_argument("--commit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.child:
        print(json.dumps(measure(args.child, args.config, args.iters)), flush=True)
        return 0
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT)]
    import bench_lora as bl
    import bench_saturation as bs
    import torch

    from bcg_core.models import describe_model, load_tokenizer_counter
    from deployments.settings import ServeConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.tiny:
        raise SystemExit("published sizes need CUDA; use --tiny on a CPU")
    trees = [t.strip() for t in args.trees.split(",") if t.strip()]
    for t in trees:
        if not (Path(t) / "bcg_core" / "lora" / "layers.py").is_file():
            raise SystemExit(f"--trees: {t} is not a checkout of this repository with LoRA (no bcg_core/lora)")
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out = Path(args.out) if args.out else (
        ROOT / "docs" / "bench" / f"{date[:10]}_lora_op_{args.model}_r{args.rank}.json")
    cfg, folder, _ = bl.build_model(args.model, args.tiny, args.scratch, device)
    work = Path(tempfile.mkdtemp(prefix="bcg-lora-op-", dir=args.scratch))
    try:
        loras = work / "loras"  # the timed rows are on slot 0: no adapter file is needed
        loras.mkdir()
        demo = bs.replay_requests(32, None, mix="gentd26")
        mc = ServeConfig.model_validate({"model": cfg}).model
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else None
        base = bs.base_config(cfg, describe_model(mc), load_tokenizer_counter(mc), demo, 20, batch_sizes=batch_sizes)
        base["runner"] = {"kernels": args.kernels}
        resolutions = args.resolutions or ("256x256" if args.tiny else None)  # tiny position tables are small
        if resolutions:
            base["buckets"]["resolutions"] = resolutions.split(",")
        lora = {**base, "lora": {"dir": str(loras), "slots": args.slots, "max_rank": args.rank,
                                 "max_per_request": args.max_per_request}}
        result: dict[str, Any] = {
            "benchmark": "lora_op", "date": date, "commit": args.commit, "argv": raw,
            "command": shlex.join(["python", "benchmarks/bench_lora_op.py", *raw]), "model": args.model,
            "tiny": args.tiny, "device": device,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
            "kernels": args.kernels, "rank": args.rank, "max_per_request": args.max_per_request,
            "slots": args.slots, "iters": args.iters,
            "trees": {t: subprocess.run(["git", "-C", t, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip() or None for t in trees}}
        rounds = []
        for r in range(max(1, args.rounds)):
            one = {"base": run_child(ROOT, base, args.iters, work)}
            for t in trees:
                one[t] = run_child(Path(t).resolve(), lora, args.iters, work)
            rounds.append(one)
            print(f"round {r}", json.dumps(one), flush=True)
        result["rounds"] = rounds
        result["buckets"] = summarize(rounds, trees)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        for b, row in result["buckets"].items():
            print(b, {k: v for k, v in row.items() if "vs_base" in k or k == "base_ms"})
        print(f"wrote {out}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
