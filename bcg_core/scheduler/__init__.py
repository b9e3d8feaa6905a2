"""The step scheduler: continuous batching of denoising steps of many requests into bucket forwards.

``step_scheduler.py`` is the asyncio front (submit, stream, close, stats), ``loop.py`` the denoising thread (admit,
step every group, retire), ``flight.py`` the requests in flight, ``admission.py`` which waiting requests
start, ``costs.py`` the cost model that decides each step's forwards (``miss_memory.py`` a miss's: one forward
while it fits the memory the replica can spare), ``finish.py`` the decode thread, the
image-encoding pool and the one place a result is built, ``prepare.py`` the prepare thread (an edit's start and
its image's VAE encode, batched across edits, off the denoising thread), ``previews.py`` the preview thread,
``load.py`` the load meter autoscaling reads, ``memtrim.py`` the idle trim. docs/DESIGN.md section 12.
"""

from bcg_core.scheduler.costs import Chunk, CostModel, Decision, StepDecider, StepForwards

__all__ = ["Chunk", "CostModel", "Decision", "StepDecider", "StepForwards", "StepScheduler"]


def __getattr__(name: str):
    """:class:`StepScheduler`, imported on first use (its loop imports the pipeline, which imports the costs)."""
    if name == "StepScheduler":
        from bcg_core.scheduler.step_scheduler import StepScheduler

        return StepScheduler
    raise AttributeError(f"module 'bcg_core.scheduler' has no attribute {name!r}")
