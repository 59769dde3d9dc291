"""The torch plugin's fallback policy: when no JIT candidate serves a request, use torch's own op with a
one-time warning, unless RTCKERN_STRICT=1 makes that an error."""
from __future__ import annotations

import threading
import warnings

from rtckern import config
from rtckern.errors import UnsupportedRequestError

_warned: set[str] = set()
_lock = threading.Lock()


def fallback_allowed() -> bool:
    return not config.settings().strict


def warn_fallback_once(op: str, error: UnsupportedRequestError) -> None:
    """Re-raise `error` under RTCKERN_STRICT=1; otherwise warn once per op that torch's op is used instead."""
    if not fallback_allowed():
        raise error
    with _lock:
        if op in _warned:
            return
        _warned.add(op)
    warnings.warn(f"rtckern: no JIT implementation serves {op!r}; using torch's own op instead "
                  f"(set RTCKERN_STRICT=1 to make this an error).\n{error}", RuntimeWarning, stacklevel=3)
