"""Disk tier: sharded, digest-checked entries with human-readable sidecars, atomic writes and per-key locks.

Layout under the cache root::

    v1/<k[:2]>/<key>.rtk    entry (see entry.py)       v1/<k[:2]>/<key>.json   metadata sidecar
    locks/<k[:2]>/<key>.lock                             quarantine/<key>.rtk    entries the driver refused
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator

from ..compiler.base import CompiledKernel
from . import entry as entry_format
from .stats import Stats

log = logging.getLogger(__name__)
LAYOUT = "v1"


class CacheWarning(UserWarning):
    """A cache problem rtckern worked around (corrupt entry, unwritable directory, ...)."""


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    key: str
    path: Path
    size: int
    mtime: float
    meta: dict


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file in the same folder, fsync, rename: readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


class DiskCache:
    def __init__(self, root: Path, *, stats: Stats | None = None, read_only: bool = False,
                 max_bytes: int | None = None, name: str = "disk"):
        self.root = Path(root)
        self.name = name
        self.read_only = read_only
        self.max_bytes = max_bytes
        self.stats = stats or Stats()
        self.enabled = True
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        if not read_only:
            self._prepare()

    # ---- setup and warnings ----
    def _prepare(self) -> None:
        try:
            for sub in (self.root, self.root / LAYOUT, self.root / "locks"):
                sub.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not os.access(self.root / LAYOUT, os.W_OK | os.X_OK):
                raise PermissionError(f"{self.root / LAYOUT} is not writable")
        except OSError as e:
            self._disable(f"cache directory {self.root} is not usable ({e}); keeping kernels in memory only. "
                          "Set RTCKERN_CACHE_DIR to a writable directory")

    def _disable(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            self._warn_once("disabled", why)

    def _warn_once(self, tag: str, msg: str) -> None:
        with self._lock:
            if tag in self._warned:
                return
            self._warned.add(tag)
        log.warning(msg)
        warnings.warn(msg, CacheWarning, stacklevel=3)

    # ---- paths ----
    def entry_path(self, key: str) -> Path:
        return self.root / LAYOUT / key[:2] / f"{key}.rtk"

    def meta_path(self, key: str) -> Path:
        return self.root / LAYOUT / key[:2] / f"{key}.json"

    def lock_path(self, key: str) -> Path:
        return self.root / "locks" / key[:2] / f"{key}.lock"

    # ---- reads ----
    def get(self, key: str) -> CompiledKernel | None:
        if not self.enabled:
            return None
        path = self.entry_path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.stats.bump(self.name, "misses")
            return None
        except OSError as e:
            self.stats.bump(self.name, "errors")
            self._warn_once(f"read:{key}", f"cannot read cache entry {path}: {e}; recompiling")
            return None
        try:
            ck = entry_format.unpack(data, key)
        except entry_format.InvalidEntry as e:
            self.stats.bump(self.name, "invalid")
            self.stats.bump(self.name, "misses")
            self._warn_once(f"invalid:{key}", f"cache entry {path} is invalid ({e}); quarantined it, recompiling")
            self._move_to_quarantine(key)
            return None
        self.stats.bump(self.name, "hits")
        if not self.read_only:
            with contextlib.suppress(OSError):
                os.utime(path)  # LRU: a hit makes the entry young
        return ck

    def get_packed(self, key: str) -> bytes | None:
        """The raw, digest-checked entry bytes (for export and remote write-back)."""
        try:
            data = self.entry_path(key).read_bytes()
            entry_format.unpack(data, key)
            return data
        except (OSError, entry_format.InvalidEntry):
            return None

    # ---- writes ----
    def put(self, key: str, ck: CompiledKernel, meta: dict | None = None) -> bool:
        return self.put_packed(key, entry_format.pack(ck, key, entry_format.identity(meta)), meta)

    def put_packed(self, key: str, data: bytes, meta: dict | None = None) -> bool:
        if not self.enabled or self.read_only:
            return False
        path = self.entry_path(key)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(path, data)
            if meta is not None:
                m = dict(meta, key=key, size=len(data), digest=entry_format.digest_of(data))
                atomic_write(self.meta_path(key), (json.dumps(m, indent=1, sort_keys=True) + "\n").encode())
        except OSError as e:
            self.stats.bump(self.name, "errors")
            self._disable(f"cannot write to cache directory {self.root} ({e}); keeping kernels in memory only")
            return False
        self.stats.bump(self.name, "writes")
        if self.max_bytes is not None:
            self.prune(max_bytes=self.max_bytes)
        return True

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = 600.0) -> Iterator[None]:
        """Exclusive per-key lock across processes. It is an OS file lock (flock), so a process killed while
        holding it releases it."""
        if not self.enabled or self.read_only:
            yield
            return
        import filelock

        lp = self.lock_path(key)
        try:
            lp.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fl = filelock.FileLock(str(lp), timeout=timeout)
            fl.acquire()
        except (OSError, filelock.Timeout) as e:
            self._warn_once(f"lock:{key}", f"cannot take cache lock {lp} ({e}); compiling without it")
            yield
            return
        try:
            yield
        finally:
            fl.release()

    def quarantine(self, key: str, reason: str) -> None:
        """Move an entry the driver refused out of the way (kept for inspection), so it is never retried."""
        self.stats.bump(self.name, "quarantined")
        self._warn_once(f"quarantine:{key}", f"the driver refused cache entry {key[:16]}… ({reason}); "
                        "quarantined it and recompiling")
        self._move_to_quarantine(key)

    def _move_to_quarantine(self, key: str) -> None:
        """Move the entry (kept for inspection) and its sidecar out of the served layout; nothing on a read-only
        tier."""
        if self.read_only or not self.enabled:
            return
        q = self.root / "quarantine"
        with contextlib.suppress(OSError):
            q.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.replace(self.entry_path(key), q / f"{key}.rtk")
        with contextlib.suppress(OSError):
            self.meta_path(key).unlink()

    # ---- housekeeping ----
    def entries(self) -> Iterator[EntryInfo]:
        base = self.root / LAYOUT
        if not base.is_dir():
            return
        for shard in sorted(p for p in base.iterdir() if p.is_dir()):
            for p in sorted(shard.glob("*.rtk")):
                try:
                    st = p.stat()
                except OSError:
                    continue
                key = p.stem
                meta = {}
                mp = p.with_suffix(".json")
                with contextlib.suppress(OSError, ValueError):
                    meta = json.loads(mp.read_text())
                yield EntryInfo(key=key, path=p, size=st.st_size, mtime=st.st_mtime, meta=meta)

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def remove(self, key: str) -> None:
        for p in (self.entry_path(key), self.meta_path(key)):
            with contextlib.suppress(OSError):
                p.unlink()

    def verify(self, remove: bool = True) -> dict:
        checked = corrupt = removed = 0
        bad = []
        for e in self.entries():
            checked += 1
            try:
                entry_format.unpack(e.path.read_bytes(), e.key)
            except (OSError, entry_format.InvalidEntry) as err:
                corrupt += 1
                bad.append({"key": e.key, "reason": str(err)})
                if remove and not self.read_only:
                    self.remove(e.key)
                    removed += 1
        return {"checked": checked, "corrupt": corrupt, "removed": removed, "bad": bad}

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None,
              keep: "callable | None" = None) -> dict:
        """Remove least-recently-used entries until the total is at most ``max_bytes``, and entries not used
        for ``older_than_s`` seconds. ``keep(entry) -> False`` removes an entry regardless (e.g. superseded
        toolchains)."""
        entries = sorted(self.entries(), key=lambda e: e.mtime)
        now = time.time()
        removed, freed = 0, 0
        survivors = []
        for e in entries:
            drop = (older_than_s is not None and now - e.mtime > older_than_s) or (keep is not None and not keep(e))
            if drop:
                self.remove(e.key)
                removed, freed = removed + 1, freed + e.size
            else:
                survivors.append(e)
        if max_bytes is not None:
            total = sum(e.size for e in survivors)
            for e in survivors:
                if total <= max_bytes:
                    break
                self.remove(e.key)
                total -= e.size
                removed, freed = removed + 1, freed + e.size
        return {"removed": removed, "freed_bytes": freed}

    def clear(self) -> dict:
        n = sum(1 for _ in self.entries())
        for sub in (LAYOUT, "locks", "quarantine"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        if not self.read_only:
            self._prepare()
        return {"removed": n}
