"""GEMM launches: grids, argument lists, TMA tensor maps and the split-K reduce, for a settled plan.

`LaunchPlan` fixes everything about one call signature except the operand addresses: grids, blocks, shared memory,
every scalar argument, and the packed parameter buffers of each kernel. A repeated call writes five addresses (and,
on the sm_90a path, the tensor maps of a and b, and of c where the kernel stores with TMA, cached per address) into
those buffers and launches: no argument lists are built, no configs looked up, nothing re-validated.

Launch route: kernels loaded by the core (`rtckern.runtime.Kernel`) on a process that uses one device are launched
with `cuLaunchKernel` straight from the prepacked buffers (the core's `Kernel.launch` / `launch_packed` build
their parameter lists per call, a few microseconds each). With several devices in use, and for anything that is
not a core Kernel (test doubles), the plan goes through `Kernel.launch` / `Kernel.launch_packed`, which make the
kernel's own device context current.
"""
from __future__ import annotations

import math
from types import MappingProxyType
from dataclasses import dataclass

from rtckern.caches import PlanCache
from rtckern.dtypes import itemsize
from rtckern.errors import LaunchError
from rtckern.runtime.streams import stream_handle
from rtckern.runtime.tma import encode_tiled

from .geometry import GemmProblem, launch_smem, normalize_splits, plan_workspace_bytes, tma_store

REDUCE_THREADS = 256
_DEFAULT_DYN_SMEM = 48 * 1024


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
    plan.run(ops.a, ops.b, ops.c, ops.bias, ops.res, stream_int(stream), workspace)


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
            self._main = _Prepared(kernels[0], (math.ceil(p.n / 64), math.ceil(p.m / 64), p.batch), 256, 0,
                                   [("u64", 0)] * 5 + [("i64", v) for v in args])
            return
        bk = cfg.bk if cfg.kind == "sm80" else 64
        splits, per = normalize_splits(p, bk, cfg.splits)
        if splits != cfg.splits:
            # The kernel specs (split-K or not) and the reduce follow cfg.splits; launching another count would
            # add partial sums nobody wrote. Plans settle the count first (geometry.with_splits).
            raise LaunchError(f"GEMM plan {cfg.as_dict()} splits K {cfg.splits} ways, but k={p.k} allows {splits} "
                              "non-empty splits; settle the plan with geometry.with_splits(cfg, problem, sm_count)")
        self.workspace_bytes = plan_workspace_bytes(p, cfg)
        self._ws_split = self.workspace_bytes > 0
        if cfg.kind == "sm80":
            tiles = math.ceil(p.m / cfg.bm) * math.ceil(p.n / cfg.bn)
            args = (p.m, p.n, p.k, ops.lda, ops.ldb, ops.ldc, ops.ldr, ops.stride_a,
                    ops.stride_b if p.b_batched else 0, ops.stride_c, ops.stride_r, splits, per, cfg.group_m)
            self._main = _Prepared(kernels[0], (tiles, splits, p.batch), cfg.threads, cfg.smem_bytes,
                                   [("u64", 0)] * 5 + [("i64", v) for v in args])
        else:
            esize = itemsize(p.dtype)
            bb = p.batch if p.b_batched else 1
            # (dims innermost first, byte strides of dims 1 and 2, box) of A's and B's tensor maps
            map_a = ((p.k, p.m, p.batch), (ops.lda * esize, ops.stride_a * esize), (64, cfg.bm))
            if p.trans_b:
                map_b = ((p.k, p.n, bb), (ops.ldb * esize, ops.stride_b * esize), (64, cfg.bn))
            else:
                map_b = ((p.n, p.k, bb), (ops.ldb * esize, ops.stride_b * esize), (64, 64))
            self._maps = (_MapCache(p.dtype, *map_a), _MapCache(p.dtype, *map_b))
            if tma_store(p, cfg):  # c: boxes of 64 rows x 128 bytes
                osize = itemsize(p.out_dtype)
                if (ops.ldc * osize) % 16 or (ops.stride_c * osize) % 16:
                    raise LaunchError(f"GEMM plan {cfg.as_dict()} stores c with TMA, whose row and batch strides must "
                                      f"be 16-byte multiples; got ldc={ops.ldc}, stride_c={ops.stride_c} elements of "
                                      f"{osize} bytes (the op's own output has ldc = n)")
                self._maps += (_MapCache(p.out_dtype, (p.n, p.m, p.batch), (ops.ldc * osize, ops.stride_c * osize),
                                         (128 // osize, 64)),)
            units = p.batch * splits * math.ceil(p.m / cfg.bm) * math.ceil(p.n / cfg.bn)
            # Persistent: at most one block per SM. Cluster split-K: one block per unit (the cluster barrier
            # needs every block of a cluster on the same unit).
            grid = units if cfg.cluster else max(1, min(units, sm_count))
            scalars = (p.m, p.n, p.k, ops.ldc, ops.ldr, ops.stride_c, ops.stride_r, p.batch, int(p.b_batched),
                       splits, per, cfg.group_m)
            self._main = _Prepared(kernels[0], (grid, 1, 1), (cfg.threads, 1, 1), launch_smem(p, cfg),
                                   [("map", bytes(128))] * len(self._maps) + [("u64", 0), ("u64", 0), ("u64", 0)]
                                   + [("i64", v) for v in scalars])
        if self._ws_split:
            total = p.batch * p.m * p.n
            grid = max(1, min(math.ceil(total / REDUCE_THREADS), sm_count * 16))
            args = (p.m, p.n, ops.ldc, ops.ldr, ops.stride_c, ops.stride_r, p.batch, splits)
            self._reduce = _Prepared(kernels[1], grid, REDUCE_THREADS, 0,
                                     [("u64", 0)] * 4 + [("i64", v) for v in args])

    def run(self, a: int, b: int, c: int, bias: int, res: int, stream: int, workspace: int = 0) -> None:
        """Launch on `stream` (an int handle; 0 for the default stream)."""
        target = c
        if self._ws_split:
            if not workspace:
                raise LaunchError(f"GEMM plan {self.cfg.as_dict()} splits K {self.cfg.splits} ways through a "
                                  "workspace but no workspace was given")
            target = workspace
        maps = self._maps
        if maps is None:
            self._main.run((a, b, target, bias, res), stream)
        elif len(maps) == 2:
            self._main.run((maps[0].get(a), maps[1].get(b), target, bias, res), stream)
        else:
            self._main.run((maps[0].get(a), maps[1].get(b), maps[2].get(c), c, bias, res), stream)
        if self._reduce is not None:
            self._reduce.run((workspace, c, bias, res), stream)


# -- prepared launches ---------------------------------------------------------------------------------------------
_smem_done = PlanCache("gemm.smem_attribute_set")  # (id(kernel), bytes); emptied with the kernels
_KINDS = MappingProxyType({"map": "M", "u64": "P", "i64": "q"})  # params' kinds -> Kernel.prepare's


class _Prepared:
    """One kernel's launch with fixed geometry and scalars; the first len(values) parameters are set per call.
    params: [(kind, value)] with kind "u64" / "i64" (8 bytes) or "map" (a 128-byte CUtensorMap, by value).
    A CUDA kernel launches through Kernel.prepare (the native launcher where it is built); a HIP kernel through
    its launch / launch_packed."""

    __slots__ = ("kernel", "grid", "block", "smem", "kinds", "params", "_has_maps", "_go", "_tail")

    def __init__(self, kernel, grid, block, smem: int, params: list):
        self.kernel, self.smem = kernel, int(smem)
        self.grid = grid if isinstance(grid, tuple) else (int(grid), 1, 1)
        self.block = block if isinstance(block, tuple) else (int(block), 1, 1)
        self.kinds = [k for k, _ in params]
        self.params = list(params)
        self._has_maps = "map" in self.kinds
        self._tail = None  # the fixed parameters after the per-call values, on the first run
        prepare = getattr(kernel, "prepare", None)
        self._go = prepare(self.grid, self.block, "".join(_KINDS[k] for k in self.kinds), self.smem) \
            if prepare is not None else None
        if self._go is None and self.smem > _DEFAULT_DYN_SMEM and (id(kernel), self.smem) not in _smem_done:
            setter = getattr(kernel, "set_max_dynamic_shared_memory", None)
            if setter is not None:
                setter(self.smem)
            _smem_done.put((id(kernel), self.smem), True)

    def run(self, values: tuple, stream: int) -> None:
        go = self._go
        if go is not None:
            tail = self._tail
            if tail is None:
                tail = self._tail = tuple(v for _, v in self.params[len(values):])
            go(stream, *values, *tail)
            return
        n = len(values)
        if self._has_maps:
            params = [(k, v) for k, v in zip(self.kinds[:n], values)] + self.params[n:]
            self.kernel.launch_packed(self.grid, self.block, params, self.smem, stream)
        else:
            args = tuple(values) + tuple(v for _, v in self.params[n:])
            self.kernel.launch(self.grid, self.block, args, shared_mem=self.smem, stream=stream)


# -- sm_90a tensor maps ----------------------------------------------------------------------------------------------
class _MapCache:
    """Tensor maps of one (dtype, dims, strides, box) by base address: a weight reused across calls is encoded
    once, and a repeated call is one dict lookup."""

    __slots__ = ("dtype", "dims", "strides", "box", "_by_ptr")

    def __init__(self, dtype, dims, strides, box):
        self.dtype, self.dims, self.strides, self.box = dtype, dims, strides, box
        self._by_ptr: dict[int, bytes] = {}

    def get(self, ptr: int) -> bytes:
        m = self._by_ptr.get(ptr)
        if m is None:
            if len(self._by_ptr) >= 64:
                self._by_ptr.clear()
            m = self._by_ptr[ptr] = tensor_map(self.dtype, ptr, self.dims, self.strides, self.box)
        return m


def tensor_map(dtype: str, ptr: int, dims: tuple[int, int, int], strides: tuple[int, int],
               box: tuple[int, int]) -> bytes:
    """128 bytes of a 3-d CUtensorMap (the core's encoder: SWIZZLE_128B, zero fill out of range) over ptr: dims
    innermost first, strides in bytes of dims 1 and 2, box (inner, outer, 1). Cached per buffer."""
    d0, d1, d2 = (int(x) for x in dims)
    s1, s2 = int(strides[0]), int(strides[1])
    if d2 == 1 or s2 == 0:
        s2 = s1 * d1  # a batch dimension of one (or a broadcast operand): any legal stride will do
    return encode_tiled(dtype, ptr, (d0, d1, d2), (s1, s2), (int(box[0]), int(box[1]), 1))


def stream_int(stream) -> int:
    """The int handle of `stream` (None: the default stream), through the core's one implementation."""
    if stream is None:
        return 0
    try:
        return stream_handle(stream)
    except TypeError:
        raise LaunchError(f"cannot get a CUDA stream handle from {stream!r}") from None
