"""Application builder: ``serve run deployments.app:build_app [config_path=serve.yaml]``.

Arguments (``serve run`` ``key=value`` pairs, or ``args:`` in a Serve config file):

- ``config``: a ``ServeConfig`` mapping (``model``, ``buckets``, ``limits``), or
- ``config_path``: a YAML or JSON file holding that mapping;
- ``dit_replicas``: DiT replicas (default 1; one per GPU); refused when ``autoscaling.enabled`` is set in the
  config, which gives the DiT deployment an ``autoscaling_config`` with
  :class:`router.autoscaling.BucketLoadPolicy` (from ``autoscaling.min_replicas`` to ``max_replicas``);
- ``dit_num_gpus``: GPUs per DiT replica (default: 1 when ``model.device`` is ``cuda``, or ``auto`` and this
  process sees CUDA, else 0; set 1 explicitly when the driver has no GPU but the workers do);
- ``dit_num_cpus``: CPUs per DiT replica (default 1);
- ``ingress_replicas``: ingress replicas (default 1; each encodes and forwards the images of its requests).

With ``routing.shape_aware`` (the default) the application has three deployments: the ingress, the
``BucketCoordinator`` (ownership) and the DiT replicas, routed by :class:`router.shape_router.ShapeAwareRouter`.

Backpressure: ``max_ongoing_requests`` and ``max_queued_requests`` of the DiT deployment, and the ingress's
``max_ongoing_requests``, come from :func:`deployments.settings.backpressure_limits` (the batch capacity, unless the
config's ``routing`` section sets them).

Without ``config`` or ``config_path`` the embedded default ``ServeConfig()`` is served. ``app`` is that
default application, for ``serve run deployments.app:app``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from router.autoscaling import BucketLoadPolicy
from router.shape_router import ShapeAwareRouter

from .coordinator import BucketCoordinator
from .dit import DiTReplica
from .ingress import Ingress
from .settings import ServeConfig, backpressure_limits, error_text, load_config

__all__ = ["AppArgs", "app", "autoscaling_config", "build_app", "load_config", "replicas_conflict"]


class AppArgs(BaseModel):
    """Arguments of :func:`build_app`."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] | None = Field(default=None, description="ServeConfig mapping.")
    config_path: str | None = Field(default=None, description="YAML or JSON file with a ServeConfig mapping.")
    dit_replicas: int = Field(default=1, ge=1, description="Number of DiT replicas (one per GPU).")
    dit_num_gpus: float | None = Field(default=None, ge=0, description="GPUs per DiT replica; None = detect.")
    dit_num_cpus: float = Field(default=1, ge=0, description="CPUs per DiT replica.")
    ingress_replicas: int = Field(default=1, ge=1, description="Ingress replicas (they base64-encode the images).")


def _default_num_gpus(config: ServeConfig) -> float:
    if config.model.device == "cuda":
        return 1
    if config.model.device == "cpu":
        return 0
    import torch

    return 1 if torch.cuda.is_available() else 0


def replicas_conflict(config: ServeConfig, given: str | None) -> str | None:
    """Why a fixed replica count cannot go with ``config``, or None.

    Args:
        config: the application's config.
        given: the fixed count as the caller took it (``"dit_replicas=2"``, ``"--replicas 2"``), None if none.

    A fixed count and ``autoscaling.enabled`` exclude each other: the autoscaling bounds set the count.
    :func:`build_app` raises with this message, ``bcg serve --replicas`` prints it before Ray starts.
    """
    if given is None or not config.autoscaling.enabled:
        return None
    return (f"{given} conflicts with autoscaling.enabled: the replica count then comes from "
            f"autoscaling.min_replicas/initial_replicas/max_replicas; drop one of them")


def autoscaling_config(config: ServeConfig) -> dict[str, Any]:
    """The DiT deployment's Ray Serve ``autoscaling_config`` for ``config.autoscaling`` (enabled).

    The policy is :class:`router.autoscaling.BucketLoadPolicy` with the config's utilisation, drain time,
    delays and capture grace as ``policy_kwargs``; Ray's own ``upscale_delay_s``/``downscale_delay_s`` are 0
    (the policy applies the delays, so they do not stack); ``max_ongoing_per_replica`` is the DiT replica's
    ``max_ongoing_requests`` (:func:`deployments.settings.backpressure_limits`).
    """
    a = config.autoscaling
    limits = backpressure_limits(config)
    return {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "initial_replicas": a.start_replicas,
        "metrics_interval_s": a.metrics_interval_s,
        "look_back_period_s": a.look_back_period_s,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {
            "policy_function": BucketLoadPolicy,
            "policy_kwargs": {
                "target_utilization": a.target_utilization,
                "backlog_drain_s": a.backlog_drain_s,
                "upscale_delay_s": a.upscale_delay_s,
                "downscale_delay_s": a.downscale_delay_s,
                "max_ongoing_per_replica": float(limits.dit_max_ongoing),
                "capture_grace_s": a.capture_grace_s,
            },
        },
    }


def build_app(args: Mapping[str, Any] | None = None) -> Application:
    """Bind the ingress and DiT deployments into one Serve application.

    Args:
        args: see the module docstring (keys ``config``, ``config_path``, ``dit_replicas``, ``dit_num_gpus``).

    Returns:
        The application; its ingress is :class:`~deployments.ingress.Ingress` (0 CPUs, so it fits next to
        the replicas on a small machine).

    Raises:
        ValueError: an unknown or bad argument, a bad config (one line naming each mistake's field and what it
            takes, separated by ``;``: :func:`~deployments.settings.error_text`, as ``bcg serve`` says it,
            instead of pydantic's report in ``serve status``), or ``dit_replicas`` given while
            ``autoscaling.enabled`` is set.
    """
    from pydantic import ValidationError

    try:
        parsed = AppArgs.model_validate(dict(args or {}))
    except ValidationError as e:
        raise ValueError(error_text(e, AppArgs, "application arguments", "the application")) from None
    try:
        config = load_config(parsed.config, parsed.config_path)
    except ValidationError as e:
        raise ValueError(error_text(e)) from None
    given = f"dit_replicas={parsed.dit_replicas}" if "dit_replicas" in parsed.model_fields_set else None
    conflict = replicas_conflict(config, given)
    if conflict:
        raise ValueError(conflict)
    as_dict = config.model_dump(mode="json")
    num_gpus = parsed.dit_num_gpus if parsed.dit_num_gpus is not None else _default_num_gpus(config)
    routing = config.routing
    limits = backpressure_limits(config, parsed.dit_replicas)
    options: dict[str, Any] = dict(
        max_ongoing_requests=limits.dit_max_ongoing,
        max_queued_requests=limits.dit_max_queued,
        ray_actor_options={"num_cpus": parsed.dit_num_cpus, "num_gpus": num_gpus},
    )
    if config.autoscaling.enabled:
        options["autoscaling_config"] = autoscaling_config(config)
        start_replicas = config.autoscaling.start_replicas
    else:
        options["num_replicas"] = start_replicas = parsed.dit_replicas
    ingress = Ingress.options(num_replicas=parsed.ingress_replicas, max_ongoing_requests=limits.ingress_max_ongoing,
                              ray_actor_options={"num_cpus": 0})
    if not routing.shape_aware:
        dit = DiTReplica.options(**options).bind(as_dict)
        return ingress.bind(dit, as_dict)
    coordinator = BucketCoordinator.bind(as_dict, start_replicas)
    options["request_router_config"] = RequestRouterConfig(
        request_router_class=ShapeAwareRouter,
        request_router_kwargs={"fallback_wait_s": routing.fallback_wait_s},
        request_routing_stats_period_s=routing.stats_period_s,
        request_routing_stats_timeout_s=max(1.0, 2 * routing.stats_period_s),
    )
    dit = DiTReplica.options(**options).bind(as_dict, coordinator)
    return ingress.bind(dit, as_dict, coordinator)


app = build_app({})
