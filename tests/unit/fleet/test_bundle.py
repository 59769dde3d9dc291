"""Bundles: deterministic bytes, verified import, refusal of traversal / links / oversized / altered members,
and never replacing a valid entry with a different one."""

import hashlib
import io
import json
import tarfile
import time
import warnings

import pytest
from fleetkit import cli

from rtckern.cache import CacheWarning, DiskCache, pack
from rtckern.compiler.base import CompiledKernel
from rtckern.fleet import BundleError, Limits, bundle_bytes, export_bundle, import_bundle, verify_bundle
from rtckern.fleet.bundle import INDEX_NAME
from rtckern.prefill import parse_archs


def _ck(i: int) -> CompiledKernel:
    return CompiledKernel(binary=b"\x7fELF" + bytes([i]) * (1000 + i), kind="cubin", lowered_name=f"_Z{i}k")


def _key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _fill(cache: DiskCache, n: int = 4, **meta_extra) -> list[str]:
    keys = []
    for i in range(n):
        arch = ("sm_80", "sm_90", "sm_90a", "sm_86")[i % 4]
        meta = {"op": "axpy" if i % 2 else "gemm", "arch": arch, "kind": "cubin", "compiler": "nvrtc-13.5|h|o",
                "kernel": f"k{i}", "created": time.strftime("%H:%M:%S.") + str(time.time()), "compile_ms": 1.0 + i,
                **meta_extra}
        cache.put(_key(i), _ck(i), meta)
        keys.append(_key(i))
    return keys


def test_bundle_file_is_readable_by_all_whatever_the_umask(tmp_path):
    import os
    import stat

    a = DiskCache(tmp_path / "a")
    _fill(a, 1)
    old = os.umask(0o077)
    try:
        export_bundle(tmp_path / "x.bundle", [a])
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.bundle").stat().st_mode) == 0o644


def test_roundtrip_and_deterministic_bytes(tmp_path):
    a, b = DiskCache(tmp_path / "a"), DiskCache(tmp_path / "b")
    keys = _fill(a)
    time.sleep(0.01)
    _fill(b, compile_ms=99.0, via="remote")  # same entries, other build times and origins
    ra = export_bundle(tmp_path / "a.bundle", [a])
    rb = export_bundle(tmp_path / "b.bundle", [b])
    assert (tmp_path / "a.bundle").read_bytes() == (tmp_path / "b.bundle").read_bytes() and ra["sha256"] == rb["sha256"]
    with tarfile.open(tmp_path / "a.bundle") as tf:
        members = tf.getmembers()
    assert [m.name for m in members] == [INDEX_NAME] + [f"v1/{k[:2]}/{k}.rtk" for k in sorted(keys)]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
    assert (tmp_path / "a.bundle").read_bytes()[4:8] == b"\0\0\0\0"  # gzip header without a time
    dest = DiskCache(tmp_path / "dest")
    r = import_bundle(tmp_path / "a.bundle", dest)
    assert (r["imported"], r["present"], r["kept"]) == (4, 0, 0)
    assert all(dest.get_packed(k) == a.get_packed(k) for k in keys)
    meta = {e.key: e.meta for e in dest.entries()}
    assert meta[keys[1]]["op"] == "axpy" and meta[keys[1]]["via"] == "bundle:a.bundle"
    assert (import_bundle(tmp_path / "b.bundle", dest)["present"]) == 4


def test_export_filters(tmp_path):
    c = DiskCache(tmp_path / "c")
    keys = _fill(c, 8)
    idx = lambda p: set(verify_bundle(p)[0])  # noqa: E731
    export_bundle(tmp_path / "90.bundle", [c], archs=parse_archs("9.0"))
    assert idx(tmp_path / "90.bundle") == {keys[i] for i in (1, 2, 5, 6)}  # sm_90 and sm_90a
    export_bundle(tmp_path / "op.bundle", [c], op="axpy", archs=parse_archs("8.0;8.6"))
    assert idx(tmp_path / "op.bundle") == {keys[3], keys[7]}
    export_bundle(tmp_path / "tc.bundle", [c], toolchain="nvrtc-12.9")
    assert idx(tmp_path / "tc.bundle") == set()
    export_bundle(tmp_path / "keys.bundle", [c], keys=keys[:2])
    assert idx(tmp_path / "keys.bundle") == set(keys[:2])
    with pytest.raises(BundleError, match="1 requested entries are not in the cache"):
        export_bundle(tmp_path / "x.bundle", [c], keys=[keys[0], "f" * 64])


def test_existing_valid_entry_is_never_replaced(tmp_path):
    src, dest = DiskCache(tmp_path / "src"), DiskCache(tmp_path / "dest")
    k0, k1 = _fill(src, 2)
    export_bundle(tmp_path / "b.bundle", [src])
    other = CompiledKernel(b"\x7fELF other build", "cubin", "_Z0k")
    dest.put(k0, other, {})  # valid, different bytes
    dest.put(k1, _ck(1), {})
    dest.entry_path(k1).write_bytes(b"corrupt")  # invalid: may be replaced
    with pytest.warns(CacheWarning, match="1 entries of .* differ from valid entries already in .*kept the existing"):
        r = import_bundle(tmp_path / "b.bundle", dest)
    assert (r["imported"], r["present"], r["kept"]) == (1, 0, 1)
    assert dest.get(k0).binary == other.binary and dest.get(k1).binary == _ck(1).binary


# ---- hostile bundles: refused as a whole, nothing written ----
def _tar(members, gz=True) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz" if gz else "w") as tf:
        for m in members:
            name, data, kind = m if len(m) == 3 else (*m, tarfile.REGTYPE)
            ti = tarfile.TarInfo(name)
            ti.type = kind
            if kind == tarfile.REGTYPE:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            else:
                ti.linkname = data.decode()
                tf.addfile(ti)
    return raw.getvalue()


def _index(entries) -> bytes:
    return json.dumps({"format": "rtckern-bundle/1", "layout": "v1", "count": len(entries), "entries": [
        {"key": k, "path": f"v1/{k[:2]}/{k}.rtk", "size": len(d), "sha256": hashlib.sha256(d).hexdigest(),
         "meta": {}} for k, d in entries]}).encode()


K = _key(1)
GOOD = pack(_ck(1), K)
P = f"v1/{K[:2]}/{K}.rtk"


@pytest.mark.parametrize("members, message", [
    ([(INDEX_NAME, _index([(K, GOOD)])), ("../../etc/evil.rtk", GOOD)], "'../../etc/evil.rtk' is not a bundle path"),
    ([(INDEX_NAME, _index([(K, GOOD)])), (f"/abs/{K}.rtk", GOOD)], "is not a bundle path"),
    ([(INDEX_NAME, _index([(K, GOOD)])), (f"v1/{K[:2]}/../../{K}.rtk", GOOD)], "is not a bundle path"),
    ([(INDEX_NAME, _index([(K, GOOD)])), (P, b"/etc/passwd", tarfile.SYMTYPE)], "is a symbolic link"),
    ([(INDEX_NAME, _index([(K, GOOD)])), (P, INDEX_NAME.encode(), tarfile.LNKTYPE)], "is a hard link"),
    ([(INDEX_NAME, _index([(K, GOOD)])), ("v1", b"", tarfile.DIRTYPE)], "is a directory"),
    ([(INDEX_NAME, _index([(K, GOOD)])), (P, GOOD[:-1] + b"\0")], "does not match its digest in the index"),
    ([(INDEX_NAME, _index([(K, GOOD[:-1] + b"\0")])), (P, GOOD[:-1] + b"\0")], "is not a valid cache entry"),
    ([(INDEX_NAME, _index([])), (P, GOOD)], "is not in the index"),
    ([(INDEX_NAME, _index([(K, GOOD), (_key(2), GOOD)])), (P, GOOD)], "lists 1 entries the archive does not hold"),
    ([(P, GOOD), (INDEX_NAME, _index([(K, GOOD)]))], "the first member is .* not the index"),
    ([(INDEX_NAME, b"{not json")], "is not JSON"),
    ([(INDEX_NAME, _index([(K, GOOD)])), (P, GOOD), (P, GOOD)], "appears twice"),
    ([(INDEX_NAME, _index([(K, GOOD)])), (f"v1/00/{K}.rtk", GOOD)], "wrong shard"),
])
def test_hostile_bundles_are_refused_whole(tmp_path, members, message):
    bad = tmp_path / "bad.bundle"
    bad.write_bytes(_tar(members))
    dest = DiskCache(tmp_path / "dest")
    with pytest.raises(BundleError, match=message):
        import_bundle(bad, dest)
    assert list(dest.entries()) == []


def test_oversized_member_and_not_a_bundle(tmp_path):
    src = DiskCache(tmp_path / "src")
    _fill(src, 2)
    export_bundle(tmp_path / "b.bundle", [src])
    dest = DiskCache(tmp_path / "dest")
    with pytest.raises(BundleError, match=r"is \d+ bytes, above the limit of 100"):
        import_bundle(tmp_path / "b.bundle", dest, Limits(max_member_bytes=100))
    assert list(dest.entries()) == []
    (tmp_path / "junk").write_bytes(b"hello" * 100)
    with pytest.raises(BundleError, match="is not a readable bundle"):
        import_bundle(tmp_path / "junk", dest)
    # Refused as a whole even when only the last member is bad: the first two valid entries are not written.
    good = [(_key(i), pack(_ck(i), _key(i))) for i in range(3)]
    members = [(INDEX_NAME, _index(good))] + [(f"v1/{k[:2]}/{k}.rtk", d) for k, d in sorted(good)]
    members[-1] = (members[-1][0], members[-1][1][:-1] + b"\1")
    (tmp_path / "last.bundle").write_bytes(_tar(members))
    with pytest.raises(BundleError, match="does not match its digest"):
        import_bundle(tmp_path / "last.bundle", dest)
    assert list(dest.entries()) == []
    assert bundle_bytes([(k, d, {}) for k, d in good]) == bundle_bytes([(k, d, {}) for k, d in reversed(good)])


def test_cli_export_import(tmp_path):
    c = DiskCache(tmp_path / "c")
    _fill(c, 4)
    ex = json.loads(cli("cache", "export", "--bundle", str(tmp_path / "x.bundle"), "--arch", "9.0a", "--json",
                        cache=tmp_path / "c").stdout)
    assert ex["entries"] == 2 and ex["bytes"] == (tmp_path / "x.bundle").stat().st_size
    im = json.loads(cli("cache", "import", str(tmp_path / "x.bundle"), "--json", cache=tmp_path / "d").stdout)
    assert (im["entries"], im["imported"]) == (2, 2)
    (tmp_path / "evil.bundle").write_bytes(_tar([(INDEX_NAME, _index([(K, GOOD)])), ("../x.rtk", GOOD)]))
    r = cli("cache", "import", str(tmp_path / "evil.bundle"), cache=tmp_path / "d", check=False)
    assert r.returncode == 2 and "'../x.rtk' is not a bundle path" in r.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(DiskCache(tmp_path / "d").entries())) == 2


def test_bundles_are_signed_with_the_cache_secret(tmp_path):
    from rtckern import config

    src = DiskCache(tmp_path / "src")
    _fill(src, 2)
    (tmp_path / "ours").write_text("a-shared-secret-of-the-fleet-0001")
    (tmp_path / "theirs").write_text("somebody-elses-secret-000000000000")
    with config.override(cache_secret_file=tmp_path / "ours"):
        export_bundle(tmp_path / "signed.bundle", [src])
        assert import_bundle(tmp_path / "signed.bundle", DiskCache(tmp_path / "d1"))["imported"] == 2
    export_bundle(tmp_path / "plain.bundle", [src])
    with config.override(cache_secret_file=tmp_path / "theirs"):
        with pytest.raises(BundleError, match="signature does not verify with this cache secret"):
            import_bundle(tmp_path / "signed.bundle", DiskCache(tmp_path / "d2"))
    with config.override(cache_secret_file=tmp_path / "ours"):
        with pytest.raises(BundleError, match="the bundle is not signed, and a cache secret is set"):
            import_bundle(tmp_path / "plain.bundle", DiskCache(tmp_path / "d3"))
    assert import_bundle(tmp_path / "signed.bundle", DiskCache(tmp_path / "d4"))["imported"] == 2  # no secret here
    assert list(DiskCache(tmp_path / "d2").entries()) == list(DiskCache(tmp_path / "d3").entries()) == []
    r = cli("cache", "import", str(tmp_path / "plain.bundle"), cache=tmp_path / "d5", check=False,
            env={"RTCKERN_CACHE_SECRET_FILE": str(tmp_path / "ours")})
    assert r.returncode != 0 and "Traceback" not in r.stderr and "not signed" in r.stderr
