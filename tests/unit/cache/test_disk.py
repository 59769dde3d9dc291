import os
import re
import warnings

import pytest

from rtckern.cache import CacheWarning, DiskCache, InvalidEntry, pack, unpack
from rtckern.compiler.base import CompiledKernel

CK = CompiledKernel(binary=b"\x7fELF" + bytes(range(256)) * 8, kind="cubin", lowered_name="_Z1kv")
KEY = "ab" + "0" * 62


def test_roundtrip_and_sidecar(tmp_path):
    d = DiskCache(tmp_path)
    assert d.put(KEY, CK, {"op": "core", "arch": "sm_90"})
    got = d.get(KEY)
    assert got.binary == CK.binary and got.lowered_name == "_Z1kv"
    assert d.entry_path(KEY).parent.name == "ab"  # sharded
    meta = list(d.entries())[0].meta
    assert meta["op"] == "core" and meta["key"] == KEY and len(meta["digest"]) == 64
    assert oct(d.root.stat().st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_damaged_entries_are_misses_with_one_warning(tmp_path, damage):
    d = DiskCache(tmp_path)
    d.put(KEY, CK, {})
    p = d.entry_path(KEY)
    data = p.read_bytes()
    if damage == "truncate":
        p.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        p.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    elif damage == "empty":
        p.write_bytes(b"")
    else:
        p.write_bytes(b"not a cache entry at all" * 10)
    with pytest.warns(CacheWarning, match="invalid"):
        assert d.get(KEY) is None
    assert not p.exists()  # removed, to be replaced by the recompile
    d.put(KEY, CK, {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d.get(KEY).binary == CK.binary
    assert d.stats.tiers["disk"].invalid == 1


def test_unpack_rejects_bad_envelope():
    data = pack(CK, KEY)
    with pytest.raises(InvalidEntry, match="digest mismatch"):
        unpack(data[:-1] + b"\x00" if data[-1] else data[:-1] + b"\x01", KEY)
    with pytest.raises(InvalidEntry, match="bad magic"):
        unpack(b"X" * len(data), KEY)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_degrades_to_memory(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.warns(CacheWarning, match="memory only"):
            d = DiskCache(tmp_path / "sub")
        assert not d.enabled and d.put(KEY, CK) is False and d.get(KEY) is None
    finally:
        tmp_path.chmod(0o700)


def test_unwritable_path_degrades_to_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache dir should be")
    with pytest.warns(CacheWarning, match="keeping kernels in memory only"):
        d = DiskCache(blocker / "cache")
    assert not d.enabled and d.put(KEY, CK) is False


def test_prune_lru_under_cap(tmp_path):
    d = DiskCache(tmp_path)
    keys = [f"{i:02x}" + "1" * 62 for i in range(6)]
    for i, k in enumerate(keys):
        d.put(k, CK, {})
        os.utime(d.entry_path(k), (1000 + i, 1000 + i))
    d.get(keys[0])  # used now: youngest
    size = d.entry_path(keys[0]).stat().st_size
    r = d.prune(max_bytes=3 * size)
    left = {e.key for e in d.entries()}
    assert r["removed"] == 3 and left == {keys[0], keys[4], keys[5]}
    assert d.total_bytes() <= 3 * size


def test_cap_enforced_on_write(tmp_path):
    """Past the cap, a write prunes to 90% of it (the oldest go), so the next prune is several writes away."""
    size = len(pack(CK, KEY))
    d = DiskCache(tmp_path, max_bytes=3 * size)
    keys = [f"{i:02x}" + "2" * 62 for i in range(5)]
    for i, k in enumerate(keys):
        d.put(k, CK, {})
        os.utime(d.entry_path(k), (1000 + i, 1000 + i))
        if i == 3:  # 4 entries > 3: pruned to 2 (<= 2.7 entries' worth)
            assert {e.key for e in d.entries(meta=False)} == {keys[2], keys[3]}
    assert {e.key for e in d.entries(meta=False)} == {keys[2], keys[3], keys[4]}


def test_verify_and_quarantine(tmp_path):
    d = DiskCache(tmp_path)
    d.put(KEY, CK, {})
    other = "cd" + "3" * 62
    d.put(other, CK, {})
    d.entry_path(other).write_bytes(b"junk")
    assert d.verify(remove=True) == {"checked": 2, "corrupt": 1, "unreadable": 0, "removed": 1,
                                     "bad": [{"key": other, "reason": "truncated (4 bytes, the header alone is 52)"}],
                                     "bad_sidecars": [], "orphan_sidecars": 0, "stale_temp_files": 0, "cleaned": 0,
                                     "read_only": False}
    with pytest.warns(CacheWarning, match="quarantined"):
        d.quarantine(KEY, "CUDA_ERROR_INVALID_IMAGE")
    assert d.get(KEY) is None and (tmp_path / "quarantine" / f"{KEY}.rtk").exists()


# ---- the tier degrades gently ----
K1, K2, K3 = ("a1" + "1" * 62), ("b2" + "2" * 62), ("c3" + "3" * 62)


def test_enospc_stops_writing_but_not_reading(tmp_path, monkeypatch):
    import errno

    d = DiskCache(tmp_path)
    assert d.put(K1, CK, {"op": "core"})

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(os, "replace", full)
    with pytest.warns(CacheWarning, match=r"cannot write to cache directory .*No space left on device.*still serving "
                      "the entries in it, keeping new kernels in memory only"):
        assert d.put(K2, CK, {}) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert d.put(K3, CK, {}) is False
        assert d.get(K1).binary == CK.binary  # still read
    assert not d.writable and d.stats.tiers["disk"].hits == 1
    assert not list(tmp_path.rglob("*.tmp"))  # the failed writes left nothing behind


def test_directory_where_an_entry_goes_blocks_that_entry_only(tmp_path):
    d = DiskCache(tmp_path)
    assert d.put(K1, CK, {})
    d.entry_path(K2).mkdir(parents=True)
    with pytest.warns(CacheWarning, match=r"cannot write cache entry .*b2{63}\.rtk .*Is a directory.*keeping this "
                      "kernel in memory only"):
        assert d.put(K2, CK, {}) is False
    assert d.writable and d.put(K3, CK, {}) and d.get(K1) is not None and d.get(K3) is not None


def test_manager_keeps_serving_disk_entries_after_a_write_error(tmp_path, monkeypatch, axpy_spec):
    """The issue's case: after one failed write, entries still on disk were recompiled."""
    import dataclasses
    import errno

    from rtckern.manager import KernelManager

    cache = tmp_path / "c"
    KernelManager(cache, remote=None).compile(axpy_spec)
    m = KernelManager(cache, remote=None)
    real_replace = os.replace

    def full(src, dst):
        if str(dst).endswith(".rtk"):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full)
    other = dataclasses.replace(axpy_spec, defines=(("RTK_TEST_OTHER_KEY", "1"),))
    with pytest.warns(CacheWarning, match="still serving the entries"):
        m.compile(other)  # compiled; its write fails: writing stops
    m.clear_memory()
    m.compile(axpy_spec)
    assert m.stats.compiles == 1 and m.stats.tiers["disk"].hits == 1


def test_lock_files_go_where_the_settings_say(tmp_path):
    from rtckern import config

    d = DiskCache(tmp_path / "c", lock_dir=tmp_path / "locks")
    assert d.lock_path(KEY).parent.parent.parent == tmp_path / "locks"
    with config.override(lock_dir=tmp_path / "set"):
        assert DiskCache(tmp_path / "c").lock_path(KEY).is_relative_to(tmp_path / "set")
        with d.lock(KEY):
            assert d.lock_path(KEY).exists()  # the holder's file
        assert not d.lock_path(KEY).exists()  # removed on release


# ---- the size cap keeps a running total ----
def test_capped_writes_do_not_walk_the_cache_each_time(tmp_path, monkeypatch):
    size = len(pack(CK, KEY))
    d = DiskCache(tmp_path, max_bytes=1000 * size)
    walks = []
    real = DiskCache._list
    monkeypatch.setattr(DiskCache, "_list", lambda self: walks.append(1) or real(self))
    for i in range(200):
        assert d.put(f"{i:04x}" + "4" * 60, CK, {"op": "x"})
    assert len(walks) == 1  # one scan for the running total, none per write
    small = DiskCache(tmp_path / "small", max_bytes=20 * size)
    walks.clear()
    for i in range(100):
        small.put(f"{i:04x}" + "5" * 60, CK, {})
    # over the cap a write prunes to 90% of it: 18 entries, then 3 writes free, so one walk per ~3 writes
    assert len(walks) <= 1 + 2 * (100 - 20) // 3 and small.total_bytes() <= 20 * size
    assert len(list(small.entries(meta=False))) >= 18


# ---- housekeeping ----
def _age(path, seconds=3600):
    t = os.path.getmtime(path) - seconds
    os.utime(path, (t, t))


def test_dead_writers_temp_files_and_orphan_sidecars_are_found_and_removed(tmp_path):
    d = DiskCache(tmp_path)
    d.put(K1, CK, {})
    shard = d.entry_path(K1).parent
    stale, fresh = shard / f".{K1}.rtk.dead1.tmp", shard / f".{K2}.rtk.live1.tmp"
    stale.write_bytes(b"half an entry")
    fresh.write_bytes(b"a write in progress")
    _age(stale)
    d.put(K2, CK, {"op": "x"})
    d.entry_path(K2).unlink()  # prune raced a writer: the sidecar outlived its entry
    _age(d.meta_path(K2))
    r = d.verify(remove=False)
    assert (r["stale_temp_files"], r["orphan_sidecars"], r["cleaned"]) == (1, 1, 0) and stale.exists()
    r = d.prune()
    assert (r["removed"], r["temp_removed"], r["sidecars_removed"]) == (0, 1, 1)
    assert not stale.exists() and fresh.exists() and not d.meta_path(K2).exists() and d.get(K1) is not None


def test_killed_writer_leaves_a_temp_file_that_prune_removes(tmp_path):
    import signal
    import subprocess
    import sys

    code = ("import os, sys, time; from rtckern.cache import DiskCache, pack; from rtckern.compiler.base import "
            "CompiledKernel\n"
            "def hang(src, dst): print('writing', flush=True); time.sleep(60)\n"
            "os.replace = hang\n"
            f"DiskCache({str(tmp_path)!r}).put({K1!r}, CompiledKernel(b'x' * 100, 'cubin', 'k'))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert p.stdout.readline().strip() == "writing"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    (tmp,) = tmp_path.rglob("*.tmp")  # what a SIGKILLed writer leaves
    d = DiskCache(tmp_path)
    assert d.prune()["temp_removed"] == 0 and tmp.exists()  # young: could be a live writer
    _age(tmp)
    assert d.verify(remove=False)["stale_temp_files"] == 1
    assert d.prune()["temp_removed"] == 1 and not tmp.exists()


def test_clear_removes_entries_but_not_live_temp_files(tmp_path):
    d = DiskCache(tmp_path)
    for k in (K1, K2):
        d.put(k, CK, {"op": "x"})
    live = d.entry_path(K3).parent / f".{K3}.rtk.live.tmp"
    live.parent.mkdir(parents=True, exist_ok=True)
    live.write_bytes(b"...")
    r = d.clear()
    assert (r["removed"], r["temp_removed"], r["read_only"]) == (2, 0, False)
    assert not list(d.entries()) and live.exists() and not list(tmp_path.rglob("*.json"))
    assert d.put(K1, CK, {}) and d.get(K1) is not None  # still a working cache


# ---- sidecars are checked against their entry ----
def test_swapped_sidecars_are_not_believed(tmp_path):
    d = DiskCache(tmp_path)
    d.put(K1, CK, {"op": "first", "arch": "sm_80"})
    d.put(K2, CK, {"op": "second", "arch": "sm_90"})
    a, b = d.meta_path(K1).read_bytes(), d.meta_path(K2).read_bytes()
    d.meta_path(K1).write_bytes(b)
    d.meta_path(K2).write_bytes(a)
    assert {e.key: (e.meta, e.sidecar_problem) for e in d.entries()} == {
        K1: ({"kind": "cubin"}, f"it names key {K2[:16]}…, the entry is {K1[:16]}…"),
        K2: ({"kind": "cubin"}, f"it names key {K1[:16]}…, the entry is {K2[:16]}…")}
    r = d.verify(remove=True)
    assert [x["key"] for x in r["bad_sidecars"]] == [K1, K2] and r["corrupt"] == 0 and r["cleaned"] == 2
    assert not d.meta_path(K1).exists() and d.get(K1) is not None  # the entry stays, described by itself
    assert d.verify()["bad_sidecars"] == []


@pytest.mark.parametrize("field,value,reason", [
    ("size", 1, r"it records 1 bytes, the entry has \d+"),
    ("digest", "0" * 64, "its digest is not the entry's"),
    ("kind", "ptx", "it says kind 'ptx', the entry holds 'cubin'"),
])
def test_sidecar_disagreeing_with_its_entry_is_reported(tmp_path, field, value, reason):
    import json

    d = DiskCache(tmp_path)
    d.put(K1, CK, {"op": "x"})
    m = json.loads(d.meta_path(K1).read_text())
    d.meta_path(K1).write_text(json.dumps(dict(m, **{field: value})))
    (e,) = d.entries()
    assert e.meta == {"kind": "cubin"}
    assert re.fullmatch(reason, e.sidecar_problem)
    (bad,) = d.verify(remove=False)["bad_sidecars"]
    assert re.fullmatch(reason, bad["reason"])


def test_binary_arch_from_real_cubins_and_ptx():
    from rtckern.arch import Arch
    from rtckern.cache.sidecar import binary_arch
    from rtckern.compiler import compiler_for
    from rtckern.spec import KernelSpec

    src = 'extern "C" __global__ void k(float* y) { y[threadIdx.x] *= 2.f; }'
    for arch, want in (("sm_75", "sm_75"), ("sm_80", "sm_80"), ("sm_90a", "sm_90"), ("sm_120", "sm_120"),
                       ("9.0a+PTX", "sm_90a")):
        a = Arch.parse(arch)
        ck = compiler_for(a).compile(KernelSpec("t.cu", "k", a, code=src))
        assert binary_arch(ck.kind, ck.binary) == want, arch
    assert binary_arch("cubin", CK.binary) is None  # not a CUDA ELF: nothing to say
    assert binary_arch("hsaco", b"\x7fELF" + bytes(100)) is None


def test_binary_arch_of_an_older_cuda_elf_abi():
    """CUDA 12 and earlier cubins (ELF ABI version 7) hold the SM in the low byte of e_flags (sm_90: 0x5a055a)."""
    import struct

    from rtckern.cache.sidecar import binary_arch

    head = bytearray(64)
    head[:9] = b"\x7fELF\x02\x01\x01\x33\x07"
    struct.pack_into("<H", head, 18, 190)
    struct.pack_into("<I", head, 48, 0x5A055A)
    assert binary_arch("cubin", bytes(head)) == "sm_90"
    struct.pack_into("<I", head, 48, 0x500550)
    assert binary_arch("cubin", bytes(head)) == "sm_80"


def test_an_entry_that_is_a_link_or_a_fifo_is_refused_unread(tmp_path):
    """A layer holding a link or a FIFO where an entry goes (the listings pass them over) is a miss with a warning,
    never a read through the link or a wait on the FIFO."""
    d = DiskCache(tmp_path / "c")
    d.put(KEY, CK, {})
    target = tmp_path / "elsewhere.rtk"
    target.write_bytes(d.entry_path(KEY).read_bytes())
    d.entry_path(KEY).unlink()
    d.entry_path(KEY).symlink_to(target)
    with pytest.warns(CacheWarning, match="cannot read cache entry"):
        assert d.get(KEY) is None
    d.entry_path(KEY).unlink()
    os.mkfifo(d.entry_path(KEY))
    with pytest.warns(CacheWarning, match="not a regular file"):
        assert DiskCache(tmp_path / "c").get(KEY) is None  # (a new tier: the warning is once per tier and key)
