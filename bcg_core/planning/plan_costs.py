"""The cost model of the table search and the score of a table on a traffic sample.

Costs (:class:`PlanCosts`): the token-count model of :meth:`~bcg_core.costs.CostModel.token_model` (a forward
costs ``launch + tokens x ms_per_token``; a graph replay a tenth of the eager launch), or the same line fitted
by least squares to measured bucket times (:func:`costs_from_profile`: ``bcg profile --json`` output). Graph
memory: one shared pool, captured largest first, grows to about its largest graph (docs/DESIGN.md section 3),
so the table's pool is estimated as its largest bucket's :func:`bcg_core.models.estimate_graph_bytes` (the
activation factor measured on the H200), or the fitted bytes of a profile.

Objective (:func:`evaluate`, a :class:`TableScore`): the expected GPU milliseconds per real image on that traffic,

    sum_r w_r * steps_r * step_ms(r)  /  sum_r w_r * n_r

where ``step_ms(r)`` is one denoising step of request ``r``'s rows as the step scheduler would run them on the
table: its shape's bucket (the smallest image tier and text bucket that hold it, :class:`~bcg_core.table.
BucketTable`), its rows split, filled or padded across the shape's batch buckets or run unpadded and eager by the
cost model's dynamic program (:meth:`~bcg_core.costs.CostModel.choose`, here with the plain minimum so that more
buckets never cost more), and a request no bucket holds (image or text miss) at its unpadded eager time. Every
request is costed with its own rows alone, as at light load: under load the scheduler fills buckets with rows
of several requests, which can only lower the cost of a table whose batch buckets are larger. Padded-token
waste is the share of the computed tokens that are padding (image tiers, text buckets and pad rows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from bcg_core.config import EngineConfig
from bcg_core.keys import BucketKey
from bcg_core.planning.samples import Traffic
from bcg_core.table import BucketTable

__all__ = ["COMPILED_HIT_GAIN", "PlanCosts", "TableScore", "costs_from_profile", "evaluate"]

COMPILED_HIT_GAIN = 1.25
"""How many times faster a bucket forward runs with compiled kernels (``runner.kernels: compiled``, ``fp8`` or
``auto`` on a GPU) than the same tokens on eager kernels, which every miss runs: the token-count model's
``eager_ms_per_token`` is ``ms_per_token`` times this. Measured per transformer forward in a graph on an H200
(docs/BENCHMARKS.md, 2026-12-02, compiled kernels per forward): 1.15x to 1.42x across FLUX.1-dev, SD3-medium and
PixArt-Sigma shapes, median 1.30x; 1.25x sits below the median. It overprices PixArt-Sigma's misses (1.15-1.22x
there) by up to 9% and underprices the wider models'; ``bcg plan --measure`` fits both from this GPU instead.
``fp8`` is priced as ``compiled`` (it gains nothing more at PixArt-Sigma's and SANA's widths, 2026-12-04)."""


@dataclass(frozen=True)
class PlanCosts:
    """Milliseconds and graph bytes of forwards, as lines in the tokens of a forward.

    ``graph_ms = graph_launch_ms + tokens * ms_per_token``; ``eager_ms = eager_launch_ms + tokens *
    eager_ms_per_token`` (unpadded tokens; ``eager_ms_per_token`` None: ``ms_per_token``); ``graph_bytes =
    bytes_per_token * tokens``. ``tokens`` is :attr:`BucketKey.tokens`:
    rows x (image + text tokens).

    Attributes:
        source: ``"token-count"`` (the stand-in of :meth:`bcg_core.costs.CostModel.token_model`) or
            ``"profile"`` (fitted to measured times, :func:`costs_from_profile`).
    """

    graph_launch_ms: float = 0.5
    eager_launch_ms: float = 5.0
    ms_per_token: float = 1e-3
    bytes_per_token: float = 0.0
    source: str = "token-count"
    eager_ms_per_token: float | None = None

    @classmethod
    def token_count(cls, config: EngineConfig, graphs: bool | None = None) -> PlanCosts:
        """The token-count stand-in of the replicas' own cost model (:meth:`bcg_core.costs.CostModel.token_model`),
        with graph bytes from the model's width and dtype (:func:`bcg_core.models.estimate_graph_bytes`: the
        activation factor measured on the H200).

        With compiled kernels on a GPU (``runner.kernels`` ``compiled``, ``fp8`` or ``auto``, and ``model.device``
        not ``cpu``; under either runner mode), a miss's unpadded forward costs :data:`COMPILED_HIT_GAIN` times a
        bucket's per token: misses always run eager kernels, so a table that holds more of the traffic gains that.

        Args:
            config: the model (width, dtype) and runner.
            graphs: whether bucket forwards are graph replays (a tenth of the eager launch); None: unless the
                config runs eager (``runner.mode: eager``, or ``model.device: cpu`` where ``auto`` means eager).
        """
        from bcg_core.models import ACTIVATION_FACTOR, transformer_width

        if graphs is None:
            graphs = config.runner.mode == "graph" or (config.runner.mode == "auto" and config.model.device != "cpu")
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[config.model.dtype]
        launch = cls.eager_launch_ms
        compiled = config.runner.kernels != "eager" and config.model.device != "cpu"  # graph or eager runner
        return cls(graph_launch_ms=launch / 10 if graphs else launch,
                   bytes_per_token=ACTIVATION_FACTOR * transformer_width(config.model.path) * dtype_bytes,
                   eager_ms_per_token=cls.ms_per_token * COMPILED_HIT_GAIN if compiled else None,
                   source=("token-count" if graphs else "token-count (eager runner)")
                   + (" (compiled hits)" if compiled else ""))

    def graph_ms(self, key: BucketKey) -> float:
        """Expected milliseconds of one replay of bucket ``key``."""
        return self.graph_launch_ms + key.tokens * self.ms_per_token

    def eager_ms(self, tokens: int) -> float:
        """Expected milliseconds of one unpadded eager forward of ``tokens`` tokens."""
        per = self.ms_per_token if self.eager_ms_per_token is None else self.eager_ms_per_token
        return self.eager_launch_ms + tokens * per

    def graph_bytes(self, key: BucketKey) -> int:
        """Expected graph-pool bytes of bucket ``key``'s capture."""
        return int(self.bytes_per_token * key.tokens)

    def lines(self) -> dict[str, float]:
        """The numbers of the model (``buckets.plan.cost_lines``; :meth:`from_lines` rebuilds it)."""
        out = {"graph_launch_ms": self.graph_launch_ms, "eager_launch_ms": self.eager_launch_ms,
               "ms_per_token": self.ms_per_token, "bytes_per_token": self.bytes_per_token}
        if self.eager_ms_per_token is not None:
            out["eager_ms_per_token"] = self.eager_ms_per_token
        return out

    @classmethod
    def from_lines(cls, lines: Mapping[str, float], source: str) -> PlanCosts:
        """The model of :meth:`lines`."""
        return cls(**{k: float(v) for k, v in lines.items()}, source=source)

    def describe(self) -> dict:
        """JSON of the model, for the plan report."""
        return {"source": self.source, "graph_launch_ms": self.graph_launch_ms, "eager_launch_ms": self.eager_launch_ms,
                "ms_per_token": self.ms_per_token, "eager_ms_per_token": self.eager_ms_per_token,
                "bytes_per_token": self.bytes_per_token}


def costs_from_profile(rows: Sequence[Mapping], fallback: PlanCosts) -> PlanCosts:
    """Lines fitted by least squares to measured buckets: ``bcg profile --json`` rows with ``key`` (a bucket key
    string), ``graph_ms``, ``eager_ms`` and optionally ``pool_bytes``: one line for replays, one for eager
    forwards (intercepts and slopes clamped at 0), and the largest per-token pool growth for graph bytes.

    Args:
        rows: at least two buckets of different token counts.
        fallback: the byte model kept when no row has ``pool_bytes``.

    Raises:
        ValueError: fewer than two distinct token counts, or a row without its fields (naming it).
    """
    pts = []
    for i, r in enumerate(rows):
        try:
            pts.append((BucketKey.parse(str(r["key"])).tokens, float(r["graph_ms"]), float(r["eager_ms"]),
                        r.get("pool_bytes")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"profile row {i}: needs key, graph_ms and eager_ms ({e})") from None
    if len({p[0] for p in pts}) < 2:
        raise ValueError("a profile needs buckets of at least two token counts to fit costs to; profile more buckets")

    def fit(xs, ys):
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        return max(0.0, my - slope * mx), max(0.0, slope)

    xs = [p[0] for p in pts]
    g0, gs = fit(xs, [p[1] for p in pts])
    e0, es = fit(xs, [p[2] for p in pts])
    # a capture's pool_bytes is how much it grew the shared pool: the largest bucket (captured first) grew it by
    # its whole activation peak, smaller ones mostly reuse it, so the largest per-token growth is the estimate
    with_bytes = [float(p[3]) / p[0] for p in pts if p[3]]
    bpt = max(with_bytes) if with_bytes else fallback.bytes_per_token
    return PlanCosts(graph_launch_ms=g0, eager_launch_ms=e0, ms_per_token=gs, eager_ms_per_token=es,
                     bytes_per_token=bpt, source="profile")


# -- evaluation --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TableScore:
    """What a table is expected to cost on a traffic sample.

    Attributes:
        ms_per_image: expected GPU milliseconds of denoising per real image (the objective).
        waste: padded tokens / computed tokens, 0..1.
        graphs: buckets of the table (captured graphs).
        pool_bytes: expected graph-pool bytes (its largest graph).
        miss_share: share of the requests no bucket holds (run unpadded and eager: planned, counted).
        shares: per bucket shape (and ``"miss"``): ``share`` of the requests it serves, its padded-token
            ``waste`` and ``work``, its share of all computed tokens.
    """

    ms_per_image: float
    waste: float
    graphs: int
    pool_bytes: int
    miss_share: float
    shares: dict[str, dict[str, float]]


def _step(costs: PlanCosts, rows: int, keys: Sequence[BucketKey], per_row: int) -> tuple[float, int]:
    """``(ms, computed tokens)`` of ``rows`` rows of ``per_row`` real tokens each on one shape's ``keys``: the cost
    model's dynamic program with the plain minimum (fill, pad, split, or unpadded eager chunks of the real tokens);
    ``keys`` sorted by batch."""
    best: list[tuple[float, int]] = [(0.0, 0)] + [(math.inf, 0)] * rows
    largest = keys[-1].batch
    for r in range(1, rows + 1):
        for c in range(1, min(r, largest) + 1):
            k = next(k for k in keys if k.batch >= c)
            ms, tok = best[r - c]
            for cand in ((ms + costs.graph_ms(k), tok + k.tokens),
                         (ms + costs.eager_ms(c * per_row), tok + c * per_row)):
                if cand[0] < best[r][0] - 1e-12:
                    best[r] = cand
    return best[rows]


def evaluate(table: BucketTable, traffic: Traffic, costs: PlanCosts, memo: dict | None = None,
             miss_penalty: float = 1.0) -> TableScore:
    """The expected cost of ``table`` on ``traffic`` (module docstring); ``memo`` keeps step costs across calls
    with the same ``costs`` (the search evaluates many tables that share shapes); a miss costs ``miss_penalty``
    times its eager time (the search under ``miss_policy: reject``, where a miss is a refused request)."""
    by_shape: dict[str, list[BucketKey]] = {}
    for k in table.keys:
        by_shape.setdefault(k.shape, []).append(k)
    for v in by_shape.values():
        v.sort(key=lambda k: k.batch)
    total_ms = images = real = computed = miss = 0.0
    shares: dict[str, dict[str, float]] = {}
    memo = {} if memo is None else memo
    for d in traffic.demands:
        q = d.query
        probe = table.lookup(replace(q, batch=min(q.batch, table.batch_sizes[-1])))
        real_tok = q.tokens
        if probe.hit:
            shape = probe.key.shape
            keys = by_shape[shape]
            per_row = q.tokens_per_row
            mk = (tuple(k.batch for k in keys), keys[0].image_tokens, keys[0].text_tokens, q.batch, per_row)
            m = memo.get(mk)
            if m is None:
                m = memo[mk] = _step(costs, q.batch, keys, per_row)
            ms, tok = m
        else:
            shape = "miss"
            ms, tok = costs.eager_ms(real_tok) * miss_penalty, real_tok
            miss += d.weight
        total_ms += d.weight * d.steps * ms
        images += d.weight * d.images
        real += d.weight * d.steps * real_tok
        computed += d.weight * d.steps * tok
        s = shares.setdefault(shape, {"requests": 0.0, "real": 0.0, "computed": 0.0})
        s["requests"] += d.weight
        s["real"] += d.weight * d.steps * real_tok
        s["computed"] += d.weight * d.steps * tok
    reqs = traffic.requests or 1.0
    out = {sh: {"share": v["requests"] / reqs, "waste": 1 - v["real"] / v["computed"] if v["computed"] else 0.0,
                "work": v["computed"] / computed if computed else 0.0}
           for sh, v in sorted(shares.items())}
    pool = max((costs.graph_bytes(k) for k in table.keys), default=0)
    return TableScore(total_ms / images if images else 0.0, 1 - real / computed if computed else 0.0,
                      len(table), pool, miss / reqs, out)

