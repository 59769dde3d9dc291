"""Grouped GEMM plans (rtckern.ops.grouped_gemm / grouped_gemm_masked): the problem record, the tile rules and kernel
specs of gemm_wgmma_sm90 and gemm_mma_sm80 compiled with RTK_GEMM_GROUPED (kernel_sources/gemm/gemm_sm90.cuh,
gemm_sm80.cuh and grouped.cuh). Nothing here validates user arrays (grouped.py does) or touches a GPU.

A request holds what decides compilation and the tile: dtypes, layout, mode, groups, N, K and the rows per group as
a power of two (contiguous: total_m / groups, the average; masked: the capacity), so that calls whose token counts
change step to step share one request and one compiled kernel. The exact row count sizes the grid only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rtckern.arch import Arch
from rtckern.spec import KernelSpec

from .. import _common_grouped as shared
from .geometry import (SM90_SMEM_LIMIT, GemmProblem, Sm80Config, Sm90Config, launch_smem, sm80_spec, sm90_spec,
                       tma_store)

OP = "grouped_gemm"


@dataclass(frozen=True)
class GroupedProblem:
    """One grouped GEMM call as far as kernel choice and compilation go. rows: rows per group as a power of two
    (_common_grouped.rows_class); aligned: a's and b's bases 16-byte aligned, row and group strides multiples of 8
    elements, K (and N with trans_b=False) multiples of 8 (TMA)."""

    mode: str
    groups: int
    rows: int
    n: int
    k: int
    dtype: str = "bf16"
    out_dtype: str = "bf16"
    trans_b: bool = True
    aligned: bool = True

    def dense(self) -> GemmProblem:
        """The batched GEMM whose kernel this one compiles with the grouped define (no epilogue, no split-K)."""
        return GemmProblem(batch=self.groups, m=self.rows, n=self.n, k=self.k, dtype=self.dtype,
                           out_dtype=self.out_dtype, trans_b=self.trans_b, aligned=self.aligned)


def stores_with_tma(p: GroupedProblem, cfg) -> bool:
    """The wgmma kernel stores c with TMA (geometry.tma_store, its store boxes beside the ring and the tile prefix)."""
    return cfg.kind == "sm90" and tma_store(p.dense(), cfg, shared.prefix_bytes(p.groups))


def smem_bytes(p: GroupedProblem, cfg) -> int:
    """Dynamic shared memory of a launch: the wgmma kernel keeps its store boxes (where it stores with TMA) and the
    tile prefix after its ring; the mma.sync kernel builds the prefix in the ring before the pipeline starts, so the
    ring must hold it."""
    prefix = shared.prefix_bytes(p.groups)
    if cfg.kind == "sm90":
        return launch_smem(p.dense(), cfg, prefix) + prefix
    return max(cfg.smem_bytes, prefix)


def sm90_config(p: GroupedProblem) -> Sm90Config:
    """The wgmma tile by rows per group where no tuned row serves (grouped_configs.py): up to 128 rows one 64 x 256
    consumer (the groups stream their experts' weights; each A byte comes back from L2 once per 256 columns, and a
    128-row tile would be half padding at 64 rows), above that the dense kernel's 128 x 256 with two consumers. Over
    the H100 sweeps of `rtckern tune grouped_gemm` (DeepSeek-V3 experts, 8-256 groups of 16-1024 rows) each is
    within 8% (64 x 256) and 11% (128 x 256) of the best tile of its range, where the earlier rule's 128 x 128 with 6
    stages at 65-256 rows was up to 1.69x slower. Cooperative schedule, no split-K."""
    if p.rows <= 128:
        return Sm90Config(64, 256, 5, 1)
    return Sm90Config(128, 256, 4, 2)


def sm80_config(p: GroupedProblem, device) -> Sm80Config:
    """The mma.sync tile (the fallback): the dense heuristic's tiles without split-K: 64 x 64 for groups of up to 64
    rows and for unaligned operands (element loads: the large tile spills), 128 x 128 otherwise (3 stages where a
    block has less than 96 KB of shared memory)."""
    if not p.aligned:
        return Sm80Config(64, 64, 64, 32, 32, 3)
    if p.rows <= 64:
        return Sm80Config(64, 64, 64, 32, 32, 4)
    small_smem = device.max_smem_per_block_optin < 96 * 1024
    return Sm80Config(128, 128, 32, 64, 64, 3 if small_smem else 4)


def invalid(p: GroupedProblem, cfg) -> str | None:
    """Why cfg cannot serve p (None when it can)."""
    if p.mode not in shared.MODES:
        return f"mode {p.mode!r}: supported {', '.join(shared.MODES)}"
    if not 1 <= p.groups <= shared.MAX_GROUPS:
        return f"{p.groups} groups: supported 1 to {shared.MAX_GROUPS} (the tile prefix lives in shared memory)"
    if cfg.splits != 1 or cfg.cluster:
        return "grouped GEMM takes no split-K"
    why = cfg.invalid(p.dense())
    if why:
        return why
    if smem_bytes(p, cfg) > SM90_SMEM_LIMIT:
        return (f"{cfg.smem_bytes} bytes of ring and {shared.prefix_bytes(p.groups)} of tile prefix exceed the "
                f"{SM90_SMEM_LIMIT} bytes of shared memory a block may have")
    return None


def spec(p: GroupedProblem, cfg, arch: Arch) -> KernelSpec:
    dense = sm90_spec(p.dense(), cfg, arch, shared.prefix_bytes(p.groups)) if cfg.kind == "sm90" \
        else sm80_spec(p.dense(), cfg, arch)
    return dataclasses.replace(dense, defines=dense.defines + (("RTK_GEMM_GROUPED", str(shared.MODE_IDS[p.mode])),),
                               op=OP)
