"""Cold and warm starts of a replica with compiled kernels: how long until a planned table is ready to serve.

One checkpoint (``--model``, a published transformer config with random weights from
``benchmarks/bench_families.py``, bf16) is built under ``--scratch``; ``bcg plan``'s table for it is chosen from the
packaged krea sample at ``--steps`` steps with at most ``--max-graphs`` graphs
(``benchmarks/bench_saturation.py`` ``planned_buckets``, token-count costs); a config with that table,
``runner.kernels: --kernels`` and ``runner.compile_cache_dir`` in a fresh folder is written. Then the same start
runs ``--starts`` times, each in a process of its own (a restart: no in-memory state of inductor or dynamo
survives), one after another:

1. ``cold``: the cache folder is empty; every bucket compiles (what ``bcg warm`` does ahead of a deploy);
2. ``warm`` (every later start): the cache holds what the first start wrote.

``--cold-by bcg-warm`` fills the cache with ``bcg warm --config`` instead of a first start (what an operator runs
ahead of a deploy), so every start measured is warm.

A start is what a replica does before it reports ready (``deployments/dit.py``): import, load the weights
(``bcg_core.models.load_model``) and prepare every bucket (``DiTPipeline``: compile, check against eager kernels,
capture). Ray Serve's own start of the replica's process is not in it. Reported per start: ``ready_s`` (the
process's wall from its launch until the pipeline is built, imports included), ``import_s``, ``load_s``,
``prepare_s`` (compile, check and capture of all buckets: ``kernels.prepare_s`` of ``/v1/buckets``), the FX graph
cache's hits and misses, ``start`` (cold, warm, partial) and the buckets left on eager kernels. The target of a warm
start with the 12-graph table is 60 s.

On the GPU machine, after ``mkdir -p $HOME/site && tar xJf .gpu/site.tar.xz -C $HOME/site && export
PYTHONPATH=$HOME/site:$PWD``::

    python benchmarks/bench_warm_start.py --model flux-dev --scratch /dev/shm --commit <sha> --out warm.json

CPU smoke: ``--device cpu --tiny --max-graphs 2`` (tiny config, fp32, inductor's C++ backend, a fixed table of
batches 1 and 2 at 256x256 instead of the planner's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]


def child(config_path: str) -> dict:
    """One start in this process: load the config, the weights, prepare every bucket; what it took."""
    import torch

    from bcg_core import DiTPipeline, load_model
    from deployments.settings import load_config

    t_import = time.perf_counter()
    config = load_config(config_path=config_path)
    model = load_model(config.model)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t_load = time.perf_counter()
    pipe = DiTPipeline(config, model)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t_ready = time.perf_counter()
    stats = pipe.stats()
    k = stats["kernels"]
    buckets = stats["buckets"]
    return dict(ready_s=round(t_ready - T0, 2), import_s=round(t_import - T0, 2), load_s=round(t_load - t_import, 2),
                prepare_s=round(t_ready - t_load, 2), kernels=k, graphs=sum(b.get("mode") == "graph" for b in buckets),
                buckets=len(buckets), on_eager=[b["key"] for b in buckets if b.get("kernels") == "eager"],
                compile_rel_err={b["key"]: b.get("compile_rel_err") for b in buckets},
                attention={b["key"]: b.get("attention") for b in buckets})


def write_config(folder: Path, scratch: Path, args) -> Path:
    """The served config: the checkpoint at ``folder``, ``bcg plan``'s table, compiled kernels, a fresh cache."""
    import yaml
    from bench_saturation import planned_buckets

    dtype = "float32" if args.tiny else "bfloat16"
    base = {"model": {"path": str(folder), "device": args.device, "dtype": dtype}}
    # the CPU smoke checks the mechanics on a small table: the planner's krea sizes are 512² and up, which the tiny
    # model's VAE (4x) turns into 16k-token attention, tens of GB on a CPU
    buckets = ({"batch_sizes": [1, 2][:args.max_graphs], "resolutions": ["256x256"], "text_lengths": [512]}
               if args.tiny else planned_buckets(base, args.steps, args.max_graphs))
    cache = scratch / "compile-cache"
    shutil.rmtree(cache, ignore_errors=True)
    config = {**base, "buckets": buckets,
              "runner": {"kernels": args.kernels, "compile_cache_dir": str(cache), "fused_step": "never"}}
    path = scratch / "warm-start.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flux-dev", help="a model of benchmarks/bench_families.py bench_models")
    ap.add_argument("--kernels", choices=("compiled", "fp8"), default="compiled")
    ap.add_argument("--max-graphs", type=int, default=12, help="graph cap of the planned table")
    ap.add_argument("--steps", type=int, default=28, help="denoising steps the table is planned for")
    ap.add_argument("--starts", type=int, default=2, help="starts in a row: the first cold, the rest warm")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: the tests' tiny config, fp32")
    ap.add_argument("--scratch", help="folder for the checkpoint, config and cache (default: a temp dir)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound on one start")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--commit", help="git commit to record")
    ap.add_argument("--cold-by", choices=("start", "bcg-warm"), default="start",
                    help="fill the cache by a first start, or by `bcg warm` ahead (every start then warm)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child)), flush=True)
        return 0

    import bench_families
    import torch

    spec = bench_families.bench_models(args.tiny)[args.model]
    scratch = Path(tempfile.mkdtemp(prefix="bcg-warm-", dir=args.scratch))
    result = dict(benchmark="warm_start", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  commit=args.commit, torch=torch.__version__, command=" ".join(["python", *sys.argv]),
                  gpu=torch.cuda.get_device_name() if args.device == "cuda" else None, model=args.model,
                  kernels=args.kernels, max_graphs=args.max_graphs, steps=args.steps, starts=[])
    try:
        folder = scratch / "checkpoint"
        dtype = torch.float32 if args.tiny else torch.bfloat16
        t0 = time.perf_counter()
        result["built"] = bench_families.build_checkpoint(spec, folder, torch.device(args.device), dtype)
        result["built"]["build_save_s"] = round(time.perf_counter() - t0, 1)
        config = write_config(folder, scratch, args)
        result["buckets"] = __import__("yaml").safe_load(config.read_text())["buckets"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        if args.cold_by == "bcg-warm":
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "deployments.cli.main", "warm", "--config", str(config)],
                                  capture_output=True, text=True, timeout=args.timeout_s, env=env)
            result["bcg_warm"] = dict(wall_s=round(time.perf_counter() - t0, 2), rc=proc.returncode,
                                      output=proc.stdout[-4000:], error=proc.stderr[-2000:] if proc.returncode else "")
            print(f"bcg warm: exit {proc.returncode} in {result['bcg_warm']['wall_s']} s", flush=True)
        for i in range(args.starts):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--child", str(config)], capture_output=True, text=True,
                                  timeout=args.timeout_s, env=env)
            wall = round(time.perf_counter() - t0, 2)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                result["starts"].append(dict(start=i, wall_s=wall, error=proc.stderr[-3000:]))
                print(proc.stderr[-3000:], file=sys.stderr)
                break
            cold = i == 0 and args.cold_by == "start"
            row = dict(start=i, phase="cold" if cold else "warm", wall_s=wall,
                       **json.loads(lines[-1][7:]))
            result["starts"].append(row)
            k = row["kernels"]
            print(f"start {i} ({row['phase']}): ready in {row['ready_s']} s (process wall {wall} s; import "
                  f"{row['import_s']} s, weights {row['load_s']} s, {row['graphs']} graphs prepared in "
                  f"{row['prepare_s']} s), cache {k['start']}: {k['cache_hits']} hits, {k['cache_misses']} misses, "
                  f"{len(row['on_eager'])} buckets on eager kernels, precompiled blocks {k.get('precompiled')}",
                  flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["starts"] and all("error" not in s for s in result["starts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
