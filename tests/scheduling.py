"""A test helper: the step scheduler fed raw requests, each validated first as the ingress validates it.

The real scheduler accepts only a :class:`~bcg_core.request.ValidatedRequest` (validated once, at the ingress);
tests that drive it with :class:`~bcg_core.request.GenerationRequest` values validate them here, once, with the
pipeline's own validator.
"""

from bcg_core import GenerationRequest, StepScheduler, ValidatedRequest


class ValidatingScheduler(StepScheduler):
    """:class:`StepScheduler` whose ``submit`` validates a raw request first (tests only)."""

    async def submit(self, validated: ValidatedRequest | GenerationRequest, on_preview=None, lease=None, on_step=None):
        if isinstance(validated, GenerationRequest):
            validated = self.pipeline.validator.validate(validated)
        return await super().submit(validated, on_preview, lease, on_step)
