"""Grouped fp8 GEMM plans (rtckern.ops.grouped_gemm_fp8 / grouped_gemm_fp8_masked): the problem record, the tile rule,
kernel specs and launch geometry of gemm_fp8_wgmma_sm90 compiled with RTK_GEMM_GROUPED (kernel_sources/gemm/
gemm_fp8_sm90.cuh and grouped.cuh). Nothing here validates user arrays (grouped.py does) or touches a GPU.

A request holds what decides compilation and the tile: output dtype, mode, groups, N, K and the rows per group as a
power of two (contiguous: total_m / groups, the average; masked: the capacity), so that calls whose token counts
change step to step share one request and one compiled kernel; the exact row count sizes the grid only. Scales are
the DeepSeek-V3 recipe's blocks (1 x 128 groups of a's rows, 128 x 128 blocks of each group's b).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rtckern.arch import Arch
from rtckern.spec import KernelSpec

from .. import _common_grouped as shared
from .geometry import OUT_BYTES, SMEM_LIMIT, Fp8Problem, Sm90Fp8Config, sm90_spec

OP = "grouped_gemm_fp8"
# less the kernel's static shared memory: its mbarriers, 16 bytes a stage (at most 8 stages: 128 bytes)
GROUPED_SMEM_LIMIT = SMEM_LIMIT - 256


@dataclass(frozen=True)
class GroupedFp8Problem:
    """One grouped fp8 GEMM call as far as kernel choice and compilation go. rows: rows per group as a power of two
    (_common_grouped.rows_class); aligned: a's and b's bases 16-byte aligned, row and group strides multiples of 16
    bytes."""

    mode: str
    groups: int
    rows: int
    n: int
    k: int
    out_dtype: str = "bf16"
    aligned: bool = True
    dtype: str = "fp8_e4m3"

    def dense(self) -> Fp8Problem:
        """The block-scaled GEMM whose kernel this one compiles with the grouped define (no bias)."""
        return Fp8Problem(m=self.rows, n=self.n, k=self.k, scale="block", out_dtype=self.out_dtype,
                          aligned=self.aligned, dtype=self.dtype)


def smem_bytes(p: GroupedFp8Problem, cfg: Sm90Fp8Config) -> int:
    """The ring, the store boxes (where the kernel stores with TMA) and the tile prefix."""
    return cfg.launch_smem(p.dense()) + shared.prefix_bytes(p.groups)


WIDE_ROWS = 256  # rows per group from which 2-byte outputs take 128 x 256 tiles


def config(p: GroupedFp8Problem) -> Sm90Fp8Config:
    """The tile by rows per group: 64-row tiles with one consumer up to 64 rows (decode-sized groups; a 128-row tile
    would be mostly padding); 128 x 256 from WIDE_ROWS for 2-byte outputs stored with TMA (half the L2 traffic per
    FLOP, as the dense GEMM's tuned rows; fp32 outputs spill beside its 256 accumulators, and outputs stored from
    registers at 128 x 256 are compiled spill-free but not measured); 128 x 128 with two consumers otherwise. The
    ring keeps the most stages that fit beside the store boxes and the tile prefix of many groups."""
    if p.rows <= 64:
        return Sm90Fp8Config(64, 128, 8, 1)
    wide = Sm90Fp8Config(128, 256, 4, 2)
    if p.rows >= WIDE_ROWS and OUT_BYTES.get(p.out_dtype) == 2 and wide.tma_store(p.dense()):
        cfg = wide
    else:
        cfg = Sm90Fp8Config(128, 128, 6, 2)
    while cfg.stages > 2 and smem_bytes(p, cfg) > GROUPED_SMEM_LIMIT:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


def invalid(p: GroupedFp8Problem, cfg: Sm90Fp8Config) -> str | None:
    """Why cfg cannot serve p (None when it can)."""
    if p.mode not in shared.MODES:
        return f"mode {p.mode!r}: supported {', '.join(shared.MODES)}"
    if not 1 <= p.groups <= shared.MAX_GROUPS:
        return f"{p.groups} groups: supported 1 to {shared.MAX_GROUPS} (the tile prefix lives in shared memory)"
    if cfg.cluster_size != 1:
        return f"cluster={cfg.cluster}, splits={cfg.splits}: the grouped kernel runs no clusters (B multicast and " \
               "split-K are the dense GEMM's)"
    why = cfg.invalid(p.dense())
    if why:
        return why
    if smem_bytes(p, cfg) > GROUPED_SMEM_LIMIT:
        return (f"{cfg.launch_smem(p.dense())} bytes of ring and store boxes and {shared.prefix_bytes(p.groups)} of "
                f"tile prefix exceed the {GROUPED_SMEM_LIMIT} bytes of shared memory a block may have")
    return None


def spec(p: GroupedFp8Problem, cfg: Sm90Fp8Config, arch: Arch) -> KernelSpec:
    base = sm90_spec(p.dense(), cfg, arch)  # the dense spec's defines kept (none for today's grouped configs)
    return dataclasses.replace(base, defines=base.defines + (("RTK_GEMM_GROUPED", str(shared.MODE_IDS[p.mode])),),
                               op=OP)
