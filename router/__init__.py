"""Shape-aware request routing across DiT replicas (bucket ownership, the Ray Serve request router and
the autoscaling policy). Empty until the routing work lands: nothing here is imported by the app yet."""

__all__: list[str] = []
