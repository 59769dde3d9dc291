"""The README's first snippet (compile, load and launch a kernel on torch tensors) runs as written on a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


def test_the_launch_snippet_runs(cache_dir):
    pytest.importorskip("torch")
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    (block,) = [b for b in blocks if "k.launch(" in b]
    exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - the README's own code (it asserts its result)
