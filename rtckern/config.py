"""Every setting rtckern reads from the environment, typed and documented in one place.

No other module reads ``os.environ``. Settings are read once into a frozen :class:`Settings`; tests (and
programs) change them with :func:`override`, which swaps the process-wide instance for the duration of a
``with`` block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from pathlib import Path
from typing import Iterator, Mapping


def _bool(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false/yes/no/on/off), got {value!r}")


def _int(name: str, value: str | None, default: int | None) -> int | None:
    if value is None or value.strip() == "":
        return default
    try:
        return int(value.strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; set it to a whole number such as 1073741824") from None


def _default_cache_dir(env: Mapping[str, str]) -> Path:
    if env.get("RTCKERN_CACHE_DIR"):
        return Path(env["RTCKERN_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "rtckern"
    return Path("~/.cache/rtckern").expanduser()


def _kv_list(name: str, value: str | None) -> dict[str, str]:
    """Parse ``op=impl,op2=impl2``."""
    out: dict[str, str] = {}
    if not value:
        return out
    for item in value.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"{name}: entry {item!r} is not of the form op=name (example: rms_norm=rms_norm.rowwise)")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _name_set(value: str | None) -> frozenset[str]:
    if not value:
        return frozenset()
    return frozenset(x.strip() for x in value.replace(";", ",").split(",") if x.strip())


@dataclasses.dataclass(frozen=True)
class Settings:
    # --- cache ---
    cache_dir: Path  # RTCKERN_CACHE_DIR, else $XDG_CACHE_HOME/rtckern, else ~/.cache/rtckern
    disk_cache: bool  # RTCKERN_DISK_CACHE=0 keeps binaries in memory only
    cache_max_bytes: int | None  # RTCKERN_CACHE_MAX_BYTES: LRU-prune the disk tier above this size
    read_only_layers: tuple[Path, ...]  # RTCKERN_CACHE_LAYERS: read-only cache dirs below the local one (os.pathsep)
    remote_cache: str | None  # RTCKERN_REMOTE_CACHE: e.g. redis://host:6379/0
    remote_timeout_s: float  # RTCKERN_REMOTE_TIMEOUT_S: bound on any remote call
    record_manifest: Path | None  # RTCKERN_RECORD_MANIFEST: append each runtime miss's request (JSON lines)
    # --- compile ---
    cuda_home: Path | None  # CUDA_HOME / CUDA_PATH: fallback for CUDA headers when cuda-pathfinder finds none
    extra_include_dirs: tuple[Path, ...]  # RTCKERN_INCLUDE_DIRS (os.pathsep separated)
    lineinfo: bool  # RTCKERN_LINEINFO=1 adds -lineinfo (changes the key)
    # --- registry ---
    force_impl: Mapping[str, str]  # RTCKERN_FORCE_IMPL=op=candidate,...
    disable_jit: frozenset[str]  # RTCKERN_DISABLE_JIT=op1,op2 (or "all")
    strict: bool  # RTCKERN_STRICT=1: no silent fallback to torch ops
    numerical_probe: bool  # RTCKERN_NUMERICAL_PROBE=1: probe candidates on a small input before accepting
    persist_decisions: bool  # RTCKERN_PERSIST_DECISIONS=0 keeps registry decisions in memory only
    tuning_table_dir: Path | None  # RTCKERN_TUNING_DIR: user tuning tables (default <cache_dir>/tuning)
    # --- logging ---
    verbose: bool  # RTCKERN_VERBOSE=1: log every compile and cache event at INFO
    # --- HIP / AMD ---
    hiprtc_library: Path | None = None  # RTCKERN_HIPRTC_LIBRARY: the library with hiprtc (else searched by name)
    rocm_path: Path | None = None  # ROCM_PATH: a ROCm install whose lib/ is searched for hiprtc (else /opt/rocm)
    # --- bundles (`rtckern cache import`) ---
    bundle_max_bytes: int = 4 << 30  # RTCKERN_BUNDLE_MAX_BYTES: refuse a bundle whose entries add up to more
    bundle_max_ratio: int = 100  # RTCKERN_BUNDLE_MAX_RATIO: refuse a bundle whose entries pass N x its file size

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        cache_dir = _default_cache_dir(env)
        layers = tuple(Path(p).expanduser() for p in env.get("RTCKERN_CACHE_LAYERS", "").split(os.pathsep) if p)
        incs = tuple(Path(p).expanduser() for p in env.get("RTCKERN_INCLUDE_DIRS", "").split(os.pathsep) if p)
        cuda_home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
        tuning = env.get("RTCKERN_TUNING_DIR")
        record = env.get("RTCKERN_RECORD_MANIFEST")
        timeout = env.get("RTCKERN_REMOTE_TIMEOUT_S", "")
        try:
            remote_timeout = float(timeout) if timeout.strip() else 0.5
        except ValueError:
            raise ValueError(f"RTCKERN_REMOTE_TIMEOUT_S={timeout!r} is not a number of seconds (example: 0.5)") from None
        return cls(
            cache_dir=cache_dir,
            disk_cache=_bool(env.get("RTCKERN_DISK_CACHE"), True),
            cache_max_bytes=_int("RTCKERN_CACHE_MAX_BYTES", env.get("RTCKERN_CACHE_MAX_BYTES"), None),
            read_only_layers=layers,
            remote_cache=env.get("RTCKERN_REMOTE_CACHE") or None,
            remote_timeout_s=remote_timeout,
            record_manifest=Path(record).expanduser() if record else None,
            cuda_home=Path(cuda_home) if cuda_home else None,
            extra_include_dirs=incs,
            lineinfo=_bool(env.get("RTCKERN_LINEINFO"), False),
            force_impl=_kv_list("RTCKERN_FORCE_IMPL", env.get("RTCKERN_FORCE_IMPL")),
            disable_jit=_name_set(env.get("RTCKERN_DISABLE_JIT")),
            strict=_bool(env.get("RTCKERN_STRICT"), False),
            numerical_probe=_bool(env.get("RTCKERN_NUMERICAL_PROBE"), False),
            persist_decisions=_bool(env.get("RTCKERN_PERSIST_DECISIONS"), True),
            tuning_table_dir=Path(tuning).expanduser() if tuning else None,
            verbose=_bool(env.get("RTCKERN_VERBOSE"), False),
            hiprtc_library=Path(env["RTCKERN_HIPRTC_LIBRARY"]).expanduser() if env.get("RTCKERN_HIPRTC_LIBRARY") else None,
            rocm_path=Path(env["ROCM_PATH"]).expanduser() if env.get("ROCM_PATH") else None,
            bundle_max_bytes=_int("RTCKERN_BUNDLE_MAX_BYTES", env.get("RTCKERN_BUNDLE_MAX_BYTES"), 4 << 30),
            bundle_max_ratio=_int("RTCKERN_BUNDLE_MAX_RATIO", env.get("RTCKERN_BUNDLE_MAX_RATIO"), 100),
        )


_lock = threading.Lock()
_current: Settings | None = None


def settings() -> Settings:
    """The process-wide settings, read from the environment on first use."""
    global _current
    s = _current
    if s is None:
        with _lock:
            if _current is None:
                _current = Settings.from_env()
            s = _current
    return s


def reload() -> Settings:
    """Re-read the environment (after it changed)."""
    global _current
    with _lock:
        _current = Settings.from_env()
        return _current


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Temporarily replace fields of the settings: ``with override(cache_dir=tmp): ...``."""
    global _current
    old = settings()
    new = dataclasses.replace(old, **changes)
    with _lock:
        _current = new
    try:
        yield new
    finally:
        with _lock:
            _current = old
