"""Tuned one-pass softmax configs, measured with `benchmarks/softmax.py --tune` (see benchmarks/results/).

Key: (arch, SM count, direction, dtype, vector width, power-of-two bucket of the row length).
Value: (threads, group, items, min_blocks) of `_softmax_plan.OnePass`.
Where no entry matches, `_softmax_plan.default_onepass` picks a config by rule.
"""
from __future__ import annotations

from rtckern.ops import _softmax_plan as plan

TUNED: dict[tuple[str, int, str, str, int, int], tuple[int, int, int, int]] = {}


def tuned_onepass(arch: str, sm_count: int, direction: str, dtype: str, vec: int, n: int) -> plan.OnePass | None:
    v = TUNED.get((arch, sm_count, direction, dtype, vec, plan.pow2ceil(n)))
    return plan.OnePass(*v) if v is not None else None
