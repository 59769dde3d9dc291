"""The grouped fp8 GEMM's tile: the tuned table `grouped_gemm_fp8` (`rtckern tune grouped_gemm_fp8 --shapes
GxMxNxK,...`, grouped_tune.py; the user's tuning dir, then rtckern/tuning_tables/grouped_gemm_fp8.json where shipped),
keyed by (arch, SM count, device class, mode, out dtype, groups, rows per group, n, k), else the rule by rows per group
(grouped_geometry.config).

Lookup (rtckern/tuning.py's rule): the device's own (arch, SM count, class) rows, exact shape then nearest; then rows
of any class of its arch; a row serves only where its config can run this problem (`grouped_geometry.invalid`: the
store boxes and the tile prefix of this many groups beside the ring). Rows are timed with e4m3 a and serve e5m2 a
too (the same tiles and instruction rate).
"""
from __future__ import annotations

from typing import Any, Mapping

from rtckern import tuning

from .. import _common_grouped as shared
from . import configs
from . import grouped_geometry as gg
from .geometry import Sm90Fp8Config

KEY_FIELDS = ("mode", "out", "groups", "rows", "n", "k")


def key_of(p: gg.GroupedFp8Problem) -> dict[str, Any]:
    return {"mode": p.mode, "out": p.out_dtype, "groups": p.groups, "rows": p.rows, "n": p.n, "k": p.k}


config_from_dict = configs.config_from_dict  # the dense kernel's tile fields


def serves(config: Mapping[str, Any], p: gg.GroupedFp8Problem) -> bool:
    return shared.config_serves(config, p, gg.invalid, config_from_dict)


def tuned(p: gg.GroupedFp8Problem, device) -> tuple[Sm90Fp8Config, tuning.Tuned | None]:
    """(config, the table's answer) for p on device: the table's row (exact, then nearest shape) when its config can
    serve p, else the rule (answer None)."""
    cfg, found = shared.table_config(gg.OP, device, key_of(p), p, gg.invalid, config_from_dict)
    return (cfg, found) if cfg is not None else (gg.config(p), None)
