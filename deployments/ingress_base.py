"""The ingress's state and the helpers its route groups share: :class:`IngressBase`.

:class:`~deployments.ingress.Ingress` is composed of route groups that each subclass :class:`IngressBase`
(:class:`~deployments.ingress_info.InfoEndpoints`, :class:`~deployments.ingress_images.ImageEndpoints`,
:class:`~deployments.ingress_videos.VideoEndpoints`); the constructor, the API key check (:meth:`IngressBase._refused`),
the validation thread (:meth:`IngressBase._validate`) and the adapter check live here, once.
"""

import asyncio
import contextlib
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse

from bcg_core.request import GenerationRequest, ValidatedRequest
from bcg_core.validation import RequestValidator

from .adapters import AdapterCatalog
from .auth import ApiKeys
from .http_errors import unauthorized_response
from .memory import configure_ingress
from .schemas import RequestLimits
from .settings import ServeConfig
from .uploads import edits_card

__all__ = ["IngressBase"]


class IngressBase:
    """The ingress replica's state: its config, API keys, validator, DiT and coordinator handles, adapter catalog,
    the misses it refused, and (a video model) its ``/v1/videos`` routes and their worker.

    Args:
        dit_handle: handle of the :class:`~deployments.dit.DiTReplica` deployment.
        config: a ``ServeConfig`` as a mapping (``ServeConfig.model_dump(mode="json")``).
        coordinator: handle of the :class:`~deployments.coordinator.BucketCoordinator` (shape-aware routing),
            or None.

    Raises:
        pydantic.ValidationError: on a bad config (at replica start); ValueError: ``auth.api_key_file`` cannot be
            read or holds no key.
    """

    def __init__(self, dit_handle, config: dict, coordinator=None):
        self._config = ServeConfig.model_validate(config)
        self._keys = ApiKeys.from_config(self._config.auth)
        self._started = int(time.time())
        self._dit = dit_handle
        self._coord = coordinator
        # The validator's spec is describe_model(config.model): the served name comes from the checkpoint's JSON
        # configs, as the replicas' own, so no request waits for (or spends a DiT slot on) a stats call for it.
        self._validator = RequestValidator.from_config(self._config)
        self._model_name = self._validator.spec.name
        self._limits = self._request_limits()
        self._adapters = AdapterCatalog.for_config(self._config)  # None without lora.dir
        self._rejected: Counter[str] = Counter()  # misses answered 422 here (reject policy), by dimension
        self._rejected_requests = 0
        # one thread validates every request: the tokenizers are not shared across threads, and an edit's image is
        # decoded off the event loop
        self._validating = ThreadPoolExecutor(1, thread_name_prefix="bcg-validate")
        self._edits = edits_card(self._validator.spec, self._config.limits)
        self._background = "transparent" if self._validator.spec.output_alpha else "opaque"  # what the images are
        configure_ingress(self._config)  # large buffers mmapped; the heap trimmed once idle
        self._videos = None  # a video model's /v1/videos routes and the worker running their jobs
        if self._validator.spec.video:
            from .videos.routes import VideoRoutes, owner_id

            self._videos = VideoRoutes(self._config, self._validator, self._validate, dit_handle, owner_id())
            with contextlib.suppress(RuntimeError):  # outside Serve no loop runs here: the caller starts it
                self._videos.worker.start()

    def __del__(self):
        """Graceful stop: the video worker's running jobs go back to the queue (for another replica, or this one
        restarted; should this fail, their leases run out and they re-queue then)."""
        if getattr(self, "_videos", None) is not None:
            self._videos.worker.stop_now()

    def _request_limits(self) -> RequestLimits:
        return RequestLimits(
            limits=self._config.limits,
            size_multiple=None if self._validator.spec.size_bins else self._validator.spec.size_step,
            model_name=self._model_name,
            resolutions=tuple(self._config.buckets.resolutions),
            lora=self._config.lora,
            cache_methods=self._validator.spec.cache_methods,
            output_alpha=self._validator.spec.output_alpha,
            guidance=self._validator.spec.guidance_role(),
        )

    def _refused(self, request: Request) -> JSONResponse | None:
        """The 401 answer for a request without a known API key, or None (accepted, or no keys configured)."""
        reason = self._keys.check(request.headers.get("authorization"))
        return None if reason is None else unauthorized_response(reason)

    async def _validate(self, request: GenerationRequest) -> ValidatedRequest:
        """``self._validator.validate(request)`` on the validation thread (raises its :class:`RequestError`)."""
        return await asyncio.get_running_loop().run_in_executor(self._validating, self._validator.validate, request)

    async def _check_adapters(self, validated) -> None:
        """A validated request naming an adapter with no file in ``lora.dir`` raises RequestError (HTTP 422 listing
        the adapters; :meth:`~deployments.adapters.AdapterCatalog.check`); the replica decides the rest."""
        if self._adapters is not None:
            await self._adapters.check(validated.request.lora)
