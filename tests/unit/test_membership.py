"""OwnershipTable: join window, heartbeats, lease expiry and graceful leave move shapes to survivors."""

from __future__ import annotations

import pytest

from bcg_core.config import EngineConfig
from router.membership import OwnershipTable
from router.ownership import BucketDemand, demands_for_config, expected_load, krea_rows, shape_shares

GiB = 1 << 30


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def demands() -> dict[str, BucketDemand]:
    return demands_for_config(EngineConfig())


def covered(table: OwnershipTable) -> set[str]:
    return {s for r in table.members for s in (table.owned(r) or ())}


def test_demands_from_config_cover_every_shape_with_krea_shares(demands):
    from bcg_core.validation import RequestValidator

    assert set(demands) == {k.shape for k in RequestValidator.from_config(EngineConfig()).table.keys}
    assert sum(d.share for d in demands.values()) == pytest.approx(1.0)
    # 512x512 is about half of the krea requests (docs/DESIGN.md section 8) but a third of the work: shares are
    # weighted by padded tokens, so a 1024x1024 request counts ~4x
    validator = RequestValidator.from_config(EngineConfig())
    by_requests = shape_shares(expected_load(validator, krea_rows(), by="requests").shares)
    assert by_requests["i1024_t256"] == pytest.approx(0.49, abs=0.03)
    assert demands["i1024_t256"].share == pytest.approx(0.34, abs=0.03)
    assert demands["i4096_m_t256"].share > 2 * by_requests["i4096_m_t256"]
    # graph bytes grow with the shape's tokens
    assert demands["i4096_t256"].graph_bytes > demands["i1024_t256"].graph_bytes > demands["i256_t256"].graph_bytes


def test_first_assignment_waits_for_expected_replicas(demands):
    clock = Clock()
    t = OwnershipTable(demands, expected=3, join_window_s=30, clock=clock)
    t.join("a", 10 * GiB)
    t.join("b", 10 * GiB)
    assert t.owned("a") is None and t.heartbeat("b", 10 * GiB) is None
    t.join("c", 10 * GiB)
    owned = {r: set(t.owned(r)) for r in "abc"}
    assert set().union(*owned.values()) == set(demands)
    # a fresh assignment splits the shapes: nobody captures everything
    assert all(len(o) < len(demands) for o in owned.values())
    # hot shapes (>= 10% of requests) have two owners
    for shape, d in demands.items():
        owners = [r for r in "abc" if shape in owned[r]]
        assert len(owners) >= (2 if d.share >= 0.10 else 1), shape


def test_join_window_closes_on_time(demands):
    clock = Clock()
    t = OwnershipTable(demands, expected=3, join_window_s=30, clock=clock)
    t.join("a", 10 * GiB)
    clock.t += 29
    assert t.heartbeat("a", 10 * GiB) is None
    clock.t += 2
    assert set(t.heartbeat("a", 10 * GiB)) == set(demands)


def test_expired_replica_shapes_move_to_survivors_and_nothing_else_moves(demands):
    clock = Clock()
    t = OwnershipTable(demands, expected=3, lease_s=5, clock=clock)
    for r in "abc":
        t.join(r, 10 * GiB)
    before = {r: set(t.owned(r)) for r in "abc"}
    version = t.version
    clock.t += 3
    t.heartbeat("a", 10 * GiB)
    t.heartbeat("b", 10 * GiB)
    clock.t += 3  # c silent for 6 s > lease
    assert t.expire() == ["c"]
    assert t.version == version + 1
    after = {r: set(t.owned(r)) for r in "ab"}
    assert covered(t) == set(demands)
    for r in "ab":
        assert before[r] <= after[r]  # survivors keep what they had
        assert after[r] - before[r] <= before["c"]  # and only gain the leaver's shapes
    assert t.owned("c") is None
    assert [e["event"] for e in t.events][-1] == "expired"


def test_graceful_leave_and_rejoin_adopts_reported_shapes(demands):
    clock = Clock()
    t = OwnershipTable(demands, expected=2, clock=clock)
    t.join("a", 10 * GiB)
    t.join("b", 10 * GiB)
    assert t.leave("b") and not t.leave("b")
    assert set(t.owned("a")) == set(demands)
    # a replica the table does not know (coordinator restart) re-joins with the shapes it holds
    t2 = OwnershipTable(demands, expected=1, clock=clock)
    t2.join("x", 10 * GiB)
    held = ("i1024_t256", "i256_t256")
    t2.heartbeat("y", 10 * GiB, owned=held, ready=held)
    assert set(held) <= set(t2.owned("y"))


def test_joiner_gets_only_new_ownerships(demands):
    clock = Clock()
    t = OwnershipTable(demands, expected=2, clock=clock)
    t.join("a", 10 * GiB)
    t.join("b", 10 * GiB)
    before = {r: set(t.owned(r)) for r in "ab"}
    t.join("c", 10 * GiB)
    for r in "ab":
        assert set(t.owned(r)) == before[r]
    assert t.owned("c")  # the joiner takes load


def test_budget_is_respected_and_unplaceable_reported(demands):
    clock = Clock()
    small = min(d.graph_bytes for d in demands.values())
    t = OwnershipTable(demands, expected=1, clock=clock, graph_overhead_bytes=0)
    t.join("a", small)  # room for the smallest shape only
    snap = t.snapshot()
    assert snap["replicas"]["a"]["graph_bytes_model"] <= small
    assert set(snap["unplaceable"]) == set(demands) - set(t.owned("a"))


def test_bad_arguments():
    with pytest.raises(ValueError, match="expected >= 1"):
        OwnershipTable({}, expected=0)


def test_a_restarted_coordinator_rebuilds_the_assignment_the_replicas_hold(demands):
    clock = Clock()
    first = OwnershipTable(demands, expected=3, clock=clock)
    for r in "abc":
        first.join(r, 10 * GiB)
    held = {r: first.owned(r) for r in "abc"}
    # a new coordinator (expected 3, nothing assigned) hears the replicas' heartbeats one by one; a fresh
    # assignment for "c" and "b" alone would differ, so the first one must wait and then keep what each holds
    second = OwnershipTable(demands, expected=3, clock=clock)
    assert second.heartbeat("c", 10 * GiB, owned=held["c"], ready=held["c"]) is None
    assert second.heartbeat("b", 10 * GiB, owned=held["b"], ready=held["b"]) is None
    assert second.heartbeat("a", 10 * GiB, owned=held["a"], ready=held["a"]) == held["a"]
    assert {r: second.owned(r) for r in "abc"} == held
    assert second.moves == sum(map(len, held.values()))  # counted against nothing: no capture is asked for


def test_a_restarted_coordinator_fills_only_the_gaps_when_a_replica_is_gone(demands):
    clock = Clock()
    first = OwnershipTable(demands, expected=3, clock=clock)
    for r in "abc":
        first.join(r, 10 * GiB)
    held = {r: set(first.owned(r)) for r in "abc"}
    second = OwnershipTable(demands, expected=3, join_window_s=3, clock=clock)
    for r in "ab":  # "c" died with the coordinator
        assert second.heartbeat(r, 10 * GiB, owned=tuple(held[r]), ready=tuple(held[r])) is None
    clock.t += 4  # the join window closes without "c"
    for r in "ab":
        second.heartbeat(r, 10 * GiB, owned=tuple(held[r]), ready=tuple(held[r]))
    assert covered(second) == set(demands)
    for r in "ab":
        assert held[r] <= set(second.owned(r))


def test_a_replica_stalled_in_capture_gives_its_shapes_away_until_it_recovers(demands):
    clock = Clock()
    t = OwnershipTable(demands, expected=3, capture_stall_s=30, clock=clock)
    for r in "abc":
        t.join(r, 10 * GiB)
    before = {r: set(t.owned(r)) for r in "abc"}
    # capturing for 20 s: still fine
    assert set(t.heartbeat("c", 10 * GiB, owned=tuple(before["c"]), stats={"capturing_s": 20.0})) == before["c"]
    assert t.heartbeat("c", 10 * GiB, owned=tuple(before["c"]), stats={"capturing_s": 31.0}) is None
    assert t.stalled.keys() == {"c"} and "c" not in t.members and t.events[-1]["event"] == "stalled"
    assert covered(t) == set(demands)  # the survivors own c's shapes now
    for r in "ab":
        assert before[r] <= set(t.owned(r))
    assert t.snapshot()["stalled"] == ["c"]
    # still stuck: its heartbeats keep it out, however long it takes
    for _ in range(20):
        clock.t += 3
        t.heartbeat("a", 10 * GiB)
        t.heartbeat("b", 10 * GiB)
        assert t.heartbeat("c", 10 * GiB, owned=tuple(before["c"]), stats={"capturing_s": 91.0}) is None
        t.expire()
    assert "c" not in t.members and [e["event"] for e in t.events].count("stalled") == 1
    # the capture ended: it re-joins with what it holds
    owned = t.heartbeat("c", 10 * GiB, owned=tuple(before["c"]), ready=tuple(before["c"]), stats={"capturing_s": None})
    assert set(owned) >= before["c"] and not t.stalled
    assert [e["event"] for e in t.events][-2:] == ["recovered", "join"]


def test_a_replica_that_dies_while_stalled_is_forgotten(demands):
    clock = Clock()
    t = OwnershipTable(demands, expected=2, lease_s=5, capture_stall_s=30, clock=clock)
    t.join("a", 10 * GiB)
    t.join("b", 10 * GiB)
    assert t.heartbeat("b", 10 * GiB, stats={"capturing_s": 40.0}) is None and "b" in t.stalled
    clock.t += 4
    t.heartbeat("a", 10 * GiB)
    t.expire()
    assert "b" in t.stalled
    clock.t += 2  # b silent for 6 s > lease
    t.heartbeat("a", 10 * GiB)
    t.expire()
    assert not t.stalled


def test_the_only_replica_is_never_stalled_out(demands):
    t = OwnershipTable(demands, expected=1, capture_stall_s=30, clock=Clock())
    t.join("a", 10 * GiB)
    assert set(t.heartbeat("a", 10 * GiB, stats={"capturing_s": 99.0})) == set(demands)
    assert not t.stalled


def test_a_stall_time_must_be_positive(demands):
    with pytest.raises(ValueError, match="capture_stall_s"):
        OwnershipTable(demands, capture_stall_s=0)
