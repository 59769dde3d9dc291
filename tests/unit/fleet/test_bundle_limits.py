"""Bundles that must be refused with one line and nothing written (issue 20): truncated downloads, malformed
indexes, compression bombs (expansion ratio and total from RTCKERN_BUNDLE_MAX_RATIO / RTCKERN_BUNDLE_MAX_BYTES),
and export into a directory."""

import hashlib
import io
import json
import re
import tarfile

import pytest
from fleetkit import cli

from rtckern import config
from rtckern.cache import DiskCache, pack
from rtckern.compiler.base import CompiledKernel
from rtckern.errors import BundleError, ConfigError
from rtckern.fleet import Limits, export_bundle, import_bundle, verify_bundle
from rtckern.fleet.bundle import INDEX_NAME


def _ck(i: int, size: int = 1000) -> CompiledKernel:
    return CompiledKernel(binary=b"\x7fELF" + bytes([i]) * (size + i), kind="cubin", lowered_name=f"_Z{i}k")


def _key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _tar(members) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return raw.getvalue()


def _record(k: str, d: bytes) -> dict:
    return {"key": k, "path": f"v1/{k[:2]}/{k}.rtk", "size": len(d), "sha256": hashlib.sha256(d).hexdigest(),
            "meta": {}}


def _bundle(path, members, **index_changes):
    index = {"format": "rtckern-bundle/1", "layout": "v1", "count": len(members),
             "entries": [_record(k, d) for k, d in members], **index_changes}
    path.write_bytes(_tar([(INDEX_NAME, json.dumps(index).encode())]
                          + [(f"v1/{k[:2]}/{k}.rtk", d) for k, d in sorted(members)]))
    return path


def one_line_refusal(r, match: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(match, r.stderr), r.stderr


@pytest.fixture
def exported(tmp_path):
    src = DiskCache(tmp_path / "src")
    for i in range(3):
        src.put(_key(i), _ck(i, 20000), {"op": "axpy", "arch": "sm_90"})
    export_bundle(tmp_path / "good.bundle", [src])
    return tmp_path / "good.bundle"


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
def test_truncated_bundle_is_one_line_and_writes_nothing(tmp_path, exported, cut):
    data = exported.read_bytes()
    part = tmp_path / "partial.bundle"
    part.write_bytes(data[:int(len(data) * cut)])
    dest = DiskCache(tmp_path / "dest")
    with pytest.raises(BundleError, match=r"partial.bundle: truncated or damaged archive \(.*\); download it "
                                          r"again or export it again"):
        import_bundle(part, dest)
    r = cli("cache", "import", str(part), cache=tmp_path / "dest", check=False)
    one_line_refusal(r, r"^rtckern cache: .*partial.bundle: truncated or damaged archive")
    assert list(dest.entries()) == []


@pytest.mark.parametrize("change, message", [
    ({"entries": [1, "x", None], "count": 3}, r"index entry 0 is int 1, not an object with key, path, size, sha256"),
    ({"entries": ["x"], "count": 1}, r"index entry 0 is str 'x', not an object"),
    ({"entries": {"a": 1}}, r"index entries is dict, not a list of objects"),
    ({"count": 7}, r"index count 7 but it lists 1 entries"),
    ({"extra": 1}, r"index has fields \['count', 'entries', 'extra', 'format', 'layout'\]"),
    ({"layout": "v2"}, r"layout 'v2'; rtckern-bundle/1 has .* and layout 'v1'"),
])
def test_malformed_index_is_refused(tmp_path, change, message):
    bad = _bundle(tmp_path / "bad.bundle", [(_key(1), pack(_ck(1), _key(1)))], **change)
    with pytest.raises(BundleError, match=message):
        verify_bundle(bad)
    one_line_refusal(cli("cache", "import", str(bad), cache=tmp_path / "dest", check=False), message)
    assert list(DiskCache(tmp_path / "dest").entries()) == []


@pytest.mark.parametrize("field, value, message", [
    ("meta", [1], r"has fields .* and meta fields list; a bundle entry has"),
    ("meta", {"digest": "x"}, r"and meta fields \['digest'\]; a bundle entry has .* meta fields among op, kernel"),
    ("size", "12", r"has a bad size or sha256 \('12', "),
    ("sha256", None, r"has a bad size or sha256 \(\d+, None\)"),
    ("key", 5, r"index entry 0 has a bad key or path \(5, "),
])
def test_malformed_index_entry_is_refused(tmp_path, field, value, message):
    k, d = _key(1), pack(_ck(1), _key(1))
    rec = dict(_record(k, d), **{field: value})
    (tmp_path / "bad.bundle").write_bytes(_tar([(INDEX_NAME, json.dumps(
        {"format": "rtckern-bundle/1", "layout": "v1", "entries": [rec]}).encode()), (f"v1/{k[:2]}/{k}.rtk", d)]))
    with pytest.raises(BundleError, match=message):
        import_bundle(tmp_path / "bad.bundle", DiskCache(tmp_path / "dest"))
    assert list(DiskCache(tmp_path / "dest").entries()) == []


def test_compression_bomb_is_refused_before_anything_is_written(tmp_path):
    # Valid entries, each 8 MiB of one byte: the bundle is ~30 KB, its entries 1000x that.
    entries = [(_key(i), pack(_ck(i, 8 << 20), _key(i))) for i in range(3)]
    bomb = _bundle(tmp_path / "bomb.bundle", entries)
    assert bomb.stat().st_size * 100 < 3 * (8 << 20)
    dest = DiskCache(tmp_path / "dest")
    with pytest.raises(BundleError, match=rf"bomb.bundle: members add up to more than 100 times the bundle's "
                                          rf"{bomb.stat().st_size} bytes \(RTCKERN_BUNDLE_MAX_RATIO; a compression "
                                          r"bomb\?\); refusing it"):
        import_bundle(bomb, dest)
    one_line_refusal(cli("cache", "import", str(bomb), cache=tmp_path / "dest", check=False),
                     r"^rtckern cache: .*more than 100 times the bundle's")
    assert list(dest.entries()) == []
    # The settings raise the ratio (env var in a real process; config.override in process) ...
    ok = cli("cache", "import", str(bomb), "--json", cache=tmp_path / "dest",
             env={"RTCKERN_BUNDLE_MAX_RATIO": "100000"})
    assert json.loads(ok.stdout)["imported"] == 3
    # ... and cap the total whatever the ratio.
    with config.override(bundle_max_ratio=100000, bundle_max_bytes=10 << 20):
        with pytest.raises(BundleError, match=rf"more than {10 << 20} bytes, the limit \(RTCKERN_BUNDLE_MAX_BYTES\)"):
            verify_bundle(bomb)
    one_line_refusal(cli("cache", "import", str(bomb), cache=tmp_path / "d2", check=False,
                         env={"RTCKERN_BUNDLE_MAX_RATIO": "100000", "RTCKERN_BUNDLE_MAX_BYTES": "2000000"}),
                     r"more than 2000000 bytes, the limit \(RTCKERN_BUNDLE_MAX_BYTES\)")
    assert list(DiskCache(tmp_path / "d2").entries()) == []


def test_small_bundles_pass_the_ratio_floor(tmp_path):
    # 1 MiB of zeros in a ~1 KB bundle: above 100x, below the floor every bundle may expand to.
    small = _bundle(tmp_path / "s.bundle", [(_key(1), pack(_ck(1, 900_000), _key(1)))])
    assert import_bundle(small, DiskCache(tmp_path / "dest"))["imported"] == 1


def test_bad_limit_settings_are_config_errors(tmp_path, exported):
    with config.override(bundle_max_ratio=0):
        with pytest.raises(ConfigError, match=r"RTCKERN_BUNDLE_MAX_RATIO=0 must be at least 1; unset it for the "
                                              r"default \(100\)"):
            verify_bundle(exported)
    assert Limits.from_settings(max_member_bytes=5) == Limits(max_member_bytes=5)


def test_export_into_a_directory_and_import_of_a_directory(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(BundleError, match=rf"--bundle {re.escape(str(tmp_path / 'out'))} is a directory; give a "
                                          r"file path, e.g. .*rtckern.bundle"):
        export_bundle(tmp_path / "out", [DiskCache(tmp_path / "c")])
    one_line_refusal(cli("cache", "import", str(tmp_path / "out"), cache=tmp_path / "c", check=False),
                     r"out: a directory; give a bundle file")
    one_line_refusal(cli("cache", "import", str(tmp_path / "nope.bundle"), cache=tmp_path / "c", check=False),
                     r"nope.bundle: no such file; give a bundle file")


def test_a_plain_tar_or_empty_file_is_one_line(tmp_path):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tf:
        tf.addfile(tarfile.TarInfo(INDEX_NAME))
    (tmp_path / "plain.tar").write_bytes(raw.getvalue())
    (tmp_path / "empty").write_bytes(b"")
    for name, why in (("plain.tar", "not a gzip file"), ("empty", "empty file")):
        one_line_refusal(cli("cache", "import", str(tmp_path / name), cache=tmp_path / "c", check=False),
                         rf"{name} is not a readable bundle \({why}\); make one with `rtckern cache export --bundle`$")


def _gz(raw: bytes) -> bytes:
    import gzip

    return gzip.compress(raw, mtime=0)


def test_header_bombs_are_refused_by_the_inflated_size(tmp_path):
    """A GNU long-name header declaring 64 MiB (tarfile reads such a header whole into memory, before any member
    size is checked) is refused as soon as the inflated stream holds more than the members' checked bytes, their
    headers and the reader's look-ahead: after a few hundred KB, long before the 64 MiB are read."""
    ti = tarfile.TarInfo("././@LongLink")
    ti.type, ti.size = tarfile.GNUTYPE_LONGNAME, 64 << 20
    raw = ti.tobuf(tarfile.GNU_FORMAT) + bytes(64 << 20)
    bomb = tmp_path / "bomb.bundle"
    bomb.write_bytes(_gz(raw))
    assert bomb.stat().st_size < 1 << 20
    from rtckern.fleet import bundle as B

    seen = []
    real = B._Inflated.readinto
    monkey = pytest.MonkeyPatch()
    monkey.setattr(B._Inflated, "readinto", lambda self, b: (seen.append(self.count), real(self, b))[1])
    try:
        with pytest.raises(BundleError, match=r"bomb.bundle: the archive holds \d+ bytes more than its members"):
            verify_bundle(bomb)
    finally:
        monkey.undo()
    assert max(seen) < 1 << 20  # refused within the first MiB of the stream


@pytest.mark.parametrize("kind", ["pax", "sparse"])
def test_extended_and_sparse_members_are_refused(tmp_path, kind):
    k, d = _key(1), pack(_ck(1), _key(1))
    index = json.dumps({"format": "rtckern-bundle/1", "layout": "v1", "entries": [_record(k, d)]}).encode()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT if kind == "pax" else tarfile.GNU_FORMAT) \
            as tf:
        for name, data in ((INDEX_NAME, index), (f"v1/{k[:2]}/{k}.rtk", d)):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            if name != INDEX_NAME:
                if kind == "pax":
                    ti.pax_headers = {"comment": "x"}
                else:
                    ti.type = tarfile.GNUTYPE_SPARSE
            tf.addfile(ti, io.BytesIO(data))
    bad = tmp_path / "bad.bundle"
    bad.write_bytes(_gz(raw.getvalue()))
    with pytest.raises(BundleError, match=r"is a (file with pax or GNU extended headers|sparse file); a bundle holds "
                                          r"plain \(ustar\) regular files only"):
        import_bundle(bad, DiskCache(tmp_path / "dest"))
    assert list(DiskCache(tmp_path / "dest").entries()) == []


@pytest.mark.parametrize("meta, message", [
    ({"compiler": None}, r"has meta compiler=None; it must be a string"),
    ({"name_expression": ["x"]}, r"has meta name_expression=\['x'\]; it must be a string"),
    ({"defines": [["A"]]}, r"has meta defines=\[\['A'\]\]; it must be a list of \[name, value\] string pairs"),
    ({"options": "-O3"}, r"has meta options='-O3'; it must be a list of strings"),
])
def test_meta_values_of_the_wrong_type_are_refused(tmp_path, meta, message):
    """The cache's readers (ls, export --toolchain, prune --superseded) take the sidecar's values as the manager
    writes them: a bundle whose meta says otherwise is refused at import."""
    k, d = _key(1), pack(_ck(1), _key(1))
    bad = _bundle(tmp_path / "bad.bundle", [(k, d)], entries=[dict(_record(k, d), meta=meta)])
    with pytest.raises(BundleError, match=message):
        import_bundle(bad, DiskCache(tmp_path / "dest"))
    assert list(DiskCache(tmp_path / "dest").entries()) == []


def test_a_bundle_rewritten_during_import_is_refused(tmp_path, exported, monkeypatch):
    """Verification and import read one open file: a bundle rewritten in place between the passes (a download into
    the same path) is refused, never imported in part with success."""
    from rtckern.fleet import bundle as B

    real = B._verify
    short = exported.read_bytes()[:len(exported.read_bytes()) // 2]

    def verify_then_rewrite(f, p, limits):
        out = real(f, p, limits)
        with open(p, "r+b") as w:  # the same file, cut short
            w.write(short)
            w.truncate()
        return out

    monkeypatch.setattr(B, "_verify", verify_then_rewrite)
    with pytest.raises(BundleError):
        import_bundle(exported, DiskCache(tmp_path / "dest"))


def test_an_entry_that_lost_its_sidecar_gets_it_back(tmp_path, exported):
    """An entry whose sidecar is gone (a crash between the two writes, before the sidecar came first) counts as
    present on a second import, which writes the sidecar again: a re-export gives the same bytes."""
    dest = DiskCache(tmp_path / "dest")
    import_bundle(exported, dest)
    key = next(iter(dest.entries())).key
    dest.meta_path(key).unlink()
    r = import_bundle(exported, dest)
    assert r["present"] == 3 and dest.meta_path(key).is_file()
    export_bundle(tmp_path / "again.bundle", [dest])
    assert (tmp_path / "again.bundle").read_bytes() == exported.read_bytes()
