"""What the plugin's CPU tests share. A test module asks for it with
`pytestmark = pytest.mark.usefixtures("fresh_warnings")`."""
from __future__ import annotations

import pytest


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-op fallback warning afresh, and strict off unless it says so."""
    from rtckern import config
    from rtckern.registry import fallback as fallback_mod

    monkeypatch.setattr(fallback_mod, "_warned", set())
    with config.override(strict=False):
        yield
