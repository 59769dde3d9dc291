"""The ops' documentation: every public op's docstring says its parameters, returns and raises (help() is the
reference: the op functions shadow their private modules, whose docstrings no user reaches), and docs/ops.md is
generated from those docstrings (python tools/gen_ops_doc.py)."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import rtckern.ops as ops

REPO = Path(__file__).resolve().parents[3]
OPS = [n for n in ops.__all__ if callable(getattr(ops, n))]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_ops_doc", REPO / "tools" / "gen_ops_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", OPS)
def test_each_op_documents_every_parameter_its_returns_and_raises(name):
    fn = getattr(ops, name)
    doc = inspect.cleandoc(fn.__doc__ or "")
    assert "module docstring" not in doc, "say it here: the module docstring is out of a user's reach"
    parts = re.split(r"^(Args|Returns|Raises):$", doc, flags=re.MULTILINE)
    sections = dict(zip(parts[1::2], parts[2::2]))
    assert set(sections) == {"Args", "Returns", "Raises"}, f"{name}: sections {sorted(sections)}"
    documented = {n.strip() for m in re.finditer(r"^    (\S[^:]*?):\s", sections["Args"], re.MULTILINE)
                  for n in m.group(1).split(",")}
    params = set(inspect.signature(fn).parameters)
    assert params == documented, f"{name}: undocumented {sorted(params - documented)}, " \
                                 f"not parameters {sorted(documented - params)}"
    assert "InputError" in sections["Raises"] and sections["Returns"].strip()


def test_ops_md_is_generated_from_the_docstrings():
    assert (REPO / "docs" / "ops.md").read_text() == _generator().ops_doc(), \
        "regenerate it: python tools/gen_ops_doc.py"
