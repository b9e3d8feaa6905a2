"""The traffic histogram: bounded counting of request shapes, its JSON snapshot, reading it back from a file or
a server, and its Prometheus counters. The replica recording what it accepts (``/v1/buckets`` ``traffic``) is
``tests/serve/test_traffic_serve.py``."""

from __future__ import annotations

import json
import threading

import pytest
from test_prometheus import FakeBackend

from bcg_core import GenerationRequest, RequestValidator, TrafficHistogram, ValidatedRequest, load_traffic
from bcg_core.config import EngineConfig
from bcg_core.keys import ShapeQuery
from bcg_core.metrics import BucketMetrics
from bcg_core.planning.traffic import TrafficKey, text_bucket
from bcg_core.table import BucketLookup
from deployments.introspection import merged_traffic
from deployments.metrics import METRICS, BucketExporter
from stub_http import StubServer


def _validated(width=256, height=256, n=1, tokens=7, steps=1, cfg=False) -> ValidatedRequest:
    """A validated request of the given shape, built by hand (the histogram reads only its request and query rows)."""
    request = GenerationRequest("p", n=n, width=width, height=height, num_inference_steps=steps,
                                guidance_scale=2.0 if cfg else 0.0, seed=0)
    query = ShapeQuery(n * (2 if cfg else 1), (width // 16) * (height // 16), 256)
    return ValidatedRequest(request, BucketLookup(query, None), tokens, (height // 16, width // 16), None)


def _shapes(snap: dict) -> dict[tuple, int]:
    return {tuple(s[f] for f in TrafficKey._fields): s["count"] for s in snap["shapes"]}


# -- the histogram ----------------------------------------------------------------------------------------


def test_requests_are_counted_by_size_n_prompt_tokens_and_steps():
    h = TrafficHistogram()
    for _ in range(3):
        h.record(_validated(512, 768, n=2, tokens=40, steps=4, cfg=True))
    h.record(_validated(512, 768, n=2, tokens=41, steps=4))  # one more prompt token: another shape
    h.record(_validated(768, 512, n=2, tokens=40, steps=4))  # width and height are not interchangeable
    snap = h.snapshot()
    assert snap["total"] == 5 and snap["dropped"] == 0 and snap["max_shapes"] == 512 and snap["version"] == 1
    assert _shapes(snap) == {(512, 768, 2, 40, 4): 3, (512, 768, 2, 41, 4): 1, (768, 512, 2, 40, 4): 1}
    assert snap["shapes"][0]["cfg_count"] == 3 and snap["shapes"][1]["cfg_count"] == 0
    assert h.count((512, 768, 2, 40, 4)) == 3 and h.count(TrafficKey(1, 1, 1, 1, 1)) == 0 and len(h) == 3
    json.dumps(snap)  # JSON-safe


def test_the_validator_count_is_recorded_not_the_padded_text_length():
    cfg = EngineConfig.model_validate({"buckets": {"batch_sizes": [1, 2, 4], "resolutions": ["256x256"],
                                                  "text_lengths": [256]}})
    validator = RequestValidator.from_config(cfg)
    validated = validator.validate(GenerationRequest("a lighthouse at dusk", n=2, width=256, height=256,
                                                num_inference_steps=1, guidance_scale=2.0))
    assert validated.lookup.query.text_tokens == 256  # the tiny model's fixed native text length
    h = TrafficHistogram()
    h.record(validated)
    (entry,) = h.snapshot()["shapes"]
    assert entry["text_tokens"] == validator.count_tokens("a lighthouse at dusk") == validated.prompt_tokens < 256
    assert (entry["n"], entry["steps"], entry["cfg_count"]) == (2, 1, 1)  # guidance 2.0: uncond rows


def test_shapes_beyond_the_bound_are_counted_as_dropped_never_lost():
    h = TrafficHistogram(max_shapes=2)
    h.record(_validated(tokens=1))
    h.record(_validated(tokens=2))
    h.record(_validated(tokens=3))  # a third shape: dropped
    h.record(_validated(tokens=3))
    h.record(_validated(tokens=1))  # a kept shape still counts
    snap = h.snapshot()
    assert _shapes(snap) == {(256, 256, 1, 1, 1): 2, (256, 256, 1, 2, 1): 1}
    assert snap["dropped"] == 2 and snap["total"] == 5 == sum(_shapes(snap).values()) + snap["dropped"]
    with pytest.raises(ValueError, match="max_shapes"):
        TrafficHistogram(max_shapes=0)


def test_the_snapshot_is_sorted_by_count_largest_first():
    h = TrafficHistogram()
    for tokens, times in ((5, 1), (6, 4), (7, 2), (8, 4)):
        for _ in range(times):
            h.record(_validated(tokens=tokens))
    snap = h.snapshot()
    assert [(s["text_tokens"], s["count"]) for s in snap["shapes"]] == [(6, 4), (8, 4), (7, 2), (5, 1)]


def test_concurrent_records_keep_the_total_exact():
    h = TrafficHistogram(max_shapes=8)
    validated_requests = [_validated(tokens=t) for t in range(12)]  # 12 shapes, 8 kept

    def work():
        for _ in range(500):
            for p in validated_requests:
                h.record(p)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    snap = h.snapshot()
    assert snap["total"] == 4 * 500 * 12
    assert len(snap["shapes"]) == 8 and all(s["count"] == 2000 for s in snap["shapes"])
    assert snap["dropped"] == 4 * 500 * 4


def test_save_and_load_round_trip(tmp_path):
    h = TrafficHistogram(max_shapes=3)
    for tokens in (1, 1, 2, 3, 4):
        h.record(_validated(tokens=tokens, cfg=tokens == 1))
    path = tmp_path / "traffic.json"
    h.save(path)
    again = TrafficHistogram.load(path)
    assert again.snapshot() == h.snapshot()
    assert again.total == 5 and again.dropped == 1 and again.max_shapes == 3
    assert load_traffic(str(path)).snapshot() == h.snapshot()
    (tmp_path / "buckets.json").write_text(json.dumps({"model": {}, "traffic": h.snapshot()}))  # a saved answer
    assert load_traffic(str(tmp_path / "buckets.json")).snapshot() == h.snapshot()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not JSON"):
        TrafficHistogram.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        load_traffic(str(tmp_path / "missing.json"))


def _valid() -> dict:
    h = TrafficHistogram(max_shapes=4)
    h.record(_validated(tokens=3, cfg=True))
    h.record(_validated(tokens=3))
    h.record(_validated(tokens=9))
    return h.snapshot()


def test_an_edit_is_recorded_with_the_steps_it_runs_and_counted_as_an_edit():
    """An edit at strength 0.6 of 28 steps runs 17 (diffusers' get_timesteps): that is its traffic's steps, so
    ``bcg plan`` weighs its forwards as they run; ``edit_count`` survives a snapshot, a merge and a reload."""
    import dataclasses

    edit = _validated(512, 512, steps=28)
    edit = dataclasses.replace(edit, request=dataclasses.replace(edit.request, image=b"png", strength=0.6))
    h = TrafficHistogram()
    h.record(edit)
    h.record(_validated(512, 512, steps=28))
    snap = h.snapshot()
    assert {(s["steps"], s["count"], s["edit_count"]) for s in snap["shapes"]} == {(17, 1, 1), (28, 1, 0)}
    both = TrafficHistogram.merged([snap, TrafficHistogram.from_snapshot(snap)]).snapshot()
    assert {(s["steps"], s["edit_count"]) for s in both["shapes"]} == {(17, 2), (28, 0)}


@pytest.mark.parametrize("field, edit", [
    ("version", lambda s: s.update(version=2)),
    ("total", lambda s: s.update(total=-1)),
    ("total", lambda s: s.update(total=99)),  # not sum(count) + dropped
    ("dropped", lambda s: s.update(dropped="0")),
    ("max_shapes", lambda s: s.update(max_shapes=0)),
    ("since", lambda s: s.update(since="yesterday")),
    ("shapes", lambda s: s.update(shapes={})),
    ("shapes", lambda s: s.update(max_shapes=1)),  # two shapes, bound 1
    ("shapes[0].width", lambda s: s["shapes"][0].update(width=0)),
    ("shapes[1].steps", lambda s: s["shapes"][1].pop("steps")),
    ("shapes[0].count", lambda s: s["shapes"][0].update(count=True)),
    ("shapes[0].cfg_count", lambda s: s["shapes"][0].update(cfg_count=5)),
    ("shapes[0].edit_count", lambda s: s["shapes"][0].update(edit_count=5)),
    ("shapes[1]", lambda s: s["shapes"].__setitem__(1, dict(s["shapes"][0]))),  # a repeated shape
    ("shapes[0]", lambda s: s["shapes"].__setitem__(0, [1, 2])),
])
def test_from_snapshot_names_the_bad_field(field, edit):
    snap = _valid()
    assert TrafficHistogram.from_snapshot(snap).snapshot() == snap
    edit(snap)
    with pytest.raises(ValueError, match=f"'{field}'".replace("[", r"\[").replace("]", r"\]")):
        TrafficHistogram.from_snapshot(snap)
    with pytest.raises(ValueError, match="JSON object"):
        TrafficHistogram.from_snapshot([])


def test_merge_sums_counts_totals_and_dropped_and_keeps_the_earlier_start():
    a = TrafficHistogram(max_shapes=2, since="2025-01-02T00:00:00+00:00")
    b = TrafficHistogram(max_shapes=2, since="2025-01-01T00:00:00+00:00")
    a.record(_validated(tokens=1, cfg=True))
    a.record(_validated(tokens=2))
    a.record(_validated(tokens=5))  # dropped in a
    b.record(_validated(tokens=1))
    b.record(_validated(tokens=3))
    b.record(_validated(tokens=3))
    both = TrafficHistogram.merged([a.snapshot(), b])
    snap = both.snapshot()
    assert snap["max_shapes"] == 4 and snap["since"] == "2025-01-01T00:00:00+00:00"
    assert _shapes(snap) == {(256, 256, 1, 1, 1): 2, (256, 256, 1, 3, 1): 2, (256, 256, 1, 2, 1): 1}
    assert snap["shapes"][0]["cfg_count"] == 1
    assert snap["total"] == 6 and snap["dropped"] == 1
    a.merge(b.snapshot())  # into a's own bound of 2: the new shape (3) does not fit and is dropped
    assert a.total == 6 and a.dropped == 3 and _shapes(a.snapshot())[(256, 256, 1, 1, 1)] == 2
    with pytest.raises(ValueError, match="'version'"):
        a.merge({"shapes": []})


def test_text_bucket_is_the_smallest_text_length_that_holds_the_tokens():
    assert text_bucket(1, [256, 64]) == "64" and text_bucket(64, [64, 256]) == "64"
    assert text_bucket(65, [64, 256]) == "256" and text_bucket(257, [64, 256]) == "over"
    assert text_bucket(3, []) == "over"


# -- load_traffic from a server ------------------------------------------------------------------------------


def test_load_traffic_reads_the_traffic_section_of_a_server():
    snap = _valid()
    with StubServer(json.dumps({"replica": "r1", "traffic": snap}).encode()) as server:
        assert load_traffic(server.url + "/", timeout_s=5).snapshot() == snap
        assert load_traffic(server.url + "/v1/buckets", timeout_s=5).snapshot() == snap
        assert load_traffic(server.url + "/v1", timeout_s=5).snapshot() == snap  # the openai client's base URL
    assert server.paths == ["/v1/buckets"] * 3


def test_load_traffic_names_the_url_when_the_section_is_missing_or_the_server_fails():
    with StubServer(json.dumps({"replica": "r1"}).encode()) as server, pytest.raises(ValueError) as missing:
        load_traffic(server.url, timeout_s=5)
    assert f"{server.url}/v1/buckets" in str(missing.value) and "no 'traffic' section" in str(missing.value)
    with (StubServer(json.dumps({"traffic": None}).encode()) as server,
          pytest.raises(ValueError, match="traffic.record")):
        load_traffic(server.url, timeout_s=5)
    with StubServer(b"{}", status=503) as server, pytest.raises(ConnectionError) as failed:
        load_traffic(server.url, timeout_s=5)
    assert f"GET {server.url}/v1/buckets answered HTTP 503" in str(failed.value)
    url = server.url  # closed now: refused
    with pytest.raises(ConnectionError, match=rf"could not read {url}/v1/buckets"):
        load_traffic(url, timeout_s=2)


# -- the ingress merges the replicas' histograms -------------------------------------------------------------


def test_the_ingress_merges_every_replicas_traffic_once():
    here, there = TrafficHistogram(), TrafficHistogram()
    here.record(_validated(tokens=1))
    there.record(_validated(tokens=1))
    there.record(_validated(tokens=2))
    stale_here = TrafficHistogram().snapshot()  # the answering replica's last heartbeat: older than its stats
    stats = {"replica": "a", "traffic": here.snapshot()}
    ownership = {"replicas": {"a": {"stats": {"served": {}, "traffic": stale_here}},
                              "b": {"stats": {"served": {}, "traffic": there.snapshot()}},
                              "c": {"stats": {"served": {}, "traffic": {"version": 7}}}}}  # invalid: left out
    merged = merged_traffic(stats, ownership)
    assert _shapes(merged) == {(256, 256, 1, 1, 1): 2, (256, 256, 1, 2, 1): 1} and merged["total"] == 3
    assert all("traffic" not in r["stats"] for r in ownership["replicas"].values())  # shown once, merged
    assert merged_traffic({"replica": "a", "traffic": None}, {"replicas": {}}) is None


def test_the_traffic_of_a_replica_that_left_stays_in_the_merged_histogram():
    """A replica removed by autoscaling (or dead, or with a lapsed lease) takes its histogram away from the
    heartbeats: the coordinator keeps its last one (its final one when it leaves gracefully), counts it once
    when it comes back or still answers, and past ``DEPARTED_KEPT`` sums the least recently reported into one."""
    import asyncio
    import copy

    from deployments.coordinator import DEPARTED_KEPT, EARLIER, BucketCoordinator
    from deployments.settings import ServeConfig

    def hist(*tokens: int) -> dict:
        h = TrafficHistogram()
        for t in tokens:
            h.record(_validated(tokens=t))
        return h.snapshot()

    def total(coord, here: str, traffic: dict | None) -> int:  # what /v1/buckets answers from replica `here`
        return merged_traffic({"replica": here, "traffic": traffic}, copy.deepcopy(coord.snapshot()))["total"]

    async def run() -> None:
        cls = BucketCoordinator.func_or_class
        coord = cls.__new__(cls)
        await coord.__init__(ServeConfig().model_dump(mode="json"), 2)
        now = [0.0]
        coord.table.clock = lambda: now[0]
        for rid in ("a", "b", "c"):
            coord.table.join(rid, 1 << 30, (), ())
        coord.heartbeat("a", 1 << 30, [], [], None, {"traffic": hist(1)})
        coord.heartbeat("b", 1 << 30, [], [], None, {"traffic": hist(2)})
        coord.heartbeat("c", 1 << 30, [], [], None, {"traffic": {"version": 7}})  # invalid: never kept
        coord.leave("b", hist(2, 2, 3))  # its final histogram, newer than its last heartbeat's
        assert total(coord, "a", hist(1)) == 4 and set(coord.snapshot()["departed_traffic"]) == {"b"}
        coord.heartbeat("b", 1 << 30, [], [], None, {"traffic": hist(2, 2, 3)})  # back: counted once, live
        assert coord.snapshot()["departed_traffic"] == {} and total(coord, "a", hist(1)) == 4
        now[0] += coord.table.lease_s + 1  # b's lease lapses; a keeps heartbeating
        coord.heartbeat("a", 1 << 30, [], [], None, {"traffic": hist(1)})
        assert coord.table.expire() == ["b", "c"] and set(coord.snapshot()["departed_traffic"]) == {"b"}
        assert total(coord, "a", hist(1)) == 4
        assert total(coord, "b", hist(2, 2, 3, 4)) == 5  # b still answers: its fresh histogram, once
        coord.leave("b")  # a graceful leave without a final histogram keeps the last one
        assert total(coord, "a", hist(1)) == 4
        for i in range(DEPARTED_KEPT + 1):
            coord.leave(f"gone{i}", hist(5))
        departed = coord.snapshot()["departed_traffic"]
        assert len(departed) == DEPARTED_KEPT and list(departed)[0] == EARLIER
        assert departed[EARLIER]["total"] == 3 + 1 + 1  # b, gone0 and gone1, the least recently reported
        assert "gone1" not in departed and f"gone{DEPARTED_KEPT}" in departed
        assert total(coord, "a", hist(1)) == 1 + 3 + DEPARTED_KEPT + 1  # nothing lost in the sum
        coord._reaper.cancel()

    asyncio.run(run())


# -- Prometheus ---------------------------------------------------------------------------------------------


def test_traffic_counters_are_pushed_by_their_increase_with_bounded_tags():
    h = TrafficHistogram(max_shapes=3)
    backend = FakeBackend()
    ex = BucketExporter(lambda: {"buckets": [], "misses": {}}, BucketMetrics([]), backend=backend,
                        traffic=h.snapshot, text_lengths=[256, 64])
    assert {"bcg_traffic_requests", "bcg_traffic_dropped"} <= {s.name for s in METRICS}
    h.record(_validated(512, 768, n=2, tokens=10, steps=4))
    h.record(_validated(512, 768, n=2, tokens=20, steps=4))  # another shape, the same text bucket: one series
    h.record(_validated(256, 256, tokens=100))
    h.record(_validated(256, 256, tokens=300))  # a fourth shape: dropped
    ex.push()
    m = backend.m["bcg_traffic_requests"]
    assert m.total(size="512x768", n="2", steps="4", text="64") == 2
    assert m.total(size="256x256", n="1", steps="1", text="256") == 1
    assert {tuple(sorted(t.items())) for _, t in m.calls} == {
        (("n", "2"), ("size", "512x768"), ("steps", "4"), ("text", "64")),
        (("n", "1"), ("size", "256x256"), ("steps", "1"), ("text", "256"))}
    assert backend.m["bcg_traffic_dropped"].total() == 1
    before = backend.calls()
    ex.push()
    assert backend.calls() == before  # nothing new: no counter moves
    h.record(_validated(512, 768, n=2, tokens=10, steps=4))
    h.record(_validated(512, 768, n=2, tokens=600, steps=4))  # a new shape past the bound: dropped
    ex.push()
    assert m.calls[-1] == (1, {"size": "512x768", "n": "2", "steps": "4", "text": "64"})  # the increase only
    assert m.total(size="512x768") == 3 and backend.m["bcg_traffic_dropped"].total() == 2


def test_an_exporter_without_traffic_pushes_no_traffic_series():
    backend = FakeBackend()
    BucketExporter(lambda: {"buckets": [], "misses": {}}, BucketMetrics([]), backend=backend).push()
    BucketExporter(lambda: {"buckets": [], "misses": {}}, BucketMetrics([]), backend=backend,
                   traffic=lambda: None).push()
    assert backend.m["bcg_traffic_requests"].calls == [] == backend.m["bcg_traffic_dropped"].calls


def test_the_readme_documents_the_traffic_counters_and_section():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    operations, api = (docs / "OPERATIONS.md").read_text(), (docs / "API.md").read_text()
    metrics = operations.split("## Metrics (Prometheus)", 1)[1].split("\n## ", 1)[0]
    assert "`ray_bcg_traffic_requests_total`" in metrics and "`ray_bcg_traffic_dropped_total`" in metrics
    buckets = api.split("### `GET /v1/buckets` and `GET /healthz`", 1)[1].split("\n## ", 1)[0]
    assert "`traffic`" in buckets and "traffic.max_shapes" in api


def test_the_traffic_config_section_is_bounded_and_typed():
    from pydantic import ValidationError

    assert EngineConfig().traffic.record is True and EngineConfig().traffic.max_shapes == 512
    assert EngineConfig.model_validate({"traffic": {"record": False, "max_shapes": 1}}).traffic.max_shapes == 1
    for bad in ({"max_shapes": 0}, {"max_shapes": 100001}, {"shapes": 3}):
        with pytest.raises(ValidationError, match="traffic"):
            EngineConfig.model_validate({"traffic": bad})
