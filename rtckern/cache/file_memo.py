"""Small memos of what a process derives from a file (NVRTC's facts, cuda.h's version, a parsed tuning table), kept
in the cache dir so that the next process reads the answer instead of deriving it again.

A memo lives at ``<cache dir>/<folder>/<prefix>-<sha256 of its key text, 32 hex digits><suffix>``. What the key
text is decides when a memo may be trusted, and is the caller's choice: the file's identity (``file_identity``:
path, size, mtime, inode, device; for files that installers replace, not edit: libraries, toolkit headers) or the
file's contents (anything a person may edit in place, where two writes can share an mtime). No memo is written
with RTCKERN_DISK_CACHE=0 or before the cache dir exists (commands that only read create nothing); any error
writing one is ignored, and one that cannot be read is a miss.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable

from ..config import settings

log = logging.getLogger(__name__)
FOLDERS = ("toolchain", "tables")  # every folder of the cache dir that holds memos


def file_identity(path: Path | str) -> dict:
    """What tells one file from another (a replaced or rewritten file changes at least one of these). Raises
    OSError when the file cannot be stat'ed."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "device": st.st_dev}


def memo_path(folder: str, prefix: str, key_text: str, suffix: str) -> Path | None:
    """Where the memo of `key_text` lives; None where memos are off (no disk cache)."""
    s = settings()
    if not s.disk_cache:
        return None
    digest = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    return s.cache_dir / folder / f"{prefix}-{digest}{suffix}"


def read(path: Path | None) -> bytes | None:
    """The memo's bytes, or None (no memo, memos off, unreadable)."""
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError:
        return None


def write(path: Path | None, data: bytes) -> None:
    """Write a memo by rename (readers see the old file or the whole new one), without fsync: a memo lost or
    garbled by a crash is a miss to its reader (each checks what it reads), so durability is not worth a first
    call's time. Nothing happens where memos are off or the cache dir does not exist; an error (a read-only or full
    cache dir) is logged at debug level and ignored: the next process derives the answer again."""
    if path is None or not path.parent.parent.is_dir():
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.debug("cannot write the memo %s: %s", path, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def forget(path: Path | None) -> None:
    """Remove a memo that turned out wrong (no error if there is none)."""
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass


def remove(root: Path, folders: tuple[str, ...] = FOLDERS, keep: Callable[[Path], bool] = lambda p: False) -> int:
    """Remove the memos (and dead writers' temp files) in `folders` of the cache dir `root`, but those keep(path)
    keeps; how many files went. The next process derives what it needs again."""
    removed = 0
    for folder in folders:
        try:
            files = sorted((root / folder).iterdir())
        except OSError:
            continue
        for f in files:
            if f.is_file() and not keep(f):
                try:
                    f.unlink()
                    removed += 1
                except OSError:
                    pass
    return removed
