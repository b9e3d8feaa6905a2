"""The step decider: each step's forwards, the cost model's cheapest over the shape's prepared buckets.

It sits below both the pipeline, which runs the forwards it is handed, and the step scheduler, which asks it for
every group's step; it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from bcg_core.costs.miss_memory import MissMemory
from bcg_core.costs.model import Chunk, CostModel, StepForwards
from bcg_core.keys import BucketKey, BucketShape

__all__ = ["StepDecider"]


class StepDecider:
    """Decides each step's forwards: the cost model's cheapest over the shape's prepared buckets.

    The one decider of a replica (the pipeline holds it as ``pipeline.decider``): the step scheduler and
    :meth:`~bcg_core.pipeline.DiTPipeline.generate` ask it, a caller of :meth:`~bcg_core.pipeline.DiTPipeline.step`
    asks it (:meth:`for_states`), and the pipeline and the runners trust what it returns.

    Args:
        keys: the table's buckets.
        prepared: returns the buckets prepared now (captured on CUDA); only those are chosen, unless a shape has
            none prepared yet.
        graphs: bucket forwards are graph replays (for the token-count stand-in, :meth:`CostModel.token_model`).
        spare_bytes: the bytes the replica can spare now (:func:`~.miss_memory.cuda_spare_bytes`), None: no bound.
    """

    def __init__(self, keys: Iterable[BucketKey], prepared: Callable[[], set], graphs: bool,
                 spare_bytes: Callable[[], int | None] | None = None):
        keys = list(keys)
        self.miss = MissMemory(spare_bytes)
        """The memory bound on a miss's forwards; measured costs bring its bytes per row-token (:meth:`set_costs`)."""
        self._prepared = prepared
        self.fallback = CostModel.token_model(keys, graphs=graphs)
        """The token-count stand-in: used for shapes the cost model has no time of."""
        self.costs = self.fallback
        """The cost model (measured at prepare on CUDA, else the stand-in)."""
        self._by_shape: dict[BucketShape, list[BucketKey]] = {}
        for k in keys:
            self._by_shape.setdefault(k.shape, []).append(k)
        self._pieces_seen = 0

    def set_costs(self, costs: CostModel, merge: bool = True) -> None:
        """Use ``costs`` from now on: merged over the current model (a shape captured later adds its times), or
        in its place when ``merge`` is False or nothing was measured before. Its eager bytes per row-token, where
        measured, go to :attr:`miss` (the largest seen is kept either way)."""
        self.miss.observe(costs.eager_bytes_per_row_token)
        self.costs = costs if not merge or self.costs is self.fallback else self.costs.merged(costs)

    def observe_pieces(self, runner) -> None:
        """Take the step-cache halves' measured shares of ``runner`` (:attr:`~bcg_core.runners.BucketRunner.
        piece_shares`) into the cost model once more of its buckets' halves were captured
        (``runner.stats.piece_captures``; one integer compare per cached step otherwise)."""
        captured = runner.stats.piece_captures
        if captured == self._pieces_seen:
            return
        self._pieces_seen = captured
        shares = runner.piece_shares
        if not shares:
            return
        costs = self.costs  # one snapshot: set_costs may swap it from the capture thread
        merged = costs.merged(CostModel({}, source=costs.source, eager=costs.eager, piece_shares=shares))
        if costs is self.fallback:
            self.fallback = merged
        self.costs = merged

    def decide(self, shape: BucketShape | None, rows: int, real_per_row: int | None = None,
               phase: str | None = None) -> StepForwards:
        """The forwards of one step of ``rows`` rows of ``shape``. ``real_per_row``: the rows' real tokens
        (:attr:`~bcg_core.keys.ShapeQuery.tokens_per_row`), fewer than the shape's in a masked tier, where an eager
        chunk computes fewer tokens than a bucket forward (None: the shape's). ``phase``: ``"head"`` or ``"tail"``,
        forwards of that half of a cached step, priced by the measured halves (:meth:`CostModel.choose`).

        A miss (``shape`` None) runs unpadded and eager, in one forward while its activations fit the memory the
        replica can spare now, else in as few, as even chunks as fit (:meth:`~.miss_memory.MissMemory.chunk_rows`).

        Raises:
            ValueError: ``rows`` below 1.
        """
        if shape is None:
            return StepForwards(tuple(Chunk(None, r, 0.0) for r in self.miss.chunk_rows(rows, real_per_row)))
        prepared = self._prepared()
        every = self._by_shape.get(shape, [])
        keys = [k for k in every if k in prepared] or every
        costs = self.costs if any(k in self.costs.bucket_ms for k in keys) else self.fallback
        share = 1.0 if real_per_row is None else real_per_row / max(1, shape.tokens_per_row)
        return costs.choose(shape, rows, keys, share, phase)

    def for_states(self, states: Sequence, rows: int | None = None, phase: str | None = None) -> StepForwards:
        """The forwards of one step of ``states`` (:class:`~bcg_core.families.RequestState`, one token grid, as
        :meth:`~bcg_core.pipeline.DiTPipeline.step` runs them together): :meth:`decide` for their rows, on the shape
        their validation looked up. States of several shapes (a direct caller's mix: the step scheduler groups by
        shape) run on the shape with the most image and text tokens, whose buckets hold every row (masked text pads
        up); a miss among them runs the step unpadded and eager. The real tokens per row are the most of any state's.
        ``rows``: decide for that many of their rows instead of all (the step cache's rows that compute their
        remaining blocks, :mod:`bcg_core.step_cache.step`), ``phase`` the half they run (:meth:`decide`).

        Raises:
            ValueError: no states.
        """
        if not states:
            raise ValueError("a step needs at least one request")
        shapes = {s.validated.shape for s in states}
        shape = None if None in shapes else max(shapes, key=lambda sh: (sh.image_tokens, sh.text_tokens))
        real = max(s.validated.lookup.query.tokens_per_row for s in states)
        return self.decide(shape, sum(s.rows for s in states) if rows is None else rows, real, phase)

    def split_adapters(self, shape: BucketShape | None, plain_rows: int, adapter_rows: int) -> bool:
        """Whether a step of ``shape`` whose rows mix requests without adapters (``plain_rows``) and with them
        (``adapter_rows``) costs less as two steps: the plain rows on the buckets' plain graphs, the adapter rows
        on their LoRA graphs, than all rows together on LoRA graphs, where every row pays the deltas' passes
        over its activations. Expected milliseconds of :meth:`decide`'s forwards, a bucket forward with adapter
        rows scaled by :meth:`CostModel.lora_factor` (an eager chunk by its home bucket's); False where the factors
        are unmeasured (1.0: one forward is then never dearer than two), for a miss, or when either side has no
        rows."""
        if shape is None or plain_rows < 1 or adapter_rows < 1:
            return False
        costs = self.costs  # one snapshot: set_costs may swap it from the capture thread

        def with_lora(forwards: StepForwards) -> float:
            # an eager chunk with adapter rows pays the deltas too: priced at its home bucket's factor
            return sum(c.ms * costs.lora_factor(c.key or c.home or forwards.home) for c in forwards.chunks)

        together = with_lora(self.decide(shape, plain_rows + adapter_rows))
        return self.decide(shape, plain_rows).ms + with_lora(self.decide(shape, adapter_rows)) < together
