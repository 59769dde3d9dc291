"""Per-key locks with real processes: a bounded wait that names the holder, lock files that housekeeping removes
only when nobody holds them, and node-local lock files when the cache is on a network filesystem."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

from rtckern import config
from rtckern.errors import ConfigError
from rtckern.cache import CacheWarning, DiskCache
from rtckern.cache import locks

KEY = "ab" + "7" * 62
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def _holder(cache, key=KEY, then="time.sleep(60)"):
    """A process that takes ``key``'s lock, says so, and then does ``then``."""
    code = ("import time; from rtckern.cache import DiskCache\n"
            f"d = DiskCache({str(cache)!r})\n"
            f"with d.lock({key!r}):\n    print('locked', flush=True)\n    {then}\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout.readline().strip() == "locked"
    return p


def _stop(p):
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait()


def test_a_long_wait_names_the_holder_and_gives_up_after_the_timeout(tmp_path):
    p = _holder(tmp_path)
    try:
        d = DiskCache(tmp_path, lock_timeout_s=1.5, lock_notice_s=0.3)
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with d.lock(KEY):
                waited = time.monotonic() - t0
        msgs = [str(w.message) for w in seen if issubclass(w.category, CacheWarning)]
        held_by = rf"held by pid {p.pid} on {socket.gethostname()} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d \(\d+ s\)"
        assert len(msgs) == 2
        assert re.match(rf"waiting for the compile lock .*{KEY}\.lock: {held_by}; giving up after "
                                      r"1\.5 s \(RTCKERN_LOCK_TIMEOUT_S\) and compiling without it$", msgs[0])
        assert re.match(rf"gave up waiting for the compile lock .*: not free after 1\.5 s "
                                      rf"\(RTCKERN_LOCK_TIMEOUT_S\); {held_by}; compiling without it$", msgs[1])
        assert 1.5 <= waited < 3.0
    finally:
        _stop(p)


def test_lock_timeout_is_a_setting(tmp_path):
    p = _holder(tmp_path)
    try:
        code = (f"import time; from rtckern.cache import DiskCache; d = DiskCache({str(tmp_path)!r}, lock_notice_s=0.2)\n"
                f"t = time.monotonic()\nwith d.lock({KEY!r}): print(round(time.monotonic() - t, 1))\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env=dict(ENV, RTCKERN_LOCK_TIMEOUT_S="1"))
        assert 1.0 <= float(r.stdout) < 3.0, r.stderr
        assert f"held by pid {p.pid}" in r.stderr and "not free after 1 s (RTCKERN_LOCK_TIMEOUT_S)" in r.stderr
    finally:
        _stop(p)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_bad_lock_timeout_is_refused(value):
    with pytest.raises(ConfigError, match=rf"RTCKERN_LOCK_TIMEOUT_S='{value}' is not a number of seconds in "
                                          r"\(0, 86400\]; give a positive number such as 600"):
        config.Settings.from_env({"RTCKERN_LOCK_TIMEOUT_S": value})
    assert config.Settings.from_env({"RTCKERN_LOCK_TIMEOUT_S": "2.5"}).lock_timeout_s == 2.5


def test_clear_keeps_a_held_lock(tmp_path):
    """`cache clear` during a compile deleted the holder's lock file: a second process took a new one and
    compiled the same key again."""
    p = _holder(tmp_path)
    try:
        d = DiskCache(tmp_path)
        r = subprocess.run([sys.executable, "-m", "rtckern", "cache", "clear", "--json"], capture_output=True,
                           text=True, env=dict(ENV, RTCKERN_CACHE_DIR=str(tmp_path)), timeout=120)
        assert r.returncode == 0, r.stderr
        assert '"locks_held": 1' in r.stdout and d.lock_path(KEY).exists()
        with pytest.warns(CacheWarning, match=rf"not free after 0\.3 s .*held by pid {p.pid}"):
            with d.lock(KEY, timeout=0.3):
                pass  # still excluded: the holder keeps its lock
    finally:
        _stop(p)


def test_prune_removes_lock_files_nobody_holds(tmp_path):
    dead = _holder(tmp_path, key=KEY)
    _stop(dead)  # SIGKILLed while holding: its file stays, nobody holds it
    live_key = "cd" + "8" * 62
    live = _holder(tmp_path, key=live_key)
    try:
        d = DiskCache(tmp_path)
        assert d.lock_path(KEY).exists() and d.lock_path(live_key).exists()
        assert d.prune()["locks_removed"] == 1
        assert not d.lock_path(KEY).exists() and d.lock_path(live_key).exists()
    finally:
        _stop(live)


def test_released_lock_leaves_no_file(tmp_path):
    p = _holder(tmp_path, then="pass")
    assert p.wait(timeout=60) == 0
    assert not DiskCache(tmp_path).lock_path(KEY).exists()


# ---- where lock files live ----
def _mounts(tmp_path, fstype):
    f = tmp_path / "mounts"
    (tmp_path / "shared").mkdir(exist_ok=True)  # the mount point
    f.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/export {tmp_path / 'shared'} {fstype} rw,vers=4.2 0 0\n")
    return str(f)


@pytest.mark.parametrize("fstype", ["nfs4", "lustre", "cifs", "gpfs", "fuse.glusterfs", "beegfs"])
def test_locks_go_node_local_when_the_cache_is_on_a_network_filesystem(tmp_path, fstype):
    cache = tmp_path / "shared" / "team" / "rtckern"  # need not exist yet
    assert locks.mount_fstype(cache, _mounts(tmp_path, fstype)) == fstype
    root, why = locks.choose_lock_root(cache, None, tmp_path / "run", _mounts(tmp_path, fstype))
    assert why == f"the cache is on {fstype}"
    assert root.parent == locks.node_local_base(tmp_path / "run") and root.name == locks.cache_tag(cache)
    (tmp_path / "run").mkdir()
    assert locks.node_local_base(tmp_path / "run") == tmp_path / "run" / "rtckern-locks"
    assert locks.node_local_base(None).name == f"rtckern-locks-{os.getuid()}"


def test_locks_stay_next_to_a_local_cache_unless_the_setting_says(tmp_path):
    cache = tmp_path / "local" / "c"
    assert locks.choose_lock_root(cache, None, None, _mounts(tmp_path, "nfs4")) == (cache / "locks",
                                                                                   "next to the cache")
    root, why = locks.choose_lock_root(tmp_path / "shared" / "c", tmp_path / "mine", None, _mounts(tmp_path, "nfs"))
    assert why == "RTCKERN_LOCK_DIR" and root.parent == tmp_path / "mine"


def test_mount_points_with_spaces_are_read(tmp_path):
    f = tmp_path / "mounts"
    f.write_text(f"srv:/x {tmp_path}/my\\040share nfs rw 0 0\n")
    (tmp_path / "my share").mkdir()
    assert locks.mount_fstype(tmp_path / "my share" / "c", str(f)) == "nfs"


def test_a_node_local_lock_dir_of_another_user_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(locks, "mount_fstype", lambda path, mounts="/proc/mounts": "nfs4")
    base = tmp_path / "run" / "rtckern-locks"
    base.mkdir(parents=True)
    os.chown(base, 4242, 4242)  # as if someone else made it first in a shared /tmp
    with config.override(runtime_dir=tmp_path / "run", lock_dir=None):
        d = DiskCache(tmp_path / "cache")
        with pytest.warns(CacheWarning, match=rf"node-local lock directory {base}/\w+ \(the cache is on nfs4\) is "
                          r"not usable .*not a directory owned by this user.*; putting lock files in "):
            assert d.lock_path(KEY).is_relative_to(tmp_path / "cache" / "locks")
        os.chown(base, os.getuid(), os.getgid())
        assert DiskCache(tmp_path / "cache").lock_path(KEY).is_relative_to(base)


def test_a_link_planted_at_a_lock_name_is_not_followed(tmp_path):
    """Someone who can write to a lock directory plants a link where a lock file goes: taking the lock refuses it
    (O_NOFOLLOW) instead of truncating the file it names when signing the lock."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock = tmp_path / "locks" / "ab" / "k.lock"
    lock.parent.mkdir(parents=True)
    lock.symlink_to(victim)
    with pytest.raises(OSError):
        with locks.hold(lock, 1.0):
            pass
    assert victim.read_text() == "precious"


def test_verify_reports_an_unreadable_entry_and_keeps_it(tmp_path, monkeypatch):
    """An entry verify cannot read (permissions, I/O, too many open files) is reported, not removed as corrupt."""
    from rtckern.cache import disk, pack
    from rtckern.compiler.base import CompiledKernel

    d = DiskCache(tmp_path)
    key = "a" * 64
    d.put_packed(key, pack(CompiledKernel(b"\x7fELF", "cubin", "k"), key))
    real = disk.read_entry_file

    def read_entry_file(path):
        if path == d.entry_path(key):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(disk, "read_entry_file", read_entry_file)
    r = d.verify()
    monkeypatch.setattr(disk, "read_entry_file", real)
    assert r["corrupt"] == 0 and r["unreadable"] == 1 and r["removed"] == 0 and "unreadable" in r["bad"][0]["reason"]
    assert d.entry_path(key).exists()
