"""Record mode: with ``RTCKERN_RECORD_MANIFEST=FILE``, each request the registry decides for the first time in a
process is appended to FILE as one manifest line, so a real workload can be replayed by ``rtckern prefill
--manifest FILE`` on a build machine. The registry announces each such decision as an ``rtckern.events.
SelectionEvent``; ``record_selection`` listens (rtckern installs it at import, so the registry imports no fleet).

Safe under concurrent writers (processes of one job, jobs on one shared filesystem): the file is opened with
``O_APPEND`` and every line is written by one ``write`` under an exclusive ``flock``; a line already in the file is
not written again, so restarts do not grow it. Called on the registry's slow path only (after a probe), never on
the hot path. A recording problem never breaks the op call: it is logged once and recording goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from .manifest import canonical_line

log = logging.getLogger(__name__)

_seen: set[tuple[str, str]] = set()  # (file, line) written or found by this process
_lock = threading.Lock()
_warned: set[str] = set()

MAIN_DTYPE_NAMES = ("x", "a", "qkv", "q", "input", "dy")


def request_line(req: Any) -> str:
    """The manifest line for an ``OpRequest``: op, main dtype, its shape features (in name order), the exact
    request, and the device it was decided on (no ordinal: the line is about a kind of device)."""
    from ..registry.request import device_to_dict

    dtypes = dict(req.dtypes)
    main = next((dtypes[n] for n in MAIN_DTYPE_NAMES if n in dtypes), None)
    if main is None:
        main = dtypes[sorted(dtypes)[0]] if dtypes else "fp32"
    dev = device_to_dict(req.device)
    dev.pop("ordinal", None)
    obj = {
        "op": req.op,
        "dtype": main,
        # The recorder sees the request, not the arrays: `shape` lists its shape features (named in `request`),
        # and replay uses `request`, which is exact.
        "shape": [int(v) for _, v in req.shape] or [1],
        "request": {"dtypes": dtypes, "shape": dict(req.shape), "flags": dict(req.flags)},
        "device": dev,
    }
    return canonical_line(obj)


def append_line(path: Path, line: str) -> bool:
    """Append ``line`` (no newline) to ``path`` unless the file already has it. True if written."""
    data = (line + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by close, or by the kernel if this process dies
        size = os.fstat(fd).st_size
        existing = os.pread(fd, size, 0) if size else b""
        if line.encode() in existing.splitlines():
            return False
        if existing and not existing.endswith(b"\n"):
            data = b"\n" + data  # a writer died mid-line (cannot happen with one write, but a human may edit)
        os.write(fd, data)
        return True
    finally:
        os.close(fd)


def record_request(req: Any) -> None:
    """Append ``req`` to the record manifest when one is set. Never raises."""
    from ..config import settings

    path = settings().record_manifest
    if path is None:
        return
    key = None
    try:
        key = (str(path), request_line(req))
        with _lock:
            if key in _seen:
                return
            _seen.add(key)
        append_line(Path(path), key[1])
    except Exception as e:  # recording is a side job: the op call goes on
        msg = f"RTCKERN_RECORD_MANIFEST={path}: cannot record {getattr(req, 'op', req)!r} ({e}); not recording it"
        with _lock:
            first = str(path) not in _warned
            _warned.add(str(path))
        if first:
            with contextlib.suppress(Exception):  # one channel: not logged as well (rtckern.logs)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
        with _lock:
            _seen.discard(key)  # not written: a later call may try again


def record_selection(event: Any) -> None:
    """The listener for the registry's ``SelectionEvent``s (rtckern installs it at import; it records only while
    ``RTCKERN_RECORD_MANIFEST`` is set). Never raises."""
    record_request(event.request)


def forget() -> None:
    """Forget which lines this process has written (tests)."""
    with _lock:
        _seen.clear()
        _warned.clear()
