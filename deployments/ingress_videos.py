"""The ingress's ``/v1/videos`` routes (OpenAI's Videos API: create, list, retrieve, delete, ``cancel``,
``content``): :class:`VideoEndpoints` checks the API key and answers an image model's request 404; a video model's
are answered by :class:`~deployments.videos.routes.VideoRoutes` (built by :class:`~deployments.ingress_base.
IngressBase`, with the worker that runs the jobs on this replica's event loop).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures (``request: Request``)
# of the class-based view that ``serve.ingress`` builds, and postponed annotations hide them from it.

from fastapi import Request
from fastapi.responses import JSONResponse

from .ingress_app import VIDEO_ERRORS, app
from .ingress_base import IngressBase
from .videos.create import VIDEO_BODY, VIDEO_CONTENT

__all__ = ["VideoEndpoints"]


class VideoEndpoints(IngressBase):
    """The ``/v1/videos`` routes of :class:`~deployments.ingress.Ingress` (each registered on
    :data:`deployments.ingress_app.app`)."""

    def _video_refusal(self, request: Request, route: str) -> JSONResponse | None:
        """The 401 of a request without a known key, the 404 of a video route on an image model, or None."""
        refused = self._refused(request)
        if refused is None and self._videos is None:
            from .videos.routes import videos_unsupported

            return videos_unsupported(self._validator.spec, route)
        return refused

    @app.post("/v1/videos", responses=VIDEO_ERRORS, openapi_extra=VIDEO_BODY)
    async def create_video(self, request: Request):
        """Create a video job (OpenAI ``videos.create``): JSON or a form; answered ``queued`` at once."""
        return self._video_refusal(request, "POST /v1/videos") or await self._videos.create(request)

    @app.get("/v1/videos", responses=VIDEO_ERRORS)
    async def list_videos(self, request: Request):
        """A page of video jobs (``videos.list``: ``after``, ``limit``, ``order``)."""
        return self._video_refusal(request, "GET /v1/videos") or await self._videos.list(request)

    @app.get("/v1/videos/{video_id}", responses=VIDEO_ERRORS)
    async def retrieve_video(self, video_id: str, request: Request):
        """One video job (``videos.retrieve``)."""
        return self._video_refusal(request, "GET /v1/videos/{id}") or await self._videos.retrieve(video_id)

    @app.delete("/v1/videos/{video_id}", responses=VIDEO_ERRORS)
    async def delete_video(self, video_id: str, request: Request):
        """Delete a video job and its files (``videos.delete``)."""
        return self._video_refusal(request, "DELETE /v1/videos/{id}") or await self._videos.delete(video_id)

    @app.post("/v1/videos/{video_id}/cancel", responses=VIDEO_ERRORS)
    async def cancel_video(self, video_id: str, request: Request):
        """Cancel a queued or running video job: ``failed`` with error code ``cancelled``."""
        return self._video_refusal(request, "POST /v1/videos/{id}/cancel") or await self._videos.cancel(video_id)

    @app.get("/v1/videos/{video_id}/content", responses={**VIDEO_ERRORS, 200: VIDEO_CONTENT})
    async def video_content(self, video_id: str, request: Request):
        """A completed job's file (``videos.download_content``: ``variant`` video, thumbnail or spritesheet)."""
        return (self._video_refusal(request, "GET /v1/videos/{id}/content")
                or await self._videos.content(video_id, request))
