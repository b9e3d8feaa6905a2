"""Choosing the bucket table: the table search of ``bcg plan``, recorded traffic and drift, GPU profiling.

``samples.py`` reads traffic samples (krea, GenTD26, a recorded histogram), ``plan_costs.py`` prices a table on one,
``table_search.py`` searches a table under a graph cap and a memory budget, ``drift.py`` compares recorded traffic
with the planned one, ``traffic.py`` is the replica's recorded shape histogram, ``profile.py`` times buckets for
``bcg profile``.
docs/PLANNER.md shows the search on the packaged krea sample.
"""

from bcg_core.planning.traffic import TrafficHistogram, TrafficKey, load_traffic

__all__ = ["TrafficHistogram", "TrafficKey", "load_traffic"]
