"""API keys end to end (the pure checks are ``tests/unit/test_api_keys.py``): one small application with keys at
``/auth`` on the session's Serve instance (``serve_apps``, ``tests/serve/conftest.py``): one key from the config,
one from a key file the way ``bcg serve --api-key-file`` adds it, and deletes it afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from deployments.settings import ServeConfig, api_key_digest

CONFIG_KEY = "sk-config-3f9c1a7e5b2d"
FILE_KEY = "sk-file-8e4b6d0c2a19"


# -- end to end --------------------------------------------------------------------------------------------

AUTH_CONFIG = {"buckets": {"batch_sizes": [1, 2], "resolutions": ["256x256"], "text_lengths": [256]},
               "routing": {"shape_aware": False}, "auth": {"api_keys": [CONFIG_KEY]}}


@pytest.fixture(scope="module")
def auth_url(serve_apps, tmp_path_factory):
    from ray import serve

    from deployments import build_app
    from deployments.cli.serve_command import with_key_file

    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# bcg serve --api-key-file\n{FILE_KEY}\n")
    config = with_key_file(ServeConfig.model_validate(AUTH_CONFIG), str(path))
    serve.run(build_app({"config": config.model_dump(mode="json")}), name="bcg-auth", route_prefix="/auth")
    try:
        yield f"{serve_apps.base_url}/auth"
    finally:
        serve.delete("bcg-auth")


def _openai(url: str, key: str):
    from openai import OpenAI

    http = httpx.Client(trust_env=False, timeout=120.0)
    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, http_client=http)


GEN_ARGS = dict(prompt="a lighthouse", size="256x256", n=1, extra_body={"num_inference_steps": 1, "seed": 3})


@pytest.mark.serve
@pytest.mark.parametrize("key", [CONFIG_KEY, FILE_KEY], ids=["config-key", "file-key"])
def test_openai_client_with_a_known_key_generates(auth_url, key):
    client = _openai(auth_url, key)
    assert len(client.images.generate(**GEN_ARGS).data) == 1
    assert [m.id for m in client.models.list()] == ["bcg-tiny-flux"]


@pytest.mark.serve
def test_openai_client_with_a_wrong_key_gets_401_in_openais_shape(auth_url):
    import openai

    client = _openai(auth_url, "sk-not-a-key")
    with pytest.raises(openai.AuthenticationError) as info:
        client.images.generate(**GEN_ARGS)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key" and info.value.body["type"] == "invalid_request_error"
    assert "sk-not-a-key" not in str(info.value)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.serve
def test_missing_key_gets_401_and_healthz_stays_open(auth_url):
    with httpx.Client(trust_env=False, timeout=60.0) as http:
        for method, path in (("POST", "/v1/images/generations"), ("GET", "/v1/models"), ("GET", "/v1/buckets"),
                             ("GET", "/v1/models/bcg-tiny-flux")):
            r = http.request(method, auth_url + path, json={"prompt": "x"} if method == "POST" else None)
            assert r.status_code == 401, (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and "API key" in err["message"] and err["param"] is None
        assert http.get(auth_url + "/healthz").json() == {"status": "ok"}
    import openai

    client = _openai(auth_url, "sk-unused")
    with pytest.raises(openai.AuthenticationError) as info:  # the client without its Authorization header
        client.images.generate(**GEN_ARGS, extra_headers={"Authorization": openai.omit})
    assert info.value.status_code == 401 and "didn't provide an API key" in str(info.value)


def _ray_log_files() -> list[Path]:
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # this session's own log folder
    logs = Path(node.get_logs_dir_path()) if node is not None else Path("/tmp/ray/session_latest/logs")
    return [p for p in sorted(logs.rglob("*"))[:2000] if p.is_file() and p.stat().st_size < 64 * 2**20]


def _scrape_bcg_metrics(timeout_s: float = 30.0) -> str:
    """The Prometheus text of this Ray node's metrics agent, once it holds ``ray_bcg_`` series (bounded wait)."""
    import urllib.request

    import ray

    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode("utf-8", "replace")
        if "ray_bcg_" in text:
            break
        time.sleep(1.0)
    return text


@pytest.mark.serve
def test_keys_never_show_in_buckets_models_metrics_or_logs(auth_url):
    with httpx.Client(trust_env=False, timeout=120.0) as http:
        good = {"Authorization": f"Bearer {CONFIG_KEY}"}
        assert http.post(auth_url + "/v1/images/generations", headers={"Authorization": f"Bearer {FILE_KEY}"},
                         json={"prompt": "x", "size": "256x256", "num_inference_steps": 1}).status_code == 200
        assert http.get(auth_url + "/v1/models", headers={"Authorization": "Bearer sk-wrong-key-77"}).status_code == 401
        texts = [http.get(auth_url + p, headers=good).text for p in ("/v1/buckets", "/v1/models")]
    secrets = [CONFIG_KEY, FILE_KEY, "sk-wrong-key-77", api_key_digest(CONFIG_KEY).removeprefix("sha256:")]
    for text in texts:
        assert not any(s in text for s in secrets)
    metrics = _scrape_bcg_metrics()
    assert "ray_bcg_" in metrics
    assert not any(secret in metrics for secret in secrets)
    files = _ray_log_files()
    assert files, "no Ray log files found"
    for path in files:
        data = path.read_bytes()
        for s in secrets[:3]:
            assert s.encode() not in data, f"a key is in {path}"


@pytest.mark.serve
def test_bcg_plan_reads_a_keyed_servers_traffic_with_its_key(auth_url, tmp_path, capsys):
    from deployments.cli.main import main

    client = _openai(auth_url, CONFIG_KEY)
    client.images.generate(**GEN_ARGS)  # some recorded traffic
    assert main(["plan", "--from", auth_url, "--max-graphs", "4"]) == 2
    err = capsys.readouterr().err
    assert "HTTP 401 (the server wants an API key: give it with --api-key-file or OPENAI_API_KEY)" in err
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# the first key is sent\n{FILE_KEY}\n")
    config = tmp_path / "config.yaml"
    config.write_text("buckets: {batch_sizes: [1, 2], resolutions: ['256x256'], text_lengths: [256]}\n")
    assert main(["plan", "--config", str(config), "--from", auth_url, "--api-key-file", str(keys),
                 "--max-graphs", "4"]) == 0
    out = capsys.readouterr()
    assert "bcg plan:" in out.out and FILE_KEY not in out.out + out.err
