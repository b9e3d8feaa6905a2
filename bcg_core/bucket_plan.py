"""The bucket planner: choose the bucket table from real traffic, under a graph-memory budget and a graph cap.

Input: a traffic sample (:class:`Demand` rows: each an exact forward shape with its images, steps and weight in
requests), from the packaged krea CSV (:func:`traffic_from_rows` over :func:`krea_rows`), a GenTD26-style trace
(:func:`traffic_from_gentd26`: image counts, steps and prompt lengths, joined with krea sizes) or a replica's
recorded shape histogram (:func:`traffic_from_histogram`, a :class:`~bcg_core.traffic.TrafficHistogram`
snapshot). Output: the ``buckets`` section of a ServeConfig (:attr:`BucketPlan.buckets`).

Objective (:func:`evaluate`): the expected GPU milliseconds per real image on that traffic,

    sum_r w_r * steps_r * step_ms(r)  /  sum_r w_r * n_r

where ``step_ms(r)`` is one denoising step of request ``r``'s rows as the step scheduler would run them on the
table: its shape's bucket (the smallest image tier and text bucket that hold it, :class:`~bcg_core.buckets.
BucketTable`), its rows split, filled or padded across the shape's batch buckets or run unpadded and eager by the
cost model's dynamic program (:meth:`~bcg_core.costs.CostModel.plan`, here with the plain minimum so that more
buckets never cost more), and a request no bucket holds (image or text miss) at its unpadded eager time. Every
request is costed with its own rows alone, as at light load: under load the scheduler fills buckets with rows
of several requests, which can only lower the cost of a table whose batch buckets are larger. Padded-token
waste is the share of the computed tokens that are padding (image tiers, text buckets and pad rows).

Costs (:class:`PlanCosts`): the token-count model of :meth:`~bcg_core.costs.CostModel.token_model` (a forward
costs ``launch + tokens x ms_per_token``; a graph replay a tenth of the eager launch), or the same line fitted
by least squares to measured bucket times (:func:`costs_from_profile`: ``bcg profile --json`` output). Graph
memory: one shared pool, captured largest first, grows to about its largest graph (docs/DESIGN.md section 3),
so the table's pool is estimated as its largest bucket's :func:`bcg_core.models.estimate_graph_bytes` (the
activation factor measured on the H200), or the fitted bytes of a profile.

Search (:func:`plan_buckets`): the best single bucket (one graph), then greedy growth: at each step the tier,
text bucket or batch size whose addition lowers the expected cost most per graph added, within the graph cap
and the memory budget, until nothing lowers it. Each table on the way is a point of the curve (graphs against
cost and waste); the chosen table is the cheapest point. The greedy path only adds buckets, so the cost never
rises with the graph count.
"""

from __future__ import annotations

import csv
import functools
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources

from .buckets import BucketKey, BucketTable, ShapeQuery, ShapeRules
from .config import BucketConfig, ModelConfig, PlannedTraffic, ServeConfig
from .errors import RequestError
from .planner import GenerationRequest, Planner

__all__ = ["BucketPlan", "Demand", "PlanCosts", "PlanPoint", "TableScore", "costs_from_profile", "drift_report", "evaluate",
           "krea_rows", "plan_buckets", "plan_matches", "profile_buckets", "planning_planner", "planning_table", "traffic_from_gentd26", "traffic_from_histogram", "traffic_from_requests",
           "traffic_from_rows"]

KREA_CSV = "krea_open_prompts_1k_flat.csv"
"""The packaged krea request mix (``bcg_core/data/README.md``): one row per image, ``num_generations`` per request."""

GENTD26_FILLER = ("a detailed photograph of a lighthouse on a rocky coast at dusk, dramatic clouds, warm light, "
                  "high resolution, sharp focus, ")
"""Text repeated and cut to a GenTD26 row's ``prompt_length`` characters (the trace has lengths, no text), so the
model's own tokenizer counts tokens for a prompt of that length."""


@dataclass(frozen=True)
class Demand:
    """One kind of request in a traffic sample.

    Attributes:
        query: the exact shape of one denoising step's forward (rows with CFG, image tokens or grid, text tokens),
            as :meth:`~bcg_core.planner.Planner.query` makes it.
        images: images per request.
        steps: denoising steps per request.
        weight: how many requests of this kind the sample holds (fractions allowed: a krea row is 1/n).
        size: the requested ``(width, height)`` in pixels.
    """

    query: ShapeQuery
    images: int
    steps: int
    weight: float
    size: tuple[int, int]


@dataclass
class Traffic:
    """A traffic sample: :class:`Demand` rows, what was refused (the limits' reason per row) and its source."""

    demands: list[Demand]
    source: str
    refused: dict[str, float] = field(default_factory=dict)

    @property
    def requests(self) -> float:
        """Requests in the sample (the weights' sum)."""
        return sum(d.weight for d in self.demands)

    def merged(self) -> Traffic:
        """The same sample with equal rows (query, images, steps, size) summed into one."""
        out: dict[tuple, Demand] = {}
        for d in self.demands:
            k = (d.query, d.images, d.steps, d.size)
            out[k] = replace(d, weight=out[k].weight + d.weight) if k in out else d
        return Traffic(list(out.values()), self.source, dict(self.refused))


def planning_planner(config: ServeConfig) -> Planner:
    """A :class:`~bcg_core.planner.Planner` of ``config``'s model and limits whose table holds every valid prompt
    (text bucket: the native length, else the family's encoder limit) and never rejects a miss: traffic is
    validated and shaped with it, independent of the table being planned.

    Raises:
        ValueError: the configured checkpoint cannot be described (naming it).
    """
    spec, counter = _spec_and_counter(config.model)
    native = spec.rules.native_text_tokens
    text = native if native is not None else (spec.max_text_tokens or max(config.buckets.text_lengths))
    wide = replace_buckets(config, text_lengths=[text], miss_policy="eager")
    return Planner(wide, spec, counter)


def planning_table(config: ServeConfig) -> BucketTable:
    """``config``'s own bucket table, as its replicas build it (to score the current table against a plan)."""
    return Planner(config, *_spec_and_counter(config.model)).table


@functools.lru_cache(maxsize=8)
def _spec_and_counter(model: ModelConfig):
    """The model's spec and token counter (JSON configs and tokenizer only), read once per model: planning and
    each drift check build several planners of one model."""
    from .models import describe_model, load_tokenizer_counter

    return describe_model(model), load_tokenizer_counter(model)


def replace_buckets(config: ServeConfig, **fields) -> ServeConfig:
    """``config`` with ``buckets`` fields replaced (validated again)."""
    return config.model_copy(update={"buckets": BucketConfig(**{**config.buckets.model_dump(), **fields})})


def krea_rows(path: str | None = None) -> list[dict[str, str]]:
    """Rows of the krea CSV: the packaged one (:data:`KREA_CSV`) or ``path``, as strings."""
    if path is None:
        text = resources.files("bcg_core").joinpath("data", KREA_CSV).read_text(encoding="utf-8")
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in ("width", "height") if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path or KREA_CSV} is not a krea-format CSV: its header {reader.fieldnames or []} lacks "
                         f"{missing}; give a CSV with the columns prompt, width, height, num_generations, num_step")
    return list(reader)


def _int(row: Mapping[str, str], name: str) -> int | None:
    v = (row.get(name) or "").strip()
    return int(float(v)) if v else None


def _float(row: Mapping[str, str], name: str) -> float | None:
    v = (row.get(name) or "").strip()
    return float(v) if v else None


def _demand(planner: Planner, request: GenerationRequest, weight: float, text_tokens: int | None,
            refused: dict[str, float]) -> Demand | None:
    """``request`` planned (validated, defaults filled, shaped); refusals counted by the field the limits name."""
    try:
        plan = planner.plan(request)
    except RequestError as e:
        refused[e.field] = refused.get(e.field, 0.0) + weight
        return None
    query = plan.lookup.query
    if text_tokens is not None and planner.rules.native_text_tokens is None:
        query = planner.query(plan.request, text_tokens)
    r = plan.request
    return Demand(query, r.n, r.num_inference_steps, weight, (r.width, r.height))


def traffic_from_rows(config: ServeConfig, rows: Iterable[Mapping[str, str]], source: str = "krea",
                      steps: int | None = None) -> Traffic:
    """Traffic from krea-format rows (``prompt``, ``width``, ``height``, ``num_generations``, ``num_step``,
    ``cfg_scale``): one row per image, so each weighs ``1 / num_generations`` of a request.

    Args:
        config: the model and limits (requests outside them are refused and counted, not planned).
        rows: the CSV rows (:func:`krea_rows`).
        source: the sample's name in the plan.
        steps: every request's steps instead of the row's ``num_step`` (krea's are SD 1.x steps).

    Raises:
        ValueError: a row without width or height, naming it.
    """
    planner = planning_planner(config)
    demands, refused = [], {}
    for i, row in enumerate(rows):
        w, h = _int(row, "width"), _int(row, "height")
        if w is None or h is None:
            raise ValueError(f"{source} row {i}: width and height are required")
        n = _int(row, "num_generations") or 1
        cfg = _float(row, "cfg_scale")
        prompt = (row.get("prompt") or "").strip() or "x"
        req = GenerationRequest(prompt, n=n, width=w, height=h, seed=0,
                                num_inference_steps=steps if steps is not None else _int(row, "num_step"),
                                guidance_scale=None if cfg is None else min(cfg, config.limits.max_guidance_scale))
        d = _demand(planner, req, 1.0 / n, None, refused)
        if d is not None:
            demands.append(d)
    return Traffic(demands, source, refused).merged()


def traffic_from_requests(config: ServeConfig, requests: Iterable[GenerationRequest], source: str = "requests") -> Traffic:
    """Traffic of whole requests (each weighs one), e.g. the ones a replay sends; refusals counted by field."""
    planner = planning_planner(config)
    demands, refused = [], {}
    for r in requests:
        d = _demand(planner, r, 1.0, None, refused)
        if d is not None:
            demands.append(d)
    return Traffic(demands, source, refused).merged()


def traffic_from_gentd26(config: ServeConfig, rows: Iterable[Mapping[str, str]],
                         sizes: Sequence[tuple[int, int]], steps: int | None = None) -> Traffic:
    """Traffic from a GenTD26-style trace (``num_images_per_prompt``, ``num_inference_steps``, ``prompt_length``
    in characters; ``TXT_2_IMG`` rows only when ``predict_type`` is given). The trace has no sizes: row ``i``
    takes ``sizes[i % len(sizes)]`` (e.g. the krea requests' sizes in file order); its prompt is
    :data:`GENTD26_FILLER` cut to ``prompt_length`` characters, counted by the model's tokenizer.

    Raises:
        ValueError: ``sizes`` is empty.
    """
    if not sizes:
        raise ValueError("traffic_from_gentd26 needs at least one (width, height) size to join the trace with")
    planner = planning_planner(config)
    demands, refused = [], {}
    i = 0
    for row in rows:
        kind = (row.get("predict_type") or "TXT_2_IMG").strip()
        if kind != "TXT_2_IMG":
            continue
        n = _int(row, "num_images_per_prompt") or 1
        chars = max(1, _int(row, "prompt_length") or 1)
        prompt = (GENTD26_FILLER * (chars // len(GENTD26_FILLER) + 1))[:chars].strip() or "x"
        w, h = sizes[i % len(sizes)]
        i += 1
        req = GenerationRequest(prompt, n=n, width=w, height=h, seed=0,
                                num_inference_steps=steps if steps is not None else _int(row, "num_inference_steps"))
        d = _demand(planner, req, 1.0, None, refused)
        if d is not None:
            demands.append(d)
    return Traffic(demands, "gentd26", refused).merged()


def traffic_from_histogram(config: ServeConfig, snapshot: Mapping) -> Traffic:
    """Traffic from a replica's recorded shape histogram (:meth:`~bcg_core.traffic.TrafficHistogram.snapshot`):
    each shape weighs its count; its ``cfg_count`` requests run with classifier-free guidance (where the family
    adds uncond rows for it), the rest without.

    Raises:
        ValueError: a snapshot that does not validate (:meth:`TrafficHistogram.from_snapshot`).
    """
    from .traffic import TrafficHistogram

    hist = TrafficHistogram.from_snapshot(dict(snapshot))
    planner = planning_planner(config)
    spec = planner.spec
    demands, refused = [], {}
    for s in hist.snapshot()["shapes"]:
        cfg_count = int(s.get("cfg_count") or 0)
        for cfg, count in ((True, cfg_count), (False, int(s["count"]) - cfg_count)):
            if count <= 0:
                continue
            extra = {}
            if cfg:
                extra = ({"true_cfg_scale": 4.0, "negative_prompt": " "} if spec.cfg_rule == "true_cfg"
                         else {"guidance_scale": min(config.limits.max_guidance_scale,
                                                     max(4.5, config.limits.default_guidance_scale))})
            elif spec.cfg_rule != "true_cfg":
                extra = {"guidance_scale": 1.0}
            req = GenerationRequest("x", n=int(s["n"]), width=int(s["width"]), height=int(s["height"]), seed=0,
                                    num_inference_steps=int(s["steps"]), **extra)
            d = _demand(planner, req, float(count), int(s["text_tokens"]), refused)
            if d is not None:
                demands.append(d)
    return Traffic(demands, "histogram", refused).merged()


# -- costs -------------------------------------------------------------------------------------------------

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
    def token_count(cls, config: ServeConfig, graphs: bool | None = None) -> PlanCosts:
        """The token-count stand-in of the replicas' own cost model (:meth:`bcg_core.costs.CostModel.token_model`),
        with graph bytes from the model's width and dtype (:func:`bcg_core.models.estimate_graph_bytes`: the
        activation factor measured on the H200).

        Args:
            config: the model (width, dtype) and runner.
            graphs: whether bucket forwards are graph replays (a tenth of the eager launch); None: unless the
                config runs eager (``runner.mode: eager``, or ``model.device: cpu`` where ``auto`` means eager).
        """
        from .models import ACTIVATION_FACTOR, transformer_width

        if graphs is None:
            graphs = config.runner.mode == "graph" or (config.runner.mode == "auto" and config.model.device != "cpu")
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[config.model.dtype]
        launch = cls.eager_launch_ms
        return cls(graph_launch_ms=launch / 10 if graphs else launch,
                   bytes_per_token=ACTIVATION_FACTOR * transformer_width(config.model.path) * dtype_bytes,
                   source="token-count" if graphs else "token-count (eager runner)")

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
            pts.append((_parse_key(str(r["key"])).tokens, float(r["graph_ms"]), float(r["eager_ms"]),
                        r.get("pool_bytes")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"profile row {i}: needs key, graph_ms and eager_ms ({e})") from None
    if len({p[0] for p in pts}) < 2:
        raise ValueError("a profile needs buckets of at least two token counts to fit costs to; profile more buckets")

    def fit(xs, ys):
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
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


def profile_buckets(config: ServeConfig, traffic: Traffic) -> BucketConfig:
    """The buckets ``bcg plan --measure`` profiles to fit its cost lines to (:func:`costs_from_profile`): the
    sample's smallest, most requested and largest resolution tiers, its median text bucket (the native length
    for fixed-length text), and 1 row and the most rows of any request, so that the fitted lines span the token
    counts the plan will price. ``image_padding: exact`` (a masked twin times the same forward).

    Raises:
        ValueError: an empty sample.
    """
    if not traffic.demands:
        raise ValueError(f"the traffic sample ({traffic.source}) has no request to profile buckets for")
    planner = planning_planner(config)
    tiers, texts, _ = _candidates(traffic, planner.rules, planner, None)
    by_tokens = sorted(tiers, key=lambda t: (t[0] * t[1], t))
    picked: list[tuple[int, int]] = []
    for t in (by_tokens[0], tiers[0], by_tokens[-1]):  # tiers[0]: the most requested
        if t not in picked and all(t[0] * t[1] != p[0] * p[1] or planner.rules.grid_keyed for p in picked):
            picked.append(t)
    native = planner.rules.native_text_tokens
    text = native if native is not None else _round_up(
        _quantile(sorted((d.query.text_tokens, d.weight) for d in traffic.demands), 0.5), 16)
    rows = sorted({1, max(d.query.batch for d in traffic.demands)})
    return BucketConfig(**{**config.buckets.model_dump(), "batch_sizes": rows, "text_lengths": [text],
                           "resolutions": [f"{w}x{h}" for w, h in sorted(picked, key=lambda t: (t[0] * t[1], t))],
                           "text_lengths_by_resolution": {}, "image_padding": "exact", "plan": None})


def _parse_key(text: str) -> BucketKey:
    """A :class:`BucketKey` from its string (``b8_i1024_m_t256_g32x32``)."""
    parts = text.split("_")
    b, i = int(parts[0][1:]), int(parts[1][1:])
    rest = parts[2:]
    mask = bool(rest) and rest[0] == "m"
    rest = rest[1:] if mask else rest
    t = int(rest[0][1:])
    hw = tuple(int(v) for v in rest[1][1:].split("x")) if len(rest) > 1 else None
    return BucketKey(b, i, t, hw, mask)


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
            for cand in ((ms + costs.graph_ms(k), tok + k.tokens), (ms + costs.eager_ms(c * per_row), tok + c * per_row)):
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
        real_tok = q.batch * (q.image_tokens + q.text_tokens)
        if probe.hit:
            shape = probe.key.shape
            keys = by_shape[shape]
            per_row = q.image_tokens + q.text_tokens
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


# -- search ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanPoint:
    """One table on the search path: its bucket lists and its score."""

    batch_sizes: tuple[int, ...]
    tiers: tuple[tuple[int, int], ...]
    text_lengths: tuple[int, ...]
    score: TableScore
    tier_texts: tuple[tuple[tuple[int, int], int], ...] = ()
    """Text buckets only some tiers have, as ``((width, height), text)`` pairs (``text_lengths_by_resolution``)."""

    def texts_by_resolution(self) -> dict[str, list[int]]:
        """The ``text_lengths_by_resolution`` section of this table (tiers with their own text buckets)."""
        return _by_resolution(self.text_lengths, self.tier_texts)


@dataclass
class BucketPlan:
    """The planner's answer.

    Attributes:
        buckets: the chosen ``buckets`` section (a :class:`~bcg_core.config.BucketConfig`).
        score: its expected cost on the traffic.
        curve: every table of the search path, 1 graph up (the plot's points).
        chosen: index of the chosen point in ``curve``.
        traffic: the sample's source, requests, and refusals by field.
        costs: the cost model used (:meth:`PlanCosts.describe`).
        budget_mib, max_graphs: the constraints.
    """

    buckets: BucketConfig
    score: TableScore
    curve: list[PlanPoint]
    chosen: int
    traffic: dict
    costs: dict
    budget_mib: float | None
    max_graphs: int

    def to_json(self) -> dict:
        """The machine-readable report (``bcg plan --json``)."""
        def point(p: PlanPoint) -> dict:
            return {"graphs": p.score.graphs, "ms_per_image": round(p.score.ms_per_image, 4),
                    "waste": round(p.score.waste, 5), "pool_mib": round(p.score.pool_bytes / 2**20, 1),
                    "miss_share": round(p.score.miss_share, 5), "batch_sizes": list(p.batch_sizes),
                    "resolutions": [f"{w}x{h}" for w, h in p.tiers], "text_lengths": list(p.text_lengths),
                    "text_lengths_by_resolution": p.texts_by_resolution()}

        return {"buckets": self.buckets.model_dump(mode="json"), "chosen": point(self.curve[self.chosen]),
                "shapes": {k: {"share": round(v["share"], 5), "waste": round(v["waste"], 5)}
                           for k, v in self.score.shares.items()},
                "curve": [point(p) for p in self.curve], "traffic": self.traffic, "costs": self.costs,
                "budget_mib": self.budget_mib, "max_graphs": self.max_graphs}


def _candidates(traffic: Traffic, rules: ShapeRules, planner: Planner, max_tiers: int | None = 16):
    """Candidate tiers (``(width, height)`` pixels; the ``max_tiers`` most requested, None: all, and always the
    largest, which with masked padding holds every smaller size), text buckets and batch sizes from the sample."""
    ppt = rules.pixels_per_token
    weights: dict[tuple[int, int], float] = {}
    for d in traffic.demands:
        q = d.query
        if rules.grid_keyed:
            h, w = q.latent_hw
        else:  # the most square grid of the request's token count that the limits allow
            h, w = _square(q.image_tokens, planner)
        weights[(w * ppt, h * ppt)] = weights.get((w * ppt, h * ppt), 0.0) + d.weight
    tiers = [t for t, _ in sorted(weights.items(), key=lambda kv: -kv[1])[:max_tiers]]
    largest = max(weights, key=lambda t: (t[0] * t[1], t))
    if largest not in tiers:
        tiers.append(largest)
    native = rules.native_text_tokens
    if native is not None:
        texts = [native]
    else:
        # multiples of 16 (PixArt-Sigma's padded forward stays bit-identical to diffusers' there,
        # bcg_core/families/pixart.py), at most what the encoder feeds
        weighted = sorted((d.query.text_tokens, d.weight) for d in traffic.demands)
        cap = planner.spec.max_text_tokens or weighted[-1][0]
        texts = sorted({min(cap, _round_up(v, 16)) for v in
                        [weighted[-1][0]] + [_quantile(weighted, q) for q in (0.5, 0.9, 0.99)]})
    rows = sorted({d.query.batch for d in traffic.demands})
    largest = max(rows) if rows else 1
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b <= largest} | set(rows))
    return tiers, texts, batches


def _by_resolution(texts: Sequence[int], extra: Sequence[tuple[tuple[int, int], int]]) -> dict[str, list[int]]:
    """``text_lengths_by_resolution`` of a table with the text buckets ``texts`` on every tier and the ``extra``
    ``((width, height), text)`` pairs on single tiers."""
    out: dict[str, set[int]] = {}
    for (w, h), x in extra:
        out.setdefault(f"{w}x{h}", set(texts)).add(x)
    return {k: sorted(v) for k, v in out.items()}


def _square(tokens: int, planner: Planner) -> tuple[int, int]:
    """The most square ``(h, w)`` grid with ``tokens`` tokens within the size limits (the grid itself if prime)."""
    lim = planner.limits
    ppt = planner.rules.pixels_per_token
    lo, hi = -(-lim.min_side_px // ppt), lim.max_side_px // ppt
    best = None
    for h in range(lo, hi + 1):
        if tokens % h == 0 and lo <= tokens // h <= hi:
            g = (h, tokens // h)
            if best is None or abs(g[0] - g[1]) < abs(best[0] - best[1]):
                best = g
    return best or (1, tokens)


def _round_up(v: float, m: int) -> int:
    return max(m, int(math.ceil(v / m)) * m)


def _quantile(weighted: list[tuple[int, float]], q: float) -> int:
    """The ``q`` quantile of sorted ``(value, weight)`` pairs, by weight (requests)."""
    total = sum(w for _, w in weighted)
    acc = 0.0
    for v, w in weighted:
        acc += w
        if acc >= q * total:
            return v
    return weighted[-1][0]


def plan_buckets(config: ServeConfig, traffic: Traffic, costs: PlanCosts | None = None,
                 budget_mib: float | None = None, max_graphs: int = 12) -> BucketPlan:
    """Choose the bucket table for ``traffic`` (module docstring).

    Args:
        config: the model, limits and the current ``buckets`` (their ``image_padding`` and ``miss_policy`` are
            kept).
        traffic: the sample (:func:`traffic_from_rows`, :func:`traffic_from_gentd26`, :func:`traffic_from_histogram`).
        costs: the cost model; None: :meth:`PlanCosts.token_count`.
        budget_mib: graph-memory budget (the shared pool's expected size); None: no budget.
        max_graphs: most graphs per replica.

    Raises:
        ValueError: an empty sample (nothing valid to plan for: names what was refused), ``max_graphs`` below 1,
            or a budget below the smallest graph any request needs (naming that graph's MiB).
    """
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
    if budget_mib is not None and not (math.isfinite(budget_mib) and budget_mib > 0):
        raise ValueError(f"budget_mib must be a positive finite number of MiB, got {budget_mib}; leave it out for no "
                         f"budget")
    if not traffic.demands:
        why = ", ".join(f"{k}: {v:g}" for k, v in sorted(traffic.refused.items())) or "no rows"
        raise ValueError(f"the traffic sample ({traffic.source}) has no request the limits allow ({why}); give it "
                         f"requests within limits, or widen limits")
    costs = costs or PlanCosts.token_count(config)
    planner = planning_planner(config)
    rules = planner.rules
    base = config.buckets
    reject = str(getattr(base.miss_policy, "value", base.miss_policy)) == "reject"
    exact = rules.grid_keyed or base.image_padding == "exact"  # every size needs its own tier
    tiers, texts, batches = _candidates(traffic, rules, planner, None if reject and exact else 16)
    budget = None if budget_mib is None else budget_mib * 2**20
    min_tokens = planner.table.min_image_tokens  # as every replica's table: from the smallest side the limits allow

    def table(bs, ts, xs, ex=()) -> BucketTable | None:
        try:
            cfg = base.model_copy(update={"batch_sizes": sorted(bs), "text_lengths": sorted(xs),
                                          "resolutions": [f"{w}x{h}" for w, h in ts],
                                          "text_lengths_by_resolution": _by_resolution(xs, ex)})
            return BucketTable(BucketConfig(**cfg.model_dump()), rules, min_tokens)
        except ValueError:
            return None  # e.g. two tiers of one token count

    memo: dict = {}
    scores: dict = {}

    def score(bs, ts, xs, ex=()):
        """The table's score, None beyond the graph cap (remembered: the search asks for tables again)."""
        k = (bs, ts, xs, ex)
        if k not in scores:
            t = table(bs, ts, xs, ex)
            # under miss_policy reject a miss is a refused request: the search prices it out (REJECT_PENALTY)
            scores[k] = None if t is None or len(t) > max_graphs else \
                evaluate(t, traffic, costs, memo, REJECT_PENALTY if reject else 1.0)
        return scores[k]

    def greedy(limit: float | None) -> list[PlanPoint] | None:
        """The search path with every graph within ``limit`` bytes (None: no limit); None if no table fits."""
        def ok(bs, ts, xs, ex=()):
            sc = score(bs, ts, xs, ex)
            return sc if sc is not None and (limit is None or sc.pool_bytes <= limit) else None

        best = None
        for b in batches:  # the best single bucket (with its masked twin where the padding makes one)
            for t in tiers:
                for x in texts:
                    sc = ok((b,), (t,), (x,))
                    if sc is not None and (best is None or sc.ms_per_image < best[3].ms_per_image):
                        best = ((b,), (t,), (x,), sc)
        if best is None:
            return None
        bs, ts, xs, sc = best
        ex: tuple = ()
        path = [PlanPoint(bs, ts, xs, sc)]
        while True:
            options = [(tuple(sorted(bs + (b,))), ts, xs, ex) for b in batches if b not in bs]
            options += [(bs, tuple(sorted(ts + (t,), key=lambda p: (p[0] * p[1], p))), xs, ex)
                        for t in tiers if t not in ts]
            # a text bucket for every tier, or for one tier only (a common tier's fine text buckets cost its
            # batch sizes' graphs, not every tier's)
            options += [(bs, ts, tuple(sorted(xs + (x,))), tuple(e for e in ex if e[1] != x))
                        for x in texts if x not in xs]
            if len(ts) > 1:
                options += [(bs, ts, xs, tuple(sorted(ex + ((t, x),)))) for t in ts for x in texts
                            if x not in xs and (t, x) not in ex]
            step = None
            cur = path[-1].score
            for o in options:
                so = ok(*o)
                if so is None or so.ms_per_image >= cur.ms_per_image - 1e-12:
                    continue
                gain = (cur.ms_per_image - so.ms_per_image) / max(1, so.graphs - cur.graphs)
                if step is None or gain > step[1]:
                    step = (o, gain, so)
            if step is None:
                return path
            (bs, ts, xs, ex), _, sc = step
            path.append(PlanPoint(bs, ts, xs, sc, ex))

    singles = [tb for t in tiers for x in texts for b in batches if (tb := table((b,), (t,), (x,))) is not None]
    fewest = min(len(tb) for tb in singles)
    if fewest > max_graphs:
        raise ValueError(f"max_graphs {max_graphs} is below the {fewest} graphs of the smallest table (one tier "
                         f"with image_padding 'masked' has a masked twin); allow {fewest} graphs or use "
                         f"image_padding: exact")
    smallest = min(max(costs.graph_bytes(k) for k in tb.keys) for tb in singles)
    if budget is not None and budget < smallest:
        raise ValueError(f"no table fits the graph-memory budget of {budget_mib} MiB: the smallest graph needs "
                         f"{smallest / 2**20:.1f} MiB; raise the budget to at least that")
    free = greedy(None)
    if budget is None:
        curve = free
    else:  # the budget in steps of LADDER from the smallest table up: a larger budget never plans worse
        paths, seen, limit = [], set(), float(smallest)
        if max(p.score.pool_bytes for p in free) <= budget:
            paths.append(free)  # the unbudgeted search fits: it fits every larger budget too
            seen.add(tuple((p.batch_sizes, p.tiers, p.text_lengths, p.tier_texts) for p in free))
        while limit <= budget * (1 + 1e-12):
            path = greedy(limit)
            key = tuple((p.batch_sizes, p.tiers, p.text_lengths, p.tier_texts) for p in path)
            if key not in seen:
                seen.add(key)
                paths.append(path)
            limit *= LADDER
        curve = min(paths, key=lambda path: min(p.score.ms_per_image for p in path))
    if reject:  # report what the tables cost (no penalty); only a table that holds every request may be chosen
        curve = [replace(p, score=evaluate(table(p.batch_sizes, p.tiers, p.text_lengths, p.tier_texts), traffic, costs,
                                            memo))
                 for p in curve]
        if all(p.score.miss_share > 0 for p in curve):
            raise ValueError(f"under miss_policy reject every request of the sample needs a bucket, and no table of at "
                             f"most {max_graphs} graphs{'' if budget is None else f' within {budget_mib} MiB'} holds "
                             f"them all; allow more graphs (--max-graphs) or use miss_policy: eager")
    chosen = min((i for i in range(len(curve)) if not reject or curve[i].score.miss_share == 0),
                 key=lambda i: (curve[i].score.ms_per_image, curve[i].score.graphs))
    p = curve[chosen]
    planned = PlannedTraffic(source=traffic.source, requests=round(traffic.requests, 3), waste=round(p.score.waste, 6),
                             ms_per_image=round(p.score.ms_per_image, 6), costs=costs.source,
                             miss_share=round(p.score.miss_share, 6), cost_lines=costs.lines(),
                             work={k: round(v["work"], 6) for k, v in p.score.shares.items()})
    buckets = BucketConfig(**{**base.model_dump(), "batch_sizes": list(p.batch_sizes),
                              "resolutions": [f"{w}x{h}" for w, h in p.tiers], "text_lengths": list(p.text_lengths),
                              "text_lengths_by_resolution": p.texts_by_resolution(), "plan": planned.model_dump()})
    return BucketPlan(buckets, p.score, curve, chosen,
                      {"source": traffic.source, "requests": round(traffic.requests, 3),
                       "refused": {k: round(v, 3) for k, v in sorted(traffic.refused.items())}},
                      costs.describe(), budget_mib, max_graphs)


REJECT_PENALTY = 1000.0
"""Under ``miss_policy: reject`` the search costs a miss at 1000x its eager time, so that holding every request
comes first; the chosen table must miss none, and its reported cost has no penalty."""

LADDER = 2 ** 0.25
"""With a graph-memory budget the search runs at limits from the smallest table's pool up to the budget, each
19% above the last, and keeps the best table found at any of them: greedy growth under a larger limit can take a
large bucket early and miss a better table that a smaller limit forces, so taking the best over every smaller
limit makes the plan never worse for a larger budget (a budget between two steps plans as the step below)."""


DRIFT_RATIO = 1.5
"""Recorded traffic has drifted from the plan when the table would serve it with more than 1.5x the planned
padded-token waste (the issue's threshold) and at least :data:`DRIFT_POINTS` above it (so a plan of 0% waste does
not warn on a single padded request)."""

DRIFT_POINTS = 0.01


def plan_matches(plan_info: PlannedTraffic, table: BucketTable) -> bool:
    """Whether ``buckets.plan`` was written for this table: every shape it weighs is one of the table's."""
    shapes = {k.shape for k in table.keys}
    planned = {s for s, v in plan_info.work.items() if s != "miss" and v > 0}
    return bool(planned) and planned <= shapes


def drift_report(config: ServeConfig, snapshot: Mapping, max_graphs: int | None = None) -> dict:
    """How recorded traffic (a :meth:`~bcg_core.traffic.TrafficHistogram.snapshot`) fares on ``config``'s table
    against what ``buckets.plan`` expected, and what a new plan of it would gain. Advice only.

    Drifted: over :data:`DRIFT_RATIO` x the planned waste and :data:`DRIFT_POINTS` above it, or over 1.5x the
    planned share of misses and 5 points above it (requests that moved outside the table).

    Returns:
        ``{"planned_waste", "recorded_waste", "recorded_miss_share", "ratio", "drifted", "requests", "gain",
        "new_buckets", "note"}``:
        ``gain`` is the expected GPU time per image a plan of the recorded traffic saves, 0..1 (None unless
        drifted); ``new_buckets`` that plan's buckets section. Without ``buckets.plan`` only the recorded waste.

    Raises:
        ValueError: a snapshot that does not validate.
    """
    traffic = traffic_from_histogram(config, snapshot)
    plan_info = config.buckets.plan
    out = {"requests": round(traffic.requests, 3), "planned_waste": None if plan_info is None else plan_info.waste,
           "recorded_waste": None, "ratio": None, "drifted": False, "gain": None, "new_buckets": None, "note": ""}
    if not traffic.demands:
        out["note"] = "no recorded request the limits allow"
        return out
    # the plan's own costs (a profile's lines where it had one), so planned and recorded waste compare alike
    costs = (PlanCosts.from_lines(plan_info.cost_lines, plan_info.costs) if plan_info is not None and plan_info.cost_lines
             else PlanCosts.token_count(config))
    table = planning_table(config)
    now = evaluate(table, traffic, costs)
    out["recorded_waste"] = round(now.waste, 6)
    out["recorded_miss_share"] = round(now.miss_share, 6)
    if plan_info is None:
        out["note"] = "buckets.plan is not set (the table was not written by bcg plan): nothing to compare with"
        return out
    if not plan_matches(plan_info, table):
        out["note"] = ("buckets.plan does not describe this table (its shapes were edited after bcg plan wrote it): "
                       "plan again with bcg plan --write, or delete buckets.plan")
        return out
    planned = plan_info.waste
    out["ratio"] = round(now.waste / planned, 3) if planned > 0 else None
    waste_drift = now.waste > DRIFT_RATIO * planned and now.waste - planned > DRIFT_POINTS
    # requests moving outside the table run eager without padding: a drift the waste alone cannot show
    miss_drift = now.miss_share > DRIFT_RATIO * plan_info.miss_share and now.miss_share - plan_info.miss_share > 0.05
    out["drifted"] = waste_drift or miss_drift
    if out["drifted"]:
        graphs = max_graphs or max(len(planning_table(config)), 1)
        fresh = plan_buckets(config, traffic, costs, max_graphs=graphs)
        out["gain"] = round(max(0.0, 1 - fresh.score.ms_per_image / now.ms_per_image), 4) if now.ms_per_image else 0.0
        out["new_buckets"] = fresh.buckets.model_dump(mode="json")
        out["note"] = (f"recorded traffic is served with {now.waste:.1%} padded-token waste against the planned "
                       f"{planned:.1%}, and {now.miss_share:.1%} of it misses every bucket against the planned "
                       f"{plan_info.miss_share:.1%}; a plan of it (bcg plan --from this server) would save "
                       f"{out['gain']:.1%} of the GPU time per image with {fresh.score.graphs} graphs")
    return out
