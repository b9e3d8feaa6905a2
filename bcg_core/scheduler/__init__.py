"""The step scheduler: continuous batching of denoising steps of many requests into bucket forwards.

``step_scheduler.py`` is the asyncio front (submit, stream, close, stats), ``loop.py`` the denoising thread (admit,
step every group, retire), ``flight.py`` the requests in flight, ``admission.py`` which waiting requests
start, ``finish.py`` the decode thread and the image-encoding pool, ``edit_start.py`` the edit-start thread (an edit's
start and its image's VAE encode, batched across edits, off the denoising thread), ``previews.py`` the preview thread,
``stats.py`` its counters, ``load.py`` the load meter autoscaling reads, ``memtrim.py`` the idle trim. Each step's
forwards are decided by the cost model below it (:mod:`bcg_core.costs`), which the pipeline holds too.
docs/DESIGN.md section 12.
"""

__all__ = ["StepScheduler"]


def __getattr__(name: str):
    """``StepScheduler``, imported on first use (PEP 562): its torch stays out of processes that import only a
    torch-free part of this package (the ingress's :mod:`~bcg_core.scheduler.memtrim`).

    Raises:
        AttributeError: any other name.
    """
    if name == "StepScheduler":
        from bcg_core.scheduler.step_scheduler import StepScheduler

        return StepScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
