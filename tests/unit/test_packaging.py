"""The sdist builds, and a wheel built from it ships every kernel source (the runtime compiles them from the
installed package, so a missing .cuh is a compile error on a user's machine, not here)."""

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BUILD = """
import sys
from setuptools import build_meta as b
kind, out = sys.argv[1], sys.argv[2]
print(b.build_sdist(out) if kind == "sdist" else b.build_wheel(out))
"""


def _build(kind: str, src: Path, out: Path) -> Path:
    r = subprocess.run([sys.executable, "-c", BUILD, kind, str(out)], cwd=src, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / r.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_sdist_builds_and_its_wheel_ships_every_kernel_source(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the tracked files are what an sdist is made of)")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for rel in tracked:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    sdist = _build("sdist", src, tmp_path / "dist")
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp_path / "unpacked", filter="data")
    unpacked = next((tmp_path / "unpacked").iterdir())
    wheel = _build("wheel", unpacked, tmp_path / "whl")
    want = {p.relative_to(ROOT).as_posix() for p in (ROOT / "rtckern" / "kernel_sources").rglob("*")
            if p.is_file() and p.suffix in (".cuh", ".md")}
    want.add("rtckern/runtime/native_launch.c")  # the native launcher is built from it on the user's machine
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
    assert want and want <= shipped, sorted(want - shipped)[:10]
    assert not any(n.startswith("rtckern/kernel_sources/") and n.endswith(".py") for n in shipped)
