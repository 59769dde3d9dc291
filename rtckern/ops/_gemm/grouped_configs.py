"""The grouped GEMM's wgmma tile: the tuned table `grouped_gemm` (`rtckern tune grouped_gemm --shapes GxMxNxK,...`,
grouped_tune.py; the user's tuning dir, then rtckern/tuning_tables/grouped_gemm.json where shipped), keyed by (arch,
SM count, device class, mode, dtype, layout, out dtype, groups, rows per group, n, k), else the rule by rows per group
(grouped_geometry.sm90_config).

Lookup (rtckern/tuning.py's rule): the device's own (arch, SM count, class) rows, exact shape then nearest; then rows
of any class of its arch; a row serves only where its config can run this problem (`grouped_geometry.invalid`: the
tile prefix of this many groups beside the ring). `rows` is the request's rows per group, a power of two (the average
of a contiguous call, the capacity of a masked one), so one row serves every call of its class. Whether the tile
stores with TMA follows from the call (geometry.tma_store): a row tuned with few groups may serve many groups, whose
tile prefix leaves its store boxes no room, from registers.
"""
from __future__ import annotations

from typing import Any, Mapping

from rtckern import tuning

from .. import _common_grouped as shared
from . import geometry
from . import grouped_geometry as gg
from .configs import layout
from .geometry import Sm90Config

KEY_FIELDS = ("mode", "dtype", "layout", "out", "groups", "rows", "n", "k")


def key_of(p: gg.GroupedProblem) -> dict[str, Any]:
    return {"mode": p.mode, "dtype": p.dtype, "layout": layout(p.trans_b), "out": p.out_dtype, "groups": p.groups,
            "rows": p.rows, "n": p.n, "k": p.k}


def config_from_dict(d: Mapping[str, Any]) -> Sm90Config:
    """A table row's config; ValueError for one that is not a wgmma tile config."""
    cfg = geometry.config_from_dict(dict(d))
    if cfg.kind != "sm90":
        raise ValueError(f"grouped_gemm config {dict(d)}: kind must be 'sm90' (the wgmma kernel's tile)")
    return cfg


def serves(config: Mapping[str, Any], p: gg.GroupedProblem) -> bool:
    return shared.config_serves(config, p, gg.invalid, config_from_dict)


def tuned(p: gg.GroupedProblem, device) -> tuple[Sm90Config, tuning.Tuned | None]:
    """(config, the table's answer) for p on device: the table's row (exact, then nearest shape) when its config can
    serve p, else the rule (answer None). Rows are timed on aligned operands; the others run the mma.sync fallback."""
    cfg, found = shared.table_config(gg.OP, device, key_of(p), p, gg.invalid, config_from_dict) if p.aligned \
        else (None, None)
    return (cfg, found) if cfg is not None else (gg.sm90_config(p), None)
