"""The cost model and the step decider: which rows of a step run in which forwards.

``model.py`` holds the cost model (:class:`CostModel`: expected milliseconds of bucket and unpadded eager forwards,
and the cheapest combination of chunks) and its answer (:class:`StepForwards`, :class:`Chunk`, :class:`Decision`);
``measure.py`` measures it through a runner (:func:`measure_costs`); ``decider.py`` the replica's one
:class:`StepDecider`; ``miss_memory.py`` how a miss's step is cut while it fits the memory the replica can spare.
Pure CPU logic over measured times: it sits below both the pipeline (which runs the forwards it is handed) and the
step scheduler (which asks it), and imports neither. docs/DESIGN.md section 12.
"""

from bcg_core.costs.decider import StepDecider
from bcg_core.costs.measure import eager_row_counts, measure_costs
from bcg_core.costs.miss_memory import ActivationPeaks, MissMemory, cuda_spare_bytes
from bcg_core.costs.model import DECISIONS, Chunk, CostModel, Decision, StepForwards

__all__ = ["DECISIONS", "ActivationPeaks", "Chunk", "CostModel", "Decision", "MissMemory", "StepDecider",
           "StepForwards", "cuda_spare_bytes", "eager_row_counts", "measure_costs"]
