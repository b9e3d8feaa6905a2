"""The ``bcg`` command line: ``bcg demo``, ``bcg config``, ``bcg serve``, ``bcg verify``, ``bcg profile``,
``bcg plan``.

The console script of ``pyproject.toml`` (``bcg = "deployments.cli.main:main"``), also run as
``python -m deployments.cli.main``.
``demo`` replays real requests (:mod:`deployments.cli.demo`), ``serve`` runs the local server until stopped
(:mod:`deployments.cli.serve_command`), ``verify`` and ``profile`` print tables of the engine's correctness gates and
timings (:mod:`deployments.cli.commands`), ``plan`` chooses the bucket table from traffic
(:mod:`bcg_core.planning.table_search`), ``config`` prints the embedded default ``ServeConfig``.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence

from pydantic import BaseModel

from ..settings import ServeConfig, error_text, load_config
from .commands import cache_dir_arg, run_profile, run_verify
from .demo import MAX_CONCURRENCY as _MAX_CONCURRENCY, demo_api_key, run_demo
from .serve_command import run_serve

__all__ = ["config_text", "main"]

_MAX_REQUESTS = 998  # rows in the data file


def _bounded_int(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"{value} is out of range ({allowed})")
        return value

    return parse


def _positive_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{value} must be a positive finite number")
    return value


def _yaml_lines(model: BaseModel, indent: int) -> list[str]:
    """YAML for ``model``, one key per line, each preceded by its field description as a comment."""
    pad = " " * indent
    lines: list[str] = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        doc = info.description
        if doc is None and isinstance(value, BaseModel):
            doc = (type(value).__doc__ or "").strip().split("\n\n")[0]
        if doc:
            doc = " ".join(doc.split())
            lines += textwrap.wrap(doc, width=104 - indent, initial_indent=pad + "# ",
                                   subsequent_indent=pad + "# ")
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines += _yaml_lines(value, indent + 2)
        else:
            # JSON scalars and flow lists are valid YAML.
            lines.append(f"{pad}{name}: {json.dumps(value.value if hasattr(value, 'value') else value)}")
    return lines


def config_text(config: ServeConfig | None = None, fmt: str = "yaml") -> str:
    """A ServeConfig as an editable YAML (with field descriptions as comments) or JSON document.

    Args:
        config: the configuration; None for the embedded default ``ServeConfig()``.
        fmt: ``"yaml"`` or ``"json"``.

    Raises:
        ValueError: unknown ``fmt``.
    """
    config = ServeConfig() if config is None else config
    if fmt == "json":
        return json.dumps(config.model_dump(mode="json"), indent=2) + "\n"
    if fmt != "yaml":
        raise ValueError(f"format {fmt!r} is not one of 'yaml', 'json'")
    head = [
        "# bcg-serve configuration (ServeConfig); this is the embedded default.",
        "# Edit it, then: bcg demo --config FILE   or   bcg serve --config FILE",
    ]
    return "\n".join(head + _yaml_lines(config, 0)) + "\n"


def _cmd_config(args: argparse.Namespace) -> int:
    if args.check:
        from .local import check_file

        print(check_file(args.check))
        return 0
    sys.stdout.write(config_text(fmt=args.format))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(requests=args.requests, steps=args.steps, concurrency=args.concurrency, out=args.out,
                    port=args.port, url=args.url, config=args.config, timeout_s=args.timeout_s,
                    num_cpus=args.num_cpus, quiet=not args.verbose, api_key_file=args.api_key_file)


def _load(path: str | None) -> ServeConfig:
    return load_config(config_path=path) if path else ServeConfig()


def _cmd_verify(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if args.kernels:
        config = config.model_copy(update={"runner": config.runner.model_copy(update={"kernels": args.kernels})})
    return 0 if run_verify(config, args.bucket, args.rtol) else 1


def _cmd_warm(args: argparse.Namespace) -> int:
    from .commands import run_warm

    config = _load(args.config)
    update = {k: v for k, v in (("kernels", args.kernels), ("compile_cache_dir", args.cache_dir)) if v}
    if update:
        config = config.model_copy(update={"runner": config.runner.model_copy(update=update)})
    k = run_warm(config)
    return 0 if k["compile_failed"] == 0 else 1


def _cmd_profile(args: argparse.Namespace) -> int:
    try:
        run_profile(_load(args.config), args.bucket, args.iters, json_path=args.json)
    except RuntimeError as exc:
        print(f"bcg profile: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from .plan_command import current_is_better, output_problem, plot_plan, run_plan

    if args.force and not args.write:
        print("bcg plan: error: --force goes with --write (it writes a planned table that is expected to cost no "
              "less than the current one)", file=sys.stderr)
        return 2
    if args.trace and args.traffic != "gentd26":
        print("bcg plan: error: --trace is a GenTD26-style trace: give it with --traffic gentd26", file=sys.stderr)
        return 2
    if args.source and (args.trace or args.traffic != "krea" or args.krea):
        print("bcg plan: error: --from replaces --traffic/--trace/--krea: give one traffic source", file=sys.stderr)
        return 2
    if args.api_key_file and not (args.source or "").startswith(("http://", "https://")):
        print("bcg plan: error: --api-key-file is sent to a server: give it with --from URL", file=sys.stderr)
        return 2
    source = args.source or ("gentd26" if args.traffic == "gentd26" and not args.trace else
                             f"gentd26:{args.trace}" if args.traffic == "gentd26" else args.traffic)
    for flag, path in (("--write", args.write), ("--json", args.json), ("--plot", args.plot)):
        if path and (problem := output_problem(flag, path)):  # before the search, not after it
            print(f"bcg plan: error: {problem}", file=sys.stderr)
            return 2
    try:
        config = _load(args.config)
        # as bcg demo: the file's first key, else OPENAI_API_KEY (a URL source only sends it)
        key = demo_api_key(args.api_key_file)[0] if source.startswith(("http://", "https://")) else None
        plan, default = run_plan(config, source, args.budget_mib, args.max_graphs, args.profile, args.steps, args.krea,
                                 measure=args.measure, api_key=key)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"bcg plan: error: {error_text(exc)}", file=sys.stderr)
        return 2
    keep = current_is_better(plan, default)
    status = 0
    if args.write and keep and not args.force:
        print(f"bcg plan: not writing {args.write}: the current table is expected to cost {default.ms_per_image:.2f} "
              f"ms per image, the planned one {plan.score.ms_per_image:.2f}; add --force to write the planned table "
              f"anyway", file=sys.stderr)
        status = 1
    elif args.write:
        planned = config.model_copy(update={"buckets": plan.buckets})
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(config_text(planned, "json" if args.write.endswith(".json") else "yaml"))
        print(f"wrote {args.write}" + (" (--force: the current table is expected to be as good or better)"
                                       if keep else ""))
    if args.json:
        report = plan.to_json()
        report["current"] = {"graphs": default.graphs, "ms_per_image": round(default.ms_per_image, 4),
                             "waste": round(default.waste, 5), "miss_share": round(default.miss_share, 5),
                             "at_least_as_good": keep}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_plan(plan, args.plot)
        print(f"wrote {args.plot}")
    return status


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bcg",
        description="bcg-serve: Diffusion Transformer image generation on Ray Serve with Bucketed CUDA "
        "Graphs (BCG).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="start the app, replay real requests over HTTP, print the bucket table",
                       description="Start Ray and the Serve app on 127.0.0.1 (or use --url), send the first "
                       "N requests of bcg_core/data/krea_open_prompts_1k_flat.csv, write the PNGs, and "
                       "print GET /v1/buckets as a table. Exit status 1 if any request failed.")
    d.add_argument("--requests", type=_bounded_int(1, _MAX_REQUESTS), default=8, metavar="N",
                   help="requests to send, from the top of the data file (default 8)")
    d.add_argument("--steps", type=_bounded_int(1), default=4, metavar="S",
                   help="num_inference_steps of each request (default 4)")
    d.add_argument("--concurrency", type=_bounded_int(1, _MAX_CONCURRENCY), default=1, metavar="C",
                   help=f"requests in flight at once, 1..{_MAX_CONCURRENCY} (default 1)")
    d.add_argument("--out", default="out/demo", metavar="DIR", help="folder for the PNGs (default out/demo)")
    d.add_argument("--port", type=_bounded_int(0, 65535), default=0, metavar="P",
                   help="port of the local server on 127.0.0.1 (default 0: a free port)")
    d.add_argument("--url", default=None, metavar="URL",
                   help="use a running server at URL (e.g. http://127.0.0.1:8000) instead of starting one")
    d.add_argument("--config", default=None, metavar="PATH",
                   help="ServeConfig YAML/JSON for the local server (default: the embedded default; "
                   "see `bcg config`)")
    d.add_argument("--timeout-s", type=_positive_float, default=600.0, metavar="T",
                   help="bound on each HTTP request in seconds (default 600)")
    d.add_argument("--num-cpus", type=_bounded_int(2), default=4, metavar="K",
                   help="logical CPUs of the local Ray instance (default 4)")
    d.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="for a server with API keys: send the file's first key as 'Authorization: Bearer <key>' "
                   "(default: the OPENAI_API_KEY environment variable when set, as the openai client reads it; "
                   "this flag wins over it)")
    d.add_argument("--verbose", action="store_true", help="show Ray's and the replicas' logs")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("config", help="print the embedded default ServeConfig (YAML or JSON) to edit",
                       description="Print the embedded default ServeConfig. Save it, edit it, and pass it "
                       "with --config to `bcg demo` or `bcg serve`.")
    c.add_argument("--format", choices=("yaml", "json"), default="yaml", help="output format (default yaml)")
    c.add_argument("--check", default=None, metavar="FILE",
                   help="check a ServeConfig file as bcg serve would, or a Serve config file (applications:) as "
                   "serve deploy's controller would build it, without starting Ray; exit 2 on a mistake")
    c.set_defaults(func=_cmd_config)

    s = sub.add_parser("serve", help="start the app on 127.0.0.1 and block until Ctrl-C",
                       description="Start Ray and the bcg-serve application on 127.0.0.1:PORT and serve "
                       "until Ctrl-C (or SIGTERM).")
    s.add_argument("--config", default=None, metavar="PATH", help="ServeConfig YAML/JSON (default: embedded)")
    s.add_argument("--port", type=_bounded_int(0, 65535), default=8000, metavar="P",
                   help="HTTP port on 127.0.0.1 (default 8000; 0 picks a free one)")
    s.add_argument("--num-cpus", type=_bounded_int(2), default=4, metavar="K",
                   help="logical CPUs of the local Ray instance (default 4)")
    s.add_argument("--replicas", type=_bounded_int(1, 64), default=None, metavar="N",
                   help="DiT replicas (one per GPU; default 1); they split the bucket shapes between them. Not with "
                   "autoscaling.enabled in the config, whose min/max_replicas then set the count")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="ask for one of the API keys in this file (one a line, '#' comments) as 'Authorization: "
                   "Bearer <key>' on every /v1/ route; added to the config's auth.api_keys (held as SHA-256 digests)")
    s.add_argument("--metrics-port", type=_bounded_int(0, 65535), default=None, metavar="P",
                   help="Prometheus port of Ray's metrics exporter (default: the config's metrics.port, 8080; 0 picks "
                   "a free one); its URL is printed when the server is ready")
    s.add_argument("--metrics-host", choices=("127.0.0.1", "0.0.0.0"), default=None,
                   help="where the local Ray node and its metrics exporter listen (default: the config's "
                   "metrics.host, 127.0.0.1: loopback only; 0.0.0.0: Ray's Linux default, every interface)")
    s.add_argument("--stop-after-s", type=_positive_float, default=None, metavar="T",
                   help="stop by itself T seconds after it is ready (default: run until Ctrl-C)")
    s.add_argument("--verbose", action="store_true", help="show Ray's and the replicas' logs")
    s.set_defaults(func=run_serve)

    v = sub.add_parser("verify", help="check every bucket against an unpadded eager run (pass/fail per bucket)",
                       description="Load the model, build the runner the config asks for (CUDA graphs on a "
                       "GPU), run each bucket's boundary shapes (the bucket size, one below, the smallest "
                       "request that maps to it) padded and unpadded, and print the max relative error and "
                       "pass or fail per bucket. Exit status 1 if any bucket fails. On stderr: a progress bar per "
                       "bucket and, after the first few buckets, an estimate of the total time (measured seconds "
                       "per token times the tokens left); the whole table on a CPU takes minutes, one bucket "
                       "(--bucket KEY) seconds.")
    v.add_argument("--config", default=None, metavar="PATH", help="ServeConfig YAML/JSON (default: embedded)")
    v.add_argument("--bucket", action="append", metavar="KEY",
                   help="check only this bucket (e.g. b2_i1024_t256; a quick check); repeatable; default: all")
    v.add_argument("--rtol", type=_positive_float, default=None,
                   help="relative tolerance (default: the dtype's padding tolerance, 1e-5 for float32, 1e-2 for "
                   "float16 and 2e-2 for bfloat16 (bcg_core/verify.py RTOL), plus with compiled kernels the tier's "
                   "own, runner.compile_rtol or derived at start)")
    v.add_argument("--kernels", choices=("eager", "compiled", "fp8"), default=None,
                   help="check this kernel tier instead of the config's runner.kernels")
    v.set_defaults(func=_cmd_verify)

    w = sub.add_parser("warm", help="compile every bucket ahead and fill the on-disk compile cache",
                       description="Load the model and prepare every bucket of the config's table with its compiled "
                       "kernels (runner.kernels 'compiled', 'fp8', or 'auto' on a GPU; --kernels overrides), as a "
                       "replica does at start: compile, check against eager kernels, capture on a GPU. The kernels "
                       "land in runner.compile_cache_dir (--cache-dir overrides; default inductor's folder), so that a "
                       "replica started later with the same model, table, torch and GPU reads them back. Prints "
                       "what each bucket got and the cache hits and misses.")
    w.add_argument("--config", default=None, metavar="PATH", help="ServeConfig YAML/JSON (default: embedded)")
    w.add_argument("--cache-dir", type=cache_dir_arg, default=None, metavar="DIR",
                   help="the compile cache folder to fill (made if its parent folder exists)")
    w.add_argument("--kernels", choices=("compiled", "fp8"), default=None,
                   help="the tier to compile instead of the config's runner.kernels")
    w.set_defaults(func=_cmd_warm)

    pr = sub.add_parser("profile", help="per bucket: kernels, eager ms, graph ms, kernel-busy ms, verdict (CUDA)",
                        description="Time each bucket at its exact size on a CUDA GPU: kernels per step, eager "
                        "ms, graph replay ms, kernel-busy ms (sum of kernel times), and whether graphs pay.")
    pr.add_argument("--config", default=None, metavar="PATH", help="ServeConfig YAML/JSON (default: embedded)")
    pr.add_argument("--bucket", action="append", metavar="KEY", help="profile only this bucket; repeatable")
    pr.add_argument("--iters", type=_bounded_int(1, 1000), default=10, help="timed iterations (default 10)")
    pr.add_argument("--json", default=None, metavar="PATH",
                    help="also write the rows (with each bucket's pool bytes) as JSON, for `bcg plan --profile`")
    pr.set_defaults(func=_cmd_profile)

    pl = sub.add_parser("plan", help="choose the bucket table from real traffic under a graph-memory budget",
                        description="Plan the buckets section (resolution tiers, text lengths, batch rows) for a "
                        "traffic sample: the packaged krea CSV (default), the packaged GenTD26 burst or a GenTD26-"
                        "style CSV (image counts joined with krea sizes), or a running server's recorded shape "
                        "histogram (--from URL) or an exported one (--from FILE). The objective is the expected GPU "
                        "time per image (bcg_core/planning/table_search.py); costs measured on this GPU (--measure), "
                        "from a `bcg profile --json` file, else the token-count model. Prints the chosen buckets with "
                        "their share of requests and waste, request counts rounded to whole requests, and whether the "
                        "current table is already as good or better (then --write needs --force).")
    pl.add_argument("--config", default=None, metavar="PATH",
                    help="ServeConfig YAML/JSON: the model, limits and current table (default: embedded)")
    pl.add_argument("--traffic", choices=("krea", "gentd26"), default="krea", help="packaged sample (default krea)")
    pl.add_argument("--trace", default=None, metavar="CSV", help="with --traffic gentd26: a GenTD26-style CSV")
    pl.add_argument("--krea", default=None, metavar="CSV", help="a krea-format CSV instead of the packaged one")
    pl.add_argument("--from", dest="source", default=None, metavar="URL|FILE",
                    help="a server's recorded traffic (http://HOST:PORT) or an exported histogram / /v1/buckets JSON")
    pl.add_argument("--budget-mib", type=_positive_float, default=None, metavar="MIB",
                    help="graph-memory budget of one replica's shared pool in MiB (default: none)")
    pl.add_argument("--max-graphs", type=_bounded_int(1, 4096), default=12, metavar="N",
                    help="most graphs per replica (default 12)")
    pl.add_argument("--profile", default=None, metavar="JSON", help="measured bucket costs (`bcg profile --json`)")
    pl.add_argument("--api-key-file", default=None, metavar="PATH",
                    help="with --from URL: a file whose first key is sent to a server with API keys (default: the "
                    "OPENAI_API_KEY environment variable when set, as bcg demo)")
    pl.add_argument("--measure", action="store_true",
                    help="profile a few buckets of the sample on this machine's CUDA GPU and plan with the fitted "
                    "costs (needs the model's weights and a GPU)")
    pl.add_argument("--steps", type=_bounded_int(1), default=None, metavar="S",
                    help="every request's denoising steps instead of the sample's")
    pl.add_argument("--write", default=None, metavar="PATH",
                    help="write the config with the planned buckets; not when the current table is expected to cost "
                    "as little or less per image (then exit status 1) unless --force")
    pl.add_argument("--force", action="store_true",
                    help="with --write: write the planned table even when the current one is expected to be as good "
                    "or better (e.g. for its fewer graphs)")
    pl.add_argument("--json", default=None, metavar="PATH", help="write the machine-readable report")
    pl.add_argument("--plot", default=None, metavar="PNG",
                    help="plot GPU time and waste against graph count (png, svg, pdf: a format matplotlib writes)")
    pl.set_defaults(func=_cmd_plan)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``bcg`` command line.

    Args:
        argv: arguments without the program name; None reads ``sys.argv``.

    Returns:
        The process exit status (2 for bad arguments or a bad configuration).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, TimeoutError) as exc:
        print(f"bcg {args.command}: error: {error_text(exc)}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # e.g. Ray cannot bind the port, or a replica failed to start
        print(f"bcg {args.command}: error: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"bcg {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
