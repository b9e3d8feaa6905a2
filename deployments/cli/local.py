"""The local server: Ray and the bcg-serve application on this machine's loopback, for ``bcg serve`` and
``bcg demo`` (:mod:`deployments.cli.main`).

:func:`check_config` reads and checks a config file before anything starts (the bucket table, the
checkpoint's JSON configs and tokenizer, the device and runner mode), so that a bad file is reported with
its own message instead of a replica failing inside Ray; :func:`start_local` starts a new local Ray
instance, Serve on ``127.0.0.1`` and the application from :func:`deployments.app.build_app`;
:func:`stop_local` drains the ingress and shuts both down; :func:`deploy_failure` says in one line why an
application failed to deploy.

Ray and httpx are imported only by the functions that use them.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..settings import ServeConfig

__all__ = [
    "DRAIN_TIMEOUT_S", "api_server_metrics_url", "bind_ray_to", "check_config", "check_file", "check_port_free",
    "deploy_failure", "free_loopback_port", "start_local", "stop_local", "uncaptured_shapes", "wait_captured",
    "wait_healthy",
]

APP_NAME = "bcg"  # the Serve application start_local runs and stop_local deletes

_HEALTH_WAIT_S = 60.0

DRAIN_TIMEOUT_S = 20.0
"""How long :func:`stop_local` waits for the requests in flight before deleting the application: as long as Serve's
own graceful stop waits for a replica's requests (``graceful_shutdown_timeout_s``, Ray's default 20 s)."""


def _poll(url: str, left: Callable[[Any], object], timeout_s: float,
          request_timeout_s: float) -> tuple[float | None, object]:
    """``GET url`` every 0.5 s until ``left(answer)`` (an ``httpx.Response``) is falsy: ``(seconds waited, None)``,
    or after ``timeout_s`` ``(None, the last thing left)``: ``left``'s last value, or the last error."""
    import httpx

    t0 = time.monotonic()
    last: object = "no attempt"
    while time.monotonic() - t0 < timeout_s:
        try:
            last = left(httpx.get(url, timeout=request_timeout_s, trust_env=False))
            if not last:
                return time.monotonic() - t0, None
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    return None, last


def wait_healthy(url: str, timeout_s: float = _HEALTH_WAIT_S) -> None:
    """Poll ``GET {url}/healthz`` until it answers 200.

    Raises:
        TimeoutError: no healthy answer within ``timeout_s`` seconds (the message has the last error).
    """
    waited, last = _poll(f"{url}/healthz", lambda r: None if r.status_code == 200 else f"HTTP {r.status_code}",
                         timeout_s, 5.0)
    if waited is None:
        raise TimeoutError(f"{url}/healthz did not answer 200 within {timeout_s:.0f} s (last: {last})")


def uncaptured_shapes(stats: dict) -> list[str]:
    """The owned shapes not captured yet of a ``GET /v1/buckets`` answer: the answering replica's (``routing``) and,
    with shape-aware routing, every other replica's last heartbeat (``ownership.replicas``); ``runner.ready_after_s``
    lets a replica report ready before every shape is captured (``deployments/dit.py``)."""
    views = [stats.get("routing") or {}]
    views += list(((stats.get("ownership") or {}).get("replicas") or {}).values())
    return sorted({s for v in views for s in set(v.get("owned") or ()) - set(v.get("ready") or ())})


def wait_captured(url: str, timeout_s: float = _HEALTH_WAIT_S) -> float:
    """Poll ``GET {url}/v1/buckets`` until every replica has captured every shape it owns
    (:func:`uncaptured_shapes` empty): what a benchmark that times the graphs waits for after ready. Returns the
    seconds waited.

    Raises:
        TimeoutError: shapes still uncaptured after ``timeout_s`` seconds (the message names them, or the last
            error or HTTP status).
    """
    waited, left = _poll(f"{url}/v1/buckets", lambda r: uncaptured_shapes(r.json()) if r.status_code == 200 else
                         f"HTTP {r.status_code}", timeout_s, 30.0)
    if waited is None:
        raise TimeoutError(f"{url} still captures {left} after {timeout_s:.0f} s")
    return waited


def check_port_free(port: int, option: str = "--port", host: str = "127.0.0.1") -> None:
    """Refuse a port something already listens on (``host``, and so every address).

    Serve's HTTP proxy binds with ``SO_REUSEPORT``, so a second server on a busy port would start and share the
    port with the first: the kernel would split connections between them, and a server with API keys would have
    its clients answered by one without. Binding here without that option fails on any port in use. Ray's
    metrics exporter on a port in use would fail inside Ray, after a minute of start-up.

    Args:
        port: the TCP port (1..65535).
        option: the command-line option (or config field) that sets it, for the message.
        host: the address to try (127.0.0.1 or 0.0.0.0).

    Raises:
        OSError: the port is in use, naming it and the fix.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a just-stopped server's TIME_WAIT is no listener
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(f"port {port} on {host} is already in use ({exc.strerror}); stop what listens there or "
                          f"pick another with {option} (0: a free one)") from None


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (default 127.0.0.1) that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pin_api_server_metrics_port(host: str) -> int:
    """Give the metrics server of Ray's API-server process a free port of ``host`` instead of its fixed 44227.

    ``ray.init(include_dashboard=False)`` still starts ``ray/dashboard/dashboard.py`` on the head node, with only
    its usage-stats module and no HTTP server (``ray/_private/services.py`` ``start_api_server``: the API server
    records usage stats, ray-project/ray#26042; no option skips it). That process serves its own Prometheus
    metrics on ``DASHBOARD_METRIC_PORT`` (``ray/dashboard/consts.py``, default 44227), on loopback on a
    loopback node and on every interface otherwise (``ray/dashboard/head.py`` ``_setup_metrics``). With the
    fixed port a second local server on the machine fails to bind it (logged in its ``dashboard.log``); a free
    port each keeps them apart and names the port :func:`api_server_metrics_url` reports. Set in this process's
    environment, which the process Ray starts inherits; call before ``ray.init``.

    Args:
        host: where the node listens: ``127.0.0.1`` or ``0.0.0.0``.

    Returns:
        The port.
    """
    import os

    port = free_loopback_port(host)
    os.environ["DASHBOARD_METRIC_PORT"] = str(port)
    return port


def api_server_metrics_url(timeout_s: float = 2.0) -> str | None:
    """``http://ADDRESS:PORT/metrics`` of the metrics server of Ray's API-server process (``dashboard.py``; see
    :func:`pin_api_server_metrics_port`), or None when that process has not announced its address in the GCS
    (``DashboardMetricsAddress``) or nothing accepts a connection there within ``timeout_s`` seconds.

    Needs a connected Ray (``ray.init``).
    """
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(b"DashboardMetricsAddress", namespace=None)
    if not raw:
        return None
    address = raw.decode()
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError):
        return None
    return f"http://{address}/metrics"


def check_config(config_path: str | Path) -> ServeConfig:
    """Load a ServeConfig file and build its bucket table, without starting anything; the config is returned with
    the table the replicas build (a file without a ``buckets`` section gets its family's default table, where the
    family has one: a video family's, :func:`bcg_core.families.defaults.family_buckets`).

    A relative ``model.path`` is taken from the current directory. Cheap (the validator loads only the tokenizer
    and the checkpoint's JSON configs), so a bad file fails with its own message before Ray starts.

    Raises:
        ValueError: a bad file, config value or bucket table (pydantic's ValidationError is a ValueError),
            ``lora.dir`` set for a model whose family serves no LoRA adapters, or ``lora.targets`` that match no
            linear layer of the transformer (built on the meta device).
        FileNotFoundError: ``config_path`` or the config's ``model.path`` does not exist, or ``lora.dir`` is not a
            directory.
    """
    from bcg_core.pipeline import runner_mode
    from bcg_core.validation import RequestValidator

    from ..settings import load_config

    config = load_config(config_path=config_path)
    if config.model.path is not None:
        # The replicas may run in another working directory: pin a relative path to this one.
        model = config.model.model_copy(update={"path": str(Path(config.model.path).resolve())})
        config = config.model_copy(update={"model": model})
    if config.auth.api_key_file is not None:  # read by the ingress at start: a bad file fails here first
        from ..auth import read_key_file

        read_key_file(config.auth.api_key_file)
    if config.lora.dir is not None:  # read by every replica at start, maybe in another working directory
        from bcg_core.lora.slots import check_served

        check_served(config.model)  # a family that serves no adapters: its replicas would fail at start
        if not Path(config.lora.dir).is_dir():
            raise FileNotFoundError(f"lora.dir {config.lora.dir!r} is not a directory: create it, or unset lora.dir")
        lora = config.lora.model_copy(update={"dir": str(Path(config.lora.dir).resolve())})
        config = config.model_copy(update={"lora": lora})
        from bcg_core.lora.layers import check_targets

        check_targets(config.model, config.lora.targets)  # on the meta device: no weights are read
    # a config without a buckets section takes its family's table where it has one (a video family's), written out
    # here so that every replica and the ingress's router read the same table
    config = RequestValidator.from_config(config).config
    runner_mode(config)  # a CUDA device or graph runner asked for where none is visible fails here, not in Ray
    return config


def plan_notes(config: ServeConfig) -> list[str]:
    """What ``bcg config --check`` says of a ``buckets.plan`` block that a server would start with but not use as
    written: one that does not describe the table (hand-edited shapes; the replicas' drift check ignores it), and
    ``miss_policy: reject`` where the plan expected misses (those requests would be refused with 422)."""
    from bcg_core.planning.drift import plan_matches
    from bcg_core.validation import RequestValidator

    plan = config.buckets.plan
    if plan is None:
        return []
    notes = []
    if not plan_matches(plan, RequestValidator.from_config(config).table):
        notes.append("buckets.plan does not describe this table (its work names shapes the table lacks): the "
                     "drift check ignores it; plan again with bcg plan --write, or delete buckets.plan")
    if config.buckets.miss_policy.value == "reject" and plan.miss_share > 0:
        notes.append(f"buckets.miss_policy is reject, and the plan expected {plan.miss_share:.1%} of its requests "
                     f"to miss every bucket: those would be refused (422)")
    return notes


def _block_start(path: Path) -> int:
    """The file line on which a RayService's ``spec.serveConfigV2`` text starts: the line after its ``|`` or ``>``
    (a block scalar, as KubeRay's examples write it); for a quoted string, the line of its opening quote (line
    numbers inside it then count from there, each line of the string one line of the file)."""
    import yaml

    with path.open() as f:
        root = yaml.compose(f, Loader=yaml.SafeLoader)
    node = root
    for key in ("spec", "serveConfigV2"):
        node = next(v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key)
    return node.start_mark.line + (2 if node.style in ("|", ">") else 1)


def check_file(path: str | Path) -> str:
    """``bcg config --check``: check a ServeConfig file as ``bcg serve`` would (:func:`check_config`), or a Serve
    config file (one with ``applications:``, as ``serve deploy`` takes, or a KubeRay ``RayService`` manifest
    embedding one in ``spec.serveConfigV2``) as the Serve controller would build it: every application whose
    ``import_path`` is ``deployments.app:build_app`` gets :func:`deployments.app.build_app` of its ``args``
    (argument names, the embedded ``config``, the replica count against autoscaling), without starting Ray. A
    ``config_path`` that does not exist here (a path on the cluster's nodes) is not read: only the arguments are
    checked, and the line says so. Nodes' paths and GPUs are not checked.

    Returns:
        One line per file or application that passed, e.g. ``my.yaml: ok (model the tiny default, 7 batch sizes x 5
        resolutions; text buckets [256] tokens)``.

    Raises:
        ValueError: the first mistake, naming the field (and, for a Serve file, the application).
        FileNotFoundError: ``path`` does not exist.
    """
    from pydantic import ValidationError

    from ..app import AppArgs, build_app
    from ..settings import error_text, parse_yaml, read_yaml

    path = Path(path)
    data = read_yaml(path)
    if isinstance(data, dict) and data.get("kind") == "RayService":
        embedded = (data.get("spec") or {}).get("serveConfigV2")
        if not isinstance(embedded, str):
            raise ValueError(f"{path}: a KubeRay RayService without a spec.serveConfigV2 text to check")
        data = parse_yaml(embedded, f"{path}: spec.serveConfigV2", _block_start(path))
        if not (isinstance(data, dict) and "applications" in data):
            raise ValueError(f"{path}: spec.serveConfigV2 holds no applications: list")
    if not (isinstance(data, dict) and "applications" in data):
        config = check_config(path)
        return (f"{path}: ok (model {config.model.path or 'the tiny default'}, {len(config.buckets.batch_sizes)} "
                f"batch sizes x {len(config.buckets.resolutions)} resolutions"
                + (f" x frames {config.buckets.frames}" if config.buckets.frames else "") + "; text buckets "
                f"{config.buckets.all_text_lengths()} tokens)" + "".join(f"\n  note: {n}" for n in plan_notes(config)))
    apps = data["applications"]
    if not isinstance(apps, list) or not apps:
        raise ValueError(f"{path}: applications must be a list of applications (name, import_path, args), got "
                         f"{apps!r}"[:300])
    lines = []
    for i, app in enumerate(apps):
        if not isinstance(app, dict):
            raise ValueError(f"{path}: applications[{i}] is a {type(app).__name__}, not a mapping (name, import_path, "
                             f"args)")
        name = app.get("name", "default")
        if app.get("import_path") != "deployments.app:build_app":
            lines.append(f"{path}: application {name}: not bcg-serve's (import_path), not checked")
            continue
        args = app.get("args") or {}
        if not isinstance(args, dict):
            raise ValueError(f"{path}: application {name}: args is a {type(args).__name__}, not a mapping of "
                             f"{', '.join(AppArgs.model_fields)}")
        where = args.get("config_path")
        try:
            if isinstance(where, str) and not Path(where).exists():
                AppArgs.model_validate(args)
                lines.append(f"{path}: application {name}: args ok; config_path {where!r} is not here (a path on "
                             f"the cluster's nodes?): its config is not checked")
                continue
            build_app(args)
        except ValidationError as e:  # of AppArgs.model_validate (build_app words its own)
            why = error_text(e, AppArgs, "application arguments", "the application")
            raise ValueError(f"{path}: application {name}: {why}") from None
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: application {name}: {e}") from None
        lines.append(f"{path}: application {name}: ok (args and config as the Serve controller builds them)")
    return "\n".join(lines)


def bind_ray_to(host: str) -> None:
    """Make the next local ``ray.init`` start its node on ``host``: ``127.0.0.1`` (loopback) or ``0.0.0.0``.

    On Linux Ray replaces a loopback ``_node_ip_address`` by the machine's routable address
    (``ray._private.services.resolve_ip_for_localhost``: by design, ray-project/ray#26293) unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is off, the opt-out Ray added for single-machine use
    (ray-project/ray#31166; it is Ray's default on macOS and Windows). With it off, ``get_node_ip_address``
    answers 127.0.0.1 and every Ray service binds there: the GCS, the raylet, the workers' gRPC servers, the
    object manager, the runtime-env agent and the metrics exporter (measured by
    ``tests/serve/test_local_server.py``). Ray reads the variable at import, so an already imported Ray also
    gets its module constant set; the variable stays in the environment for the processes Ray starts.

    ``0.0.0.0`` restores Ray's Linux default: the node IP is the machine's address.
    """
    import os

    loopback = host != "0.0.0.0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0" if loopback else "1"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = not loopback


def start_local(config: ServeConfig | None = None, port: int = 8000, num_cpus: int = 4,
                quiet: bool = True, replicas: int | None = None, metrics_port: int = 0) -> str:
    """Start Ray and the bcg-serve application on ``127.0.0.1:port``; returns the base URL.

    A new local Ray instance is always started (``address="local"``), never a cluster found on the
    machine, bound where ``config.metrics.host`` says (default 127.0.0.1: every Ray service on loopback, see
    :func:`bind_ray_to`), with Ray's metrics exporter on ``metrics_port`` (read it back with
    :func:`deployments.metrics.metrics_url`). ``serve.run`` returns once the replicas are ready (the DiT replica has
    built its pipeline) and this function once ``/healthz`` answers too, so the caller can print readiness.

    Args:
        config: the configuration (see :func:`check_config`), or None for the embedded default.
        port: HTTP port on 127.0.0.1 (0 picks a free one).
        num_cpus: logical CPUs Ray may hand out (each replica asks for its own share).
        quiet: keep Ray's and the replicas' logs out of the terminal (they stay in Ray's log folder).
        replicas: DiT replicas (one per GPU); with more than one they split the bucket shapes. None: 1, or the
            config's ``autoscaling`` bounds when it autoscales.
        metrics_port: Prometheus port of Ray's exporter (0 picks a free one; ``bcg serve`` passes
            ``config.metrics.port``).

    Raises:
        OSError: ``port`` or ``metrics_port`` is already in use, or both are the same port (naming the option to
            change).
        RuntimeError: the application failed to deploy (each failing deployment's last error line).
    """
    from ..settings import LOOPBACK

    host = config.metrics.host if config is not None else LOOPBACK
    if port and port == metrics_port:
        raise OSError(f"--port and --metrics-port are both {port}: the API and Ray's metrics exporter need a port "
                      f"each; pick another for one of them (0: a free one)")
    if port == 0:
        port = free_loopback_port()
    else:
        check_port_free(port)
    if metrics_port == 0:
        metrics_port = free_loopback_port()
    else:
        check_port_free(metrics_port, "--metrics-port (or metrics.port in the config)", host)
    bind_ray_to(host)
    pin_api_server_metrics_port(host)

    import ray
    from ray import serve

    from ..app import build_app

    level = logging.WARNING if quiet else logging.INFO
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=not quiet,
             logging_level=level, _metrics_export_port=metrics_port,
             _node_ip_address=LOOPBACK if host == LOOPBACK else None)
    logging.getLogger("ray.serve").setLevel(level)
    serve.start(http_options={"host": LOOPBACK, "port": port})
    args: dict = {"config": config.model_dump(mode="json")} if config is not None else {}
    if replicas is not None:
        args["dit_replicas"] = replicas
    try:
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:
        raise RuntimeError(f"the bcg application failed to start: {deploy_failure(APP_NAME)}") from exc
    url = f"http://{LOOPBACK}:{port}"
    wait_healthy(url)
    return url


def deploy_failure(app_name: str) -> str:
    """Why a Serve application failed to deploy, in one line: each failing deployment's last error line.

    Reads ``serve.status()`` (the replica's constructor traceback is in the deployment's status message),
    so that a bad checkpoint or device shows its cause instead of Ray's "Deploying application failed".
    """
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return f"application {app_name!r} is not known to Serve"
    reasons = []
    for name, dep in app.deployments.items():
        lines = [ln.strip() for ln in (dep.message or "").splitlines() if ln.strip()]
        if lines and str(dep.status) not in ("HEALTHY", "DeploymentStatus.HEALTHY"):
            reasons.append(f"{name}: {lines[-1]}")
    return "; ".join(reasons) or (app.message or "no reason reported").strip().splitlines()[-1]


def stop_local(drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Shut down the application, Serve and Ray started by :func:`start_local` (safe to call when they are not
    running).

    The ingress drains first (:func:`deployments.drain.drain_ingress`): a request that arrives from then on is
    answered 503 with ``Retry-After`` in OpenAI's error shape (code ``server_stopping``), and the requests in flight
    are served, for at most ``drain_timeout_s`` seconds. Only then is the application deleted (``serve.delete``: its
    replicas finish what they still hold and stop gracefully), since deleting it takes its route out of Serve's HTTP
    proxy at once, which then answers a plain-text 404. Then Ray is shut down, which ends the Serve controller and
    proxy with the local node. Not ``serve.shutdown()``: the controller ends its own ``graceful_shutdown`` call by
    killing itself, and Ray retries that task (the controller's ``max_task_retries=-1``), so the driver printed
    ``(raylet) Task ServeController.graceful_shutdown failed. There are infinite retries remaining ...`` on every
    stop; ``tests/serve/test_ctrl_c_serve.py`` checks that a Ctrl-C now prints no such line, and that a request
    arriving during the drain is answered 503 while the one in flight completes.
    """
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from ..drain import drain_ingress

    if ray.is_initialized():
        try:
            try:
                drain_ingress(APP_NAME, drain_timeout_s)
            except Exception:  # noqa: BLE001 - no running application (a failed start) or a dead ingress: stop anyway
                logging.getLogger("ray.serve").info("the ingress was not drained before the stop", exc_info=True)
            serve.delete(APP_NAME)
        except RayServeException:  # Serve never started (a failed start): nothing to delete
            pass
        finally:
            ray.shutdown()
