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
import time
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


def memo_name(prefix: str, key_text: str, suffix: str) -> str:
    """The file name of the memo of `key_text` (in any cache dir)."""
    return f"{prefix}-{hashlib.sha256(key_text.encode()).hexdigest()[:32]}{suffix}"


def memo_path(folder: str, prefix: str, key_text: str, suffix: str) -> Path | None:
    """Where the memo of `key_text` lives in this process's cache dir; None where memos are off (no disk cache)."""
    s = settings()
    return s.cache_dir / folder / memo_name(prefix, key_text, suffix) if s.disk_cache else None


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
    from .disk import atomic_write  # not at import: the compiler (imported by the disk tier) uses these memos

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, durable=False)
    except OSError as e:
        log.debug("cannot write the memo %s: %s", path, e)


def forget(path: Path | None) -> None:
    """Remove a memo that turned out wrong (no error if there is none)."""
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass


TEMP_GRACE_S = 600  # a writer's temp file younger than this may still be renamed into place: left alone


def remove(root: Path, folders: tuple[str, ...] = FOLDERS, keep: Callable[[Path], bool] = lambda p: False) -> int:
    """Remove the memos in `folders` of the cache dir `root`, but those keep(path) keeps, and temp files writers
    left more than TEMP_GRACE_S ago; how many files went. The next process derives what it needs again."""
    removed, now = 0, time.time()
    for folder in folders:
        try:
            files = sorted((root / folder).iterdir())
        except OSError:
            continue
        for f in files:
            try:
                young_temp = f.name.endswith(".tmp") and now - f.stat().st_mtime < TEMP_GRACE_S
            except OSError:
                continue
            if f.is_file() and not young_temp and not keep(f):
                try:
                    f.unlink()
                    removed += 1
                except OSError:
                    pass
    return removed
