"""The ingress's routes that describe the server: ``GET /healthz``, ``GET /v1/models`` (and ``/v1/models/{id}``),
``GET /v1/buckets`` and ``GET /metrics``'s pointer (:class:`InfoEndpoints`); the answers themselves are built by
:mod:`deployments.introspection`.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures (``request: Request``)
# of the class-based view that ``serve.ingress`` builds, and postponed annotations hide them from it.

from fastapi import Request
from fastapi.responses import JSONResponse
from ray.serve.exceptions import BackPressureError

from .adapters import AdapterCatalog
from .http_errors import error_response, unavailable_response
from .ingress_app import app
from .ingress_base import IngressBase
from .introspection import ingress_view, metrics_pointer, model_card
from .responses import ModelCard, ModelList
from .routing import overloaded
from .schemas import ErrorBody

__all__ = ["InfoEndpoints"]


class InfoEndpoints(IngressBase):
    """Liveness, the model card, the bucket counters and the metrics pointer of :class:`~deployments.ingress.Ingress`
    (each route is registered on :data:`deployments.ingress_app.app`)."""

    @app.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz(self) -> dict[str, str]:
        """Liveness: ``{"status": "ok"}`` (no key asked for); ``HEAD`` answers 200 with no body, as load balancers
        that probe with ``HEAD`` expect."""
        return {"status": "ok"}

    def _model_card(self) -> ModelCard:
        card = model_card(self._validator, self._config, self._model_name, self._started, self._adapters, self._edits)
        card.bcg["videos"] = self._videos.options.card() if self._videos is not None else None
        return card

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorBody}})
    async def models(self, request: Request):
        """The served model in OpenAI's list format (``openai`` ``client.models.list()``), its bucket table
        summarised under ``bcg``."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        await AdapterCatalog.fresh(self._adapters)
        return ModelList(data=[self._model_card()])

    @app.get("/v1/models/{model_id}", response_model=ModelCard, responses={401: {"model": ErrorBody},
                                                                          404: {"model": ErrorBody}})
    async def model(self, model_id: str, request: Request):
        """One model (``client.models.retrieve(id)``): the served one, else 404 naming it."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if model_id != self._model_name:
            return error_response(404, f"model {model_id!r} is not served here; served: {self._model_name!r}",
                                  param="model", code="model_not_found")
        await AdapterCatalog.fresh(self._adapters)
        return self._model_card()

    @app.get("/v1/buckets", responses={401: {"model": ErrorBody}, 500: {"model": ErrorBody},
                                       503: {"model": ErrorBody}})
    async def buckets(self, request: Request):
        """Per-bucket counters of the DiT replica (``DiTPipeline.stats()``), plus the misses this ingress
        rejected under the reject policy (``misses.rejected``, ``misses.rejected_by_dim``) and, with a
        coordinator, ``ownership`` and every replica's ``traffic`` merged
        (:func:`~deployments.introspection.ingress_view`). When every DiT slot and queue place is taken the call is
        answered 503 with ``Retry-After`` in OpenAI's error shape, like a generation request."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        try:
            stats = await self._dit.stats.remote()
        except BackPressureError as exc:
            full = overloaded(exc, self._config.routing.retry_after_s)
            return unavailable_response(full.message, full.retry_after_s, param="request")
        return await ingress_view(stats, self._rejected_requests, self._rejected, self._coord)

    @app.get("/metrics", include_in_schema=False)
    async def metrics_elsewhere(self) -> JSONResponse:
        """Not on the API port: a 404 in OpenAI's error shape naming the URL of Ray's Prometheus exporter on this
        replica's node (the one metrics source, docs/OPERATIONS.md "Metrics"). No key asked for: it reveals
        only the address (:func:`~deployments.introspection.metrics_pointer`)."""
        return await metrics_pointer()
