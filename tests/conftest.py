"""Fixtures of every test folder: a clean ``os.environ`` per test.

The session's Ray Serve instance (``serve_apps``) is ``tests/serve/conftest.py``'s, so that only the tests under
``tests/serve/`` start Ray. ``pyproject.toml`` puts this folder on ``sys.path`` (``pythonpath``): the shared
helpers here (``closeness``, ``fake_metrics``, ``validation_counting``, ``reference_gate``, ``tiny``) import the same
from every folder.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _restore_environ():
    """Give every test the environment it started with, whatever it sets."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
