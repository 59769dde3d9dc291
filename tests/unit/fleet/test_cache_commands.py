"""`rtckern cache ls` filters, `cache prune` by age, size and superseded toolchain, sidecars checked against their
entries (export by arch), and a read-only cache dir (read; housekeeping removes nothing and says so)."""

import hashlib
import json
import os
import time

import pytest

from fleetkit import cli

from rtckern.cache import DiskCache
from rtckern.compiler.base import CompiledKernel


def _current_identity() -> str:
    from rtckern.compiler.nvrtc import NvrtcCompiler

    return NvrtcCompiler().identity()


def _fill(root, rows):
    d = DiskCache(root)
    keys = []
    for i, (op, arch, compiler, age_days) in enumerate(rows):
        key = hashlib.sha256(f"{i}".encode()).hexdigest()
        d.put(key, CompiledKernel(b"\x7fELF" + bytes(1000 * (i + 1)), "cubin", "k"),
              {"op": op, "arch": arch, "compiler": compiler, "name_expression": f"k{i}"})
        t = time.time() - age_days * 86400
        os.utime(d.entry_path(key), (t, t))
        keys.append(key)
    return d, keys


def test_ls_filters(tmp_path):
    cur = _current_identity()
    _, keys = _fill(tmp_path, [("gemm", "sm_90a", cur, 0), ("gemm", "sm_90", cur, 0), ("softmax", "sm_80", cur, 0),
                               ("softmax", "sm_90", "nvrtc-12.8|cuda-headers-12080|-std=c++17", 0)])

    def ls(*a):
        return {r["key"] for r in json.loads(cli("cache", "ls", "--json", *a, cache=tmp_path).stdout)}

    assert ls() == set(keys)
    assert ls("--op", "gemm") == set(keys[:2])
    # --arch names device archs, as in export and prefill: an sm_90 device runs the sm_90 and sm_90a entries
    sm90 = {keys[0], keys[1], keys[3]}
    assert ls("--arch", "9.0") == ls("--arch", "sm_90") == ls("--arch", "90") == ls("--arch", "sm_90a") == sm90
    assert ls("--arch", "8.0;9.0") == set(keys)
    assert ls("--toolchain", "nvrtc-12.8") == {keys[3]}
    assert ls("--op", "softmax", "--toolchain", cur.split("|")[0]) == {keys[2]}
    bad = cli("cache", "ls", "--arch", "hopper", cache=tmp_path, check=False)
    assert bad.returncode == 2 and "unknown arch entry 'hopper'" in bad.stderr


def test_prune_by_age_size_and_superseded_toolchain(tmp_path):
    cur = _current_identity()
    old_tc = "nvrtc-12.8|cuda-headers-12080|-std=c++17"
    d, keys = _fill(tmp_path, [("a", "sm_80", cur, 10), ("b", "sm_80", cur, 0.5), ("c", "sm_80", old_tc, 0),
                               ("d", "sm_80", "hiprtc-6.2", 0), ("e", "sm_80", cur, 0)])

    def prune(*a):
        return json.loads(cli("cache", "prune", "--json", *a, cache=tmp_path).stdout)

    assert prune("--older-than-days", "2")["removed"] == 1  # a, unused for 10 days
    assert prune("--superseded")["removed"] == 1  # c: another NVRTC; hiprtc entries are not NVRTC's to judge
    left = {e.key for e in d.entries()}
    assert left == {keys[1], keys[3], keys[4]}
    sizes = {e.key: e.size for e in d.entries()}
    # size: least recently used go first (b is the oldest of the rest)
    r = prune("--max-bytes", str(sizes[keys[3]] + sizes[keys[4]]))
    assert r["removed"] == 1 and {e.key for e in d.entries()} == {keys[3], keys[4]}
    assert r["bytes"] == sizes[keys[3]] + sizes[keys[4]]


# ---- sidecars are checked, not trusted ----
def _real_entries(cache):
    """Real cubins of one kernel for sm_80 and sm_90, with correct sidecars: {arch: key}."""
    from rtckern.arch import Arch
    from rtckern.manager import KernelManager
    from rtckern.spec import KernelSpec

    m = KernelManager(cache, remote=None)
    keys = {}
    for arch in ("sm_80", "sm_90"):
        spec = KernelSpec("core/axpy.cuh", "axpy", Arch.parse(arch), template_args=("float",), op="core")
        m.compile(spec)
        keys[arch] = m.key(spec)
    return keys


def test_export_by_arch_reads_the_arch_from_the_binary_not_a_wrong_sidecar(tmp_path):
    """The issue's case: a sidecar saying sm_90 on an sm_80 cubin made `export --arch 9.0` ship the sm_80 cubin
    and miss the real sm_90 entry. Here both sidecars lie (consistent key, size and digest, as an import of a
    hand-made bundle writes them)."""
    from rtckern.fleet import verify_bundle

    cache = tmp_path / "cache"
    keys = _real_entries(cache)
    d = DiskCache(cache)
    for arch, other in (("sm_80", "sm_90"), ("sm_90", "sm_80")):
        m = json.loads(d.meta_path(keys[arch]).read_text())
        d.meta_path(keys[arch]).write_text(json.dumps(dict(m, arch=other)))
    r = cli("cache", "export", "--bundle", str(tmp_path / "b.bundle"), "--arch", "9.0", "--json", cache=cache)
    assert json.loads(r.stdout)["entries"] == 1
    index, _ = verify_bundle(tmp_path / "b.bundle")
    assert list(index) == [keys["sm_90"]] and index[keys["sm_90"]]["meta"] == {"arch": "sm_90", "kind": "cubin"}
    ls = json.loads(cli("cache", "ls", "--arch", "9.0", "--json", cache=cache).stdout)
    assert [row["key"] for row in ls] == [keys["sm_90"]]
    v = cli("cache", "verify", "--keep", "--json", cache=cache, check=False)
    assert v.returncode == 1
    assert sorted((b["key"], b["reason"]) for b in json.loads(v.stdout)["bad_sidecars"]) == sorted([
        (keys["sm_80"], "it says arch 'sm_90', the binary is for sm_80"),
        (keys["sm_90"], "it says arch 'sm_80', the binary is for sm_90")])
    v = cli("cache", "verify", cache=cache)  # removes the two sidecars, keeps the entries
    assert "bad sidecars 2" in v.stdout and "cleaned 2" in v.stdout
    assert cli("cache", "verify", "--keep", cache=cache).returncode == 0 and len(list(d.entries())) == 2


# ---- a read-only cache: read, and never claimed cleaned ----
def _can_bind_read_only() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind -o ro /tmp /tmp"], capture_output=True)
    return r.returncode == 0


def _in_read_only_mount(path, *argv, **kw):
    """Run ``argv`` in a private mount namespace where ``path`` is a read-only bind mount of itself: a really
    read-only filesystem (EROFS), which root cannot write either (chmod would not stop root)."""
    import shlex

    inner = f"mount --bind -o ro {shlex.quote(str(path))} {shlex.quote(str(path))} && exec " + shlex.join(argv)
    return ["unshare", "-m", "sh", "-c", inner]


@pytest.mark.skipif(not _can_bind_read_only(), reason="needs unshare -m and mount (root in a mount namespace)")
def test_read_only_cache_dir_is_read_and_housekeeping_removes_nothing(tmp_path):
    import subprocess
    import sys

    from fleetkit import ROOT, UNIT

    cache = tmp_path / "cache"
    keys = _real_entries(cache)
    d = DiskCache(cache)
    d.entry_path(keys["sm_80"]).write_bytes(b"junk")  # something verify would remove
    stale = d.entry_path(keys["sm_90"]).parent / ".x.rtk.dead.tmp"
    stale.write_bytes(b"x")
    os.utime(stale, (1, 1))
    before = sorted((str(p), p.stat().st_mtime_ns) for p in cache.rglob("*"))
    env = dict(os.environ, RTCKERN_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([str(UNIT), str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def run(*argv):
        return subprocess.run(_in_read_only_mount(cache, *argv), capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=300)

    code = ("import warnings; warnings.simplefilter('always')\n"
            "from rtckern.arch import Arch; from rtckern.manager import KernelManager; from rtckern.spec import "
            "KernelSpec\nm = KernelManager(remote=None)\n"
            "m.compile(KernelSpec('core/axpy.cuh', 'axpy', Arch.parse('sm_90'), template_args=('float',), op='core'))\n"
            "print(m.stats.compiles, m.stats.tiers['disk'].hits)\n")
    r = run(sys.executable, "-c", code)
    assert r.stdout.split() == ["0", "1"], r.stderr  # served from the read-only cache, not recompiled
    assert f"cache directory {cache} is read-only" in r.stderr and "serving the entries in it" in r.stderr
    v = run(sys.executable, "-m", "rtckern", "cache", "verify", "--json")
    rep = json.loads(v.stdout)
    assert v.returncode == 1 and (rep["corrupt"], rep["removed"], rep["stale_temp_files"], rep["cleaned"],
                                  rep["read_only"]) == (1, 0, 1, 0, True)
    v = run(sys.executable, "-m", "rtckern", "cache", "verify")
    assert f"; {cache} is read-only: nothing removed" in v.stdout
    p = run(sys.executable, "-m", "rtckern", "cache", "prune", "--max-bytes", "0", "--json")
    rep = json.loads(p.stdout)
    assert p.returncode == 1 and (rep["removed"], rep["would_remove"], rep["read_only"]) == (0, 2, True)
    c = run(sys.executable, "-m", "rtckern", "cache", "clear")
    assert c.returncode == 1 and c.stdout.strip() == f"removed 0 of 2 entries; {cache} is read-only: nothing removed"
    assert sorted((str(p), p.stat().st_mtime_ns) for p in cache.rglob("*")) == before


def test_prune_superseded_and_clear_remove_memos(tmp_path):
    """`prune --superseded` removes the memos of tuning tables as they no longer are and keeps the current ones, in
    the cache it is given (`--cache-dir`, whatever RTCKERN_CACHE_DIR and RTCKERN_DISK_CACHE say); `clear` removes every
    memo (the next process derives them again)."""
    from rtckern import config, tuning

    cache = tmp_path / "cache"
    _fill(cache, [("a", "sm_80", _current_identity(), 0)])
    with config.override(cache_dir=cache):
        for op in ("norm_fwd", "softmax"):
            tuning.load_table(tuning.shipped_table_path(op), op, check_rows=False)
    current = {p.name for p in (cache / "tables").iterdir()}
    assert len(current) == 2 and current <= tuning.shipped_memo_names()
    stale = cache / "tables" / "norm_fwd-0123456789abcdef0123456789abcdef.marshal"
    stale.write_bytes(b"an older table's memo")
    (cache / "toolchain").mkdir(exist_ok=True)
    (cache / "toolchain" / "cuda-h-0123.json").write_text("{}")
    r = json.loads(cli("cache", "--cache-dir", str(cache), "prune", "--superseded", "--json", cache=tmp_path / "other",
                       env={"RTCKERN_DISK_CACHE": "0"}).stdout)
    assert r["memos_removed"] == 1 and {p.name for p in (cache / "tables").iterdir()} == current
    memos = [p for d in ("tables", "toolchain") for p in (cache / d).iterdir()]  # the commands' own too
    r = json.loads(cli("cache", "clear", "--yes", "--json", cache=cache).stdout)
    assert r["memos_removed"] == len(memos) >= 3 and not any((cache / "tables").iterdir()) and \
        not any((cache / "toolchain").iterdir())
