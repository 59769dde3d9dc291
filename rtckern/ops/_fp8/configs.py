"""The sm_90a fp8 kernel's tile config: the tuned table `gemm_fp8` (`rtckern tune gemm_fp8 --shapes ...`, tune.py;
the user's tuning dir, then rtckern/tuning_tables/gemm_fp8.json where shipped), keyed by (arch, SM count, device
class, scale kind, out dtype, m, n, k), else a rule per shape class.

Lookup (rtckern/tuning.py's rule): the device's own (arch, SM count, class) rows, exact shape then nearest; then rows
of any class of its arch; a row serves only where its config can run this problem (`Sm90Fp8Config.invalid`). The
rule: each consumer warpgroup keeps the promoted fp32 sums of its rows and the partial sums of one K block for at most
128 columns at a time, so a consumer owns at most 64 x 256 outputs; 128 x 256 tiles with two consumers where the
output is wide (half the L2 traffic per FLOP of 128 x 128, which at fp8 rates the SMs wait on), 128 x 128 where N
is narrow, 64-row tiles with one consumer where M is small (decode, M <= 64), split over K in clusters of 2-4 blocks
where N's tiles would leave SMs idle (`decode_splits`).

The key's `scale` is the kernel's scale kind: "tensor" (per-tensor and per-channel scales, which share one epilogue
and one kernel) or "block". Rows are timed without bias on 16-byte aligned operands; unaligned problems never reach
this kernel.
"""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Mapping

from rtckern import tuning

from .geometry import OP, Fp8Problem, Sm90Fp8Config

KEY_FIELDS = ("scale", "out", "m", "n", "k")
CONFIG_FIELDS = ("bm", "bn", "stages", "consumers", "group_m", "cluster", "partials", "splits")  # Sm90Fp8Config's
SCALE_KIND = MappingProxyType({"tensor": "tensor", "channel": "tensor", "block": "block"})


def key_of(p: Fp8Problem) -> dict[str, Any]:
    return {"scale": SCALE_KIND.get(p.scale, p.scale), "out": p.out_dtype, "m": p.m, "n": p.n, "k": p.k}


def config_from_dict(d: Mapping[str, Any]) -> Sm90Fp8Config:
    """A table row's config; ValueError for one that is not an sm90 fp8 tile config."""
    if d.get("kind", "sm90") != "sm90":
        raise ValueError(f"gemm_fp8 config {dict(d)}: kind must be 'sm90'")
    extra = set(d) - {"kind", *CONFIG_FIELDS}
    if extra:
        raise ValueError(f"gemm_fp8 config {dict(d)}: unknown fields {sorted(extra)}")
    vals = {k: d[k] for k in CONFIG_FIELDS if k in d}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in vals.values()):
        raise ValueError(f"gemm_fp8 config {dict(d)}: tile fields must be positive integers")
    return Sm90Fp8Config(**vals)


SPLIT_MIN_K_BLOCKS = 8  # K blocks of 128 per split at least: a shorter range is mostly the ring's fill


def decode_splits(p: Fp8Problem, sm_count: int, bn: int = 128) -> int:
    """Split-K clusters for one row block of N / bn tiles: 4 or 2 where that many blocks per tile still fit the SMs
    in one round, each split keeping SPLIT_MIN_K_BLOCKS K blocks; else none. Clusters of 4 count against 3/4 of the
    SMs: a GPC's SMs that do not make a whole cluster stay idle (the H200's tuner chose pairs at 32 tiles, fours at
    17). Measured on an H200 (docs/performance.md): pairs on 56 and 64 tiles gain 15-25%, while splits that need a
    second round of tiles (224 tiles in fours, 64 in fours) lose more than the fuller SMs give."""
    tiles, kb = math.ceil(p.n / bn), math.ceil(p.k / 128)
    for s, sms in ((4, sm_count * 3 // 4), (2, sm_count)):
        if tiles * s <= sms and kb >= SPLIT_MIN_K_BLOCKS * s:
            return s
    return 1


def heuristic(p: Fp8Problem, sm_count: int) -> Sm90Fp8Config:
    if p.m <= 64:  # 8 x 24 KB ring: B streams once, deep prefetch; split-K where N's tiles leave SMs idle
        return Sm90Fp8Config(64, 128, 8, 1, splits=decode_splits(p, sm_count))
    if p.n >= 1024 and p.scale != "channel":
        return Sm90Fp8Config(128, 256, 4, 2)  # 4 x 48 KB
    return Sm90Fp8Config(128, 128, 6, 2)  # 6 x 32 KB


def tuned(p: Fp8Problem, device) -> tuple[Sm90Fp8Config, tuning.Tuned | None]:
    """(config, the table's answer) for p on device: the table's row (exact, then nearest shape) when its config can
    serve p, else the rule (answer None)."""

    def valid(config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        try:
            return config_from_dict(config).invalid(p) is None
        except (TypeError, ValueError):
            return False

    if p.aligned:
        found = tuning.lookup(OP, device, key_of(p), valid=valid)
        # an exact row is not checked by the lookup, and rows are keyed without bias: a row's config may not serve
        # this call (a clustered 128 x 256 tile with a bias), which the rule then does
        if found is not None and valid(found.config, {}):
            return config_from_dict(found.config), found
    return heuristic(p, device.sm_count), None
