"""The README says what is true: its set-up commands are the ones CI runs, its snippets run (the compile-only one
here, the GPU one in tests/gpu/test_readme_gpu.py), its values are accepted by the ops, and every file it names
exists (docs pages, result files, embedded plots)."""

from __future__ import annotations

import re
from pathlib import Path

import rtckern.ops as ops

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
SETUP = ('python3 -m pip install . && rtckern prefill',
         'python3 -m pip install "torch==2.13.0" -e ".[test]" && python3 -m pytest -q tests')


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.DOTALL)


def test_the_two_set_up_commands_are_there_and_ci_runs_the_second():
    for command in SETUP:
        assert f"\n{command}\n" in README, command
    assert SETUP[1] in (REPO / ".ci" / "run").read_text()


def test_the_compile_only_snippet_runs(cache_dir):
    (block,) = [b for b in python_blocks() if "DeviceInfo.for_arch(" in b and "compile(" in b]
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    assert scope["binary"].kind == "cubin" and len(scope["binary"].binary) > 1000


def test_gemm_activations_in_the_readme_are_the_ops():
    used = re.findall(r'activation="([^"]+)"', README)
    assert used and set(used) <= set(ops.ACTIVATIONS), used


def test_every_file_the_readme_names_exists():
    named = set(re.findall(r"`((?:docs|benchmarks/results|rtckern|tools|tests)/[^`*<> ]+?)`", README))
    named |= set(re.findall(r"\]\(((?:docs|benchmarks)/[^)]+)\)", README))
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert named and not missing, missing
    plots = re.findall(r"!\[[^\]]+\]\((benchmarks/results/[^)]+\.png)\)", README)
    assert len(plots) >= 4, "the headline plots are embedded"
