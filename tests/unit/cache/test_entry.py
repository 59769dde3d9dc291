"""Cache entries are bound to their key: an entry of one kernel placed under another kernel's key (a file copy, a
swapped bundle member, a malformed header with a valid digest) is a miss with one warning, quarantined and
recompiled, never served; `cache verify` lists it and `cache import` refuses it."""

import hashlib
import json
import struct
import sys
import warnings
from pathlib import Path

import pytest

from rtckern.arch import Arch
from rtckern.cache import CacheWarning, DiskCache, pack, unpack
from rtckern.cache import entry as entry_format
from rtckern.cache.entry import InvalidEntry
from rtckern.compiler.base import CompiledKernel
from rtckern.manager import KernelManager
from rtckern.spec import KernelSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fleet"))
from fleetkit import cli  # noqa: E402

CK = CompiledKernel(binary=b"\x7fELF" + bytes(range(256)) * 4, kind="cubin", lowered_name="_Z1kv")
KA, KB = "a" * 64, "b" * 64


def _forge(header_bytes: bytes, binary: bytes = b"\x7fELFxx") -> bytes:
    """An entry whose digest is valid but whose header is whatever the test gives."""
    body = struct.pack("<I", len(header_bytes)) + header_bytes + binary
    return entry_format._HEAD.pack(entry_format.MAGIC, entry_format.FORMAT, hashlib.sha256(body).digest(),
                                   len(body)) + body


MALFORMED = {
    "not json": b"{nope",
    "not an object": b"[1, 2]",
    "no key": json.dumps({"kind": "cubin", "lowered_name": "k"}).encode(),
    "key not a string": json.dumps({"key": 5, "kind": "cubin", "lowered_name": "k"}).encode(),
    "unknown kind": json.dumps({"key": KA, "kind": "exe", "lowered_name": "k"}).encode(),
    "spec not an object": json.dumps({"key": KA, "kind": "cubin", "lowered_name": "k", "spec": [1]}).encode(),
    "not utf-8": b"\xff\xfe{}",
    "nested too deep": b"[" * 200_000 + b"]" * 200_000,  # json.loads raises RecursionError, not ValueError
}


def test_pack_binds_the_key_and_unpack_checks_it():
    data = pack(CK, KA, {"name_expression": "k", "arch": "sm_90"})
    assert unpack(data, KA) == CK
    assert entry_format.header(data)["spec"] == {"name_expression": "k", "arch": "sm_90"}
    with pytest.raises(InvalidEntry, match=r"bound to key aaaaaaaaaaaaaaaa… \(k\), read under key bbbbbbbbbbbbbbbb…"):
        unpack(data, KB)


@pytest.mark.parametrize("what", list(MALFORMED))
def test_malformed_header_with_valid_digest_is_invalid_not_a_crash(what):
    with pytest.raises(InvalidEntry, match="bad header"):
        unpack(_forge(MALFORMED[what]), KA)


def test_header_length_past_the_body_is_invalid():
    body = struct.pack("<I", 10_000) + b"{}"
    data = entry_format._HEAD.pack(entry_format.MAGIC, entry_format.FORMAT, hashlib.sha256(body).digest(),
                                   len(body)) + body
    with pytest.raises(InvalidEntry, match="runs past the body"):
        unpack(data, KA)


def _two_kernels(cache_dir):
    m = KernelManager(cache_dir, remote=None)
    f = KernelSpec("core/axpy.cuh", "axpy", Arch.parse("sm_80"), template_args=("float",), op="core")
    h = KernelSpec("core/axpy.cuh", "axpy", Arch.parse("sm_80"), template_args=("rtk_half",), op="core")
    return m, f, h, m.compile(f), m.compile(h)


def test_entry_copied_under_another_key_is_quarantined_and_recompiled(cache_dir):
    m, f, h, ck_f, ck_h = _two_kernels(cache_dir)
    kf, kh = m.key(f), m.key(h)
    m.disk.entry_path(kf).write_bytes(m.disk.entry_path(kh).read_bytes())  # a restore mix-up: half under float
    m2 = KernelManager(cache_dir, remote=None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = m2.compile(f)
    msgs = [str(x.message) for x in w if issubclass(x.category, CacheWarning)]
    assert len(msgs) == 1 and "bound to key" in msgs[0] and "quarantined" in msgs[0], msgs
    assert got.binary == ck_f.binary and m2.stats.compiles == 1
    assert (cache_dir / "quarantine" / f"{kf}.rtk").read_bytes() == pack(ck_h, kh, entry_format.identity(
        m._meta(h, ck_h, "compile")))
    assert m2.disk.get(kf).binary == ck_f.binary  # the recompiled entry replaced it


def test_cache_verify_lists_entries_bound_to_another_key_and_bad_headers(cache_dir):
    m, f, h, _, _ = _two_kernels(cache_dir)
    kf, kh = m.key(f), m.key(h)
    m.disk.entry_path(kf).write_bytes(m.disk.entry_path(kh).read_bytes())
    odd = "c" * 64
    p = m.disk.entry_path(odd)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(_forge(MALFORMED["no key"]))
    r = json.loads(cli("cache", "verify", "--keep", "--json", cache=cache_dir, check=False).stdout)
    reasons = {b["key"]: b["reason"] for b in r["bad"]}
    assert r["checked"] == 3 and r["corrupt"] == 2
    assert "bound to key" in reasons[kf] and "bad header" in reasons[odd]


def test_bundle_with_swapped_members_and_a_consistent_index_is_refused(tmp_path):
    from test_bundle import _index, _tar

    from rtckern.fleet import BundleError, import_bundle
    from rtckern.fleet.bundle import INDEX_NAME

    a, b = pack(CK, KA), pack(CompiledKernel(b"\x7fELFother", "cubin", "_Z1kv"), KB)
    swapped = [(KA, b), (KB, a)]  # each member's bytes are the other key's entry; the index agrees with them
    members = [(INDEX_NAME, _index(swapped))] + [(f"v1/{k[:2]}/{k}.rtk", d) for k, d in swapped]
    (tmp_path / "swap.bundle").write_bytes(_tar(members))
    dest = DiskCache(tmp_path / "dest")
    with pytest.raises(BundleError, match=r"is not a valid cache entry \(bound to key bbbb"):
        import_bundle(tmp_path / "swap.bundle", dest)
    assert list(dest.entries()) == []
    r = cli("cache", "import", str(tmp_path / "swap.bundle"), cache=tmp_path / "dest2", check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "bound to key" in r.stderr


# ---- authenticity: a shared secret signs what crosses machines ----
def test_sealed_entries_verify_only_with_the_secret():
    data = pack(CK, KA)
    sealed = entry_format.seal(data, KA, b"s" * 32)
    assert entry_format.open_sealed(sealed, KA, b"s" * 32) == data
    assert entry_format.open_sealed(sealed, KA, None) == data  # no secret here: integrity checks still apply
    assert entry_format.open_sealed(data, KA, None) == data
    with pytest.raises(InvalidEntry, match=r"signature does not verify with this cache secret"):
        entry_format.open_sealed(sealed, KA, b"t" * 32)
    with pytest.raises(InvalidEntry, match=r"signature does not verify"):  # a signature made for another key
        entry_format.open_sealed(entry_format.seal(data, KB, b"s" * 32), KA, b"s" * 32)
    with pytest.raises(InvalidEntry, match=r"not signed, and a cache secret is set"):
        entry_format.open_sealed(data, KA, b"s" * 32)


def test_secret_file_is_read_and_checked(tmp_path):
    from rtckern.cache.secret import read_secret
    from rtckern.errors import ConfigError

    assert read_secret(None) is None
    (tmp_path / "s").write_text("  0123456789abcdef0123  \n")
    assert read_secret(tmp_path / "s") == b"0123456789abcdef0123"
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ConfigError, match=r"RTCKERN_CACHE_SECRET_FILE=.*short: the secret is 3 bytes; use at least 16"):
        read_secret(tmp_path / "short")
    with pytest.raises(ConfigError, match=r"RTCKERN_CACHE_SECRET_FILE=.*nope: cannot read it"):
        read_secret(tmp_path / "nope")


def test_an_entry_the_driver_refuses_in_a_layer_is_passed_over_not_the_good_local_copy(tmp_path, monkeypatch):
    """A read-only layer serves an image the driver refuses: the first process recompiles into its local cache and
    marks the layer's entry refused on this machine; later processes load the local copy (no compile, nothing
    quarantined), and the layer is left as it is."""
    import rtckern.runtime
    from rtckern.device import DeviceInfo
    from rtckern.errors import LoadError

    builder = KernelManager(tmp_path / "builder", remote=None)
    f = KernelSpec("core/axpy.cuh", "axpy", Arch.parse("sm_80"), template_args=("float",), op="core")
    key, good = builder.key(f), builder.compile(f)
    bad = CompiledKernel(b"\x7fELF refused by this driver", "cubin", good.lowered_name)
    layer = DiskCache(tmp_path / "layer")
    layer.put_packed(key, pack(bad, key), {"arch": "sm_80"})
    layer_bytes = layer.entry_path(key).read_bytes()

    def load_kernel(binary, kind, name, info, label):
        if binary == bad.binary:
            e = LoadError("CUDA_ERROR_INVALID_IMAGE")
            e.refused = True
            raise e
        return ("loaded", binary)

    monkeypatch.setattr(rtckern.runtime, "load_kernel", load_kernel)
    monkeypatch.setattr(DeviceInfo, "from_device", staticmethod(lambda o: DeviceInfo.for_arch("sm_80", ordinal=o)))
    for n in range(3):  # three processes on one machine
        m = KernelManager(tmp_path / "local", layers=(tmp_path / "layer",), remote=None)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert m.get(f, 0) == ("loaded", good.binary)
        msgs = [str(x.message) for x in w if issubclass(x.category, CacheWarning)]
        assert m.stats.compiles == (1 if n == 0 else 0), n
        assert len(msgs) == (1 if n == 0 else 0) and (n or "read-only layer" in msgs[0]), msgs
        assert not (tmp_path / "local" / "quarantine" / f"{key}.rtk").exists()  # the good local copy stays
    assert layer.entry_path(key).read_bytes() == layer_bytes
