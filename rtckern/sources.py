"""Kernel source files: where ``kernel_sources/`` is, and the text of a source plus every header it includes."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from .errors import RtckernError

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@functools.lru_cache(maxsize=1)
def kernel_sources_dir() -> Path:
    """``kernel_sources/`` ships inside the package (``rtckern/kernel_sources``); in a source checkout it is
    the top-level folder beside ``rtckern/``."""
    here = Path(__file__).resolve().parent
    for cand in (here / "kernel_sources", here.parent / "kernel_sources"):
        if (cand / "common" / "portability.cuh").is_file():
            return cand
    raise RtckernError(f"kernel_sources/ not found next to {here}; reinstall rtckern (pip install .)")


def read_source(relpath: str) -> str:
    path = kernel_sources_dir() / relpath
    try:
        return path.read_text()
    except FileNotFoundError:
        raise RtckernError(f"kernel source {relpath!r} not found under {kernel_sources_dir()}") from None


def resolve_includes(text: str, including: str = "") -> list[tuple[str, str]]:
    """Every project header ``text`` includes, transitively, as sorted (relative path, content) pairs.

    Quoted includes are looked up beside the including file, then under ``kernel_sources/``. Angle-bracket
    (system/CUDA) headers are not read here: the compiler and header versions in the key cover them.
    """
    root = kernel_sources_dir()
    seen: dict[str, str] = {}
    stack = [(text, including)]
    while stack:
        body, inc_from = stack.pop()
        for name in _INCLUDE.findall(body):
            rel = None
            if inc_from:
                cand = (Path(inc_from).parent / name).as_posix()
                if (root / cand).is_file():
                    rel = cand
            if rel is None and (root / name).is_file():
                rel = name
            if rel is None:
                raise RtckernError(f"{including or 'source'} includes \"{name}\", which is not under {root}")
            rel = Path(rel).as_posix()
            if rel in seen:
                continue
            content = (root / rel).read_text()
            seen[rel] = content
            stack.append((content, rel))
    return sorted(seen.items())
