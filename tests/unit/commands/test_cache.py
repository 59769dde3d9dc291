"""`rtckern cache`: commands that read or tidy a cache create no directory ("no cache at DIR"), `ls` aligns its
columns and never cuts a kernel name silently, sizes take suffixes, `prune` without options and `clear`'s question
on a terminal. Real `python -m rtckern` processes."""
from __future__ import annotations

import hashlib
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from rtckern.cache import DiskCache
from rtckern.compiler.base import CompiledKernel

REPO = Path(__file__).resolve().parents[3]


def rtckern(*args: str, cache: Path, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO), RTCKERN_CACHE_DIR=str(cache), **(env or {}))
    e.pop("RTCKERN_CACHE_MAX_BYTES", None) if "RTCKERN_CACHE_MAX_BYTES" not in (env or {}) else None
    return subprocess.run([sys.executable, "-m", "rtckern", *args], capture_output=True, text=True, env=e,
                          timeout=300, cwd=REPO, **kw)


def fill(root: Path, names: list[str], arch: str = "sm_90") -> list[str]:
    d = DiskCache(root)
    keys = []
    for i, name in enumerate(names):
        key = hashlib.sha256(name.encode()).hexdigest()
        d.put(key, CompiledKernel(b"\x7fELF" + bytes(1000 * (i + 1)), "cubin", "k"),
              {"op": "rms_norm", "arch": arch, "compiler": "nvrtc-13.0|h|o", "name_expression": name})
        keys.append(key)
    return keys


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("argv", [["cache", "stats"], ["cache", "ls"], ["cache", "verify"], ["cache", "clear", "--yes"],
                                  ["cache", "prune", "--max-bytes", "0"],
                                  ["cache", "export", "--bundle", "{tmp}/out.bundle"]])
def test_a_missing_or_mistyped_cache_dir_is_reported_not_created(tmp_path, argv):
    argv = [a.format(tmp=tmp_path) for a in argv]
    missing = tmp_path / "no" / "cache"
    r = rtckern(*argv, cache=missing)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"rtckern cache: no cache at {missing} "), r.stderr
    assert not (tmp_path / "no").exists()
    # a directory that exists but holds no cache (a mistyped --cache-dir) is left as it was
    r = rtckern(*argv[:2], "--cache-dir", str(tmp_path), *argv[2:], cache=missing)
    assert r.returncode == 2 and f"no cache at {tmp_path} " in r.stderr and tree(tmp_path) == []


def test_info_on_a_missing_cache_dir_says_so_and_creates_nothing(tmp_path):
    missing = tmp_path / "no" / "cache"
    r = rtckern("info", cache=missing, env={"RTCKERN_CACHE_LAYERS": str(tmp_path / "layer")})
    assert r.returncode == 0, r.stderr
    assert f"disk cache: no cache at {missing}" in r.stdout
    assert f"read-only layer: no cache at {tmp_path / 'layer'}" in r.stdout
    assert tree(tmp_path) == []


def test_ls_aligns_columns_and_marks_cut_kernel_names(tmp_path):
    common = "rtk_norm_fwd<rtk_bf16, float, rtk_bf16, 8, 1024, 4, true, false, false, true, "
    names = [common + "1>", common + "2>", "axpy<float>"]
    fill(tmp_path, names)
    lines = rtckern("cache", "ls", cache=tmp_path).stdout.splitlines()
    header, rule, rows = lines[0], lines[1], lines[2:]
    assert header.split() == ["key", "op", "kernel", "arch", "size", "compiler", "last", "used"]
    kernels = [r[header.index("kernel"):header.index("arch")].rstrip() for r in rows]
    assert "axpy<float>" in kernels  # text left-aligned: starts at the column's start
    cut = sorted(k for k in kernels if k != "axpy<float>")
    assert len(cut) == 2 and cut[0] != cut[1] and all("…" in k and k.endswith(("1>", "2>")) for k in cut)
    size_end = header.index("size") + len("size")
    sizes = [r[:size_end].rsplit("  ", 1)[-1] for r in rows]
    assert all(s.endswith("KiB") and len(r) > size_end and r[size_end] == " " for s, r in zip(sizes, rows))
    wide = rtckern("cache", "ls", "--wide", cache=tmp_path).stdout
    assert all(n in wide for n in names) and "…" not in wide
    assert {r["kernel"] for r in json.loads(rtckern("cache", "ls", "--json", cache=tmp_path).stdout)} == set(names)


def test_arch_means_device_archs_in_ls_and_export(tmp_path):
    cache = tmp_path / "c"
    plain = fill(cache, ["a"], "sm_90")
    specific = fill(cache, ["b"], "sm_90a")
    other = fill(cache, ["c"], "sm_80")
    for arch in ("9.0", "sm_90a", "90"):
        ls = {r["key"] for r in json.loads(rtckern("cache", "ls", "--arch", arch, "--json", cache=cache).stdout)}
        out = tmp_path / f"{arch}.bundle"
        exported = json.loads(rtckern("cache", "export", "--bundle", str(out), "--arch", arch, "--json",
                                      cache=cache).stdout)
        assert ls == set(plain + specific) and exported["entries"] == 2
    assert len(json.loads(rtckern("cache", "ls", "--arch", "8.0", "--json", cache=cache).stdout)) == len(other)


@pytest.mark.parametrize("size, limit", [("1G", 1 << 30), ("1GiB", 1 << 30), ("1gb", 1 << 30), ("5K", 5120),
                                         ("5KiB", 5120), ("5120", 5120), ("0", 0)])
def test_prune_max_bytes_takes_size_suffixes(tmp_path, size, limit):
    fill(tmp_path, ["a", "b", "c"])  # entries of about 1, 2 and 3 KB
    total = sum(e.size for e in DiskCache(tmp_path).entries())
    r = rtckern("cache", "prune", "--max-bytes", size, "--json", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["bytes"] <= limit and (out["removed"] == 0) == (total <= limit)


def test_prune_without_options_applies_the_configured_cap_or_names_the_options(tmp_path):
    fill(tmp_path, ["a"])
    r = rtckern("cache", "prune", cache=tmp_path)
    assert r.returncode == 2 and "prune needs at least one of --max-bytes SIZE" in r.stderr
    assert len(list(DiskCache(tmp_path).entries())) == 1
    r = rtckern("cache", "prune", "--json", cache=tmp_path, env={"RTCKERN_CACHE_MAX_BYTES": "1M"})
    assert r.returncode == 0 and json.loads(r.stdout)["removed"] == 0, r.stderr


def _clear_on_a_terminal(cache: Path, answer: bytes, *extra: str) -> tuple[int, str]:
    main, child = pty.openpty()
    try:
        os.write(main, answer)
        r = rtckern("cache", "clear", *extra, cache=cache, stdin=child)
    finally:
        os.close(child)
        os.close(main)
    return r.returncode, r.stderr


def test_clear_asks_on_a_terminal(tmp_path):
    fill(tmp_path, ["a", "b"])
    code, err = _clear_on_a_terminal(tmp_path, b"n\n")
    assert code == 1 and f"remove all 2 entries (" in err and "nothing removed" in err
    assert len(list(DiskCache(tmp_path).entries())) == 2
    code, err = _clear_on_a_terminal(tmp_path, b"y\n")
    assert code == 0 and len(list(DiskCache(tmp_path).entries())) == 0
    fill(tmp_path, ["a"])
    code, err = _clear_on_a_terminal(tmp_path, b"", "--yes")
    assert code == 0 and "remove all" not in err and len(list(DiskCache(tmp_path).entries())) == 0
    fill(tmp_path, ["a"])  # not a terminal: no question (scripts)
    assert rtckern("cache", "clear", cache=tmp_path, stdin=subprocess.DEVNULL).returncode == 0


def test_importing_a_missing_bundle_creates_no_cache(tmp_path):
    """The missing bundle is said before the cache directory is made (a failed import left an empty cache, which
    `cache stats` then reported as 0 entries instead of no cache)."""
    missing = tmp_path / "new" / "cache"
    r = rtckern("cache", "import", str(tmp_path / "nothing.bundle"), cache=missing)
    assert r.returncode == 2 and "no such file; give a bundle file" in r.stderr, r.stderr
    assert not missing.exists()


def test_importing_a_truncated_bundle_creates_no_cache(tmp_path):
    """A bundle that fails verification (cut short) is refused before the cache directory is made; the whole
    bundle imports into a new directory."""
    src = tmp_path / "src"
    fill(src, ["a", "b"])
    bundle = tmp_path / "all.bundle"
    assert rtckern("cache", "export", "--bundle", str(bundle), cache=src).returncode == 0
    cut = tmp_path / "cut.bundle"
    cut.write_bytes(bundle.read_bytes()[:len(bundle.read_bytes()) // 2])
    missing = tmp_path / "new" / "cache"
    r = rtckern("cache", "import", str(cut), cache=missing)
    assert r.returncode == 2 and str(cut) in r.stderr, r.stderr
    assert not missing.exists()
    r = rtckern("cache", "import", str(bundle), cache=missing)
    assert r.returncode == 0 and "imported 2" in r.stdout, r.stdout + r.stderr
    assert len(list(DiskCache(missing).entries())) == 2


def test_import_readable_makes_a_layer_another_user_can_read(tmp_path):
    """A cache is private (0700 / 0600); `cache import --readable` makes the imported layer readable by every user
    (an image built as root, run as another user), never writable."""
    import stat

    src = tmp_path / "src"
    fill(src, ["a", "b"])
    bundle = tmp_path / "all.bundle"
    assert rtckern("cache", "export", "--bundle", str(bundle), cache=src).returncode == 0
    layer = tmp_path / "layer"
    r = rtckern("cache", "import", str(bundle), "--readable", cache=layer)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(layer.stat().st_mode) == 0o755
    for p in (layer / "v1").rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644), p
    private = tmp_path / "private"
    assert rtckern("cache", "import", str(bundle), cache=private).returncode == 0
    assert all(not stat.S_IMODE(p.stat().st_mode) & 0o077 for p in (private / "v1").rglob("*") if p.is_file())


def test_export_takes_the_bundle_as_import_does_or_as_prefill_does(tmp_path):
    """`cache export FILE` (as `cache import FILE`) and `cache export --bundle FILE` (as `prefill --bundle`) write the
    same bytes; neither, or two that differ, is one line and exit 2."""
    src = tmp_path / "src"
    fill(src, ["a", "b"])
    a, b = tmp_path / "a.bundle", tmp_path / "b.bundle"
    assert rtckern("cache", "export", str(a), cache=src).returncode == 0
    assert rtckern("cache", "export", "--bundle", str(b), cache=src).returncode == 0
    assert a.read_bytes() == b.read_bytes()
    for argv, message in (([], "export: give the bundle to write, as FILE or --bundle FILE"),
                          ([str(a), "--bundle", str(b)], "differ; give the bundle once")):
        r = rtckern("cache", "export", *argv, cache=src)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
