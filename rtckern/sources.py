"""Kernel source files: where ``kernel_sources/`` is, and the text of a source plus every header it includes.

Read once per process: the text of each file and the include list resolved for each including text are memoized
(``PlanCache``s, so ``rtckern.clear_caches()``, a settings change and ``set_manager()`` forget them, and so does
building a ``KernelManager``). The rule: an edited source or header changes the key in a new process, and within a
process once those caches are cleared (a new ``KernelManager`` sees the edit; one built before it keeps the keys
it computed). A long-lived process that edits headers under RTCKERN_INCLUDE_DIRS calls ``rtckern.clear_caches()``.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Sequence

from .caches import PlanCache
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


_texts = PlanCache("sources.texts", 4096)  # file path -> its text
_includes = PlanCache("sources.includes", 4096)  # (text, including, dirs) -> resolved (label, content) pairs


def forget() -> None:
    """Forget the memoized file texts and include lists (a KernelManager being built calls it)."""
    _texts.clear()
    _includes.clear()


def _read(path: str | Path) -> str:
    k = str(path)
    t = _texts.get(k)
    if t is None:
        with open(k) as f:  # the locale's encoding, as Path.read_text
            t = _texts.put(k, f.read())
    return t


def read_source(relpath: str) -> str:
    path = kernel_sources_dir() / relpath
    try:
        return _read(path)
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
    Memoized per process by (text, including, the dirs): see the module docstring for when an edit is seen.
    """
    root = str(kernel_sources_dir())
    user = [str(d) for d in user_dirs]
    system = [str(d) for d in system_dirs]
    memo = (text, including, root, tuple(user), tuple(system))
    hit = _includes.get(memo)
    if hit is None:
        hit = _includes.put(memo, tuple(_resolve(text, including, root, user, system)))
    return list(hit)


# Paths below are strings joined with os.path: a key's include walk runs once per process and source, and through
# pathlib it was most of the host time of a kernel's load from a warm disk.
def _resolve(text: str, including: str, root: str, user: list[str], system: list[str]) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    stack = [_direct(text, os.path.join(root, including) if including else None, including, root, user, system)]
    while stack:
        for label, path in stack.pop():
            if label in seen:
                continue
            seen[label] = _read(path)
            stack.append(_file_includes(path, including, root, user, system))
    return sorted(seen.items())


def _file_includes(path: str, including: str, root: str, user: list[str],
                   system: list[str]) -> tuple[tuple[str, str], ...]:
    """The headers one file includes directly, memoized by its path and the search dirs."""
    memo = (path, root, tuple(user), tuple(system))
    hit = _includes.get(memo)
    if hit is None:
        hit = _includes.put(memo, _direct(_read(path), path, including, root, user, system))
    return hit


def _direct(body: str, where: str | None, including: str, root: str, user: list[str],
            system: list[str]) -> tuple[tuple[str, str], ...]:
    """(label, path) of each header ``body`` (the text of the file at ``where``) includes, in order."""
    out = []
    for quoted, angled in _INCLUDE.findall(body):
        name = quoted or angled
        path = _find(name, where if quoted else None, ([root] if quoted else []) + user)
        if path is None:
            if angled or any(os.path.isfile(os.path.join(d, name)) for d in system):
                continue
            dirs = ", ".join([root, *user])
            raise RtckernError(f"{including or 'source'} includes \"{name}\", which is not under {dirs}; put it "
                               "under a directory of RTCKERN_INCLUDE_DIRS")
        out.append((_label(path, root, user), path))
    return tuple(out)


def _find(name: str, including_file: str | None, dirs: Sequence[str]) -> str | None:
    if including_file is not None:
        p = os.path.join(os.path.dirname(including_file), name)
        if os.path.isfile(p):
            return p
    for d in dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    return None


def _label(path: str, root: str, user: Sequence[str]) -> str:
    """Where a header is, without machine-specific parts: relative to kernel_sources/ or to its user dir."""
    p = os.path.normpath(path)
    for base, prefix in ((root, ""), *((d, "user:") for d in user)):
        b = os.path.normpath(base)
        if b == ".":  # the working directory: every relative path is under it (as PurePath.relative_to(".") says)
            if not os.path.isabs(p):
                return prefix + p.replace(os.sep, "/")
            continue
        under = b if b.endswith(os.sep) else b + os.sep  # "/" keeps its separator
        if p.startswith(under):
            return prefix + p[len(under):].replace(os.sep, "/")
    return "user:" + os.path.basename(p)
