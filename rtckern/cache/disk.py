"""Disk tier: sharded, digest-checked entries with human-readable sidecars, atomic writes and per-key locks.

Layout under the cache root::

    v1/<k[:2]>/<key>.rtk    entry (see entry.py)       v1/<k[:2]>/<key>.json   metadata sidecar (see sidecar.py)
    locks/<k[:2]>/<key>.lock                             quarantine/<key>.rtk    entries the driver refused

(lock files go elsewhere when the cache is on a network filesystem: see locks.py).

The tier degrades gently: a directory that cannot be written (read-only, full, wrong permissions) is still read,
and only writing stops, with one warning. Housekeeping (verify, prune, clear) never removes what a live process
is using (a held lock, a fresh temp file) and removes nothing from a cache it cannot write, saying so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

from ..compiler.base import CompiledKernel
from . import entry as entry_format
from . import locks
from . import sidecar as sidecar_format
from .stats import Stats

log = logging.getLogger(__name__)
LAYOUT = "v1"
STALE_S = 600.0  # temp files and orphan sidecars this old belong to no live writer (a write takes well under 1 s)
AUTO_PRUNE_TO = 0.9  # a write past the size cap prunes to this fraction of it: the next prune is many writes away
# Write errors that concern the whole directory stop writing (reads go on); any other concerns one entry.
TIER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})


class CacheWarning(UserWarning):
    """A cache problem rtckern worked around (corrupt entry, unwritable directory, ...)."""


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """One disk entry as housekeeping lists it."""
    key: str
    path: Path
    size: int
    mtime: float
    meta: dict  # the sidecar if it checks out against the entry, else what the entry itself says
    sidecar_problem: str | None = None  # why the sidecar was not believed


@dataclasses.dataclass
class _Listing:
    """One walk of the shards: entries, sidecars and temp files, by name."""

    entries: dict[str, os.stat_result] = dataclasses.field(default_factory=dict)
    sidecars: dict[str, os.stat_result] = dataclasses.field(default_factory=dict)
    temps: dict[Path, float] = dataclasses.field(default_factory=dict)  # path -> mtime


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


# An entry file is at most this large (the biggest cubins are tens of MB): a larger one is refused unread.
MAX_ENTRY_FILE_BYTES = 1 << 30


def read_entry_file(path: Path) -> bytes:
    """An entry file's bytes: a regular file only (a link is not followed, a FIFO or device not waited on: the
    cache's listings pass them over too), at most MAX_ENTRY_FILE_BYTES. OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if st.st_size > MAX_ENTRY_FILE_BYTES:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, above the {MAX_ENTRY_FILE_BYTES}-byte limit", str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int | None = None, durable: bool = True) -> None:
    """Temp file in the same folder, fsync, rename: readers see the old file or the whole new one. The file is
    private (0600, as mkstemp makes it) unless ``mode`` says otherwise (a bundle is shipped: 0644). durable=False
    skips the fsyncs, for files whose readers check what they read (the memos: a garbled one is a miss)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(path.parent)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False


class DiskCache:
    def __init__(self, root: Path, *, stats: Stats | None = None, read_only: bool = False,
                 max_bytes: int | None = None, name: str = "disk", lock_dir: Path | None = None,
                 lock_timeout_s: float | None = None, lock_notice_s: float = locks.NOTICE_AFTER_S):
        """lock_dir, lock_timeout_s: default to RTCKERN_LOCK_DIR and RTCKERN_LOCK_TIMEOUT_S."""
        self.root = Path(root)
        self.name = name
        self.read_only = read_only  # a layer: never written
        self.writable = not read_only  # False also once writing failed for the whole directory
        self.max_bytes = max_bytes
        self.stats = stats or Stats()
        self.lock_notice_s = lock_notice_s
        self._lock_dir = lock_dir
        self._lock_timeout_s = lock_timeout_s
        self._lock_root: Path | None = None
        self._total: int | None = None  # bytes of entries: scanned on the first capped write, then kept
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        if not read_only:
            self._prepare()

    @property
    def enabled(self) -> bool:
        """Whether the tier takes writes (reads go on regardless: see ``writable``)."""
        return self.writable

    # ---- setup and warnings ----
    def _prepare(self) -> None:
        try:
            for sub in (self.root, self.root / LAYOUT):
                sub.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not os.access(self.root / LAYOUT, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", str(self.root / LAYOUT))
        except OSError as e:
            if self.root.is_dir():
                self._stop_writing(f"cache directory {self.root} is read-only ({e}): serving the entries in it, "
                                   "keeping new kernels in memory only. Set RTCKERN_CACHE_DIR to a writable "
                                   f"directory (and RTCKERN_CACHE_LAYERS={self.root} to keep serving these)")
            else:
                self._stop_writing(f"cache directory {self.root} is not usable ({e}); keeping kernels in memory "
                                   "only. Set RTCKERN_CACHE_DIR to a writable directory")

    def _stop_writing(self, why: str) -> None:
        if self.writable:
            self.writable = False
            self._warn_once("stop-writing", why)

    def _warn_once(self, tag: str, msg: str) -> None:
        with self._lock:
            if tag in self._warned:
                return
            self._warned.add(tag)
        warnings.warn(msg, CacheWarning, stacklevel=3)  # one channel: not logged as well (rtckern.logs)

    # ---- paths ----
    def entry_path(self, key: str) -> Path:
        return self.root / LAYOUT / key[:2] / f"{key}.rtk"

    def meta_path(self, key: str) -> Path:
        return self.root / LAYOUT / key[:2] / f"{key}.json"

    def lock_path(self, key: str) -> Path:
        return self.lock_root / key[:2] / f"{key}.lock"

    @property
    def lock_root(self) -> Path:
        """Where this cache's lock files go: next to it, or node-local when it is on a network filesystem."""
        if self._lock_root is None:
            from ..config import settings

            s = settings()
            lock_dir = self._lock_dir if self._lock_dir is not None else s.lock_dir
            root, why = locks.choose_lock_root(self.root, lock_dir, s.runtime_dir)
            if lock_dir is None and root != self.root / "locks":
                try:  # a node-local folder in a shared /tmp: ours alone, or not used
                    locks.private_dir(root.parent)
                    locks.private_dir(root)
                except OSError as e:
                    self._warn_once("lock-dir", f"node-local lock directory {root} ({why}) is not usable ({e}); "
                                    f"putting lock files in {self.root / 'locks'}. Set RTCKERN_LOCK_DIR to a "
                                    "node-local directory of this user")
                    root = self.root / "locks"
            log.debug("lock files of %s go to %s (%s)", self.root, root, why)
            self._lock_root = root
        return self._lock_root

    # ---- reads ----
    def get(self, key: str) -> CompiledKernel | None:
        path = self.entry_path(key)
        try:
            data = read_entry_file(path)
        except (FileNotFoundError, NotADirectoryError):
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
        if self.writable:
            with contextlib.suppress(OSError):
                os.utime(path)  # LRU: a hit makes the entry young
        return ck

    def get_packed(self, key: str) -> bytes | None:
        """The raw, digest-checked entry bytes (for export and remote write-back)."""
        try:
            data = read_entry_file(self.entry_path(key))
            entry_format.unpack(data, key)
            return data
        except (OSError, entry_format.InvalidEntry):
            return None

    def meta(self, key: str, data: bytes | None = None) -> tuple[dict, str | None]:
        """(what is known about the entry ``key``, why its sidecar was not believed or None). The sidecar if it
        checks out against the entry (``data``, read if not given), else what the entry itself says; ({}, None)
        for an entry that is missing or invalid."""
        try:
            data = read_entry_file(self.entry_path(key)) if data is None else data
            ck = entry_format.unpack(data, key)
        except (OSError, entry_format.InvalidEntry):
            return {}, None
        try:
            side = json.loads(self.meta_path(key).read_bytes())
        except FileNotFoundError:
            return sidecar_format.from_entry(ck), None  # written without metadata: nothing to check
        except (OSError, ValueError, RecursionError) as e:
            return sidecar_format.from_entry(ck), f"unreadable ({type(e).__name__}: {e})"
        why = sidecar_format.problem(side, key, data, ck)
        return (sidecar_format.from_entry(ck), why) if why else (side, None)

    # ---- writes ----
    def put(self, key: str, ck: CompiledKernel, meta: dict | None = None) -> bool:
        return self.put_packed(key, entry_format.pack(ck, key, entry_format.identity(meta)), meta)

    def has_sidecar(self, key: str, data: bytes) -> bool:
        """Whether the entry ``key`` (its bytes ``data``) has a sidecar that checks out."""
        if not self.meta_path(key).is_file():
            return False
        return self.meta(key, data)[1] is None

    def put_packed(self, key: str, data: bytes, meta: dict | None = None) -> bool:
        if not self.writable:
            return False
        path = self.entry_path(key)
        try:
            if meta is not None:  # the sidecar first: an entry is never left without one (a stray sidecar, believed
                # only when its digest matches an entry, is removed by verify and prune)
                m = dict(meta, key=key, size=len(data), digest=entry_format.digest_of(data))
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                atomic_write(self.meta_path(key), (json.dumps(m, indent=1, sort_keys=True) + "\n").encode())
            old = self._write(path, data)
        except OSError as e:
            self.stats.bump(self.name, "errors")
            if e.errno in TIER_ERRNOS:
                self._stop_writing(f"cannot write to cache directory {self.root} ({e}); still serving the entries "
                                   "in it, keeping new kernels in memory only. Free space or fix its permissions, "
                                   "then restart")
            else:  # this entry's place is blocked (a directory where the file goes, ...): the others are fine
                self._warn_once(f"write:{key}", f"cannot write cache entry {path} ({e}); keeping this kernel in "
                                "memory only. Remove what is in the way")
            return False
        self.stats.bump(self.name, "writes")
        self._count(len(data) - old)
        if self.max_bytes is not None:
            self._enforce_cap(self.max_bytes)
        return True

    def _write(self, path: Path, data: bytes) -> int:
        """Write the entry; returns the size of the entry it replaced (0 if none)."""
        try:
            old = path.stat().st_size
        except OSError:
            old = 0
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            atomic_write(path, data)
        except FileNotFoundError:  # the shard was removed under us (by hand): make it again, once
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(path, data)
        return old

    # ---- the size cap: a running total, so a write costs no walk of the cache ----
    def _count(self, delta: int) -> None:
        with self._lock:
            if self._total is not None:
                self._total = max(0, self._total + delta)

    def _enforce_cap(self, max_bytes: int) -> None:
        """Prune when this process's running total passes the cap. The total starts from one scan and follows
        this process's writes and removals; another process's writes are seen at the next prune's scan."""
        with self._lock:
            total = self._total
        if total is None:
            total = self.total_bytes()
        if total > max_bytes:
            self._prune_entries(self._list(), max_bytes=int(max_bytes * AUTO_PRUNE_TO))

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """Exclusive per-key lock across processes (see locks.py): a flock, released by the kernel if its holder
        dies. A wait longer than a few seconds is reported once, naming the holder; after ``timeout`` seconds
        (RTCKERN_LOCK_TIMEOUT_S) the caller goes on without the lock, with one warning."""
        if not self.writable:
            yield
            return
        if timeout is None:
            from ..config import settings

            timeout = self._lock_timeout_s if self._lock_timeout_s is not None else settings().lock_timeout_s
        with contextlib.ExitStack() as stack:
            lp = None
            try:
                lp = self.lock_path(key)
                lp.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                stack.enter_context(locks.hold(lp, timeout, notice_after=self.lock_notice_s,
                                               notice=lambda msg: self._warn_once(f"wait:{key}", msg)))
            except locks.LockTimeout as e:
                self._warn_once(f"lock:{key}", f"gave up waiting for the compile lock {lp}: {e}; compiling "
                                "without it")
            except OSError as e:
                self._warn_once(f"lock:{key}", f"cannot take cache lock {lp} ({e}); compiling without it")
            yield

    def quarantine(self, key: str, reason: str) -> None:
        """Move an entry the driver refused out of the way (kept for inspection), so it is never retried."""
        self.stats.bump(self.name, "quarantined")
        self._warn_once(f"quarantine:{key}", f"the driver refused cache entry {key[:16]}… ({reason}); "
                        "quarantined it and recompiling")
        self._move_to_quarantine(key)

    def refuse_elsewhere(self, key: str, binary: bytes, where: str, reason: str) -> None:
        """The driver refused the binary a read-only tier (``where``) serves for ``key``: remember it on this
        machine (quarantine/<key>.refused holds its sha256), so that ``refused`` lets the lookup pass that entry over
        and this cache's own recompiled entry serve; the other tier is left as it is."""
        self.stats.bump(self.name, "quarantined")
        self._warn_once(f"refused:{key}", f"the driver refused cache entry {key[:16]}… of {where} ({reason}); "
                        "passing it over on this machine and recompiling into the local cache. Rebuild that layer")
        if not self.writable:
            return
        with contextlib.suppress(OSError):
            q = self.root / "quarantine"
            q.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(q / f"{key}.refused", hashlib.sha256(binary).hexdigest().encode())

    def refused(self, key: str, binary: bytes) -> bool:
        """Whether ``binary`` is the one the driver refused for ``key`` on this machine (``refuse_elsewhere``)."""
        try:
            mark = (self.root / "quarantine" / f"{key}.refused").read_bytes()
        except OSError:
            return False
        return mark == hashlib.sha256(binary).hexdigest().encode()

    def _move_to_quarantine(self, key: str) -> None:
        """Move the entry (kept for inspection) and its sidecar out of the served layout; nothing on a read-only
        tier."""
        if not self.writable:
            return
        q = self.root / "quarantine"
        with contextlib.suppress(OSError):
            size = self.entry_path(key).stat().st_size
            q.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.replace(self.entry_path(key), q / f"{key}.rtk")
            self._count(-size)
        with contextlib.suppress(OSError):
            self.meta_path(key).unlink()

    # ---- housekeeping ----
    def _list(self) -> _Listing:
        out = _Listing()
        base = self.root / LAYOUT
        try:
            shards = sorted(d.path for d in os.scandir(base) if d.is_dir(follow_symlinks=False))
        except OSError:
            return out
        for shard in shards:
            with contextlib.suppress(OSError), os.scandir(shard) as it:
                for d in it:
                    with contextlib.suppress(OSError):
                        if d.name.endswith(".tmp"):
                            out.temps[Path(d.path)] = d.stat(follow_symlinks=False).st_mtime
                        elif d.name.endswith(".rtk") and d.is_file(follow_symlinks=False):
                            out.entries[d.name[:-4]] = d.stat()
                        elif d.name.endswith(".json") and d.is_file(follow_symlinks=False):
                            out.sidecars[d.name[:-5]] = d.stat()
        return out

    def entries(self, *, meta: bool = True) -> Iterator[EntryInfo]:
        """Every entry, sorted by key. ``meta``: read each entry and its sidecar and check one against the other
        (ls, export); without it only sizes and times (prune)."""
        listing = self._list()
        for key in sorted(listing.entries):
            st = listing.entries[key]
            info, why = self.meta(key) if meta else ({}, None)
            yield EntryInfo(key=key, path=self.entry_path(key), size=st.st_size, mtime=st.st_mtime, meta=info,
                            sidecar_problem=why)

    def total_bytes(self) -> int:
        """Bytes of all entries now on disk (one scan; it also resets the running total)."""
        total = sum(st.st_size for st in self._list().entries.values())
        with self._lock:
            self._total = total
        return total

    def remove(self, key: str) -> None:
        try:
            size = self.entry_path(key).stat().st_size
        except OSError:
            size = 0
        if _unlink(self.entry_path(key)):
            self._count(-size)
        _unlink(self.meta_path(key))

    def _read_only_note(self) -> dict:
        return {"read_only": not self.writable}

    def _leftovers(self, listing: _Listing, now: float) -> tuple[list[Path], list[Path]]:
        """(temp files of writers that died, sidecars whose entry is gone), both older than STALE_S: younger ones
        may belong to a write in progress."""
        temps = [p for p, mtime in listing.temps.items() if now - mtime > STALE_S]
        orphans = [self.meta_path(k) for k, st in listing.sidecars.items()
                   if k not in listing.entries and now - st.st_mtime > STALE_S]
        return temps, orphans

    def _free_locks(self) -> tuple[int, int]:
        """Remove the lock files nobody holds: (removed, held and kept)."""
        removed = held = 0
        try:
            paths = sorted(self.lock_root.glob("*/*.lock"))
        except OSError:
            return 0, 0
        for p in paths:
            if locks.remove_if_free(p):
                removed += 1
            elif p.exists():
                held += 1
        return removed, held

    def verify(self, remove: bool = True) -> dict:
        """Check every entry (digest, header) and every sidecar against its entry; with ``remove``, remove bad
        entries, bad sidecars, orphan sidecars and dead writers' temp files (unless the cache is read-only)."""
        listing = self._list()
        can_remove = remove and self.writable
        checked = corrupt = removed = unreadable = 0
        bad, bad_sidecars = [], []
        for key in sorted(listing.entries):
            path = self.entry_path(key)
            try:
                data = read_entry_file(path)
            except FileNotFoundError:  # removed meanwhile (a prune, another verify): nothing to check
                continue
            except OSError as err:  # unreadable (permissions, I/O, too many open files): reported, not removed
                checked += 1
                unreadable += 1
                bad.append({"key": key, "reason": f"unreadable: {err}"})
                continue
            checked += 1
            try:
                entry_format.unpack(data, key)
            except entry_format.InvalidEntry as err:
                corrupt += 1
                bad.append({"key": key, "reason": str(err)})
                if can_remove:
                    self.remove(key)
                    removed += 1
                continue
            if key in listing.sidecars:
                _, why = self.meta(key, data)
                if why:
                    bad_sidecars.append({"key": key, "reason": why})
        temps, orphans = self._leftovers(listing, time.time())
        cleaned = 0
        if can_remove:
            cleaned = sum(_unlink(p) for p in temps + orphans + [self.meta_path(b["key"]) for b in bad_sidecars])
        return {"checked": checked, "corrupt": corrupt, "unreadable": unreadable, "removed": removed, "bad": bad,
                "bad_sidecars": bad_sidecars, "orphan_sidecars": len(orphans), "stale_temp_files": len(temps),
                "cleaned": cleaned, **self._read_only_note()}

    def _prune_entries(self, listing: _Listing, max_bytes: int | None = None, older_than_s: float | None = None,
                       keep: Callable[[EntryInfo], bool] | None = None) -> tuple[int, int, int]:
        """(removed, freed bytes, bytes left): least recently used first. Removes nothing when read-only (the
        counts are then what would go)."""
        infos = [EntryInfo(key=k, path=self.entry_path(k), size=st.st_size, mtime=st.st_mtime, meta={})
                 for k, st in listing.entries.items()]
        if keep is not None:  # keep() judges by the metadata: read it only when asked
            infos = [dataclasses.replace(e, meta=self.meta(e.key)[0]) for e in infos]
        infos.sort(key=lambda e: (e.mtime, e.key))
        now = time.time()
        drop, survivors = [], []
        for e in infos:
            old = older_than_s is not None and now - e.mtime > older_than_s
            (drop if old or (keep is not None and not keep(e)) else survivors).append(e)
        total = sum(e.size for e in survivors)
        for e in survivors:
            if max_bytes is None or total <= max_bytes:
                break
            drop.append(e)
            total -= e.size
        removed, freed = len(drop), sum(e.size for e in drop)
        if self.writable:
            for e in drop:
                self.remove(e.key)
            with self._lock:
                self._total = total
        return removed, freed, total

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None,
              keep: Callable[[EntryInfo], bool] | None = None) -> dict:
        """Remove least-recently-used entries until the total is at most ``max_bytes``, and entries not used
        for ``older_than_s`` seconds. ``keep(entry) -> False`` removes an entry regardless (e.g. superseded
        toolchains). Also removes what no live process uses: dead writers' temp files, sidecars without an
        entry, lock files nobody holds. A read-only cache is left alone (``would_remove`` says what would go)."""
        listing = self._list()
        removed, freed, left = self._prune_entries(listing, max_bytes, older_than_s, keep)
        if not self.writable:
            return {"removed": 0, "freed_bytes": 0, "would_remove": removed, "bytes": left, "temp_removed": 0,
                    "sidecars_removed": 0, "locks_removed": 0, **self._read_only_note()}
        temps, orphans = self._leftovers(listing, time.time())
        locks_removed, _ = self._free_locks()
        return {"removed": removed, "freed_bytes": freed, "bytes": left, "temp_removed": sum(map(_unlink, temps)),
                "sidecars_removed": sum(map(_unlink, orphans)), "locks_removed": locks_removed,
                **self._read_only_note()}

    def clear(self) -> dict:
        """Remove every entry, sidecar and quarantined entry, dead writers' temp files and the lock files nobody
        holds. A held lock's file stays (removing it would let a second process compile the same key), and so do
        temp files of writes in progress. A read-only cache is left alone."""
        listing = self._list()
        if not self.writable:
            return {"removed": 0, "entries": len(listing.entries), "temp_removed": 0, "locks_removed": 0,
                    "locks_held": 0, **self._read_only_note()}
        removed = 0
        for key in sorted(listing.entries):
            removed += _unlink(self.entry_path(key))
        for key in listing.sidecars:
            _unlink(self.meta_path(key))
        temps, _ = self._leftovers(listing, time.time())
        temp_removed = sum(map(_unlink, temps))
        shutil.rmtree(self.root / "quarantine", ignore_errors=True)
        locks_removed, locks_held = self._free_locks()
        self.total_bytes()
        return {"removed": removed, "entries": len(listing.entries), "temp_removed": temp_removed,
                "locks_removed": locks_removed, "locks_held": locks_held, **self._read_only_note()}
