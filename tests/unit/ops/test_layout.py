"""The layout of the op layer, kept by an AST scan of rtckern/ops/ (nothing is imported).

One layout for every family. A family (rtckern.ops.FAMILIES) is a private subpackage rtckern/ops/_<family>/ (private
because `rtckern.ops.softmax`, `.attention`, `.gemm` are the ops: a public subpackage of that name would shadow
them) whose modules have the same name wherever they have the same role:

    api.py          the public ops (its __all__ is what rtckern.ops exports)           every family
    candidates.py   the registry candidates, request builders, kernel providers         every family
    plan.py         the hot path: call plans and their memo                              where the family has one
    geometry.py     launch geometry and tile math, problem and config records            where the family has one
    configs.py      kernel configs: tuned-table lookups, heuristics, default tables      where the family has one
    tune.py         the product tuner registered with `rtckern tune`, its config sweep   where the family has one
    launch.py       kernel launch helpers                                                where the family has one

plus family-specific modules whose names say what they hold (softmax's ring.py and selftest.py, the wgmma_gen.py
code generators). rtckern/ops/ itself holds only __init__.py and the shared rtckern/ops/_common*.py.

No module-level mutable state in the op layer: no module under rtckern/ops/ binds, at module level (including
inside module-level if / for / try / with blocks) or in a class body, a dict / list / set literal or
comprehension, or a dict() / list() / set() / OrderedDict() / defaultdict() / deque() / Counter() /
WeakValueDictionary() / WeakKeyDictionary() call; and no module-level function is decorated with
functools.lru_cache / functools.cache. A memo is a `rtckern.caches.PlanCache(...)` (bounded; emptied when the
settings change, by set_manager() and by rtckern.clear_caches()); a constant table is immutable: a tuple, a
frozenset, or a types.MappingProxyType over a dict built in the same statement.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
OPS = ROOT / "rtckern" / "ops"

EVERY_FAMILY = ("api.py", "candidates.py")
SHARED_ROLES = ("plan.py", "geometry.py", "configs.py", "tune.py", "launch.py")
MUTABLE_CALLS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter", "WeakValueDictionary",
                 "WeakKeyDictionary"}
MUTABLE_NODES = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
CACHE_DECORATORS = {"lru_cache", "cache"}


def families() -> tuple[str, ...]:
    """rtckern.ops.FAMILIES, read from the source."""
    for node in ast.parse((OPS / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FAMILIES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("rtckern/ops/__init__.py defines no FAMILIES tuple")


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return getattr(node, "id", "")


def _is_mutable(value: ast.AST | None) -> bool:
    if isinstance(value, MUTABLE_NODES):
        return True
    if isinstance(value, ast.BinOp):  # [a] + [b], {**x} | y, ...
        return _is_mutable(value.left) or _is_mutable(value.right)
    return isinstance(value, ast.Call) and _call_name(value) in MUTABLE_CALLS


def _statements(body: list[ast.stmt]):
    """The statements a module (or class body) runs at its own level: into if / for / while / try / with blocks,
    not into functions."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.ClassDef):
            yield from _statements(node.body)
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _statements(getattr(node, field, None) or [])
        for handler in getattr(node, "handlers", None) or []:
            yield from _statements(handler.body)


def mutable_state(source: str, name: str = "<string>") -> list[str]:
    """'line: what' for every module-level (or class-level) mutable container or cached function in source."""
    out = []
    for node in _statements(ast.parse(source, name).body):
        value, targets = None, []
        if isinstance(node, ast.Assign):
            value, targets = node.value, node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            value, targets = node.value, [node.target]
        if _is_mutable(value):
            what = ", ".join(ast.unparse(t) for t in targets)
            out.append(f"{node.lineno}: {what} = {ast.unparse(value)[:60]}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if _call_name(d) in CACHE_DECORATORS:
                    out.append(f"{node.lineno}: @{ast.unparse(d)} on {node.name}()")
    return out


def test_every_family_is_a_subpackage_with_the_shared_names():
    fams = families()
    assert set(fams) >= {"norms", "softmax", "attention", "gemm"}
    for fam in fams:
        pkg = OPS / f"_{fam}"
        assert (pkg / "__init__.py").is_file(), f"family {fam}: no package rtckern/ops/_{fam}/"
        missing = [m for m in EVERY_FAMILY if not (pkg / m).is_file()]
        assert not missing, f"family {fam}: rtckern/ops/_{fam}/ has no {', '.join(missing)}"
        for old in pkg.parent.glob(f"_{fam}_*.py"):
            raise AssertionError(f"{old.relative_to(ROOT)}: family modules live in rtckern/ops/_{fam}/")
    # what the families share, each family has under the shared name
    roles = {m: [f for f in fams if (OPS / f"_{f}" / m).is_file()] for m in SHARED_ROLES}
    assert all(roles.values()), {m: fs for m, fs in roles.items() if not fs}


def test_nothing_else_at_the_top_of_rtckern_ops():
    allowed = {"__init__.py"} | {p.name for p in OPS.glob("_common*.py")}
    stray = sorted(p.name for p in OPS.glob("*.py") if p.name not in allowed)
    assert not stray, f"modules directly under rtckern/ops/ (put them in a family or in _common.py): {stray}"
    packages = sorted(p.name for p in OPS.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert packages == sorted(f"_{f}" for f in families()), packages


def test_no_module_level_mutable_state_in_ops():
    found = [f"{p.relative_to(ROOT)}:{hit}" for p in sorted(OPS.rglob("*.py"))
             for hit in mutable_state(p.read_text(), str(p))]
    assert not found, ("module-level mutable state in rtckern/ops (a memo is a rtckern.caches.PlanCache; a constant "
                       "table a tuple, frozenset or MappingProxyType):\n" + "\n".join(found))


@pytest.mark.parametrize("src, hits", [
    ("_memo = {}", ["1: _memo = {}"]),
    ("TABLE = {'a': 1}", ["1: TABLE = {'a': 1}"]),
    ("x: dict = dict()", ["1: x = dict()"]),
    ("import collections\nseen = collections.OrderedDict()", ["2: seen = collections.OrderedDict()"]),
    ("if True:\n    cache = [i for i in range(3)]", ["2: cache = [i for i in range(3)]"]),
    ("OFFSETS = [1, 2] + [3]", ["1: OFFSETS = [1, 2] + [3]"]),
    ("class C:\n    _by_key = {}", ["2: _by_key = {}"]),
    ("import functools\n@functools.lru_cache(maxsize=None)\ndef f(x):\n    return x",
     ["3: @functools.lru_cache(maxsize=None) on f()"]),
    ("from functools import cache\n@cache\ndef f(x):\n    return x", ["3: @cache on f()"]),
    # allowed: PlanCache, immutable tables, containers inside functions
    ("from rtckern.caches import PlanCache\n_memo = PlanCache('x.memo')", []),
    ("import types\nT = types.MappingProxyType({'a': 1})\nS = frozenset({1})\nU = (1, 2)", []),
    ("def f():\n    d = {}\n    return d", []),
])
def test_the_scan_finds_each_kind(src, hits):
    assert mutable_state(src) == hits
