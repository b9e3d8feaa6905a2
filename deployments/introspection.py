"""What the ingress's read-only routes say about the service: the model card of ``GET /v1/models``
(:func:`model_card`), the ingress's part of ``GET /v1/buckets`` (:func:`ingress_view`: its rejected misses, the
coordinator's ownership and every replica's traffic merged by :func:`merged_traffic`) and the answer of
``GET /metrics`` on the API port (:func:`metrics_pointer`: where Ray's exporter is instead).

:class:`~deployments.ingress.Ingress` registers the routes and checks the API key; these build the answers.
"""

import asyncio
import logging
from collections import Counter

from fastapi.responses import JSONResponse

from bcg_core.images import IMAGE_FORMATS
from bcg_core.planning.traffic import TrafficHistogram
from bcg_core.request import QUALITY_ALIASES
from bcg_core.validation import RequestValidator

from .adapters import AdapterCatalog
from .http_errors import error_response
from .responses import ModelCard
from .settings import ServeConfig

__all__ = ["COORDINATOR_TIMEOUT_S", "ingress_view", "merged_traffic", "metrics_pointer", "model_card"]

logger = logging.getLogger("ray.serve")

COORDINATOR_TIMEOUT_S = 2.0
"""Seconds ``/v1/buckets`` waits for the ownership coordinator's snapshot; past it ``ownership`` is an error note
(the coordinator is being restarted) and the rest of the stats are answered."""


def merged_traffic(stats: dict, ownership: dict) -> dict | None:
    """Every replica's traffic histogram summed (:meth:`TrafficHistogram.merged`), for ``/v1/buckets``.

    The answering replica's is ``stats["traffic"]``; the others' that of their last heartbeat (``ownership
    ["replicas"][id]["stats"]["traffic"]``), and gone replicas' ``ownership["departed_traffic"]``, both removed
    from ``ownership`` so the answer holds each once. An invalid snapshot is left out (logged). Returns the
    merged snapshot, or None when no replica records traffic."""
    here = stats.get("replica")
    parts = [stats["traffic"]] if stats.get("traffic") is not None else []
    for replica, view in (ownership.get("replicas") or {}).items():
        reported = view.get("stats") or {}
        snap = reported.pop("traffic", None)
        if snap is not None and replica != here:
            parts.append(snap)
    parts += [snap for replica, snap in (ownership.pop("departed_traffic", None) or {}).items() if replica != here]
    good: list[TrafficHistogram] = []
    for snap in parts:
        try:
            good.append(TrafficHistogram.from_snapshot(snap))
        except ValueError:
            logger.exception("a replica's traffic snapshot is invalid; left out of /v1/buckets traffic")
    return TrafficHistogram.merged(good).snapshot() if good else None


async def ingress_view(stats: dict, rejected: int, rejected_by_dim: Counter[str], coordinator) -> dict:
    """``stats`` (a DiT replica's ``stats()``) with what the ingress knows added, for ``/v1/buckets``: the misses
    it rejected under the reject policy (``misses.rejected``, ``misses.rejected_by_dim``) and, with a
    ``coordinator`` (a handle, or None), ``ownership`` (an error note past :data:`COORDINATOR_TIMEOUT_S`) and every
    replica's ``traffic`` merged (:func:`merged_traffic`). Returns ``stats``, updated in place."""
    misses = stats.setdefault("misses", {})
    misses["rejected"] = rejected
    misses["rejected_by_dim"] = {d: rejected_by_dim.get(d, 0) for d in ("batch", "image_tokens", "text_tokens")}
    if coordinator is not None:
        try:
            stats["ownership"] = await asyncio.wait_for(coordinator.snapshot.remote(), COORDINATOR_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a coordinator being restarted must not fail the stats
            stats["ownership"] = {"error": f"the ownership coordinator did not answer within "
                                           f"{COORDINATOR_TIMEOUT_S:g} s ({type(exc).__name__}); it is "
                                           f"restarted by Serve and rebuilds ownership from the replicas' "
                                           f"heartbeats"}
        stats["traffic"] = merged_traffic(stats, stats["ownership"])
    return stats


def model_card(validator: RequestValidator, config: ServeConfig, name: str, created: int,
               adapters: AdapterCatalog | None, edits: dict | None) -> ModelCard:
    """The served model's card (``GET /v1/models``): ``name``, served since ``created``, with its bucket table, the
    limits, the steps of each ``quality``, the image formats and what the images are (``background``:
    ``transparent`` where they carry alpha), the ``adapters`` in ``lora.dir``, the ``edits`` it serves and its step
    cache (``cache_methods``, ``cache_default``) under ``bcg``."""
    spec, table, lim = validator.spec, validator.table, config.limits
    quality = {q: spec.steps_for_quality(q, config.quality, validator.default_steps, lim.max_steps)
               for q in ("low", "medium", "high", "auto")}
    return ModelCard(id=name, created=created, bcg={
        "family": spec.family, "pipeline_class": spec.pipeline_class,
        "buckets": {**table.describe_limits(), "count": len(table)},
        "limits": {"max_images": lim.max_images, "min_side_px": lim.min_side_px, "max_side_px": lim.max_side_px,
                   "size_multiple": spec.size_step, "max_steps": lim.max_steps,
                   "default_steps": validator.default_steps, "default_size": "{}x{}".format(*validator.default_size)},
        "defaults": validator.defaults,
        "quality_steps": quality,
        "quality_aliases": dict(QUALITY_ALIASES),
        "output_formats": [f for f in IMAGE_FORMATS if not (spec.output_alpha and f == "jpeg")],  # JPEG: no alpha
        "background": "transparent" if spec.output_alpha else "opaque",
        "lora": None if adapters is None else adapters.card(),
        "edits": edits,
        "cache_methods": list(spec.cache_methods),
        "cache_default": None if validator.default_cache.method == "none" else validator.default_cache.model_dump(),
    })


async def metrics_pointer() -> JSONResponse:
    """The answer of ``GET /metrics`` on the API port: a 404 in OpenAI's error shape naming the URL of Ray's
    Prometheus exporter on this replica's node, or, when it cannot be found, where each node serves it."""
    import ray

    from .metrics import metrics_url

    try:
        url = await asyncio.to_thread(metrics_url, ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - the pointer is best effort; the answer stays a 404
        url = None
    where = (f"at {url} (this node's exporter; every Ray node serves its own)" if url else
             "at http://<node>:<metrics export port>/metrics on each Ray node")
    return error_response(404, f"GET /metrics: Prometheus metrics are served by Ray's exporter, not on the API "
                          f"port: {where}; see docs/OPERATIONS.md#metrics-prometheus", code="not_found")
