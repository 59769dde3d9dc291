"""Shared fixtures: a fresh cache directory per test, a tiny kernel spec, and GPU skipping."""

from __future__ import annotations

import pytest

from rtckern import config
from rtckern.arch import Arch
from rtckern.manager import KernelManager, set_manager
from rtckern.spec import KernelSpec


def _gpu_visible() -> bool:
    from rtckern.device import device_count

    return device_count() > 0




def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not _gpu_visible():
        pytest.skip("no CUDA GPU visible")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache dir, used by the process-wide settings and manager for the test's duration."""
    d = tmp_path / "cache"
    monkeypatch.setenv("RTCKERN_CACHE_DIR", str(d))
    with config.override(cache_dir=d, cache_max_bytes=None, read_only_layers=(), remote_cache=None):
        old = set_manager(None)
        try:
            yield d
        finally:
            set_manager(old)


@pytest.fixture
def manager(cache_dir):
    return KernelManager(cache_dir)


@pytest.fixture
def axpy_spec():
    return KernelSpec("core/axpy.cuh", "axpy", Arch.parse("sm_80"), template_args=("float",), op="core")
