"""Fixtures of the fleet tests (helpers live in fleetkit.py; pytest runs with --import-mode=importlib, so this
folder goes on sys.path here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleetkit import kit  # noqa: E402


@pytest.fixture
def registry():
    """A registry with the axpy test candidates and request builder; decisions in memory only."""
    return kit.make_registry(None)
