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

import dataclasses
import json
from pathlib import Path

from ..cache import file_memo

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class NvrtcFacts:
    """What the cache keys and compile targets need to know of an NVRTC."""
    version: tuple[int, int]
    archs: tuple[int, ...]


file_identity = file_memo.file_identity


def memo_path(identity: dict) -> Path | None:
    return file_memo.memo_path("toolchain", "nvrtc", json.dumps(identity, sort_keys=True), ".json")


def recall(library: Path) -> NvrtcFacts | None:
    """The facts remembered for the library file as it is now, or None."""
    try:
        ident = file_identity(library)
        data = json.loads(file_memo.read(memo_path(ident)) or b"null")
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
    data = {"format": FORMAT, "library": identity, "nvrtc_version": list(facts.version),
            "supported_archs": list(facts.archs)}
    file_memo.write(memo_path(identity), json.dumps(data, sort_keys=True).encode())


def forget(library: Path) -> None:
    """Remove the memo of the library file as it is now (one that turned out wrong)."""
    try:
        file_memo.forget(memo_path(file_identity(library)))
    except OSError:  # the file is gone: so is any memo that could match it
        pass
