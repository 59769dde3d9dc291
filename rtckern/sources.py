"""Kernel source files: where ``kernel_sources/`` is, and the text of a source plus every header it includes."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Sequence

from .errors import RtckernError

_INCLUDE = re.compile(r'^\s*#\s*include\s+(?:"([^"]+)"|<([^>]+)>)', re.MULTILINE)


@functools.lru_cache(maxsize=1)
def kernel_sources_dir() -> Path:
    """``rtckern/kernel_sources/``: the CUDA C++ sources, shipped inside the package as package data."""
    d = Path(__file__).resolve().parent / "kernel_sources"
    if not (d / "common" / "portability.cuh").is_file():
        raise RtckernError(f"{d} is missing or incomplete (no common/portability.cuh); reinstall rtckern "
                           "(pip install rtckern, or pip install . from a checkout)")
    return d


def read_source(relpath: str) -> str:
    path = kernel_sources_dir() / relpath
    try:
        return path.read_text()
    except FileNotFoundError:
        raise RtckernError(f"kernel source {relpath!r} not found under {kernel_sources_dir()}") from None


def resolve_includes(text: str, including: str = "", user_dirs: Sequence[Path] = (),
                     system_dirs: Sequence[Path] = ()) -> list[tuple[str, str]]:
    """Every header ``text`` includes, transitively, that can change the code outside the compiler's own
    headers, as sorted (label, content) pairs.

    The search follows the compiler's: a quoted include is looked up beside the including file, then under
    ``kernel_sources/``, then in each user include dir (RTCKERN_INCLUDE_DIRS) in order, then in the system dirs;
    an angle-bracket include in the user dirs, then the system dirs. Project headers are labelled by their path
    under ``kernel_sources/``; user headers ``user:<path relative to its dir>`` (no absolute path, so a key is the
    same on every machine). System headers (CUDA's) are not read: the compiler identity's header version covers
    them, as it does angle-bracket includes found nowhere here (the compiler's built-in headers).
    """
    root = kernel_sources_dir()
    user = [Path(d) for d in user_dirs]
    seen: dict[str, str] = {}
    stack: list[tuple[str, Path | None]] = [(text, root / including if including else None)]
    while stack:
        body, where = stack.pop()
        for quoted, angled in _INCLUDE.findall(body):
            name = quoted or angled
            path = _find(name, where if quoted else None, ([root] if quoted else []) + user)
            if path is None:
                if angled or any((Path(d) / name).is_file() for d in system_dirs):
                    continue
                dirs = ", ".join(str(d) for d in [root, *user])
                raise RtckernError(f"{including or 'source'} includes \"{name}\", which is not under {dirs}; put it "
                                   "under a directory of RTCKERN_INCLUDE_DIRS")
            label = _label(path, root, user)
            if label in seen:
                continue
            content = path.read_text()
            seen[label] = content
            stack.append((content, path))
    return sorted(seen.items())


def _find(name: str, including_file: Path | None, dirs: Sequence[Path]) -> Path | None:
    if including_file is not None and (including_file.parent / name).is_file():
        return including_file.parent / name
    for d in dirs:
        if (d / name).is_file():
            return d / name
    return None


def _label(path: Path, root: Path, user: Sequence[Path]) -> str:
    """Where a header is, without machine-specific parts: relative to kernel_sources/ or to its user dir."""
    p = Path(os.path.normpath(path))
    for base, prefix in ((root, ""), *((d, "user:") for d in user)):
        try:
            return prefix + p.relative_to(os.path.normpath(base)).as_posix()
        except ValueError:
            continue
    return "user:" + p.name
