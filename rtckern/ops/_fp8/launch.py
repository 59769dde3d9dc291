"""Prepared launches of the fp8 kernels: grid, block, shared memory and every scalar fixed once per call
signature; a call sets the addresses (and, on sm_90a, the tensor maps of a and b, and of c where the kernel stores
with TMA, cached per base address) and launches through Kernel.prepare."""
from __future__ import annotations

import math
from types import MappingProxyType

from rtckern.runtime.tma import encode_tiled

from .geometry import OUT_BYTES, SIMT_TILE, Fp8Problem

_KINDS = MappingProxyType({"map": "M", "u64": "P", "i64": "q"})
# The decode kernels, launched as programmatic dependents on sm_90: they wait for the previous kernel at their start
# (gemm_fp8_gemv.cuh, gemm_fp8_stream.cuh), so their launch overlaps its end: up to 14% of a call on 8-60 MB weights
# (H200, graph replays; docs/performance.md).
DEPENDENT_KINDS = frozenset(("gemv", "stream"))


class Prepared:
    """One kernel at fixed geometry; the first len(values) parameters are given per call."""

    __slots__ = ("kernel", "grid", "block", "smem", "params", "_go", "_tail")

    def __init__(self, kernel, grid: tuple, block: tuple, smem: int, params: list, dependent: bool = False):
        """dependent: a programmatic dependent launch on sm_90 (Kernel.prepare), for kernels that wait for the
        previous kernel before their first read (common/pdl.cuh)."""
        self.kernel, self.grid, self.block, self.smem = kernel, grid, block, int(smem)
        self.params = list(params)
        self._tail = None
        prepare = getattr(kernel, "prepare", None)
        self._go = prepare(grid, block, "".join(_KINDS[k] for k, _ in params), self.smem, dependent=dependent) \
            if prepare is not None else None

    def run(self, values: tuple, stream: int) -> None:
        tail = self._tail
        if tail is None:
            tail = self._tail = tuple(v for _, v in self.params[len(values):])
        if self._go is not None:
            self._go(stream, *values, *tail)
        else:  # a test double: records the launch
            self.kernel.launch(self.grid, self.block, tuple(values) + tail, shared_mem=self.smem, stream=stream)


class MapCache:
    """Tensor maps of one operand (dims, row stride in bytes, box; a batch of `batch` matrices `batch_stride` bytes
    apart for the grouped GEMM; fp8 unless `dtype` says otherwise) by base address."""

    __slots__ = ("dims", "stride", "box", "batch", "batch_stride", "dtype", "_by_ptr")

    def __init__(self, dims: tuple[int, int], stride: int, box: tuple[int, int], batch: int = 1,
                 batch_stride: int = 0, dtype: str = "fp8_e4m3"):
        self.dims, self.stride, self.box = dims, stride, box
        self.batch, self.batch_stride, self.dtype = batch, batch_stride, dtype
        self._by_ptr: dict[int, bytes] = {}

    def get(self, ptr: int) -> bytes:
        m = self._by_ptr.get(ptr)
        if m is None:
            if len(self._by_ptr) >= 64:
                self._by_ptr.clear()
            d0, d1 = self.dims
            # a batch of one: any legal stride will do
            bstride = self.batch_stride if self.batch > 1 else self.stride * d1
            m = self._by_ptr[ptr] = encode_tiled(self.dtype, ptr, (d0, d1, self.batch), (self.stride, bstride),
                                                 (self.box[0], self.box[1], 1))
        return m


def a_box_rows(p: Fp8Problem, cfg) -> int:
    """Rows of A's TMA box for the sm_90a kernel: what its producer expects per stage (gemm_fp8_sm90.cuh)."""
    return min(cfg.bm, p.m) if cfg.bm == 64 else cfg.bm


class GemmLaunch:
    """gemm_fp8 for one signature: run(a, b, c, sa, sb, bias, stream)."""

    __slots__ = ("_main", "_maps")

    def __init__(self, kernel, p: Fp8Problem, cfg, lda: int, ldb: int, scale_strides: tuple, sm_count: int):
        sa_row, sa_kb, sb_row, sb_kb = scale_strides
        if cfg is not None and cfg.kind != "sm90":  # the GEMV, streaming and mma.sync kernels: the skinny's parameters
            self._maps = None
            scalars = (p.m, p.n, p.k, lda, ldb, p.n, sa_row, sa_kb, sb_row, sb_kb)
            self._main = Prepared(kernel, *cfg.launch_geometry(p), [("u64", 0)] * 6 + [("i64", v) for v in scalars],
                                  dependent=cfg.kind in DEPENDENT_KINDS)
        elif cfg is not None:  # sm_90a
            # a multicast pair's blocks each load B's rows bn / 2 ..; units: tiles, or pairs of row blocks; cl: the
            # cluster size. A's box: 64-row tiles load min(m, 64) rows (a box past m zero-fills at TMA's cost), wider
            # tiles whole boxes: the kernel expects the same bytes per stage
            cl = cfg.cluster_size
            self._maps = (MapCache((p.k, p.m), lda, (128, a_box_rows(p, cfg))),
                          MapCache((p.k, p.n), ldb, (128, cfg.bn // cfg.cluster)))
            if cfg.tma_store(p):  # c: boxes of 64 rows x 128 bytes
                width = OUT_BYTES[p.out_dtype]
                self._maps += (MapCache((p.n, p.m), p.n * width, (128 // width, 64), dtype=p.out_dtype),)
            smem = cfg.launch_smem(p)
            units = math.ceil(math.ceil(p.m / cfg.bm) / cfg.cluster) * math.ceil(p.n / cfg.bn)
            resident = sm_count // cl
            if cl > 1:  # the GPCs leave fewer whole clusters than sm_count / cl: a grid past them runs a second wave
                fit = getattr(kernel, "max_active_clusters", lambda *a: -1)((cl, 1, 1), cfg.threads, smem)
                resident = fit if fit > 0 else resident
            scalars = (p.m, p.n, p.k, p.n, sa_row, sa_kb, sb_row, sb_kb, cfg.group_m)
            self._main = Prepared(kernel, (cl * max(1, min(units, resident)), 1, 1), (cfg.threads, 1, 1), smem,
                                  [("map", bytes(128))] * len(self._maps) + [("u64", 0)] * 4
                                  + [("i64", v) for v in scalars])
        else:
            self._maps = None
            bm, bn, threads = SIMT_TILE
            scalars = (p.m, p.n, p.k, lda, ldb, p.n, sa_row, sa_kb, sb_row, sb_kb)
            self._main = Prepared(kernel, (math.ceil(p.n / bn), math.ceil(p.m / bm), 1), (threads, 1, 1), 0,
                                  [("u64", 0)] * 6 + [("i64", v) for v in scalars])

    def run(self, a: int, b: int, c: int, sa: int, sb: int, bias: int, stream: int) -> None:
        maps = self._maps
        if maps is None:
            self._main.run((a, b, c, sa, sb, bias), stream)
        elif len(maps) == 2:
            self._main.run((maps[0].get(a), maps[1].get(b), c, sa, sb, bias), stream)
        else:
            self._main.run((maps[0].get(a), maps[1].get(b), maps[2].get(c), c, sa, sb, bias), stream)


QUANT_WARPS = 8


def quant_groups_per_block(elem_bytes: int, group: int) -> int:
    """Groups one block of quantize_fp8_groups covers (rtk_quant_fp8_geometry in gemm/quantize_fp8.cuh): lanes of
    max(16 bytes, group / 32 elements), so group / that lanes per group, 32 / those groups per warp and round, four
    rounds, QUANT_WARPS warps."""
    v = max(16 // elem_bytes, group // 32)
    return QUANT_WARPS * (32 // (group // v)) * 4


class QuantLaunch:
    """quantize_fp8 for one signature: run(x, q, s, stream)."""

    __slots__ = ("_main",)

    def __init__(self, kernel, m: int, k: int, group: int, ldx: int, s_row: int, s_col: int, elem_bytes: int):
        groups = m * (k // group)
        per_block = quant_groups_per_block(elem_bytes, group)
        self._main = Prepared(kernel, (max(1, math.ceil(groups / per_block)), 1, 1), (32 * QUANT_WARPS, 1, 1), 0,
                              [("u64", 0)] * 3 + [("i64", v) for v in (m, k, ldx, k, s_row, s_col)],
                              dependent=True)  # (it waits for the previous kernel: quantize_fp8.cuh)

    def run(self, x: int, q: int, s: int, stream: int) -> None:
        self._main.run((x, q, s), stream)
