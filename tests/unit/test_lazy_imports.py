"""The package exports are lazy (PEP 562): a Serve process imports only the modules it uses.

Ray Serve unpickles the ownership coordinator and the shape-aware router (Serve's controller holds it) in processes that
never run the model; their imports must load neither torch nor diffusers nor transformers (docs/OPERATIONS.md, what
each process loads). Every exported name still resolves from its package.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import bcg_core
import deployments

HEAVY = ("torch", "diffusers", "transformers")


def test_the_coordinator_and_the_router_import_no_torch_diffusers_or_transformers():
    script = f"""
import json, sys
import deployments, bcg_core, deployments.coordinator, router.shape_router, router.autoscaling
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("package", [bcg_core, deployments], ids=lambda p: p.__name__)
def test_every_exported_name_resolves_and_an_unknown_one_is_an_attribute_error(package):
    assert len(package.__all__) > 20
    for name in package.__all__:
        assert getattr(package, name) is not None, name
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="no_such_name"):
        package.no_such_name  # noqa: B018
