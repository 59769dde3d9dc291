"""Where NVRTC and the CUDA headers are, for NVIDIA's pip wheels, found without importing cuda-pathfinder.

cuda.bindings loads NVRTC through cuda-pathfinder, and rtckern found the headers through it too: its import and
search cost tens of milliseconds, paid by every process, even one whose kernels all come from the cache. The
lookups here repeat what pathfinder does first (its site-packages step: the same wheel directories, site-packages
in the same order, the same file names), so where a wheel holds the file they give the file pathfinder gives.
Where they find nothing (conda, a system CUDA, a libnvrtc already loaded by someone else) they return None and the
caller asks pathfinder as before. tests/unit/compiler/test_toolkit.py checks the answers against pathfinder's.
"""
from __future__ import annotations

import os
import site
import sys
from pathlib import Path

# pathfinder's descriptors for NVRTC and the cudart headers (cuda-pathfinder 1.x, CUDA 12 and 13 wheels)
NVRTC_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12")
NVRTC_WHEEL_DIRS = ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib")
HEADER_WHEEL_DIRS = ("nvidia/cu13/include", "nvidia/cuda_runtime/include")
HEADER_MARK = "cuda_runtime.h"  # the file pathfinder looks for in a header dir


def site_dirs() -> list[str]:
    """site-packages in pathfinder's order: the interpreter's, with the user's inserted after a venv's own
    (PEP 405) or first (PEP 370)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        user = site.getusersitepackages()
        if user:
            dirs.insert(1 if sys.prefix != sys.base_prefix else 0, user)
    return dirs


def _wheel_file(rel_dirs: tuple[str, ...], names: tuple[str, ...]) -> Path | None:
    """The first of `names` in the first `rel_dir` under the first site dir that has it, as pathfinder walks them
    (each wheel dir over every site dir before the next wheel dir)."""
    for rel in rel_dirs:
        for base in site_dirs():
            d = os.path.join(base, *rel.split("/"))
            if not os.path.isdir(d):
                continue
            for name in names:
                p = os.path.join(d, name)
                if os.path.isfile(p):
                    return Path(p)
    return None


def nvrtc_loaded() -> bool:
    """Whether a libnvrtc is loaded in this process already (pathfinder then uses that one, wherever it is)."""
    import ctypes

    for soname in NVRTC_SONAMES:
        try:
            ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        return True
    return False


def loaded_nvrtc() -> Path | None:
    """The file of the libnvrtc this process has loaded already (torch's CUDA build loads one at import), read from
    /proc/self/maps, or None. pathfinder, and so cuda.bindings, takes a loaded libnvrtc whatever its directory."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        return None
    for soname in NVRTC_SONAMES:
        for line in maps.splitlines():
            fields = line.split(None, 5)  # address, perms, offset, dev, inode[, path]
            if len(fields) < 6:
                continue
            path = fields[5].strip()
            name = os.path.basename(path)
            if name == soname or (name.startswith(soname + ".") and "builtins" not in name):
                return Path(path)
    return None


def wheel_nvrtc() -> Path | None:
    """The libnvrtc cuda.bindings would load: the one loaded in this process already, else an NVIDIA wheel's; None
    off Linux, or when neither is found (ask pathfinder then)."""
    if not sys.platform.startswith("linux"):
        return None
    if nvrtc_loaded():
        return loaded_nvrtc()
    return _wheel_file(NVRTC_WHEEL_DIRS, NVRTC_SONAMES)


def wheel_headers() -> Path | None:
    """The CUDA header dir of an NVIDIA wheel, as pathfinder's find_nvidia_header_directory("cudart") gives it
    (symlinks resolved), or None."""
    f = _wheel_file(HEADER_WHEEL_DIRS, (HEADER_MARK,))
    return f.parent.resolve() if f is not None else None


def preload_nvrtc(path: Path) -> None:
    """Load the libnvrtc at `path` as pathfinder would (RTLD_NOW | RTLD_GLOBAL), so that the NVRTC cuda.bindings
    uses is this file: pathfinder takes a libnvrtc that is loaded already. Its one extra step for wheels is kept:
    NVRTC 13.0 wheels need their builtins library loaded beside them."""
    import ctypes

    ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    real = os.path.realpath(path)
    if os.path.basename(real).removeprefix("libnvrtc.so.").split(".")[0] == "13":
        builtins = os.path.join(os.path.dirname(real), "libnvrtc-builtins.so.13.0")
        if os.path.isfile(builtins):
            try:
                ctypes.CDLL(builtins, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            except OSError:  # as pathfinder: NVRTC's own lookup of its builtins may still succeed
                pass
