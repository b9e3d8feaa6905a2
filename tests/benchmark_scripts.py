"""The benchmark scripts of ``benchmarks/`` as modules, for the tests that check their pure parts and CPU smokes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["BENCHMARKS", "load"]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
"""The folder of the benchmark scripts."""


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` executed as the module ``name`` (registered in ``sys.modules`` first, so the script's
    own imports of its siblings, e.g. ``import bench_saturation as sat``, find the same module)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module
