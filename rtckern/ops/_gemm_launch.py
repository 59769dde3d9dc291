"""GEMM launches: grids, argument lists, TMA tensor maps and the split-K reduce, for a settled plan.

The sm_90a kernel takes two CUtensorMap structs by value (128 bytes each), so it launches through the core's
`Kernel.launch_packed` (`_raw_launch`); the other kernels use `Kernel.launch`.
"""
from __future__ import annotations

import math
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

from rtckern.errors import LaunchError

from ._gemm_plan import ITEMSIZE, GemmProblem, normalize_splits

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
    """Run the plan: main kernel (+ split-K reduce). `workspace`: device address of
    `workspace_bytes(p, cfg.splits)` bytes when cfg.splits > 1."""
    if cfg.kind == "simt":
        _launch_simt(kernels[0], p, ops, stream)
        return
    settled, _ = normalize_splits(p, cfg.bk if cfg.kind == "sm80" else 64, cfg.splits)
    if settled != cfg.splits:
        # The kernel specs (split-K or not) and the reduce follow cfg.splits; launching another count would add
        # partial sums nobody wrote. Plans settle the count first (_gemm_plan.with_splits).
        raise LaunchError(f"GEMM plan {cfg.as_dict()} splits K {cfg.splits} ways, but k={p.k} allows {settled} "
                          "non-empty splits; settle the plan with _gemm_plan.with_splits(cfg, problem, sm_count)")
    split = cfg.splits > 1
    if split and not workspace:
        raise LaunchError(f"GEMM plan {cfg} splits K {cfg.splits} ways but no workspace was given")
    target = workspace if split else ops.c
    if cfg.kind == "sm80":
        _launch_sm80(kernels[0], p, cfg, ops, target, stream)
    else:
        _launch_sm90(kernels[0], p, cfg, ops, target, stream, sm_count)
    if split:
        _launch_reduce(kernels[1], p, cfg.splits, ops, workspace, stream, sm_count)


def _launch_sm80(kernel, p, cfg, ops, target, stream) -> None:
    splits, per = normalize_splits(p, cfg.bk, cfg.splits)
    tiles = math.ceil(p.m / cfg.bm) * math.ceil(p.n / cfg.bn)
    args = (ops.a, ops.b, target, ops.bias, ops.res, p.m, p.n, p.k, ops.lda, ops.ldb, ops.ldc, ops.ldr,
            ops.stride_a, ops.stride_b if p.b_batched else 0, ops.stride_c, ops.stride_r, splits, per, cfg.group_m)
    kernel.launch((tiles, splits, p.batch), cfg.threads, args, shared_mem=cfg.smem_bytes, stream=stream)


def _launch_simt(kernel, p, ops, stream) -> None:
    args = (ops.a, ops.b, ops.c, ops.bias, ops.res, p.m, p.n, p.k, ops.lda, ops.ldb, ops.ldc, ops.ldr,
            ops.stride_a, ops.stride_b if p.b_batched else 0, ops.stride_c, ops.stride_r)
    kernel.launch((math.ceil(p.n / 64), math.ceil(p.m / 64), p.batch), 256, args, stream=stream)


def _launch_reduce(kernel, p, splits, ops, workspace, stream, sm_count) -> None:
    total = p.batch * p.m * p.n
    grid = max(1, min(math.ceil(total / REDUCE_THREADS), sm_count * 16))
    args = (workspace, ops.c, ops.bias, ops.res, p.m, p.n, ops.ldc, ops.ldr, ops.stride_c, ops.stride_r, p.batch,
            splits)
    kernel.launch(grid, REDUCE_THREADS, args, stream=stream)


# -- sm_90a: tensor maps and the raw launch --------------------------------------------------------------------------
def _launch_sm90(kernel, p, cfg, ops, target, stream, sm_count) -> None:
    splits, per = normalize_splits(p, 64, cfg.splits)
    esize = ITEMSIZE[p.dtype]
    tm_a = tensor_map(p.dtype, ops.a, (p.k, p.m, p.batch), (ops.lda * esize, ops.stride_a * esize), (64, cfg.bm))
    bb = p.batch if p.b_batched else 1
    if p.trans_b:
        tm_b = tensor_map(p.dtype, ops.b, (p.k, p.n, bb), (ops.ldb * esize, ops.stride_b * esize), (64, cfg.bn))
    else:
        tm_b = tensor_map(p.dtype, ops.b, (p.n, p.k, bb), (ops.ldb * esize, ops.stride_b * esize), (64, 64))
    units = p.batch * splits * math.ceil(p.m / cfg.bm) * math.ceil(p.n / cfg.bn)
    grid = max(1, min(units, sm_count))
    _ensure_smem(kernel, cfg.smem_bytes)
    params = [("map", tm_a), ("map", tm_b), ("u64", target), ("u64", ops.bias), ("u64", ops.res)]
    params += [("i64", v) for v in (p.m, p.n, p.k, ops.ldc, ops.ldr, ops.stride_c, ops.stride_r, p.batch,
                                    int(p.b_batched), splits, per, cfg.group_m)]
    _raw_launch(kernel, (grid, 1, 1), (cfg.threads, 1, 1), cfg.smem_bytes, stream, params)


_smem_done: set = set()


def _ensure_smem(kernel, nbytes: int) -> None:
    key = (id(kernel), nbytes)
    if key not in _smem_done:
        kernel.set_max_dynamic_shared_memory(nbytes)
        _smem_done.add(key)


_TMA_CACHE_SIZE = 256
_tma_cache: "OrderedDict[tuple, bytes]" = OrderedDict()
_tma_lock = threading.Lock()


def tensor_map(dtype: str, ptr: int, dims: tuple[int, int, int], strides: tuple[int, int],
               box: tuple[int, int]) -> bytes:
    """128 bytes of a 3-d CUtensorMap (SWIZZLE_128B, zero fill out of range) over ptr: dims innermost first,
    strides in bytes of dims 1 and 2, box (inner, outer, 1). Cached: a weight reused across calls is encoded once."""
    d0, d1, d2 = (int(x) for x in dims)
    s1, s2 = int(strides[0]), int(strides[1])
    if d2 == 1 or s2 == 0:
        s2 = s1 * d1  # a batch dimension of one (or a broadcast operand): any legal stride will do
    key = (dtype, ptr, d0, d1, d2, s1, s2, box)
    with _tma_lock:
        hit = _tma_cache.get(key)
        if hit is not None:
            _tma_cache.move_to_end(key)
            return hit
    from cuda.bindings import driver as drv

    dt = (drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if dtype == "bf16"
          else drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t  # older cuda-bindings refuse plain ints here
    err, tmap = drv.cuTensorMapEncodeTiled(
        dt, 3, ptr, [u64(d0), u64(d1), u64(d2)], [u64(s1), u64(s2)], [u32(int(box[0])), u32(int(box[1])), u32(1)],
        [u32(1), u32(1), u32(1)],
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"cuTensorMapEncodeTiled failed ({err}) for {dtype} tensor at 0x{ptr:x}, dims {dims}, "
                          f"byte strides {(s1, s2)}, box {box}: TMA needs a 16-byte aligned base and byte strides "
                          "that are multiples of 16")
    raw = struct.pack("<16Q", *[int(x) for x in tmap.opaque])
    with _tma_lock:
        _tma_cache[key] = raw
        while len(_tma_cache) > _TMA_CACHE_SIZE:
            _tma_cache.popitem(last=False)
    return raw


def _stream_handle(stream) -> int:
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        h = getattr(stream, attr, None)
        if h is not None:
            return int(h)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    raise LaunchError(f"cannot get a CUDA stream handle from {stream!r}")


def _raw_launch(kernel, grid, block, smem: int, stream, params) -> None:
    """By-value TMA maps need typed parameters: the core's Kernel.launch_packed (device context handled)."""
    kernel.launch_packed(grid, block, params, smem, _stream_handle(stream))
