"""Every memo is a PlanCache (rtckern.caches): bounded, emptied when the settings change, by set_manager() and by
rtckern.clear_caches(); no other module-level mutable container in the ops layer."""

import ast
from pathlib import Path

import rtckern
from rtckern import caches, config
from rtckern.manager import get_manager, set_manager

OPS = Path(rtckern.__file__).parent / "ops"
# Module-level containers that are not memos: which families imported, and why one could not be.
NOT_MEMOS = {("__init__.py", "_exports"), ("__init__.py", "unavailable"), ("__init__.py", "__all__")}
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakValueDictionary", "WeakKeyDictionary"}


def _module_level_containers(path: Path):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in MUTABLE_CALLS)
        for t in targets:  # UPPER_CASE names are constant tables by convention, never written
            if mutable and isinstance(t, ast.Name) and not t.id.lstrip("_").isupper() and t.id != "__all__":
                yield t.id, node.lineno


def test_no_module_level_memo_outside_plancache():
    found = [f"rtckern/ops/{p.name}:{line} {name}" for p in sorted(OPS.rglob("*.py"))
             for name, line in _module_level_containers(p) if (p.name, name) not in NOT_MEMOS]
    assert not found, "module-level containers in ops/ (make them rtckern.caches.PlanCache): " + ", ".join(found)


def test_plancache_is_bounded_and_emptied_by_settings_manager_and_clear_caches(tmp_path):
    c = caches.PlanCache("test.memo", maxsize=3)
    for i in range(3):
        c.put(i, i)
    c.put(3, 3)  # past the bound: starts over
    assert dict(c) == {3: 3}
    with config.override(verbose=not config.settings().verbose):
        assert len(c) == 0  # plans built under other settings go
        c.put("in", 1)
    assert len(c) == 0  # ... and those built inside the override too
    c.put("x", 1)
    rtckern.clear_caches()
    assert len(c) == 0
    c.put("x", 1)
    old = set_manager(None)
    try:
        assert len(c) == 0
    finally:
        set_manager(old)
    assert c in caches.all_caches()


def test_every_ops_memo_is_registered():
    import rtckern.ops  # noqa: F401  (imports the families)

    names = {c.name for c in caches.all_caches()}
    for family in ("norms", "softmax", "attention", "gemm"):
        assert any(n.startswith(family + ".") for n in names), (family, sorted(names))
    assert get_manager() is not None
