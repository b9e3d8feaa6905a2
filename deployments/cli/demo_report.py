"""The demo's closing report: the replica's per-bucket table, the failures and a one-line summary.

:func:`render_report` prints, with rich, the ``GET /v1/buckets`` answer (used buckets with their requests,
hits, misses, padding waste and latency; misses by dimension) and the outcome of the replayed requests
(:class:`~deployments.cli.demo_replay.DemoResult`). It only prints: nothing is fetched or decided here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .demo_replay import DemoResult, _plural

__all__ = ["render_report"]


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def render_report(stats: Mapping[str, Any] | None, results: list[DemoResult], wall_s: float,
                  out_dir: Path, console: Any) -> None:
    """Print the per-bucket table, the failures and the one-line summary with rich.

    Args:
        stats: ``GET /v1/buckets`` answer, or None when it could not be fetched.
        results: one per request.
        wall_s: wall time of the replay, seconds.
        out_dir: where the images went.
        console: a ``rich.console.Console``.
    """
    from rich.table import Table

    if stats is not None:
        buckets = stats.get("buckets", [])
        used = [b for b in buckets if b.get("requests")]
        model = stats.get("model", {}).get("name", "?")
        policy = stats.get("table", {}).get("miss_policy", "?")
        modes = Counter(str(b.get("mode") or "?") for b in buckets)
        table = Table(title=f"Buckets of the replica (model {model}; counts since the server started)",
                      caption=f"{len(buckets)} buckets in the table ({', '.join(f'{m} {k}' for m, k in modes.items())}"
                              f"), {len(buckets) - len(used)} unused not shown; miss policy: {policy}")
        table.add_column("bucket", no_wrap=True)
        for name in ("requests", "hits", "misses", "padding waste %", "mean latency ms"):
            table.add_column(name, justify="right", min_width=min(len(name), 8))
        for b in used:
            hits = b.get("hits", 0)
            table.add_row(str(b.get("key")), str(b["requests"]), str(hits), str(b["requests"] - hits),
                          _fmt(b.get("padding_waste_pct")), _fmt(b.get("mean_latency_ms")))
        misses = stats.get("misses", {})
        missed = misses.get("requests", 0)
        by_dim = "".join(f"\n  {k} {v}" for k, v in misses.get("by_dim", {}).items())
        table.add_section()
        table.add_row(f"misses by dimension{by_dim}", str(missed), "0", str(missed), "0.0" if missed else "-",
                      _fmt(misses.get("mean_latency_ms") if missed else None),
                      style="yellow" if missed else None)
        console.print(table)
    else:
        console.print("[yellow]GET /v1/buckets failed: no bucket table to show[/yellow]")
    failed = [r for r in results if not r.ok]
    for r in failed:
        status = f"HTTP {r.status}" if r.status else "no answer"
        console.print(f"[red]failed[/red] {r.request.describe()}: {r.error or status}", highlight=False)
    retried = [r for r in results if r.retries]
    if retried:
        console.print(
            f"retried {_plural(len(retried), 'request')} after 503 Retry-After "
            f"({_plural(sum(r.retries for r in retried), 'retry', 'retries')}, "
            f"{sum(r.retry_wait_s for r in retried):.1f} s waited)", highlight=False)
    images = sum(len(r.files) for r in results)
    console.print(
        f"{_plural(len(results), 'request')} ({len(results) - len(failed)} ok, {len(failed)} failed), "
        f"{_plural(images, 'image')} in {wall_s:.1f} s wall -> {out_dir}/", highlight=False)
