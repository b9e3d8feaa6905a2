"""The engine ``bcg_core`` never imports Ray, ``deployments`` or ``router`` (STYLE.md: a torch-only engine).

Two checks: no module of ``bcg_core`` names them in an import statement (a static scan, which also sees
imports inside functions), and importing ``bcg_core`` with every one of its submodules, in a fresh
interpreter, leaves them out of ``sys.modules`` (which also catches a dependency that pulls Ray in).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import bcg_core

PACKAGE = Path(bcg_core.__file__).resolve().parent
FORBIDDEN = ("ray", "deployments", "router")


def _imported_roots(tree: ast.AST) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_engine_module_has_an_import_of_ray_deployments_or_router():
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 10 and PACKAGE / "pipeline.py" in sources
    offenders = {str(p.relative_to(PACKAGE)): sorted(_imported_roots(ast.parse(p.read_text())) & {*FORBIDDEN})
                 for p in sources}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_importing_the_engine_and_all_its_submodules_loads_no_ray():
    script = """
import importlib, json, pkgutil, sys
import bcg_core
names = sorted(m.name for m in pkgutil.walk_packages(bcg_core.__path__, "bcg_core."))
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "deployments", "router"))
print(json.dumps({"modules": names, "loaded": loaded}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # every submodule was imported, the command line (which needs Ray) is no longer one of them
    assert {"bcg_core.pipeline", "bcg_core.validation", "bcg_core.families.flux"} <= \
        set(report["modules"])
    assert not {"bcg_core.cli", "bcg_core.commands"} & set(report["modules"])
    assert report["loaded"] == []
