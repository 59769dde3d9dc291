"""GEMM launches: grids, argument lists, TMA tensor maps and the split-K reduce, for a settled plan.

`LaunchPlan` fixes everything about one call signature except the operand addresses: grids, blocks, shared memory,
every scalar argument, and the packed parameter buffers of each kernel. A repeated call writes five addresses
(and, on the sm_90a path, two tensor maps cached per address) into those buffers and launches: no argument lists
are built, no configs looked up, nothing re-validated.

Each kernel's launch is a `rtckern.runtime.PreparedLaunch` (the runtime's one raw launch: parameter block packed
once, device context handled); tensor maps come from `rtckern.runtime.tma` (one encoder, one cache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rtckern.dtypes import itemsize
from rtckern.errors import LaunchError
from rtckern.runtime.prepared import PreparedLaunch
from rtckern.runtime.streams import stream_handle
from rtckern.runtime.tma import MapLayout

from ._gemm_plan import GemmProblem, normalize_splits, plan_workspace_bytes

REDUCE_THREADS = 256


@dataclass(frozen=True)
class Operands:
    """Device addresses and strides (in elements) of one call; 0 for an absent bias or residual."""

    a: int
    b: int
    c: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    bias: int = 0
    res: int = 0
    ldr: int = 0
    stride_r: int = 0


def launch(kernels, p: GemmProblem, cfg, ops: Operands, *, stream=None, sm_count: int, workspace: int = 0) -> None:
    """Run the plan once: main kernel (+ split-K reduce). `workspace`: device address of
    `plan_workspace_bytes(p, cfg)` bytes when the plan splits K through a workspace."""
    plan = LaunchPlan(kernels, p, cfg, ops, sm_count)
    plan.run(ops.a, ops.b, ops.c, ops.bias, ops.res, _stream_handle(stream), workspace)


class LaunchPlan:
    """The launches of one (problem, config, strides) with the operand addresses left open: `run(a, b, c, bias,
    res, stream, workspace)`. `workspace_bytes`: the global scratch `run` needs (0 for none)."""

    __slots__ = ("p", "cfg", "workspace_bytes", "_main", "_reduce", "_maps", "_kind", "_ws_split")

    def __init__(self, kernels, p: GemmProblem, cfg, ops: Operands, sm_count: int):
        self.p, self.cfg = p, cfg
        self._reduce = None
        self._maps = None
        self._kind = cfg.kind
        if cfg.kind == "simt":
            self.workspace_bytes, self._ws_split = 0, False
            args = (p.m, p.n, p.k, ops.lda, ops.ldb, ops.ldc, ops.ldr, ops.stride_a,
                    ops.stride_b if p.b_batched else 0, ops.stride_c, ops.stride_r)
            self._main = _prepared(kernels[0], (math.ceil(p.n / 64), math.ceil(p.m / 64), p.batch), 256, 0, 0, 5,
                                   args)
            return
        bk = cfg.bk if cfg.kind == "sm80" else 64
        splits, per = normalize_splits(p, bk, cfg.splits)
        if splits != cfg.splits:
            # The kernel specs (split-K or not) and the reduce follow cfg.splits; launching another count would
            # add partial sums nobody wrote. Plans settle the count first (_gemm_plan.with_splits).
            raise LaunchError(f"GEMM plan {cfg.as_dict()} splits K {cfg.splits} ways, but k={p.k} allows {splits} "
                              "non-empty splits; settle the plan with _gemm_plan.with_splits(cfg, problem, sm_count)")
        self.workspace_bytes = plan_workspace_bytes(p, cfg)
        self._ws_split = self.workspace_bytes > 0
        if cfg.kind == "sm80":
            tiles = math.ceil(p.m / cfg.bm) * math.ceil(p.n / cfg.bn)
            args = (p.m, p.n, p.k, ops.lda, ops.ldb, ops.ldc, ops.ldr, ops.stride_a,
                    ops.stride_b if p.b_batched else 0, ops.stride_c, ops.stride_r, splits, per, cfg.group_m)
            self._main = _prepared(kernels[0], (tiles, splits, p.batch), cfg.threads, cfg.smem_bytes, 0, 5, args)
        else:
            esize = itemsize(p.dtype)
            bb = p.batch if p.b_batched else 1
            # (dims innermost first, byte strides of dims 1 and 2, box) of A's and B's tensor maps
            map_a = ((p.k, p.m, p.batch), (ops.lda * esize, ops.stride_a * esize), (64, cfg.bm))
            if p.trans_b:
                map_b = ((p.k, p.n, bb), (ops.ldb * esize, ops.stride_b * esize), (64, cfg.bn))
            else:
                map_b = ((p.n, p.k, bb), (ops.ldb * esize, ops.stride_b * esize), (64, 64))
            self._maps = (map_layout(p.dtype, *map_a), map_layout(p.dtype, *map_b))
            units = p.batch * splits * math.ceil(p.m / cfg.bm) * math.ceil(p.n / cfg.bn)
            # Persistent: at most one block per SM. Cluster split-K: one block per unit (the cluster barrier
            # needs every block of a cluster on the same unit).
            grid = units if cfg.cluster else max(1, min(units, sm_count))
            scalars = (p.m, p.n, p.k, ops.ldc, ops.ldr, ops.stride_c, ops.stride_r, p.batch, int(p.b_batched),
                       splits, per, cfg.group_m)
            self._main = _prepared(kernels[0], (grid, 1, 1), (cfg.threads, 1, 1), cfg.smem_bytes, 2, 3, scalars)
        if self._ws_split:
            total = p.batch * p.m * p.n
            grid = max(1, min(math.ceil(total / REDUCE_THREADS), sm_count * 16))
            args = (p.m, p.n, ops.ldc, ops.ldr, ops.stride_c, ops.stride_r, p.batch, splits)
            self._reduce = _prepared(kernels[1], grid, REDUCE_THREADS, 0, 0, 4, args)

    def run(self, a: int, b: int, c: int, bias: int, res: int, stream: int, workspace: int = 0) -> None:
        """Launch on `stream` (an int handle; 0 for the default stream)."""
        target = c
        if self._ws_split:
            if not workspace:
                raise LaunchError(f"GEMM plan {self.cfg.as_dict()} splits K {self.cfg.splits} ways through a "
                                  "workspace but no workspace was given")
            target = workspace
        if self._maps is None:
            self._main.launch(stream, a, b, target, bias, res)
        else:
            ma, mb = self._maps
            self._main.launch(stream, ma.at(a), mb.at(b), target, bias, res)
        if self._reduce is not None:
            self._reduce.launch(stream, workspace, c, bias, res)


def _prepared(kernel, grid, block, smem: int, maps: int, pointers: int, scalars) -> PreparedLaunch:
    """A kernel's launch with `maps` tensor maps, then `pointers` addresses (set per call), then 64-bit scalars."""
    types = ["map"] * maps + ["ptr"] * pointers + ["i64"] * len(scalars)
    return PreparedLaunch(kernel, grid, block, smem, types, [None] * (maps + pointers) + [int(v) for v in scalars])


# -- sm_90a tensor maps ----------------------------------------------------------------------------------------------
def map_layout(dtype: str, dims: tuple[int, int, int], strides: tuple[int, int], box: tuple[int, int]) -> MapLayout:
    """The 3-d tensor-map layout (the core's encoder and its one cache: SWIZZLE_128B, zero fill out of range):
    dims innermost first, strides in bytes of dims 1 and 2, box (inner, outer, 1)."""
    d0, d1, d2 = (int(x) for x in dims)
    s1, s2 = int(strides[0]), int(strides[1])
    if d2 == 1 or s2 == 0:
        s2 = s1 * d1  # a batch dimension of one (or a broadcast operand): any legal stride will do
    return MapLayout(dtype, (d0, d1, d2), (s1, s2), (int(box[0]), int(box[1]), 1))


def _stream_handle(stream) -> int:
    """The int handle of `stream` (None: the default stream), through the core's one implementation."""
    if stream is None:
        return 0
    try:
        return stream_handle(stream)
    except TypeError:
        raise LaunchError(f"cannot get a CUDA stream handle from {stream!r}") from None
