"""The sdist builds, and a wheel built from it ships every kernel source (the runtime compiles them from the
installed package, so a missing .cuh is a compile error on a user's machine, not here); the project metadata
(license, version, typing marker, declared dependencies) says what the package is."""

import ast
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
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
    want.add("rtckern/plugins/_torch_native.cpp")  # the native front of torch.ops.rtckern, built likewise
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
    want.add("rtckern/py.typed")
    assert want and want <= shipped, sorted(want - shipped)[:10]
    meta = next(n for n in shipped if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(wheel) as z:
        text = z.read(meta).decode()
    assert "License-Expression: Apache-2.0" in text and f"Version: {_version()}" in text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in shipped)
    assert not any(n.startswith("rtckern/kernel_sources/") and n.endswith(".py") for n in shipped)


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# third-party module imported somewhere in rtckern -> the requirement that provides it, and where it is declared
# ("" = a dependency, else the extra's name); None: an optional integration used only where the user has it
PROVIDERS = {"numpy": ("numpy", ""), "cuda": ("cuda-core", ""), "tqdm": ("tqdm", ""), "torch": ("torch", "torch"),
             "cupy": ("cupy-cuda13x", "cupy"), "hip": ("hip-python", "hip"), "transformers": None,
             "ml_dtypes": None}  # ml_dtypes: bf16 / fp8 numpy dtypes for CuPy arrays, asked for by name where needed


def _version() -> str:
    m = re.search(r'^__version__ = "([^"]+)"$', (ROOT / "rtckern" / "__init__.py").read_text(), re.MULTILINE)
    assert m, "rtckern/__init__.py writes __version__ as a string literal (setuptools reads it from there)"
    return m.group(1)


def test_license_version_and_typing_marker_are_declared_once():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0, January 2004" in \
        (ROOT / "LICENSE").read_text()
    assert not any(c.startswith("License ::") for c in project["classifiers"]), "the SPDX expression says it"
    assert "version" not in project and project["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rtckern.__version__"} and _version()
    assert (ROOT / "rtckern" / "py.typed").is_file() and "py.typed" in PYPROJECT["tool"]["setuptools"][
        "package-data"]["rtckern"] and "Typing :: Typed" in project["classifiers"]


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower() for r in reqs}


def test_every_third_party_import_is_declared():
    found = set()
    for path in (ROOT / "rtckern").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    third_party = found - set(sys.stdlib_module_names) - {"rtckern", "__future__"}
    assert third_party <= set(PROVIDERS), f"declare {sorted(third_party - set(PROVIDERS))} in pyproject.toml"
    deps = _requirement_names(PYPROJECT["project"]["dependencies"])
    extras = {k: _requirement_names(v) for k, v in PYPROJECT["project"]["optional-dependencies"].items()}
    for module in sorted(third_party):
        if PROVIDERS[module] is None:
            continue
        req, extra = PROVIDERS[module]
        assert req in (extras.get(extra, set()) if extra else deps), f"{module}: {req} is not declared"


def test_cuda_wheels_are_pinned_to_one_major_version():
    deps = {re.split(r"[<>=!~ ]", r, maxsplit=1)[0]: r for r in PYPROJECT["project"]["dependencies"]}
    for name in ("nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "cuda-bindings"):
        assert re.fullmatch(rf"{name}>=13\.\d+,<14", deps[name]), deps[name]
