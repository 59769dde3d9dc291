"""What the op families share (they never import each other): parsing the numeric arguments the ops take (eps,
scale), and finding a memoized call plan on the hot path. It imports no family. (The memos themselves are
rtckern.caches.PlanCache, below the op layer: the core's settings and manager clear them.)
"""
from __future__ import annotations

from typing import Any

from rtckern.config import settings
from rtckern.errors import InputError


def parse_number(value: Any, name: str, example: str) -> float:
    """float(value), or an InputError that names the argument and says what to pass (`example`)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}={value!r} is not a number; pass {example}") from None


def current_plan(plans, key):
    """The plan memoized under `key` in `plans` when it was made under the current settings, else None (also for
    an unhashable key: an argument the full path refuses or handles)."""
    try:
        p = plans.get(key)
    except TypeError:
        return None
    if p is not None and p.settings is settings():
        return p
    return None
