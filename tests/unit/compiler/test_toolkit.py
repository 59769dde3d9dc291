"""rtckern.compiler.toolkit: NVRTC and the CUDA headers found in NVIDIA wheels as cuda-pathfinder finds them."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rtckern.compiler import toolkit


def _in_fresh_process(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the wheel lookup is for Linux")
def test_same_files_as_pathfinder():
    """In a process that has loaded no NVRTC yet, the lookups give the files pathfinder gives (or nothing)."""
    out = _in_fresh_process("""
        import os
        from rtckern.compiler import toolkit
        lib, headers = toolkit.wheel_nvrtc(), toolkit.wheel_headers()
        from cuda.pathfinder import find_nvidia_header_directory, load_nvidia_dynamic_lib
        if lib is not None:
            assert os.path.samefile(lib, load_nvidia_dynamic_lib("nvrtc").abs_path), lib
        if headers is not None:
            assert str(headers) == find_nvidia_header_directory("cudart"), headers
        print(lib is not None, headers is not None)
    """)
    if out.split() != ["True", "True"]:
        pytest.skip(f"no NVIDIA wheel holds NVRTC and the headers here ({out.strip()})")


def test_a_loaded_nvrtc_is_the_file_used():
    """Once a libnvrtc is loaded (torch's CUDA build loads one), the lookup names that file, the one pathfinder
    and cuda.bindings then take."""
    out = _in_fresh_process("""
        import os
        from rtckern.compiler import toolkit
        lib = toolkit.wheel_nvrtc()
        if lib is not None:
            toolkit.preload_nvrtc(lib)
            loaded = toolkit.wheel_nvrtc()
            assert toolkit.nvrtc_loaded() and loaded is not None and os.path.samefile(loaded, lib), loaded
            from cuda.pathfinder import load_nvidia_dynamic_lib
            assert os.path.samefile(load_nvidia_dynamic_lib("nvrtc").abs_path, lib)
        print("ok")
    """)
    assert out.strip() == "ok"


def _site(tmp_path, name, *files):
    base = tmp_path / name
    for f in files:
        (base / f).parent.mkdir(parents=True, exist_ok=True)
        (base / f).write_bytes(b"")
    return str(base)


def test_search_order_is_pathfinders(tmp_path, monkeypatch):
    """Each wheel dir is searched in every site dir before the next wheel dir; within a dir, the newer soname."""
    a = _site(tmp_path, "a", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    b = _site(tmp_path, "b", "nvidia/cu13/lib/libnvrtc.so.12", "nvidia/cu13/lib/libnvrtc.so.13",
              "nvidia/cu13/include/cuda_runtime.h")
    monkeypatch.setattr(toolkit, "site_dirs", lambda: [a, b])
    monkeypatch.setattr(toolkit, "nvrtc_loaded", lambda: False)
    assert toolkit.wheel_nvrtc() == tmp_path / "b/nvidia/cu13/lib/libnvrtc.so.13"
    assert toolkit.wheel_headers() == (tmp_path / "b/nvidia/cu13/include").resolve()
    monkeypatch.setattr(toolkit, "site_dirs", lambda: [a])
    assert toolkit.wheel_nvrtc() == tmp_path / "a/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
    assert toolkit.wheel_headers() is None


@pytest.mark.parametrize("venv, expected", [(True, ["venv", "user", "system"]), (False, ["user", "venv", "system"])])
def test_user_site_goes_where_pathfinder_puts_it(monkeypatch, venv, expected):
    monkeypatch.setattr(toolkit.site, "getsitepackages", lambda: ["venv", "system"])
    monkeypatch.setattr(toolkit.site, "getusersitepackages", lambda: "user")
    monkeypatch.setattr(toolkit.site, "ENABLE_USER_SITE", True)
    monkeypatch.setattr(toolkit.sys, "base_prefix", "/base" if venv else toolkit.sys.prefix)
    assert toolkit.site_dirs() == expected


def test_loaded_nvrtc_reads_maps_with_anonymous_lines(tmp_path, monkeypatch):
    """/proc/self/maps lines without a path (anonymous mappings, padded with spaces) are skipped; the builtins
    library is not NVRTC."""
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 rw-p 00000000 00:00 0 \n"
                    "7f01-7f02 rw-p 00000000 00:00 0                          \n"
                    "7f02-7f03 r--p 00000000 08:01 120    /w/lib/libnvrtc-builtins.so.13.0\n"
                    "7f03-7f04 r-xp 00000000 08:01 123    /w/lib/libnvrtc.so.13\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(maps if p == "/proc/self/maps" else p, *a, **k))
    assert toolkit.loaded_nvrtc() == Path("/w/lib/libnvrtc.so.13")
