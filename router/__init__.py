"""Shape-aware request routing across DiT replicas (docs/DESIGN.md section 5).

- :mod:`router.ownership`: which replicas own (capture and serve) which bucket shapes, from the expected
  work of the request mix and each replica's graph-memory budget. Pure and deterministic, no Ray.
- :mod:`router.membership`: joins, heartbeats, leases; the live assignment as replicas come and go.
- :mod:`router.shape_router`: ``ShapeAwareRouter``, the Ray Serve request router (imports ``ray.serve``,
  so it is not re-exported here).

Importing this package does not import Ray; it re-exports the ownership API.
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
