"""rtckern's logging: the ``rtckern`` logger tree, the stderr handler RTCKERN_VERBOSE asks for, and the name
``rtckern`` in torch's logging.

Every module logs through ``logging.getLogger(__name__)`` (children of ``rtckern``): compiles at INFO, cache hits
at DEBUG. A problem rtckern works around is a Python warning (``warnings.warn``), not logged as well: one problem,
one line (``logging.captureWarnings(True)`` routes warnings to logging where an application wants them there).

A library attaches no handler unless asked: RTCKERN_VERBOSE=1 (2) sets the ``rtckern`` logger to INFO (DEBUG) when
the application left its level unset, and adds a stderr handler that writes only while no other handler would
receive the records (the application's, a root handler from ``logging.basicConfig``, torch's from TORCH_LOGS),
whichever is configured first.

torch: TORCH_LOGS=+rtckern (DEBUG) or TORCH_LOGS=rtckern (INFO) works as for any importable package; `register_torch`
also registers the name with torch's log registry (lazily: ``import rtckern`` never imports torch), so
``torch._logging.set_logs(modules={"rtckern": logging.DEBUG})`` finds it without importing rtckern's subpackages.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "rtckern"
VERBOSE_LEVELS = {1: logging.INFO, 2: logging.DEBUG}  # RTCKERN_VERBOSE -> level of the rtckern logger

_root = logging.getLogger(LOGGER_NAME)
_level_set_here: int | None = None  # the level apply_verbose gave the logger (None: the application's, or unset)


class _StderrHandler(logging.StreamHandler):
    """RTCKERN_VERBOSE's handler: writes a record only when no other handler would receive it, so configuring
    logging before or after rtckern never prints a line twice."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("[rtckern] %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if not _other_handlers(self):
            self.stream = sys.stderr  # the current one (redirected, or captured by pytest)
            super().emit(record)


def _other_handlers(mine: logging.Handler) -> bool:
    """Whether a record of the rtckern logger reaches a handler other than ``mine`` (logging.lastResort aside)."""
    logger: logging.Logger | None = _root
    while logger is not None:
        if any(h is not mine for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


_handler = _StderrHandler()


def apply_verbose(verbose: int) -> None:
    """Follow RTCKERN_VERBOSE (0, 1 or 2): set the rtckern logger's level unless the application set one, and keep
    the stderr handler attached while verbose. Called whenever the settings are read or replaced."""
    global _level_set_here
    want = VERBOSE_LEVELS.get(min(int(verbose), 2))
    if want is None:
        if _level_set_here is not None and _root.level == _level_set_here:
            _root.setLevel(logging.NOTSET)
        _level_set_here = None
        _root.removeHandler(_handler)
        return
    if _root.level == logging.NOTSET or _root.level == _level_set_here:
        _root.setLevel(want)
        _level_set_here = want
    if _handler not in _root.handlers:
        _root.addHandler(_handler)


def register_torch() -> bool:
    """Register ``rtckern`` with torch's log registry when torch is imported; False where it is not, or where this
    torch has no such registry (a private API: its absence only loses the shorthand, never breaks rtckern)."""
    if "torch" not in sys.modules:
        return False
    try:
        from torch._logging import _internal as torch_logs

        if not torch_logs.log_registry.is_log(LOGGER_NAME):
            torch_logs.register_log(LOGGER_NAME, LOGGER_NAME)
        return True
    except Exception as e:  # noqa: BLE001 - any change of torch's private logging API
        _root.debug("not registered with torch's logging (%s: %s)", type(e).__name__, e)
        return False
