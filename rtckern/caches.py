"""Every memo of rtckern is a :class:`PlanCache`: a bounded dict that is emptied when the settings change
(``config.override`` / ``config.reload``), when the process-wide manager is replaced (``set_manager``) and by
``rtckern.clear_caches()``. Reads are plain dict reads, so a hot path that looks a plan up pays nothing for this;
writes go through :meth:`PlanCache.put`, which keeps the bound (a workload with endlessly new shapes starts over
rather than grows).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

_all: "dict[int, weakref.ref[PlanCache]]" = {}  # by id: a dict is not hashable, and equal contents are not one cache
_on_clear: list[Callable[[], None]] = []  # memos kept outside Python (the torch op library's recipes)


class PlanCache(dict):
    __slots__ = ("name", "maxsize", "__weakref__")

    def __init__(self, name: str, maxsize: int = 4096):
        super().__init__()
        self.name = name
        self.maxsize = maxsize
        _all[id(self)] = weakref.ref(self, lambda _, i=id(self): _all.pop(i, None))

    def put(self, key: Any, value: Any) -> Any:
        """Store and return ``value``; past ``maxsize`` entries the cache starts over."""
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value
        return value

    def __repr__(self) -> str:
        return f"PlanCache({self.name!r}, {len(self)}/{self.maxsize})"


def clear_all() -> None:
    """Empty every PlanCache of the process, and every memo registered with on_clear."""
    for ref in list(_all.values()):
        c = ref()
        if c is not None:
            c.clear()
    for fn in list(_on_clear):
        fn()


def on_clear(fn: Callable[[], None]) -> None:
    """Call fn whenever clear_all() empties the PlanCaches: for a memo that is not a PlanCache (one held in C++)."""
    _on_clear.append(fn)


def all_caches() -> list[PlanCache]:
    return sorted((c for c in (r() for r in list(_all.values())) if c is not None), key=lambda c: c.name)
