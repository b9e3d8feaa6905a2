"""The parts of the DiT replica deployment (:class:`deployments.dit.DiTReplica`), one concern each:
:class:`~deployments.replica.model.ReplicaModel` (the model, its pipeline and step scheduler, captures),
:class:`~deployments.replica.membership.Membership` (join, heartbeats and leave with the ownership coordinator),
:class:`~deployments.replica.background.DriftWatch` and :class:`~deployments.replica.background.MetricsPush` (the
plan-drift check and the Prometheus push). Importing this package imports none of them (they import torch and Ray).
"""

from __future__ import annotations

import importlib

__all__ = ["DriftWatch", "Membership", "MetricsPush", "ReplicaModel"]

_MODULES = {"DriftWatch": "background", "MetricsPush": "background", "Membership": "membership",
            "ReplicaModel": "model"}


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f".{_MODULES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
