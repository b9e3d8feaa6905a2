"""The table search behind ``bcg plan``: choose the bucket table for a traffic sample, under a graph-memory
budget and a graph cap.

Input: a :class:`~bcg_core.planning.samples.Traffic` sample and a :class:`~bcg_core.planning.plan_costs.PlanCosts`
cost model. Output: a :class:`TableChoice` whose :attr:`TableChoice.buckets` is the ``buckets`` section of a
EngineConfig, chosen to minimise the expected GPU milliseconds per image
(:func:`~bcg_core.planning.plan_costs.evaluate`).

Search (:func:`search_table`): the best single bucket (one graph), then greedy growth: at each step the tier,
text bucket or batch size whose addition lowers the expected cost most per graph added, within the graph cap
and the memory budget, until nothing lowers it. Each table on the way is a point of the curve (graphs against
cost and waste); the chosen table is the cheapest point. The greedy path only adds buckets, so the cost never
rises with the graph count. :func:`profile_buckets` picks the buckets ``bcg plan --measure`` times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bcg_core.config import BucketConfig, EngineConfig, PlannedTraffic
from bcg_core.families.defaults import family_buckets
from bcg_core.planning.plan_costs import PlanCosts, TableScore, evaluate
from bcg_core.planning.samples import Traffic, planning_validator
from bcg_core.table import BucketTable, ShapeRules
from bcg_core.validation import RequestValidator

__all__ = ["LADDER", "REJECT_PENALTY", "PlanPoint", "TableChoice", "profile_buckets", "search_table"]


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
class TableChoice:
    """The table search's answer.

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


def _candidates(traffic: Traffic, rules: ShapeRules, validator: RequestValidator, max_tiers: int | None = 16):
    """Candidate tiers (``(width, height)`` pixels; the ``max_tiers`` most requested, None: all, and always the
    largest, which with masked padding holds every smaller size), text buckets and batch sizes from the sample."""
    ppt = rules.pixels_per_token
    weights: dict[tuple[int, int], float] = {}
    for d in traffic.demands:
        q = d.query
        if rules.grid_keyed:
            h, w = q.latent_hw
        else:  # the most square grid of the request's token count that the limits allow
            h, w = _square(q.image_tokens, validator)
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
        cap = validator.spec.max_text_tokens or weighted[-1][0]
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


def _square(tokens: int, validator: RequestValidator) -> tuple[int, int]:
    """The most square ``(h, w)`` grid with ``tokens`` tokens within the size limits (the grid itself if prime)."""
    lim = validator.limits
    ppt = validator.rules.pixels_per_token
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


def search_table(config: EngineConfig, traffic: Traffic, costs: PlanCosts | None = None,
                 budget_mib: float | None = None, max_graphs: int = 12) -> TableChoice:
    """Choose the bucket table for ``traffic`` (module docstring).

    Args:
        config: the model, limits and the current ``buckets`` (their ``image_padding``, ``miss_policy`` and, for a
            video family, ``frames`` are kept: the search plans resolutions, text and batch buckets at those frame
            counts; without a ``buckets`` section, the family's table's).
        traffic: the sample (:mod:`bcg_core.planning.samples`: ``traffic_from_rows``, ``traffic_from_gentd26``,
            ``traffic_from_histogram``).
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
        counts = {k: max(1, round(v)) for k, v in sorted(traffic.refused.items())}
        if not counts:  # e.g. a server's /v1/buckets before its first request
            raise ValueError(f"the traffic sample ({traffic.source}) holds no request: nothing to plan for; plan "
                             f"once the server has served traffic, or from a sample (bcg plan --traffic, --krea)")
        why = ", ".join(f"{k}: {n} request{'s' if n > 1 else ''}" for k, n in counts.items())
        raise ValueError(f"the traffic sample ({traffic.source}) has no request the limits allow ({why}); give it "
                         f"requests within limits, or widen limits")
    costs = costs or PlanCosts.token_count(config)
    validator = planning_validator(config)
    rules = validator.rules
    base = family_buckets(config, validator.spec).buckets  # the config's, or its family's (a video family's frames)
    reject = str(getattr(base.miss_policy, "value", base.miss_policy)) == "reject"
    exact = rules.grid_keyed or base.image_padding == "exact"  # every size needs its own tier
    tiers, texts, batches = _candidates(traffic, rules, validator, None if reject and exact else 16)
    # every table starts from one bucket at the sample's longest text (capped at the encoder's cut), and the search
    # only adds text buckets: a longer prompt is a text miss (eager kernels) or, under miss_policy reject, refused
    # with 422 (RequestValidator.text_limit; a 173-token krea prompt was, on a [144] table), so the sample's own long
    # prompts keep a bucket; the smallest table and the budget ladder's first rung start there too
    longest_text = texts[-1:]
    budget = None if budget_mib is None else budget_mib * 2**20
    min_tokens = validator.table.min_image_tokens  # as every replica's table: from the smallest side the limits allow

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
                for x in longest_text:
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

    singles = [tb for t in tiers for x in longest_text for b in batches if (tb := table((b,), (t,), (x,))) is not None]
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
    return TableChoice(buckets, p.score, curve, chosen,
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


def profile_buckets(config: EngineConfig, traffic: Traffic) -> BucketConfig:
    """The buckets ``bcg plan --measure`` profiles to fit its cost lines to
    (:func:`~bcg_core.planning.plan_costs.costs_from_profile`): the sample's smallest, most requested and largest
    resolution tiers, its median text bucket (the native length for fixed-length text), and 1 row and the most
    rows of any request, so that the fitted lines span the token counts the plan will price.
    ``image_padding: exact`` (a masked twin times the same forward).

    Raises:
        ValueError: an empty sample.
    """
    if not traffic.demands:
        raise ValueError(f"the traffic sample ({traffic.source}) has no request to profile buckets for")
    validator = planning_validator(config)
    tiers, texts, _ = _candidates(traffic, validator.rules, validator, None)
    by_tokens = sorted(tiers, key=lambda t: (t[0] * t[1], t))
    picked: list[tuple[int, int]] = []
    for t in (by_tokens[0], tiers[0], by_tokens[-1]):  # tiers[0]: the most requested
        if t not in picked and all(t[0] * t[1] != p[0] * p[1] or validator.rules.grid_keyed for p in picked):
            picked.append(t)
    native = validator.rules.native_text_tokens
    text = native if native is not None else _round_up(
        _quantile(sorted((d.query.text_tokens, d.weight) for d in traffic.demands), 0.5), 16)
    rows = sorted({1, max(d.query.batch for d in traffic.demands)})
    return BucketConfig(**{**config.buckets.model_dump(), "batch_sizes": rows, "text_lengths": [text],
                           "resolutions": [f"{w}x{h}" for w, h in sorted(picked, key=lambda t: (t[0] * t[1], t))],
                           "text_lengths_by_resolution": {}, "image_padding": "exact", "plan": None})
