import os
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
    data = pack(CK)
    with pytest.raises(InvalidEntry, match="digest mismatch"):
        unpack(data[:-1] + b"\x00" if data[-1] else data[:-1] + b"\x01")
    with pytest.raises(InvalidEntry, match="bad magic"):
        unpack(b"X" * len(data))


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
    size = len(pack(CK))
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
    assert d.verify(remove=True) == {"checked": 2, "corrupt": 1, "removed": 1,
                                     "bad": [{"key": other, "reason": "truncated (4 bytes, the header alone is 52)"}],
                                     "bad_sidecars": [], "orphan_sidecars": 0, "stale_temp_files": 0, "cleaned": 0,
                                     "read_only": False}
    with pytest.warns(CacheWarning, match="quarantined"):
        d.quarantine(KEY, "CUDA_ERROR_INVALID_IMAGE")
    assert d.get(KEY) is None and (tmp_path / "quarantine" / f"{KEY}.rtk").exists()
