"""What a benchmark waits for after ready (``deployments/cli/local.py``): every replica's owned shapes captured
(``runner.ready_after_s`` lets a replica report ready before), read from ``/v1/buckets`` answers."""

import json

import pytest

from deployments.cli.local import uncaptured_shapes, wait_captured
from stub_http import StubServer


def _answer(ready: list[str], peer_ready: list[str] | None = None) -> dict:
    out = {"routing": {"owned": ["i1024_t256", "i256_t256"], "ready": ready}}
    if peer_ready is not None:
        out["ownership"] = {"replicas": {"r2": {"owned": ["i512_t256"], "ready": peer_ready, "stats": {}}}}
    return out


def test_uncaptured_shapes_reads_the_answering_replica_and_every_peers_heartbeat():
    assert uncaptured_shapes(_answer(["i1024_t256"])) == ["i256_t256"]
    assert uncaptured_shapes(_answer(["i1024_t256", "i256_t256"])) == []
    assert uncaptured_shapes(_answer(["i1024_t256", "i256_t256"], peer_ready=[])) == ["i512_t256"]
    assert uncaptured_shapes(_answer(["i256_t256"], peer_ready=["i512_t256"])) == ["i1024_t256"]
    assert uncaptured_shapes({}) == []  # an answer without routing (an older server): nothing to wait for


def test_wait_captured_polls_until_every_shape_is_captured_and_times_out_naming_the_rest():
    answers = iter([_answer([]), _answer(["i1024_t256"])])
    final = {"answer": _answer(["i1024_t256", "i256_t256"])}

    with StubServer(lambda: json.dumps(next(answers, final["answer"])).encode()) as server:
        assert 0.9 <= wait_captured(server.url, timeout_s=20) < 20  # two polls 0.5 s apart before the third answers
        final["answer"] = _answer(["i1024_t256"])
        with pytest.raises(TimeoutError, match="i256_t256"):
            wait_captured(server.url, timeout_s=1.2)
