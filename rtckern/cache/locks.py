"""Per-key compile locks: one compile per key across the processes of a node.

A lock is an OS file lock (``flock``) on ``<lock root>/<k[:2]>/<key>.lock``. The kernel releases it when its
holder exits or is killed, so a dead holder never blocks anyone. The holder writes who it is (host, pid, since
when) into the file; a process that waits longer than a few seconds says so once, naming the holder, and gives
up after ``RTCKERN_LOCK_TIMEOUT_S`` (600 s by default), compiling without the lock (a duplicate compile, never a
wrong entry: entries are written atomically).

Lock files come and go safely: the holder removes its file before releasing it, and whoever takes a lock checks
that the file it locked is still the one at the path (a file removed meanwhile is taken again). Housekeeping
(``cache prune``/``clear``) removes only lock files nobody holds, by taking them first.

Shared filesystems. ``flock`` over NFS is emulated by the client with whole-file byte-range locks (NLM on v3,
which fails with ENOLCK when rpc.statd is not running; leases on v4); on Lustre it needs the ``flock`` mount
option (without it: ENOSYS; with ``localflock``: node-local only); CIFS and GPFS differ again. Where it works, a
lock call can hang in the kernel on an unresponsive lock server, which no user-space timeout bounds, and a client
that loses its lease can lose the lock unnoticed (triton-lang/triton#11512, flashinfer-ai/flashinfer#3777). So
when the cache directory is on a network filesystem (its mount's type in /proc/mounts), lock files go to
node-local storage instead: ``$XDG_RUNTIME_DIR/rtckern-locks``, else ``<temp dir>/rtckern-locks-<uid>``, one
subfolder per cache directory. ``RTCKERN_LOCK_DIR`` overrides the choice. Consequence: the processes of one node
compile a key once; nodes sharing the cache may each compile it once, and the last atomic rename wins with the
same bytes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

# Filesystem types (as /proc/mounts names them) whose locks are not node-local or not dependable.
NETWORK_FS = frozenset({
    "nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "glusterfs", "fuse.glusterfs", "ceph",
    "fuse.ceph", "fuse.ceph-fuse", "cephfs", "afs", "openafs", "9p", "fuse.sshfs", "sshfs", "panfs", "wekafs",
    "fuse.juicefs", "juicefs", "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "davfs", "fuse.davfs",
    "ocfs2", "gfs2", "pvfs2", "orangefs", "ncpfs", "coda", "fuse.rclone",
})
NOTICE_AFTER_S = 5.0  # a wait longer than this is reported once, naming the holder
_POLL_MAX_S = 0.05


class LockTimeout(TimeoutError):
    """The lock was not free within the timeout; the message names the holder."""


# ---- where lock files live ----
def _unescape_mount(field: str) -> str:
    """/proc/mounts escapes space, tab, newline and backslash as octal (``\\040``)."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_fstype(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """The filesystem type of the mount holding ``path`` (or its nearest existing parent); None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        target = str(p.resolve())
        lines = Path(mounts).read_text(errors="replace").splitlines()
    except OSError:
        return None
    best, fstype = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mp = _unescape_mount(parts[1])
        inside = target == mp or target.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) >= len(best):  # the last of equal mount points is the one on top
            best, fstype = mp, parts[2]
    return fstype


def is_network_fs(path: Path, mounts: str = "/proc/mounts") -> bool:
    t = mount_fstype(path, mounts)
    return t is not None and (t in NETWORK_FS or t.split(".")[0] in NETWORK_FS)


def node_local_base(runtime_dir: Path | None) -> Path:
    """Node-local storage for lock files: the per-user runtime dir (a tmpfs), else the temp dir."""
    if runtime_dir is not None and runtime_dir.is_dir() and os.access(runtime_dir, os.W_OK | os.X_OK):
        return runtime_dir / "rtckern-locks"
    return Path(tempfile.gettempdir()) / f"rtckern-locks-{os.getuid()}"


def cache_tag(cache_root: Path) -> str:
    """One subfolder per cache directory, so housekeeping of one cache never touches another's locks."""
    return hashlib.sha256(str(Path(cache_root).absolute()).encode()).hexdigest()[:16]


def choose_lock_root(cache_root: Path, lock_dir: Path | None, runtime_dir: Path | None,
                     mounts: str = "/proc/mounts") -> tuple[Path, str]:
    """(directory of the lock files, why there)."""
    if lock_dir is not None:
        return Path(lock_dir) / cache_tag(cache_root), "RTCKERN_LOCK_DIR"
    fstype = mount_fstype(cache_root, mounts)
    if fstype is not None and (fstype in NETWORK_FS or fstype.split(".")[0] in NETWORK_FS):
        return node_local_base(runtime_dir) / cache_tag(cache_root), f"the cache is on {fstype}"
    return Path(cache_root) / "locks", "next to the cache"


def private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) and refuse one that another user owns or that is a link: a shared /tmp must
    not let someone else hold or fake our locks."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(errno.EPERM, "not a directory owned by this user", str(path))


# ---- taking and releasing ----
def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def holder_of(path: Path) -> str:
    """Who holds the lock at ``path``, as its holder wrote it: 'pid 123 on node7 since 12:00:01 (41 s)'."""
    try:
        info = json.loads(Path(path).read_text() or "null")
        host, pid, since = info["host"], int(info["pid"]), float(info["since"])
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return "a holder that has not written its name yet"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    return f"pid {pid} on {host} since {when} ({max(0.0, time.time() - since):.0f} s)"


def _try_take(path: Path) -> int | None:
    """A locked descriptor of the file now at ``path``, or None if someone holds it."""
    while True:
        # O_NOFOLLOW: a link planted at the lock's name (a lock directory others can write) is refused, never
        # followed to truncate the file it names when the holder signs the lock
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # the file was removed between open and flock: take the new one


def _sign(fd: int) -> None:
    info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode()
    with contextlib.suppress(OSError):  # the name is a courtesy to waiters; the lock holds without it
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)


@contextlib.contextmanager
def hold(path: Path, timeout: float, *, notice_after: float = NOTICE_AFTER_S,
         notice: Callable[[str], None] = log.warning) -> Iterator[None]:
    """Hold the lock at ``path``. Raises LockTimeout after ``timeout`` seconds, naming the holder; calls
    ``notice`` once with one line when the wait passes ``notice_after`` seconds."""
    t0 = time.monotonic()
    delay, noticed = 0.002, False
    while True:
        fd = _try_take(path)
        if fd is not None:
            break
        waited = time.monotonic() - t0
        if waited >= timeout:
            raise LockTimeout(f"not free after {timeout:g} s (RTCKERN_LOCK_TIMEOUT_S); held by {holder_of(path)}")
        if not noticed and waited >= notice_after:
            noticed = True
            notice(f"waiting for the compile lock {path}: held by {holder_of(path)}; giving up after "
                   f"{timeout:g} s (RTCKERN_LOCK_TIMEOUT_S) and compiling without it")
        time.sleep(min(delay, max(0.0, timeout - waited)))
        delay = min(delay * 2, _POLL_MAX_S)
    _sign(fd)
    try:
        yield
    finally:
        # Remove the file while still holding it: a waiter that opened it finds it gone and takes a new one.
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)  # closing the last descriptor releases the flock


def remove_if_free(path: Path) -> bool:
    """Remove the lock file at ``path`` if nobody holds it (taking it first, so a holder is never robbed)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        if not _same_file(fd, path):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
