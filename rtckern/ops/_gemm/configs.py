"""GEMM tile configs: the tuned table `gemm` (rtckern/tuning_tables/gemm.json, measured by
`benchmarks/gemm.py --tune` or `rtckern tune gemm --shapes MxNxK,...`), keyed by (arch, SM count, dtype, layout,
m, n, k), and the heuristics used where no row applies.

A row's config is a kernel-family config (`geometry.config_from_dict`): {"kind": "sm90", "bm": 128, ...}.
The kind says which candidate the row measured fastest: that candidate's expected cost is the lowest, so one table
ranks both kernel families on one GPU (the other keeps its own config: `sm90_heuristic`, `sm80_heuristic`). m in
the key is batch x m (rows of work). "splits": 0 in a config means "choose split-K by the wave heuristic at run
time". The configs worth timing and the tuner that writes the rows are in tune.py.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping

from rtckern import tuning

from . import geometry

OP = "gemm"
KEY_FIELDS = ("dtype", "layout", "m", "n", "k")


def layout(trans_b: bool) -> str:
    """"tn": B is (n, k) row-major (nn.Linear weights, trans_b=True); "nn": B is (k, n) row-major."""
    return "tn" if trans_b else "nn"


def key_of(p: geometry.GemmProblem) -> dict[str, Any]:
    return {"dtype": p.dtype, "layout": layout(p.trans_b), "m": p.batch * p.m, "n": p.n, "k": p.k}


def config_ok(cfg, p: geometry.GemmProblem, device) -> bool:
    if cfg.invalid(p) is not None:
        return False
    if cfg.kind == "sm90" and not (device.arch.major == 9 and device.arch.minor == 0):
        return False
    if cfg.kind == "sm80" and device.arch.major < 8:
        return False
    if getattr(cfg, "cluster", False) and device.arch.major < 9:  # thread-block clusters: sm_90+
        return False
    limit = device.max_smem_per_block_optin
    return cfg.smem_bytes <= limit


def tuned_config(p: geometry.GemmProblem, device):
    """(config, source) for problem p on device: the table's row (exact, then nearest shape) when its config
    can serve p, else the heuristic. source: 'exact', 'nearest' or 'heuristic'. Unaligned problems always take
    the heuristic (rows are measured on aligned operands)."""
    cfg, source, _ = tuned_config_row(p, device)
    return cfg, source


def tuned_config_row(p: geometry.GemmProblem, device):
    """(config, source, the table's answer or None) as tuned_config: the answer names the row that served and
    whether its device class matched (`tuning.Tuned.describe`, for explain)."""

    def valid(config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        try:
            return config_ok(geometry.config_from_dict(config), p, device)
        except (TypeError, ValueError):
            return False

    if not p.aligned:
        # Rows are timed on 16-byte aligned operands (the fast paths); the general path has its own heuristic.
        return heuristic(p, device), "heuristic", None
    found = tuning.lookup(OP, device, key_of(p), valid=valid)
    if found is not None:
        return settle_splits(geometry.config_from_dict(found.config), p, device, found.source), found.source, found
    return heuristic(p, device), "heuristic", None


def settle_splits(cfg, p: geometry.GemmProblem, device, source: str):
    """A row's split count fits the row's shape, not necessarily p's: an exact row's count is clamped to p's
    k-blocks (every split non-empty); a nearest row's is chosen afresh by the wave heuristic. Launch plans must
    use this settled count: the kernel specs (split or not) and the launch both follow it."""
    if cfg.kind == "simt":
        return cfg
    if source != "exact":
        cfg = replace(cfg, splits=0)
    return geometry.with_splits(cfg, p, device.sm_count)


def heuristic(p: geometry.GemmProblem, device):
    """The config without a table row, from what the H200 sweeps showed (docs/performance.md, GEMM):
    wgmma 128x256 cooperative for large outputs; for outputs that fill few tiles, smaller tiles and split-K
    (inside a thread-block cluster on sm_90+: no workspace, no second kernel); for M <= 32, the mma.sync split-K
    kernel with 16-row tiles (it streams B best); sm80 kernels elsewhere."""
    rows = p.batch * p.m
    if device.arch.major == 9 and device.arch.minor == 0 and p.aligned and rows > 32:
        return sm90_heuristic(p, device)
    return sm80_heuristic(p, device)


def sm90_heuristic(p: geometry.GemmProblem, device):
    """The wgmma kernel's config without a table row (for any M: heuristic() prefers the mma.sync kernel at
    M <= 32, and this is the wgmma candidate's own config there)."""
    rows = p.batch * p.m
    big = math.ceil(rows / 128) * math.ceil(p.n / 256) >= device.sm_count
    if big:
        cfg = geometry.Sm90Config(128, 256, 4, 2)
    elif rows <= 256:
        # Skinny: 128 x 64 tiles read A once per tile and keep ~1 block per SM (H200, M = 128: best or within
        # 0.3% at N = K = 4096 and 8192, split 2 in a cluster at 4096).
        cfg = geometry.Sm90Config(128, 64, 8, 2, splits=0, cluster=True)
    else:
        cfg = geometry.Sm90Config(128, 128, 6, 2, splits=0, cluster=True)
    return geometry.with_splits(cfg, p, device.sm_count)


def sm80_heuristic(p: geometry.GemmProblem, device):
    if device.arch.major < 8:
        return geometry.SimtConfig()
    rows = p.batch * p.m
    small_smem = device.max_smem_per_block_optin < 96 * 1024  # sm_86/89-class parts
    cluster = device.arch.major >= 9  # split-K inside a cluster where clusters exist
    if not p.aligned:
        cfg = geometry.Sm80Config(64, 64, 64, 32, 32, 3, splits=0, cluster=cluster)
    elif rows <= 16:
        cfg = geometry.Sm80Config(16, 128, 64, 16, 32, 4, splits=0, cluster=cluster)
    elif rows <= 64:
        cfg = geometry.Sm80Config(64, 64, 64, 32, 32, 4, splits=0, cluster=cluster)
    elif small_smem:
        cfg = geometry.Sm80Config(128, 128, 32, 64, 64, 3)
    else:
        cfg = geometry.Sm80Config(128, 128, 32, 64, 64, 4)
    return geometry.with_splits(cfg, p, device.sm_count)
