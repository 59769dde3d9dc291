"""rtckern.logs: RTCKERN_VERBOSE's stderr handler (only where no other handler takes the records), compiles at INFO
and cache hits at DEBUG, warnings on one channel, and the name `rtckern` in torch's logging.

The handler tests run in a fresh interpreter: pytest installs root handlers of its own, which (rightly) keep the
stderr handler quiet in this process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

from rtckern import logs
from rtckern.cache import CacheWarning, DiskCache

COMPILE_TWICE = """
import sys
{before}
from rtckern import Arch, KernelSpec, get_manager
spec = KernelSpec("core/axpy.cuh", "noop0", Arch.parse("sm_80"), op="core")
get_manager().compile(spec)
{after}
get_manager().compile(spec)
"""


def _run(tmp_path, env: dict, before: str = "", after: str = "") -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RTCKERN_", "TORCH_LOGS"))}
    full.update(RTCKERN_CACHE_DIR=str(tmp_path / "cache"), **env)
    r = subprocess.run([sys.executable, "-c", COMPILE_TWICE.format(before=before, after=after)], env=full,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_quiet_by_default(tmp_path):
    assert _run(tmp_path, {}) == ""


def test_verbose_attaches_a_stderr_handler_and_logs_compiles_at_info(tmp_path):
    err = _run(tmp_path, {"RTCKERN_VERBOSE": "1"})
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rtckern] INFO rtckern.manager: compiled noop0 [core/axpy.cuh] "
                                                   "for sm_80 in "), err


def test_verbose_2_logs_cache_hits_at_debug(tmp_path):
    err = _run(tmp_path, {"RTCKERN_VERBOSE": "2"})
    assert "INFO rtckern.manager: compiled noop0" in err
    assert "DEBUG rtckern.manager: cache hit (memory) noop0 [core/axpy.cuh] for sm_80" in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_application_handler_prints_each_record_once(tmp_path, where):
    """logging.basicConfig before rtckern reads its settings, or between two compiles: one line per record, from
    whichever handler is there at the time."""
    config = "import logging; logging.basicConfig(format='APP %(name)s: %(message)s')"
    err = _run(tmp_path, {"RTCKERN_VERBOSE": "2"}, **{where: config})
    assert err.count("compiled noop0") == 1 and err.count("cache hit (memory)") == 1, err
    compiled = "APP rtckern.manager: compiled" if where == "before" else "[rtckern] INFO rtckern.manager: compiled"
    assert compiled in err and "APP rtckern.manager: cache hit (memory)" in err, err


def test_an_application_level_is_kept():
    logger = logging.getLogger("rtckern")
    old = logger.level
    logger.setLevel(logging.WARNING)
    try:
        logs.apply_verbose(2)
        assert logger.level == logging.WARNING
        logs.apply_verbose(0)
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(old)
        logs.apply_verbose(0)


def test_verbose_off_takes_the_level_and_handler_back():
    logger = logging.getLogger("rtckern")
    logs.apply_verbose(1)
    assert logger.level == logging.INFO and any(isinstance(h, logs._StderrHandler) for h in logger.handlers)
    logs.apply_verbose(0)
    assert logger.level == logging.NOTSET and not any(isinstance(h, logs._StderrHandler) for h in logger.handlers)


def test_a_cache_warning_is_a_warning_and_not_also_a_log_record(tmp_path, caplog):
    disk = DiskCache(tmp_path)
    key = "ab" * 32
    path = disk.entry_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not an entry")
    caplog.set_level(logging.DEBUG, logger="rtckern")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert disk.get(key) is None
    assert [str(w.message) for w in seen if issubclass(w.category, CacheWarning)], "the bad entry is warned about"
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_torch_logs_shows_rtckern_records_once(tmp_path):
    """TORCH_LOGS=+rtckern: torch's handler prints them (DEBUG); RTCKERN_VERBOSE's handler stays quiet."""
    pytest.importorskip("torch")
    err = _run(tmp_path, {"TORCH_LOGS": "+rtckern", "RTCKERN_VERBOSE": "1"}, before="import torch")
    assert err.count("compiled noop0") == 1 and "cache hit (memory)" in err and "[rtckern]" not in err, err


def test_registered_with_torch_lazily():
    """`import rtckern` never imports torch; with torch imported, `rtckern` is a name in torch's log registry."""
    pytest.importorskip("torch")
    code = ("import sys, rtckern; print('torch' in sys.modules); import torch, rtckern.torch; "
            "from torch._logging import _internal as t; print(t.log_registry.is_log('rtckern'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
