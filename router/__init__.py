"""Shape-aware request routing across DiT replicas (DESIGN.md section 5).

- :mod:`router.ownership`: which replicas own (capture and serve) which buckets, from the expected request
  mix and each replica's graph-memory budget. Pure and deterministic, no Ray; recomputed when the replica
  set changes.

Nothing here imports Ray at module import.
"""

from .ownership import (
    DEFAULT_GRAPH_OVERHEAD_BYTES,
    DEFAULT_HOT_SHARE,
    KREA_CSV,
    Assignment,
    BucketDemand,
    LoadEstimate,
    ReplicaCapacity,
    assign,
    bucket_demands,
    expected_load,
    krea_rows,
)

__all__ = [
    "Assignment",
    "BucketDemand",
    "DEFAULT_GRAPH_OVERHEAD_BYTES",
    "DEFAULT_HOT_SHARE",
    "KREA_CSV",
    "LoadEstimate",
    "ReplicaCapacity",
    "assign",
    "bucket_demands",
    "expected_load",
    "krea_rows",
]
