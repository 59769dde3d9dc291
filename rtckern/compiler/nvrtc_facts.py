"""NVRTC's version and supported archs, remembered per library file: a process whose kernels all come from the
cache computes their keys and compile targets without loading NVRTC (whose load through cuda-pathfinder costs tens
of milliseconds).

Why a remembered answer is the right one: both facts belong to the library file, and a memo is keyed by that
file's identity — its real path, size, modification time (ns), inode and device — so another NVRTC, or this one
upgraded or reinstalled (pip writes new files), is a miss, answered by the library itself and remembered anew.
The file asked about is the one the process compiles with: NvrtcCompiler loads NVRTC from that very path before
its first compile (toolkit.preload_nvrtc) and checks then that the library says what was remembered, so a key
never names another NVRTC than the one that would compile it.

Memos live in ``<cache dir>/toolchain/nvrtc-<hash of the file identity>.json`` (not with RTCKERN_DISK_CACHE=0, nor
before the cache dir exists: commands that only read create nothing); one that cannot be read or does not match
its file is a miss, and any error writing one is ignored.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from ..config import settings

log = logging.getLogger(__name__)
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class NvrtcFacts:
    """What the cache keys and compile targets need to know of an NVRTC."""
    version: tuple[int, int]
    archs: tuple[int, ...]


def file_identity(library: Path) -> dict:
    """What tells one library file from another (a replaced or rewritten file changes at least one of these)."""
    st = os.stat(library)
    return {"path": os.path.realpath(library), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino, "device": st.st_dev}


def memo_path(identity: dict) -> Path | None:
    s = settings()
    if not s.disk_cache:
        return None
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return s.cache_dir / "toolchain" / f"nvrtc-{digest}.json"


def recall(library: Path) -> NvrtcFacts | None:
    """The facts remembered for the library file as it is now, or None."""
    try:
        ident = file_identity(library)
        path = memo_path(ident)
        if path is None:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return _facts_of(data, ident)


def _facts_of(data, ident: dict) -> NvrtcFacts | None:
    """The facts in a memo's JSON if it is a memo of this very file, else None."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("library") != ident:
        return None
    version, archs = data.get("nvrtc_version"), data.get("supported_archs")
    ints = (lambda v: isinstance(v, list) and v and all(type(x) is int for x in v))  # noqa: E731
    if not ints(version) or len(version) != 2 or not ints(archs):
        return None
    return NvrtcFacts(tuple(version), tuple(archs))


def remember(identity: dict, facts: NvrtcFacts) -> None:
    """Write the facts read from the library whose identity (taken before it was loaded) is `identity`."""
    path = memo_path(identity)
    if path is None or not path.parent.parent.is_dir():  # a cache dir that does not exist is not created for it
        return
    data = {"format": FORMAT, "library": identity, "nvrtc_version": list(facts.version),
            "supported_archs": list(facts.archs)}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:  # a read-only or full cache dir: the next process asks the library again
        log.debug("cannot remember NVRTC's facts in %s: %s", path, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def forget(library: Path) -> None:
    """Remove the memo of the library file as it is now (one that turned out wrong)."""
    with contextlib.suppress(OSError):
        path = memo_path(file_identity(library))
        if path is not None:
            path.unlink()

