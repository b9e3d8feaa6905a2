"""A test helper: the step scheduler fed raw requests, each planned first as the ingress plans it.

The real scheduler accepts only a :class:`~bcg_core.request.PlannedRequest` (validated once, at the ingress);
tests that drive it with :class:`~bcg_core.request.GenerationRequest` values plan them here, once, with the
pipeline's own planner.
"""

from bcg_core import GenerationRequest, PlannedRequest, StepScheduler


class PlanningScheduler(StepScheduler):
    """:class:`StepScheduler` whose ``submit`` plans a raw request first (tests only)."""

    async def submit(self, plan: PlannedRequest | GenerationRequest, on_preview=None, lease=None):
        if isinstance(plan, GenerationRequest):
            plan = self.pipeline.planner.plan(plan)
        return await super().submit(plan, on_preview, lease)
