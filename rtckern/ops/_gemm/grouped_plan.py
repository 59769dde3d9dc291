"""The hot path of grouped_gemm / grouped_gemm_masked: one call signature, decided once. The plan
(rtckern.ops._common.OutputPlan) holds the output's shape and dtype and the prepared launch (`GroupedLaunch`: tensor
maps by address, every scalar fixed), so a repeated call allocates the output, reads the current stream and launches;
`plans` is the memo of Plans (grouped.py keys it by everything the checks read). The group index is passed by address:
its values never reach the host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rtckern.caches import PlanCache
from rtckern.dtypes import itemsize

from .. import _common_grouped as shared
from . import grouped_geometry as gg
from .launch import _MapCache, _Prepared

plans = PlanCache("grouped_gemm.call_plans")


@dataclass(frozen=True)
class Layout:
    """One call's exact sizes and element strides: rows (contiguous: total_m; masked: the capacity), a's row and
    group strides, b's (with trans_b, rows of K; else rows of N), the output's group stride (masked; 0 otherwise)."""

    rows: int
    lda: int
    stride_a: int
    ldb: int
    stride_b: int
    stride_c: int


class GroupedLaunch:
    """The grouped kernel of one (problem, config, layout): run(a, b, c, groups, stream). gemm_wgmma_sm90 (sm90
    config): persistent, tensor maps by address; gemm_mma_sm80 (sm80 config): one block per unit of the tile
    bound, plain pointers."""

    __slots__ = ("_main", "_maps")

    def __init__(self, kernel, p: gg.GroupedProblem, cfg, lay: Layout, sm_count: int):
        masked = p.mode == "masked"
        if cfg.kind == "sm80":
            self._maps = None
            units = shared.m_tiles_bound(p.mode, p.groups, lay.rows, cfg.bm) * math.ceil(p.n / cfg.bn)
            # m, n, k, lda, ldb, ldc, ldr, stride_a, stride_b, stride_c, stride_r, splits, kb_per_split, group_m, batch
            scalars = (lay.rows, p.n, p.k, lay.lda, lay.ldb, p.n, 0, lay.stride_a, lay.stride_b, lay.stride_c, 0, 1,
                       math.ceil(p.k / cfg.bk), cfg.group_m, p.groups)
            self._main = _Prepared(kernel, (max(1, units), 1, 1), (cfg.threads, 1, 1), gg.smem_bytes(p, cfg),
                                   [("u64", 0)] * 6 + [("i64", v) for v in scalars])
            return
        es = itemsize(p.dtype)
        # (dims innermost first, byte strides of dims 1 and 2, box) of A's and B's 3-d tensor maps
        map_a = ((p.k, lay.rows, p.groups if masked else 1), (lay.lda * es, lay.stride_a * es), (64, cfg.bm))
        if p.trans_b:
            map_b = ((p.k, p.n, p.groups), (lay.ldb * es, lay.stride_b * es), (64, cfg.bn))
        else:
            map_b = ((p.n, p.k, p.groups), (lay.ldb * es, lay.stride_b * es), (64, 64))
        self._maps = (_MapCache(p.dtype, *map_a), _MapCache(p.dtype, *map_b))
        if gg.stores_with_tma(p, cfg):  # c: boxes of 64 rows x 128 bytes; masked: the group is the batch coordinate
            osize = itemsize(p.out_dtype)
            self._maps += (_MapCache(p.out_dtype, (p.n, lay.rows, p.groups if masked else 1),
                                     (p.n * osize, lay.stride_c * osize), (128 // osize, 64)),)
        kb_total = math.ceil(p.k / 64)
        # m, n, k, ldc, ldr, stride_c, stride_r, batch (groups), b_batched, splits, kb_per_split, group_m
        scalars = (lay.rows, p.n, p.k, p.n, 0, lay.stride_c, 0, p.groups, 1, 1, kb_total, cfg.group_m)
        grid = shared.persistent_grid(p.mode, p.groups, lay.rows, p.n, cfg.bm, cfg.bn, sm_count)
        self._main = _Prepared(kernel, (grid, 1, 1), (cfg.threads, 1, 1), gg.smem_bytes(p, cfg),
                               [("map", bytes(128))] * len(self._maps) + [("u64", 0)] * 4
                               + [("i64", v) for v in scalars])

    def run(self, a: int, b: int, c: int, groups: int, stream: int) -> None:
        maps = self._maps
        if maps is None:
            self._main.run((a, b, c, 0, 0, groups), stream)
        elif len(maps) == 2:
            self._main.run((maps[0].get(a), maps[1].get(b), c, 0, 0, groups), stream)
        else:
            self._main.run((maps[0].get(a), maps[1].get(b), maps[2].get(c), c, 0, 0, groups), stream)


