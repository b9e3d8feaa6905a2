"""HTTP ingress: OpenAI Images API on FastAPI, validated before any GPU work.

Routes (relative to the application's route prefix):

- ``POST /v1/images/generations``: body :class:`~deployments.schemas.ImageGenerationRequest`, answer
  :class:`~deployments.responses.ImageGenerationResponse`; with ``stream: true`` Server-Sent Events instead
  (``image_generation.partial_image`` per preview and image, then ``image_generation.completed`` per image, the
  shapes the ``openai`` client parses; the DiT replica streams them through ``DiTReplica.generate_stream``).
- ``GET /v1/buckets``: one DiT replica's ``DiTReplica.stats()`` (its per-bucket counters, routing view,
  step scheduler counters) and, with shape-aware routing, ``ownership``: the coordinator's assignment and
  every replica's last heartbeat (owned and ready shapes, queue, owner hits), at most
  ``routing.stats_period_s`` old; ``traffic``: the request shapes accepted (with shape-aware routing, every
  replica's histogram merged: the answering replica's current one and the others' from their last heartbeat).
- ``POST /v1/images/edits``: a ``multipart/form-data`` body (the ``openai`` client's ``images.edit``) read within
  its bound (:mod:`deployments.uploads`) and mapped onto :class:`~deployments.schemas.ImageEditRequest`, then
  validated, routed and answered as a generation (``image_edit.*`` events when streamed); the validator reads and
  bounds the image and mask (:mod:`bcg_core.edits`).
- ``GET /v1/models`` (and ``GET /v1/models/{id}``): the served model in OpenAI's list format, with the bucket
  table, the limits, the step count of each ``quality``, the LoRA adapters in ``lora.dir`` (``lora``, null
  without it), the edits it serves (``edits``, null for a family without) and its step cache (``cache_methods``,
  ``cache_default``) under ``bcg``.
- ``GET /healthz``: ``{"status": "ok"}``; never asks for a key.
- ``/v1/videos`` (a video model's: create, list, retrieve, delete, ``cancel``, ``content``; OpenAI's Videos API):
  :mod:`deployments.videos.routes` answers them, and its worker, started here, runs the jobs on this replica's event
  loop; an image model answers them 404, and a video model its image routes 422 (field ``model``).
- ``POST /v1/images/variations``: not served; answered 404 in OpenAI's error shape (code ``unsupported_endpoint``)
  saying to use ``/v1/images/edits``, without reading the body, after the API key check
  (:func:`~deployments.http_errors.unsupported_response`).

API keys: with ``auth.api_keys`` or ``auth.api_key_file`` set, every ``/v1/`` route asks for
``Authorization: Bearer <key>`` (:mod:`deployments.auth`: digests only, compared in constant time); a missing or
unknown key is answered 401 in OpenAI's error shape, naming neither the key nor its digest.

LoRA adapters (a request's ``lora``): the schema bounds the entries, the validator checks names and scales, and the
ingress refuses a name with no file in ``lora.dir`` with a 422 listing the adapters
(:class:`~deployments.adapters.AdapterCatalog`: no GPU, no replica); the replica that serves the request reads the
file and stays the authority (422 for a file it cannot serve, 503 with ``Retry-After`` when no adapter slot freed
within ``lora.load_timeout_s``; neither is resent to another replica).

Stopping: ``Ingress.drain`` (a handle method, called by :func:`deployments.drain.drain_ingress` before the local
server deletes the application) makes every new HTTP request answered 503 with ``Retry-After`` (code
``server_stopping``) while the requests in flight finish.

Python handle callers use ``Ingress.images`` (same validation and routing). Each request is validated here
once, on the ingress's one validation thread, so the event loop stays free while an edit's image is decoded
(:class:`~bcg_core.validation.RequestValidator`: validation, defaults, the seed, the bucket lookup), and its
:class:`~bcg_core.request.ValidatedRequest` travels to the DiT deployment, which trusts it, with its bucket shape in the
request metadata (:mod:`deployments.routing`); the same validated request (the same seed) is resent when its replica
dies mid-request (answered 503 only if that keeps happening). The served model name (a request's ``model``) comes
from the model's spec (``describe_model``: the checkpoint's JSON configs), known at start.

Every error is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 413 for a
body over ``limits.max_body_bytes`` (an edit's: :func:`~deployments.uploads.upload_limit`), 400 for a body that is
not JSON (or not readable multipart), 415 for an edit not sent as ``multipart/form-data`` or a generation sent as a
form, 422 for a field that fails validation (the message names the field and the values it accepts), 503
when no replica could serve it (under overload at once, with ``Retry-After``: backpressure from
``routing.max_queued_requests``), 500 for a server fault (the answers: :mod:`deployments.http_errors`; usage,
``bcg`` and the event stream: :mod:`deployments.answers`; the model card, ``/v1/buckets``'s additions and
``/metrics``'s pointer: :mod:`deployments.introspection`).

Where the parts live: the FastAPI ``app``, its middleware and exception handlers in :mod:`deployments.ingress_app`;
the replica's state, the key check and the validation thread in :mod:`deployments.ingress_base`; the routes by concern
in :mod:`deployments.ingress_info` (health, models, buckets, metrics), :mod:`deployments.ingress_images`
(generations, edits, variations, the handle's ``images``) and :mod:`deployments.ingress_videos`; :class:`Ingress`
composes them. ``app`` is importable from here too.
"""

# No ``from __future__ import annotations`` in the route modules: FastAPI reads the route signatures
# (``request: Request``) of the class-based view that ``serve.ingress`` builds, and postponed annotations hide them.

import sys
from typing import Any

from ray import serve

from .drain import drain_replica
from .ingress_app import app
from .ingress_info import InfoEndpoints

# isort: split
# the image routes are registered (imported) after the info routes: OpenAPI lists the paths in that order
from .ingress_images import ImageEndpoints
from .ingress_videos import VideoEndpoints

__all__ = ["Ingress", "app"]


@serve.deployment
@serve.ingress(app)
class Ingress(InfoEndpoints, ImageEndpoints, VideoEndpoints):
    """FastAPI ingress: validates each request once (bucket lookup, miss policy), forwards the validated request.

    Its routes come from its route groups (``serve.ingress`` finds a route of any class in its MRO); the
    constructor, its arguments and what it raises are :class:`~deployments.ingress_base.IngressBase`'s.
    """

    # Ray Serve pickles this class by value, its route groups' methods by name (their modules). serve.ingress below
    # gives those methods their ``self`` dependency in the process that runs it, so the replica's process must import
    # this module too, or FastAPI takes ``self`` for a query parameter (422 on every route). Holding the module makes
    # unpickling the class import it (deployments/__init__.py no longer imports every module: its exports are lazy).
    _routes_module = sys.modules[__name__]

    async def drain(self, wait_s: float = 1.0) -> dict[str, Any]:
        """Handle method (``serve.get_app_handle(name).drain.remote(wait_s)``; :func:`~deployments.drain.
        drain_ingress` calls it before the application is deleted): from now on this replica answers every new HTTP
        request 503 with ``Retry-After`` (``routing.retry_after_s``; :func:`~deployments.drain.stopping_response`)
        and serves those in flight to the end; then waits up to ``wait_s`` seconds for them.

        Returns:
            ``{"replica": this process's drain id, "in_flight": HTTP requests still in flight}``.
        """
        return await drain_replica(self._config.routing.retry_after_s, wait_s)
