"""Shared fixtures: a fresh cache directory per test, a tiny kernel spec, GPU skipping, and the every-variant
tests' kernels queued for compiling at collection (the ``compiles`` marker)."""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile

import pytest

from rtckern import config
from rtckern.arch import Arch
from rtckern.manager import KernelManager, set_manager
from rtckern.spec import KernelSpec


def _gpu_visible() -> bool:
    from rtckern.device import device_count

    return device_count() > 0


def pytest_configure(config):
    """Where the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE), the session's Python child processes
    (some 360: the CLI, prefill, the benchmarks, the compile pool) write and read it under a folder of this session
    (PYTHONPYCACHEPREFIX), as benchmarks/first_call.py does: otherwise each compiles rtckern's modules from source
    again (~0.1 s of CPU per CLI process). A fresh folder per session: nothing carries over from an earlier run."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):  # (an xdist worker finds it gone: its controller took it)
        return
    prefix = tempfile.mkdtemp(prefix="rtckern-test-pycache-")
    config._rtk_pycache = (prefix, os.environ.pop("PYTHONDONTWRITEBYTECODE"), os.environ.get("PYTHONPYCACHEPREFIX"))
    os.environ["PYTHONPYCACHEPREFIX"] = prefix


def pytest_unconfigure(config):
    saved = getattr(config, "_rtk_pycache", None)
    if saved is None:
        return
    prefix, dont_write, old_prefix = saved
    os.environ["PYTHONDONTWRITEBYTECODE"] = dont_write
    if old_prefix is None:
        os.environ.pop("PYTHONPYCACHEPREFIX", None)
    else:
        os.environ["PYTHONPYCACHEPREFIX"] = old_prefix
    shutil.rmtree(prefix, ignore_errors=True)


def pytest_collection_modifyitems(items):
    """The tests marked ``compiles`` run last: the others run first, while their kernels compile on the spare core."""
    items[:] = [i for i in items if i.get_closest_marker("compiles") is None] + \
        [i for i in items if i.get_closest_marker("compiles") is not None]


def pytest_collection_finish(session):
    """Queue the kernels of every test marked ``compiles(builder=..., no_spills=False)`` on rtckern.testing's pool
    before the first test runs: they compile on the spare core (and on both while a test waits for them) while the
    other tests run here. ``builder`` takes the test's parameters it names and returns the KernelSpecs the test
    will give compile_all; whatever it returns that the test does not ask for is only wasted work."""
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):  # xdist: a worker runs a share
        return
    from rtckern.testing import prefetch

    for item in session.items:
        for mark in item.iter_markers("compiles"):
            kwargs = dict(mark.kwargs)
            builder = kwargs.pop("builder")
            params = getattr(item, "callspec", None)
            names = inspect.signature(builder).parameters
            try:
                specs = builder(**{k: v for k, v in (params.params if params else {}).items() if k in names})
            except Exception:  # the test calls it too, and fails there with the whole story
                continue
            prefetch(specs, **kwargs)


def pytest_sessionfinish(session):
    """A session that ends before its ``compiles`` tests (-x, a failure, Ctrl-C) does not wait for their kernels."""
    import sys

    testing = sys.modules.get("rtckern.testing")
    if testing is not None:
        testing.stop_pool()


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


@pytest.fixture(scope="session")
def _session_cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("shared-cache")


@pytest.fixture
def shared_cache_dir(_session_cache_root, monkeypatch):
    """As `cache_dir`, but one directory for the whole session: for tests that read the registry's choices on
    described devices and never look at the cache itself, so that a kernel one of them compiled is a disk hit for
    the next (the explain tests of the attention ops compile the same kernels over and over otherwise)."""
    d = _session_cache_root / "cache"
    monkeypatch.setenv("RTCKERN_CACHE_DIR", str(d))
    # kernels only: a persisted probe decision (a rejection is reused whatever its stage) would carry one test's
    # transient failure into every later one
    with config.override(cache_dir=d, cache_max_bytes=None, read_only_layers=(), remote_cache=None,
                         persist_decisions=False):
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
