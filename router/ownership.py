"""Bucket ownership: which DiT replicas capture and serve which buckets (docs/DESIGN.md section 5).

Pure CPU logic, no Ray: the router and the autoscaling policy call :func:`assign` whenever the replica set
changes, and replicas capture the buckets they own at start. Two inputs:

- expected load per bucket, from a real request mix (:func:`expected_load`, :func:`krea_rows`);
- graph memory per bucket and each replica's graph budget (:class:`BucketDemand`, :class:`ReplicaCapacity`).

Memory model. A replica captures all its buckets into ONE shared CUDA graph pool, largest first, so its
pool is about the largest owned bucket's pool, not the sum (docs/BENCHMARKS.md: shared pool 1.0-1.05x the
largest single bucket). A replica's graph memory is modelled as
``max(bucket graph_bytes) + graph_overhead_bytes * number_of_owned_buckets``.

Load model. A bucket's expected share of requests is split evenly among its owners; a replica's load is
the sum of its per-owner shares (a fraction of all requests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from bcg_core.errors import RequestError
from bcg_core.keys import BucketKey
from bcg_core.models import ACTIVATION_FACTOR, estimate_graph_bytes, transformer_width
from bcg_core.planning.samples import KREA_CSV, krea_rows
from bcg_core.request import GenerationRequest
from bcg_core.validation import RequestValidator

__all__ = [
    "Assignment",
    "BucketDemand",
    "DEFAULT_GRAPH_OVERHEAD_BYTES",
    "DEFAULT_HOT_SHARE",
    "KREA_CSV",
    "LoadEstimate",
    "ReplicaCapacity",
    "ACTIVATION_FACTOR",
    "assign",
    "bucket_demands",
    "demands_for_config",
    "estimate_graph_bytes",
    "shape_demands",
    "shape_shares",
    "expected_load",
    "krea_rows",
]

log = logging.getLogger(__name__)


DEFAULT_HOT_SHARE = 0.10
"""A bucket with at least this fraction of requests is hot and gets >= 2 owners (on the krea mix with the
default table: the two 512x512 buckets, ~22% and ~18%; the next bucket has ~7%)."""

DEFAULT_GRAPH_OVERHEAD_BYTES = 32 * 2**20
"""Bytes each owned graph adds to a replica's shared pool beyond the largest bucket (BENCHMARKS: 24
FLUX.1-dev buckets took 8,809 MiB shared vs 8,366 MiB for the largest alone, ~18 MiB per graph)."""


# ---------------------------------------------------------------------------------------------------------
# Expected load from real data


@dataclass(frozen=True, slots=True)
class LoadEstimate:
    """Result of :func:`expected_load`.

    Attributes:
        shares: fraction of requests per bucket (sums to 1.0 when any row was placed; buckets no row
            reached are absent).
        rows: data rows read.
        skipped: rows that failed validation, had an unreadable field, or missed every bucket.
    """

    shares: Mapping[BucketKey, float]
    rows: int
    skipped: int


def _int_field(row: Mapping[str, object], name: str) -> int | None:
    """An integer column (``"512"`` or ``"9.0"``); None when empty or missing."""
    v = row.get(name)
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    f = float(v)  # type: ignore[arg-type]
    if f != int(f):
        raise ValueError(f"{name}={v!r} is not an integer")
    return int(f)


def expected_load(table_validator: RequestValidator, rows: Iterable[Mapping[str, object]],
                  guidance_scale: float | None = 3.5, by: str = "requests") -> LoadEstimate:
    """Share of requests per bucket from real data rows.

    Each row becomes ``GenerationRequest(prompt="x", n=num_generations or 1, width, height,
    guidance_scale)`` (the row's own prompt is not used: the text bucket does not depend on it for
    fixed-length text models, and rows with an empty prompt still carry a real size). A row is one image,
    so it weighs ``1 / n`` of a request.

    Args:
        table_validator: the validator whose bucket table keys the requests.
        rows: mappings with ``width``, ``height`` and (optional, may be empty) ``num_generations``.
        guidance_scale: CFG scale of every request (above 1 the batch dimension doubles); None: the validator's
            default (the config's, else the family's).
        by: ``"requests"``: each request weighs 1; ``"work"``: each request weighs the padded tokens of its
            bucket's forward (``BucketKey.tokens``, proportional to its GPU time per denoising step), so a
            1024x1024 request counts ~4x a 512x512 one. Ownership balances work.

    Returns:
        Shares per bucket and the count of rows skipped (invalid or missed; also logged).
    """
    weights: dict[BucketKey, float] = {}
    read = skipped = 0
    for row in rows:
        read += 1
        try:
            n = _int_field(row, "num_generations") or 1
            width, height = _int_field(row, "width"), _int_field(row, "height")
            if width is None or height is None:
                raise ValueError("no size")
            validated = table_validator.validate(GenerationRequest(prompt="x", n=n, width=width, height=height,
                                                        guidance_scale=guidance_scale, seed=0))
        except (RequestError, ValueError, TypeError):
            skipped += 1
            continue
        key = validated.lookup.key
        if key is None:
            skipped += 1
            continue
        weights[key] = weights.get(key, 0.0) + (1.0 / n) * (key.tokens if by == "work" else 1)
    if skipped:
        log.info("expected_load: skipped %d of %d rows (invalid or no bucket)", skipped, read)
    total = sum(weights.values())
    shares = {k: w / total for k, w in sorted(weights.items())} if total > 0 else {}
    return LoadEstimate(MappingProxyType(shares), read, skipped)


def shape_shares(shares: Mapping[BucketKey, float]) -> dict[str, float]:
    """Sum per-bucket shares into per-shape shares (:attr:`BucketKey.shape`: every batch bucket of one
    resolution tier and text bucket, the unit replicas own, route by and share steps within)."""
    out: dict[str, float] = {}
    for k, v in shares.items():
        out[k.shape] = out.get(k.shape, 0.0) + float(v)
    return dict(sorted(out.items()))


def shape_demands(keys: Iterable[BucketKey], shares: Mapping[BucketKey, float],
                  graph_bytes: Callable[[BucketKey], int]) -> dict[str, BucketDemand]:
    """One :class:`BucketDemand` per bucket shape: the summed share of its batch buckets, and the graph
    bytes of its largest batch bucket (all of a shape's graphs share one pool, which the largest sets).

    Args:
        keys: every bucket of the table.
        shares: fraction of requests per bucket (e.g. :attr:`LoadEstimate.shares`).
        graph_bytes: ``key -> bytes`` of one bucket's graph pool.
    """
    per_shape = shape_shares(shares)
    out: dict[str, BucketDemand] = {}
    for k in sorted(set(keys)):
        prev = out.get(k.shape)
        b = int(graph_bytes(k))
        out[k.shape] = BucketDemand(per_shape.get(k.shape, 0.0), max(b, prev.graph_bytes if prev else 0))
    return dict(sorted(out.items()))


def demands_for_config(config, validator: RequestValidator | None = None) -> dict[str, BucketDemand]:
    """Per-shape demand of a ``ServeConfig``: shares of the expected work, from the table's plan when ``bcg plan``
    wrote it (``buckets.plan.work``: each shape's share of the computed tokens on the planned traffic), else from
    the krea mix (requests at the configured default guidance scale, weighted by padded tokens:
    :func:`expected_load` ``by="work"``); graph bytes from :func:`estimate_graph_bytes` with the model's width and
    dtype, once per expert (a Wan 2.2 checkpoint of two experts captures every bucket twice, :mod:`bcg_core.experts`).

    Args:
        config: a :class:`deployments.settings.ServeConfig`.
        validator: its validator (built with :meth:`RequestValidator.from_config`, tokenizer only, when None).

    Raises:
        FileNotFoundError, ValueError: the configured checkpoint folder is unreadable.
    """
    validator = validator or RequestValidator.from_config(config)
    hidden = transformer_width(config.model.path)
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[config.model.dtype]
    experts = 1 if validator.spec.boundary_ratio is None else 2  # transformer and transformer_2: a pool each
    graph_bytes = lambda k: experts * estimate_graph_bytes(k, hidden, dtype_bytes)  # noqa: E731
    plan = config.buckets.plan
    if plan is not None:
        from bcg_core.planning.drift import plan_matches

        if plan_matches(plan, validator.table):
            # the plan's expected work per shape (bcg plan wrote it for this very table) replaces the krea prior
            largest: dict[str, BucketKey] = {}
            for k in validator.table.keys:
                if k.shape not in largest or k.batch > largest[k.shape].batch:
                    largest[k.shape] = k
            whole = sum(v for s, v in plan.work.items() if s in largest)
            return {s: BucketDemand(plan.work.get(s, 0.0) / whole, int(graph_bytes(k)))
                    for s, k in sorted(largest.items())}
        log.warning("buckets.plan does not describe this table (edited after bcg plan wrote it): ownership uses "
                    "the krea prior; plan again with bcg plan --write, or delete buckets.plan")
    load = expected_load(validator, krea_rows(), guidance_scale=None, by="work")  # the default request's guidance
    return shape_demands(validator.table.keys, load.shares, graph_bytes)


# ---------------------------------------------------------------------------------------------------------
# Assignment


@dataclass(frozen=True, slots=True)
class BucketDemand:
    """What one bucket asks of the replicas that own it.

    Attributes:
        share: expected fraction of all requests that use this bucket (0.0 to 1.0).
        graph_bytes: bytes of the bucket's captured graph pool when captured alone.
    """

    share: float
    graph_bytes: int


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """A replica that can own buckets.

    Attributes:
        replica_id: the replica's stable id (Ray Serve's replica id).
        graph_budget_bytes: bytes its shared graph pool may take.
    """

    replica_id: str
    graph_budget_bytes: int


def bucket_demands(shares: Mapping[BucketKey, float], keys: Iterable[BucketKey],
                   graph_bytes: Callable[[BucketKey], int]) -> dict[BucketKey, BucketDemand]:
    """One :class:`BucketDemand` per key of the table (share 0.0 for keys the mix never reached).

    Args:
        shares: fraction of requests per bucket (e.g. :attr:`LoadEstimate.shares`).
        keys: every bucket of the table.
        graph_bytes: ``key -> bytes`` of the bucket's graph pool (measured or estimated).
    """
    return {k: BucketDemand(float(shares.get(k, 0.0)), int(graph_bytes(k))) for k in sorted(set(keys))}


@dataclass(frozen=True)
class Assignment:
    """A frozen bucket-to-replica assignment (the result of :func:`assign`).

    Attributes:
        owners: replica ids per placed bucket, sorted.
        buckets: owned buckets per replica id, sorted (every replica appears, maybe with none).
        unplaceable: buckets no replica could hold within its budget, sorted.
        under_replicated: hot buckets that got fewer than 2 owners although there were >= 2 replicas.
        loads: expected fraction of all requests per replica (shares split evenly among owners).
        graph_bytes: modelled graph memory per replica in bytes (see the module docstring).
    """

    owners: Mapping[BucketKey, tuple[str, ...]]
    buckets: Mapping[str, tuple[BucketKey, ...]]
    unplaceable: tuple[BucketKey, ...] = ()
    under_replicated: tuple[BucketKey, ...] = ()
    loads: Mapping[str, float] = field(default_factory=dict)
    graph_bytes: Mapping[str, int] = field(default_factory=dict)

    def pairs(self) -> frozenset[tuple[BucketKey, str]]:
        """Every ``(bucket, replica_id)`` ownership."""
        return frozenset((b, r) for b, rs in self.owners.items() for r in rs)

    def moved_from(self, previous: Assignment | None) -> int:
        """Ownerships here that ``previous`` did not have: graphs some replica must newly capture.

        Against None every ownership counts.
        """
        before = previous.pairs() if previous is not None else frozenset()
        return len(self.pairs() - before)


class _State:
    """Mutable working state of :func:`assign` (owners per bucket, buckets per replica)."""

    def __init__(self, demands: Mapping[BucketKey, BucketDemand], replicas: list[ReplicaCapacity],
                 overhead_bytes: int):
        self.demands = demands
        self.budget = {r.replica_id: r.graph_budget_bytes for r in replicas}
        self.ids = sorted(self.budget)
        self.overhead = overhead_bytes
        self.owners: dict[BucketKey, list[str]] = {b: [] for b in demands}
        self.owned: dict[str, list[BucketKey]] = {r: [] for r in self.ids}

    def memory(self, r: str, extra: BucketKey | None = None) -> int:
        """Modelled graph bytes of replica ``r`` (with ``extra`` added when given)."""
        bs = self.owned[r] + ([extra] if extra is not None else [])
        if not bs:
            return 0
        return max(self.demands[b].graph_bytes for b in bs) + self.overhead * len(bs)

    def fits(self, r: str, b: BucketKey) -> bool:
        """True when ``r`` does not own ``b`` and can add it within its budget."""
        return b not in self.owned[r] and self.memory(r, b) <= self.budget[r]

    def load(self, r: str) -> float:
        """Expected fraction of requests replica ``r`` serves."""
        return sum(self.demands[b].share / len(self.owners[b]) for b in self.owned[r])

    def add(self, r: str, b: BucketKey) -> None:
        self.owners[b].append(r)
        self.owned[r].append(b)


def assign(buckets: Mapping[BucketKey, BucketDemand], replicas: list[ReplicaCapacity],
           previous: Assignment | None = None, hot_share: float = DEFAULT_HOT_SHARE,
           graph_overhead_bytes: int = DEFAULT_GRAPH_OVERHEAD_BYTES,
           balance_tolerance: float = 0.25) -> Assignment:
    """Assign buckets to replicas: pure and deterministic (same inputs, same result; input order ignored).

    Steps:

    1. Keep: every ownership of ``previous`` whose replica and bucket still exist, in bucket order, as
       long as it fits the replica's budget (it always does when budgets and bucket bytes are unchanged).
    2. Cover: buckets in order of share (then graph bytes, then key), descending, get owners until they
       have 1 (2 when hot and >= 2 replicas exist): each goes to the least-loaded replica that can hold it
       (ties: fewest owned buckets, then replica id); buckets of share 0 go to the replica with the fewest
       buckets instead.
    3. Balance: while the most-loaded replica's load exceeds the least-loaded receiver's by more than
       ``balance_tolerance`` x the mean load, that receiver becomes a co-owner of one bucket of the
       most-loaded replica, if that lowers the larger of their two loads. Receivers are all replicas for a
       fresh assignment, and only the replicas absent from ``previous`` otherwise, so a replica that stays
       captures new graphs only to restore coverage.

    Guarantees with ``previous`` (same buckets, budgets and bucket bytes): every ownership of a remaining
    replica is kept (ownerships are only ever added). When replicas leave, the only new ownerships are
    re-homed buckets the leavers owned: ``moved_from(previous)`` <= their ownerships. When replicas join,
    every new ownership lands on a joining replica, at most one per bucket of share > 0 (zero-share
    buckets are already covered). Not balanced after a leave: survivors only re-home the leavers' buckets,
    so co-owners of a bucket that lost an owner carry more (krea mix, 8 -> 7 replicas: up to ~1.6x the mean
    load); a fresh assignment (``previous=None``) rebalances at the cost of more captures.

    Args:
        buckets: demand per bucket.
        replicas: the current replicas (ids must be unique).
        previous: the assignment before the replica set changed, or None for a fresh one.
        hot_share: buckets with at least this share of requests get >= 2 owners.
        graph_overhead_bytes: bytes each owned graph adds beyond the largest one in the shared pool.
        balance_tolerance: allowed load spread (max - min) as a fraction of the mean replica load.

    Returns:
        The assignment. Buckets no replica can hold are in ``unplaceable``; they are never dropped
        silently.

    Raises:
        ValueError: duplicate replica ids, a negative share or byte count, or a negative tolerance.
    """
    ids = [r.replica_id for r in replicas]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate replica ids in {sorted(ids)}")
    if any(d.share < 0 or d.graph_bytes < 0 for d in buckets.values()):
        raise ValueError("bucket shares and graph bytes must be >= 0")
    if graph_overhead_bytes < 0 or balance_tolerance < 0:
        raise ValueError("graph_overhead_bytes and balance_tolerance must be >= 0")
    st = _State(dict(sorted(buckets.items())), replicas, graph_overhead_bytes)

    # 1. keep still-valid ownerships
    if previous is not None:
        for b in st.owners:
            for r in sorted(previous.owners.get(b, ())):
                if r in st.budget and st.fits(r, b):
                    st.add(r, b)

    # 2. cover
    hot_owners = 2 if len(st.ids) >= 2 else 1
    order = sorted(st.owners, key=lambda b: (-st.demands[b].share, -st.demands[b].graph_bytes, b))
    unplaceable: list[BucketKey] = []
    under: list[BucketKey] = []
    for b in order:
        want = hot_owners if st.demands[b].share >= hot_share else 1
        while len(st.owners[b]) < want:
            cands = [r for r in st.ids if st.fits(r, b)]
            if not cands:
                break
            if st.demands[b].share > 0:
                pick = min(cands, key=lambda r: (st.load(r), len(st.owned[r]), r))
            else:  # no load to balance: spread the graphs (capture time, overhead bytes) instead
                pick = min(cands, key=lambda r: (len(st.owned[r]), st.load(r), r))
            st.add(pick, b)
        if not st.owners[b]:
            unplaceable.append(b)
        elif len(st.owners[b]) < want:
            under.append(b)

    # 3. balance by adding co-owners (with a previous assignment: only onto replicas that joined)
    receivers = [r for r in st.ids if previous is None or r not in previous.buckets]
    if receivers:
        while True:
            loads = {r: st.load(r) for r in st.ids}
            mean = sum(loads.values()) / len(st.ids)
            src = max(st.ids, key=lambda r: (loads[r], r))
            dst = min(receivers, key=lambda r: (loads[r], r))
            if loads[src] - loads[dst] <= balance_tolerance * mean or src == dst:
                break
            best: tuple[float, BucketKey] | None = None
            for b in sorted(st.owned[src]):
                if not st.fits(dst, b) or st.demands[b].share <= 0:
                    continue
                k = len(st.owners[b])
                per_old, per_new = st.demands[b].share / k, st.demands[b].share / (k + 1)
                worst = max(loads[src] - per_old + per_new, loads[dst] + per_new)
                if worst < loads[src] - 1e-12 and (best is None or worst < best[0]):
                    best = (worst, b)
            if best is None:
                break
            st.add(dst, best[1])

    owners = {b: tuple(sorted(rs)) for b, rs in st.owners.items() if rs}
    return Assignment(
        owners=MappingProxyType(owners),
        buckets=MappingProxyType({r: tuple(sorted(st.owned[r])) for r in st.ids}),
        unplaceable=tuple(sorted(unplaceable)),
        under_replicated=tuple(sorted(under)),
        loads=MappingProxyType({r: st.load(r) for r in st.ids}),
        graph_bytes=MappingProxyType({r: st.memory(r) for r in st.ids}),
    )
