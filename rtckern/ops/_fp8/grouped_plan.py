"""The hot path of grouped_gemm_fp8 / grouped_gemm_fp8_masked: one call signature, decided once. The plan
(rtckern.ops._common.OutputPlan) holds the output's shape and dtype and the prepared launch (`GroupedLaunch`: tensor
maps by address, every scalar fixed); a repeated call allocates the output, reads the current stream and launches.
`plans` is the memo (grouped.py keys it by everything the checks read). The group index is passed by address: its values
never reach the host.
"""
from __future__ import annotations

from dataclasses import dataclass

from rtckern.caches import PlanCache

from .. import _common_grouped as shared
from . import grouped_geometry as gg
from .geometry import OUT_BYTES, Sm90Fp8Config
from .launch import MapCache, Prepared

plans = PlanCache("grouped_gemm_fp8.call_plans")


@dataclass(frozen=True)
class Layout:
    """One call's exact rows (contiguous: total_m; masked: the capacity) and element strides: a's rows and groups
    (masked), b's rows and groups, the output's groups (masked; else 0), and the scales' (row, K block, group)
    strides (a_scale's group stride 0 in contiguous mode: its rows are a's)."""

    rows: int
    lda: int
    stride_a: int
    ldb: int
    stride_b: int
    stride_c: int
    sa: tuple[int, int, int]
    sb: tuple[int, int, int]


class GroupedLaunch:
    """gemm_fp8_wgmma_sm90 with RTK_GEMM_GROUPED for one (problem, config, layout):
    run(a, b, c, a_scale, b_scale, groups, stream)."""

    __slots__ = ("_main", "_maps")

    def __init__(self, kernel, p: gg.GroupedFp8Problem, cfg: Sm90Fp8Config, lay: Layout, sm_count: int):
        masked = p.mode == "masked"
        self._maps = (MapCache((p.k, lay.rows), lay.lda, (128, cfg.bm), p.groups if masked else 1, lay.stride_a),
                      MapCache((p.k, p.n), lay.ldb, (128, cfg.bn), p.groups, lay.stride_b))
        if cfg.tma_store(p.dense()):  # c: boxes of 64 rows x 128 bytes; masked: the group is the batch coordinate
            width = OUT_BYTES[p.out_dtype]
            self._maps += (MapCache((p.n, lay.rows), p.n * width, (128 // width, 64), p.groups if masked else 1,
                                    lay.stride_c * width, dtype=p.out_dtype),)
        (sa_row, sa_kb, sa_batch), (sb_row, sb_kb, sb_batch) = lay.sa, lay.sb
        # m, n, k, ldc, sa_row, sa_kb, sb_row, sb_kb, group_m, then batch (groups), stride_c, sa_batch, sb_batch
        scalars = (lay.rows, p.n, p.k, p.n, sa_row, sa_kb, sb_row, sb_kb, cfg.group_m, p.groups, lay.stride_c,
                   sa_batch, sb_batch)
        grid = shared.persistent_grid(p.mode, p.groups, lay.rows, p.n, cfg.bm, cfg.bn, sm_count)
        self._main = Prepared(kernel, (grid, 1, 1), (cfg.threads, 1, 1), gg.smem_bytes(p, cfg),
                              [("map", bytes(128))] * len(self._maps) + [("u64", 0)] * 5
                              + [("i64", v) for v in scalars])

    def run(self, a: int, b: int, c: int, sa: int, sb: int, groups: int, stream: int) -> None:
        maps = self._maps
        if len(maps) == 2:
            self._main.run((maps[0].get(a), maps[1].get(b), c, sa, sb, 0, groups), stream)
        else:
            self._main.run((maps[0].get(a), maps[1].get(b), maps[2].get(c), c, sa, sb, 0, groups), stream)


