"""The native launcher (native_launch.c): built once per machine and Python with the system C compiler, cached
under ``<cache_dir>/native/``, loaded once per process.

A launch through cuda.core costs ~4 us of host time on an H100, more than the whole of some torch ops; the C
launcher costs the driver call (~1.5 us). Building needs a C compiler (``$CC``, else cc/gcc/clang) and the Python
headers; where either is missing (or RTCKERN_NATIVE_LAUNCH=0) rtckern launches through cuda.core and says why once
at INFO (RTCKERN_NATIVE_LAUNCH=1 makes it an error instead).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

from rtckern.cache.locks import private_dir
from rtckern.config import settings
from rtckern.errors import LaunchError

from .libcuda import LIBCUDA

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("native_launch.c")
MODULE = "rtckern_native_launch"

_lock = threading.Lock()


class _Recording(threading.local):
    """A recording of this thread's launches (rtckern/plugins/_torch_native.py): the native launcher records its
    prepared launches itself; every other launch route marks the recording tainted, so it is refused."""
    active = False
    tainted = False


recording = _Recording()


class _DirectFront:
    """The torch plugin's native front as an entry for the op layer's own functions (rtckern/plugins/_torch_native.cpp,
    direct_call; rtckern.torch's rms_norm / layer_norm entry points use it too): `call(slot, *args)` gives the results
    of the torch op bound to the function's slot (rtckern.ops._common.DIRECT_SLOTS) replayed in C++, or None where
    that call takes the function's Python path. None until `import rtckern.torch` loads the front
    (RTCKERN_TORCH_NATIVE)."""
    __slots__ = ("call",)

    def __init__(self):
        self.call = None


direct_front = _DirectFront()


def note_unrecorded_launch() -> None:
    """Called by the launch routes that bypass the native launcher (cuda.core, packed parameter blocks)."""
    if recording.active:
        recording.tainted = True
_state: dict[str, object] = {}  # "module" (the loaded module or None), "why" (why there is none)


def find_compiler(configured: tuple[str, ...] | None, names: tuple[str, ...]) -> list[str] | None:
    """The configured compiler command (CC / CXX) where its program is on PATH, else the first of names there."""
    if configured:
        return list(configured) if shutil.which(configured[0]) else None
    for name in names:
        if shutil.which(name):
            return [name]
    return None


def _compiler() -> list[str] | None:
    return find_compiler(settings().c_compiler, ("cc", "gcc", "clang"))


def _artifact_name(source: bytes) -> str:
    h = hashlib.sha256(source)
    # the C library too: a cache directory shared by hosts of one interpreter but another glibc must not hand one
    # host the other's build (it would not load)
    for part in (sys.version, sysconfig.get_platform(), sysconfig.get_config_var("EXT_SUFFIX") or "",
                 platform.machine(), " ".join(platform.libc_ver())):
        h.update(b"\0" + part.encode())
    return f"{MODULE}-{h.hexdigest()[:20]}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _build(dest: Path) -> None:
    cc = _compiler()
    if cc is None:
        raise LaunchError(f"no C compiler found ({'CC=' + ' '.join(settings().c_compiler) + ' is not on PATH' if settings().c_compiler else 'no cc, gcc or clang on PATH'}; set CC or install one)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise LaunchError(f"no Python headers at {include} (install python3-dev or the interpreter's headers)")
    compile_atomically(dest, lambda out: [*cc, "-O2", "-shared", "-fPIC", "-std=c11", f"-I{include}", str(SOURCE),
                                          "-o", out, "-ldl"], timeout=120)


def compile_atomically(dest: Path, command, timeout: int) -> None:
    """Run command(output path) to build dest: into a temporary file beside it, moved over dest when the compiler
    succeeds (a process never loads a half-written build). LaunchError with the compiler's message otherwise."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    cmd = command(tmp)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise LaunchError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()[-3000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def module():
    """The loaded native launcher module, or None (then `why()` says why)."""
    s = settings()
    if _state.get("settings") is s:
        return _known(s)
    with _lock:
        if _state.get("settings") is s:
            return _known(s)
        mode = s.native_launch
        mod, why = None, "RTCKERN_NATIVE_LAUNCH=0"
        if mode != "off" and _state.get("loaded") is not None:
            mod = _state["loaded"]  # built and loaded under earlier settings: a module loads once per process
        elif mode != "off":
            try:
                mod = _open()
            except (OSError, LaunchError, ImportError, subprocess.SubprocessError) as e:
                why = f"{type(e).__name__}: {e}"
                if mode == "on":  # remembered: later launches raise at once instead of building again
                    _state.update(why=why, module=None, settings=s)
                    return _known(s)
                log.info("rtckern: launching through cuda.core (the native launcher is unavailable: %s)", why)
        _state.update(why=None if mod else why, module=mod, settings=s)
        if mod is not None:
            _state["loaded"] = mod
        return mod


def _trusted(path: Path) -> bool:
    """Whether a built launcher may be loaded (it runs as host code in this process): a regular file, not a link,
    owned by this user or root, that no one else can write."""
    try:
        return trusted_stat(os.lstat(path))
    except OSError:
        return False


def trusted_stat(st: os.stat_result) -> bool:
    """A build's stat as _trusted accepts it: a regular file of this user or root that no one else can write."""
    return stat.S_ISREG(st.st_mode) and st.st_uid in (os.getuid(), 0) and not st.st_mode & 0o022


def _known(s):
    """The module decided under settings ``s``; under RTCKERN_NATIVE_LAUNCH=1 its absence is an error."""
    mod = _state["module"]
    if mod is None and s.native_launch == "on":
        raise LaunchError(f"RTCKERN_NATIVE_LAUNCH=1 but the native launcher is unavailable: {_state['why']}. Install "
                          "a C compiler and the Python headers, or unset the variable")
    return mod


def _open():
    path = built_artifact("native", _artifact_name(SOURCE.read_bytes()), _build)
    mod = _load(path)
    mod.init(LIBCUDA, LaunchError)
    return mod


def built_artifact(subdir: str, name: str, build) -> Path:
    """The path of a trusted build ``name`` (host code this process will load), made by ``build(path)`` where
    missing: in ``<cache dir>/<subdir>`` (which a team may share: a build someone else wrote there is passed over),
    else in a private directory of this user under the temp dir (refused if another user holds or links it)."""
    places = _places(subdir)
    for i, d in enumerate(places):  # the first that has a build of ours or can make one
        path = d / name
        try:
            if i:
                private_dir(d)
            if not _trusted(path):
                if os.path.lexists(path) and i == 0:
                    continue  # a build not ours (or writable by others) in a shared cache: use our own place
                build(path)
        except PermissionError:
            continue
        except OSError as e:
            if not os.access(d if d.exists() else d.parent, os.W_OK):
                continue
            raise LaunchError(str(e)) from e
        if _trusted(path):
            return path
    raise LaunchError(f"no writable place of this user's to build {name} ({', '.join(map(str, places))})")


def _places(subdir: str) -> list[Path]:
    """Where builds live, in order: the cache dir, then this user's private directory under the temp dir."""
    return [settings().cache_dir / subdir, Path(tempfile.gettempdir()) / f"rtckern-{subdir}-{os.getuid()}"]


def find_artifact(subdir: str, name: str) -> Path | None:
    """The trusted build ``name`` where built_artifact would find it, or None (nothing is built)."""
    for i, d in enumerate(_places(subdir)):
        if i and d.exists():
            try:
                private_dir(d)  # refused (PermissionError) when another user holds or links it
            except OSError:
                continue
        if _trusted(d / name):
            return d / name
    return None


def why() -> str | None:
    """Why the native launcher is not in use (None when it is, or before the first launch asked)."""
    return _state.get("why")
