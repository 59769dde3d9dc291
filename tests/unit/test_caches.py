"""Every memo is a PlanCache (rtckern.caches): bounded, emptied when the settings change, by set_manager() and by
rtckern.clear_caches(). (That the op layer keeps no other module-level mutable state: tests/unit/ops/test_layout.py.)
"""

import rtckern
from rtckern import caches, config
from rtckern.manager import get_manager, set_manager


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
