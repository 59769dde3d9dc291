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

import hashlib
import logging
import os
from pathlib import Path

from ..config import settings

log = logging.getLogger(__name__)


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
    """Write a memo atomically (readers see no half-written file). Nothing happens where memos are off or the cache
    dir does not exist; an error (a read-only or full cache dir) is logged at debug level and ignored: the next
    process derives the answer again."""
    if path is None or not path.parent.parent.is_dir():
        return
    from .disk import atomic_write  # not at import: the compiler (imported by the disk tier) uses these memos

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
    except OSError as e:
        log.debug("cannot write the memo %s: %s", path, e)


def forget(path: Path | None) -> None:
    """Remove a memo that turned out wrong (no error if there is none)."""
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass
