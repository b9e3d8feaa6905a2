"""A fake ``ray.util.metrics`` backend for :class:`deployments.metrics.BucketExporter`: it records what the
exporter does to each metric and checks the rules Ray's metrics enforce (``tests/unit/test_prometheus.py``,
``tests/unit/test_traffic.py``, ``tests/unit/test_bucket_plan.py``, ``tests/engine/test_prometheus_engine.py``)."""

from __future__ import annotations


class FakeMetric:
    """Records what the exporter does to one metric; checks the ``ray.util.metrics`` rules it must follow."""

    def __init__(self, kind: str, name: str, tag_keys: tuple[str, ...], boundaries=None):
        self.kind, self.name, self.tag_keys, self.boundaries = kind, name, tag_keys, boundaries
        self.calls: list[tuple[float, dict]] = []

    def _check(self, value, tags):
        assert isinstance(value, (int, float)) and set(tags) == set(self.tag_keys), (self.name, tags)
        assert all(isinstance(v, str) for v in tags.values())
        self.calls.append((value, dict(tags)))

    def inc(self, value=1.0, tags=None):
        assert self.kind == "counter" and value > 0, (self.name, value)  # Ray refuses value <= 0
        self._check(value, tags)

    def set(self, value, tags=None):
        assert self.kind == "gauge"
        self._check(value, tags)

    def observe(self, value, tags=None):
        assert self.kind == "histogram"
        self._check(value, tags)

    def total(self, **tags) -> float:
        """Sum of increments (or last gauge value) at tags matching ``tags``."""
        hits = [v for v, t in self.calls if all(t.get(k) == w for k, w in tags.items())]
        return (hits[-1] if hits else None) if self.kind == "gauge" else sum(hits)


class FakeBackend:
    def __init__(self):
        self.m: dict[str, FakeMetric] = {}

    def counter(self, name, description, tag_keys):
        return self.m.setdefault(name, FakeMetric("counter", name, tag_keys))

    def gauge(self, name, description, tag_keys):
        return self.m.setdefault(name, FakeMetric("gauge", name, tag_keys))

    def histogram(self, name, description, boundaries, tag_keys):
        return self.m.setdefault(name, FakeMetric("histogram", name, tag_keys, boundaries))

    def calls(self) -> int:
        return sum(len(m.calls) for m in self.m.values() if m.kind != "gauge")
