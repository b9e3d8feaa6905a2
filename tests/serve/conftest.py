"""The serve tests' fixture: one local Ray Serve instance for the session (the clean ``os.environ`` per test is
``tests/conftest.py``'s, for every folder).

The ``serve_apps`` fixture starts Ray (4 logical CPUs, no dashboard) and Serve on 127.0.0.1 at a free
port with two small applications, both on the tiny default model and a small bucket table (batch rows
[1, 2, 4], resolutions 256x256 and 512x512, text 256 tokens):

- ``/`` (app ``bcg``): miss policy eager (a miss runs unpadded and is counted);
- ``/reject`` (app ``bcg-reject``): miss policy reject (a miss is answered 422).

Tests use 256x256 and 1-2 steps so the suite stays small on a 2-core CI machine.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import pytest

SMALL_BUCKETS = {"batch_sizes": [1, 2, 4], "resolutions": ["256x256", "512x512"], "text_lengths": [256]}
EAGER_CONFIG = {"buckets": {**SMALL_BUCKETS, "miss_policy": "eager"}}
REJECT_CONFIG = {"buckets": {**SMALL_BUCKETS, "miss_policy": "reject"}}


@dataclass(frozen=True)
class ServeApps:
    """Where the test applications listen.

    Attributes:
        port: HTTP port on 127.0.0.1.
        base_url: ``http://127.0.0.1:PORT`` (eager-miss app at route prefix ``/``).
        reject_url: base URL of the reject-miss app (route prefix ``/reject``).
        app_name: Serve name of the eager-miss app; reject_app_name: of the reject-miss app.
    """

    port: int
    base_url: str
    reject_url: str
    app_name: str = "bcg"
    reject_app_name: str = "bcg-reject"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_apps():
    """Start Ray and Serve with the two small applications; shut both down after the session."""
    import ray
    from ray import serve

    from deployments import build_app

    port = _free_port()
    # address="local": always a new Ray instance, never a cluster named by RAY_ADDRESS or found running
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        apps = ServeApps(port=port, base_url=f"http://127.0.0.1:{port}", reject_url=f"http://127.0.0.1:{port}/reject")
        serve.run_many(
            [
                serve.RunTarget(build_app({"config": EAGER_CONFIG}), name=apps.app_name, route_prefix="/"),
                serve.RunTarget(build_app({"config": REJECT_CONFIG}), name=apps.reject_app_name,
                                route_prefix="/reject"),
            ]
        )
        yield apps
    finally:
        serve.shutdown()
        ray.shutdown()
