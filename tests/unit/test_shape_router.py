"""Tests of :mod:`router.shape_router`: the pure tier ranking and the router driven through Ray's own routing
loop with fake replicas (no Ray cluster). The end-to-end run on a local Ray Serve instance is
``tests/serve/test_shape_router_serve.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace

import pytest

from router.routing_key import RoutingKey
from router.shape_router import DEFAULT_FALLBACK_WAIT_S, TIERS, ShapeAwareRouter, rank_replicas

KEY = "i1024_t256"
OTHER = "i1536_t256"
K = RoutingKey(KEY)
NONE = RoutingKey()


def fake(rid: str, owned=(), ready=(), queue=None, capturing=False, stats=None, adapters=None) -> SimpleNamespace:
    """A replica as :func:`rank_replicas` sees it (``stats`` overrides the built stats, e.g. ``{}``)."""
    if stats is None:
        stats = {"owned": list(owned), "ready": list(ready), "queue": dict(queue or {}), "capturing": capturing}
        if adapters is not None:
            stats["adapters"] = list(adapters)
    return SimpleNamespace(replica_id=rid, routing_stats=stats)


def ids(lists) -> list[list[str]]:
    return [[r.replica_id for r in rs] for rs in lists]


# ---------------------------------------------------------------------------------------------------------
# rank_replicas: pure


def test_ready_owner_comes_before_warming_owner_and_non_owners_wait():
    reps = [fake("none"), fake("warm", owned=[KEY]), fake("ready", owned=[KEY], ready=[KEY])]
    assert rank_replicas(K, reps, waited_s=0.0, fallback_wait_s=2.0) == ("ready_owner", [reps[2:3], reps[1:2]])


def test_warming_owner_comes_before_non_owners():
    reps = [fake("none"), fake("warm", owned=[KEY], ready=[OTHER]), fake("other", owned=[OTHER], ready=[OTHER])]
    tier, lists = rank_replicas(K, reps, waited_s=0.0, fallback_wait_s=2.0)
    assert (tier, ids(lists)) == ("warming_owner", [["warm"]])
    tier, lists = rank_replicas(K, reps, waited_s=2.5, fallback_wait_s=2.0)
    assert (tier, ids(lists)) == ("warming_owner", [["warm"], ["none", "other"]])


def test_non_owners_are_offered_only_after_the_fallback_wait():
    reps = [fake("a", owned=[OTHER], ready=[OTHER]), fake("b")]
    assert rank_replicas(K, reps, waited_s=1.99, fallback_wait_s=2.0) == ("", [])
    tier, lists = rank_replicas(K, reps, waited_s=2.0, fallback_wait_s=2.0)
    assert tier == "fallback" and sorted(ids(lists)[0]) == ["a", "b"] and len(lists) == 1
    # an owner keeps its place in front of the fallback list
    reps.append(fake("owner", owned=[KEY], ready=[KEY]))
    tier, lists = rank_replicas(K, reps, waited_s=5.0, fallback_wait_s=2.0)
    assert tier == "ready_owner" and ids(lists)[0] == ["owner"] and sorted(ids(lists)[1]) == ["a", "b"]
    assert rank_replicas(K, reps[:2], waited_s=0.0, fallback_wait_s=0.0)[0] == "fallback"


def test_owners_are_ranked_by_queued_requests_of_the_shape():
    reps = [fake("busy", owned=[KEY], ready=[KEY], queue={KEY: 3}),
            fake("idle", owned=[KEY], ready=[KEY], queue={KEY: 0, OTHER: 1}),
            fake("some", owned=[KEY], ready=[KEY], queue={KEY: 1}),
            fake("w_busy", owned=[KEY], queue={KEY: 2}),
            fake("w_idle", owned=[KEY, OTHER], ready=[OTHER], queue={OTHER: 9})]
    tier, lists = rank_replicas(K, reps, waited_s=0.0, fallback_wait_s=2.0)
    assert tier == "ready_owner"
    assert ids(lists) == [["idle", "some", "busy"], ["w_idle", "w_busy"]]
    # equal shape queues: fewer queued in total first
    reps = [fake("x", ready=[KEY], queue={OTHER: 4}), fake("y", ready=[KEY], queue={OTHER: 1})]
    assert ids(rank_replicas(K, reps, 0.0, 2.0)[1]) == [["y", "x"]]


def test_fallback_prefers_replicas_not_capturing_then_short_queues():
    reps = [fake("cap", capturing=True), fake("long", queue={OTHER: 5}), fake("short", queue={OTHER: 1})]
    assert ids(rank_replicas(K, reps, 3.0, 2.0)[1]) == [["short", "long", "cap"]]


@pytest.mark.parametrize("stats", [{}, None, "garbage", {"owned": KEY, "ready": None, "queue": [1]}])
def test_replicas_with_missing_or_malformed_stats_are_not_owners(stats):
    reps = [SimpleNamespace(replica_id="new", routing_stats=stats), fake("owner", owned=[KEY])]
    assert ids(rank_replicas(K, reps, 0.0, 2.0)[1]) == [["owner"]]
    assert rank_replicas(K, reps[:1], 0.0, 2.0) == ("", [])
    assert ids(rank_replicas(K, reps[:1], 2.0, 2.0)[1]) == [["new"]]


def test_unkeyed_goes_to_every_replica_at_once():
    reps = [fake("a", owned=[KEY], ready=[KEY]), fake("b", stats={}), fake("c", owned=[OTHER])]
    assert rank_replicas(NONE, reps, 0.0, 2.0) == ("unkeyed", [reps])


def test_routing_keys_carry_sorted_adapters():
    assert str(K) == KEY and RoutingKey.parse(KEY) == K and K.keyed and not NONE.keyed
    key = RoutingKey.of(KEY, ["ink", "anime", "ink"])
    assert str(key) == KEY + "|lora=anime,ink" and RoutingKey.parse(str(key)) == key
    assert key.adapters == frozenset({"anime", "ink"})
    assert RoutingKey.parse(str(RoutingKey.of("", ["a"]))) == RoutingKey("", frozenset({"a"}))
    assert RoutingKey.parse(None) == RoutingKey.parse("") == NONE and str(NONE) == ""


def test_replicas_holding_the_adapters_come_first_within_a_tier_unless_much_busier():
    key = RoutingKey.of(KEY, ["anime"])
    reps = [fake("idle", ready=[KEY], queue={KEY: 0}), fake("holder", ready=[KEY], queue={KEY: 2}, adapters=["anime"]),
            fake("w_holder", owned=[KEY], adapters=["anime", "x"]), fake("w", owned=[KEY])]
    tier, lists = rank_replicas(key, reps, 0.0, 2.0, adapter_slack=2.0)
    assert tier == "ready_owner" and ids(lists) == [["holder"], ["idle"], ["w_holder"], ["w"]]
    # a holder more than the slack busier than an idle replica is one list with it (least queue first)
    reps[1].routing_stats["queue"][KEY] = 3
    assert ids(rank_replicas(key, reps, 0.0, 2.0, adapter_slack=2.0)[1])[0] == ["idle", "holder"]
    # every adapter must be held; the plain shape key ignores adapters
    both = RoutingKey.of(KEY, ["anime", "ink"])
    assert ids(rank_replicas(both, reps, 0.0, 2.0)[1])[:1] == [["idle", "holder"]]
    assert ids(rank_replicas(K, reps, 0.0, 2.0)[1]) == [["idle", "holder"], ["w", "w_holder"]]
    # a miss with adapters: holders first, by total queue
    tier, lists = rank_replicas(RoutingKey.of("", ["anime"]), reps, 0.0, 2.0)
    assert tier == "unkeyed" and ids(lists) == [["w_holder", "holder"], ["idle", "w"]]


def test_no_replicas_gives_no_candidates():
    assert rank_replicas(K, [], 10.0, 2.0) == ("", [])
    assert rank_replicas(NONE, [], 0.0, 2.0) == ("", [])


# ---------------------------------------------------------------------------------------------------------
# ShapeAwareRouter with fake replicas, driven by Ray's own routing code (no Ray cluster)


class FakeRunningReplica:
    """The part of ``RunningReplica`` Ray's base router uses, with a settable queue length."""

    def __init__(self, unique_id: str, stats: dict, queue_len: int = 0, max_ongoing: int = 2):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DeploymentID(name="dit", app_name="t"))
        self.routing_stats = stats
        self.queue_len = queue_len
        self.max_ongoing_requests = max_ongoing
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len

    def push_proxy_handle(self, handle) -> None:
        pass


_request_ids = itertools.count()


def make_router(clock=None, **kwargs) -> ShapeAwareRouter:
    """A router built the way Serve's ``AsyncioRouter`` builds it (the extra keyword arguments Serve passes
    for its locality mixin included), then ``initialize_state(**request_router_kwargs)``."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = ShapeAwareRouter(
        deployment_id=DeploymentID(name="dit", app_name="t"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        self_node_id="node",
        self_actor_id="",
        self_actor_handle=None,
        use_replica_queue_len_cache=False,
        get_curr_time_s=clock,
        create_replica_wrapper_func=None,
        prefer_local_node_routing=False,
        prefer_local_az_routing=False,
        self_availability_zone=None,
        initial_backoff_s=0.01,
        backoff_multiplier=2,
        max_backoff_s=0.05,
    )
    router.initialize_state(**kwargs)
    return router


def make_request(key: str, created_at: float | None = None, internal_id: str | None = None):
    """A ``PendingRequest`` keyed by ``key`` (call inside a running event loop)."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    n = next(_request_ids)
    meta = RequestMetadata(request_id=f"r{n}", internal_request_id=internal_id or f"i{n}",
                           multiplexed_model_id=key)
    pr = PendingRequest(args=[], kwargs={}, metadata=meta)
    if created_at is not None:
        pr.created_at = created_at
    return pr


def test_initialize_state_takes_fallback_wait_and_rejects_bad_values():
    assert make_router().fallback_wait_s == DEFAULT_FALLBACK_WAIT_S == 2.0
    assert make_router(fallback_wait_s=0.25, unknown_option=1).fallback_wait_s == 0.25
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            make_router(fallback_wait_s=bad)


def test_choose_replicas_tiers_backoff_and_counts():
    async def main():
        now = [1000.0]
        router = make_router(clock=lambda: now[0], fallback_wait_s=2.0)
        owner = FakeRunningReplica("owner", {"owned": [KEY], "ready": [KEY], "queue": {}, "capturing": False})
        warm = FakeRunningReplica("warm", {"owned": [KEY], "ready": [], "queue": {}, "capturing": True})
        new = FakeRunningReplica("new", {})
        reps = [new, warm, owner]

        pr = make_request(KEY, created_at=now[0])
        assert pr.routing_context.should_backoff is False  # Ray's default: no backoff, i.e. a busy loop
        assert await router.choose_replicas(reps, pr) == [[owner], [warm]]
        assert pr.routing_context.should_backoff is True
        # asked again while it waits (all candidates full): still backs off, not counted twice
        pr.routing_context.should_backoff = False
        assert await router.choose_replicas(reps, pr) == [[owner], [warm]]
        assert pr.routing_context.should_backoff is True
        assert router.decisions == {"ready_owner": 1, "warming_owner": 0, "fallback": 0, "unkeyed": 0}

        # no owner at all: nothing to offer inside the window, so it must back off; then every replica
        lone = make_request(OTHER, created_at=now[0])
        assert await router.choose_replicas(reps, lone) == []
        assert lone.routing_context.should_backoff is True
        now[0] += 1.9
        assert await router.choose_replicas(reps, lone) == []
        now[0] += 0.2
        lists = await router.choose_replicas(reps, lone)
        assert [[r.replica_id.unique_id for r in rs] for rs in lists] == [["new", "owner", "warm"]]
        assert lone.routing_context.should_backoff is True

        un = make_request("")
        assert await router.choose_replicas(reps, un) == [reps]
        assert router.decisions == {"ready_owner": 1, "warming_owner": 0, "fallback": 1, "unkeyed": 1}
        assert set(router.decisions) == set(TIERS)

    asyncio.run(main())


def test_routing_loop_waits_for_a_full_owner_then_falls_back():
    async def main():
        router = make_router(fallback_wait_s=0.4)
        owner = FakeRunningReplica("owner", {"owned": [KEY], "ready": [KEY], "queue": {KEY: 1}}, queue_len=1)
        other = FakeRunningReplica("other", {"owned": [OTHER], "ready": [OTHER], "queue": {}}, queue_len=0)
        router.update_replicas([owner, other])

        # the owner has room: it gets the request although the other replica has the shorter queue
        t0 = time.monotonic()
        got = await asyncio.wait_for(router._choose_replica_for_request(make_request(KEY)), 5)
        assert got is owner and time.monotonic() - t0 < 0.3

        # the owner is full: the request waits for fallback_wait_s, then takes the other replica
        owner.queue_len = owner.max_ongoing_requests
        t0 = time.monotonic()
        got = await asyncio.wait_for(router._choose_replica_for_request(make_request(KEY)), 5)
        waited = time.monotonic() - t0
        assert got is other and 0.35 <= waited < 2.0, waited
        assert router.decisions["ready_owner"] == 2 and router.decisions["fallback"] == 0

    asyncio.run(main())


def test_sibling_calls_sharing_an_internal_request_id_each_get_their_own_owner():
    """Calls made while serving one parent request share its internal_request_id; Ray's base class would give
    the replica found for one sibling to the other and leave one of them unrouted forever."""

    async def main():
        router = make_router(fallback_wait_s=60.0)
        a = FakeRunningReplica("a", {"owned": [KEY], "ready": [KEY]})
        b = FakeRunningReplica("b", {"owned": [OTHER], "ready": [OTHER]})
        router.update_replicas([a, b])
        for _ in range(5):
            prs = [make_request(KEY, internal_id="parent"), make_request(OTHER, internal_id="parent"),
                   make_request(KEY, internal_id="parent")]
            got = await asyncio.wait_for(
                asyncio.gather(*(router._choose_replica_for_request(pr) for pr in prs)), 5)
            assert [g.replica_id.unique_id for g in got] == ["a", "b", "a"]
        # Ray's per-key index of pending requests does not keep finished requests alive
        assert not router._pending_requests_by_model_id

    asyncio.run(main())


def test_requests_waiting_for_a_busy_owner_do_not_hold_up_other_shapes():
    """Ray starts at most 2 x replicas routing tasks, each bound to one request until it is placed; here the
    router must still place a request whose owner is idle while more requests than that wait for theirs."""

    async def main():
        router = make_router(fallback_wait_s=1.0)
        busy = FakeRunningReplica("busy", {"owned": [KEY], "ready": [KEY]}, queue_len=2, max_ongoing=2)
        idle = FakeRunningReplica("idle", {"owned": [OTHER], "ready": [OTHER]}, queue_len=0, max_ongoing=100)
        router.update_replicas([busy, idle])
        waiting = [asyncio.ensure_future(router._choose_replica_for_request(make_request(KEY))) for _ in range(6)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        got = await asyncio.wait_for(router._choose_replica_for_request(make_request(OTHER)), 5)
        assert got is idle and time.monotonic() - t0 < 0.5
        assert not any(w.done() for w in waiting)  # still inside their fallback window
        assert {r.replica_id.unique_id for r in await asyncio.wait_for(asyncio.gather(*waiting), 5)} == {"idle"}

    asyncio.run(main())
