"""The shape-aware router end to end on a local Ray Serve instance (a 3-replica echo deployment routed by
:class:`router.shape_router.ShapeAwareRouter`); its tier ranking and routing loop with fake replicas are
``tests/unit/test_shape_router.py``.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from router.shape_router import ShapeAwareRouter

APP = "shape-router-test"
SHAPES = ["i1024_t256", "i1536_t256", "i2304_t256"]
SHARED = "i4096_m_t256"
"""Owned by the replicas of rank 0 and 1."""


@pytest.fixture(scope="module")
def echo_handle():
    """Deploy a 3-replica echo deployment routed by ShapeAwareRouter; reuse a running Ray (e.g. conftest's
    ``serve_apps``) or start and stop one for this module."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(
        num_replicas=3,
        max_ongoing_requests=8,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class=ShapeAwareRouter,
            request_routing_stats_period_s=0.2,
            request_router_kwargs={"fallback_wait_s": 20.0},
        ),
    )
    class ShapeEcho:
        def __init__(self):
            ctx = serve.get_replica_context()
            rank = getattr(ctx.rank, "rank", ctx.rank)
            self.owned = [SHAPES[rank % len(SHAPES)]] + ([SHARED] if rank in (0, 1) else [])
            self.polls = 0

        def record_routing_stats(self) -> dict:
            self.polls += 1
            return {"owned": self.owned, "ready": self.owned, "queue": {}, "capturing": False}

        async def __call__(self, shape: str) -> dict:
            await asyncio.sleep(0.01)
            return {"replica": serve.get_replica_context().replica_id.unique_id, "owned": self.owned,
                    "shape": shape, "polls": self.polls}

    started = not ray.is_initialized()
    if started:
        # address="local": a fresh Ray instance, never a cluster named by RAY_ADDRESS
        ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        if started:  # Serve's HTTP proxy on loopback at a free port (the default 8000 may be taken)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        handle = serve.run(ShapeEcho.bind(), name=APP, route_prefix=None)
        yield handle
    finally:
        try:
            serve.delete(APP)
        finally:
            if started:
                serve.shutdown()
                ray.shutdown()


@pytest.mark.serve
def test_keyed_calls_land_on_their_owners(echo_handle):
    # Until the first poll the router knows no owner: these wait (fallback 20 s) until the stats arrive.
    t0 = time.monotonic()
    first = [echo_handle.options(multiplexed_model_id=s).remote(s).result(timeout_s=30) for s in SHAPES]
    assert time.monotonic() - t0 < 15, "routing stats did not arrive"
    assert all(r["shape"] in r["owned"] for r in first)
    owner_of = {s: r["replica"] for s, r in zip(SHAPES, first, strict=True)}
    assert len(set(owner_of.values())) == 3, owner_of

    shapes = [(SHAPES + [SHARED])[i % 4] for i in range(60)]
    t0 = time.monotonic()
    responses = [echo_handle.options(multiplexed_model_id=s).remote(s) for s in shapes]
    results = [r.result(timeout_s=30) for r in responses]
    assert time.monotonic() - t0 < 15  # well inside the fallback window: no call waited for a fallback
    for s, r in zip(shapes, results, strict=True):
        assert r["shape"] == s and s in r["owned"], (s, r)
        if s != SHARED:
            assert r["replica"] == owner_of[s], (s, r, owner_of)
    shared_on = {r["replica"] for s, r in zip(shapes, results, strict=True) if s == SHARED}
    assert shared_on <= {owner_of[SHAPES[0]], owner_of[SHAPES[1]]}

    # un-keyed calls are not held back
    t0 = time.monotonic()
    assert echo_handle.remote("").result(timeout_s=10)["shape"] == ""
    assert time.monotonic() - t0 < 5
