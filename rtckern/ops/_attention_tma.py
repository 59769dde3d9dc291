"""Host side of the TMA attention kernel (flash_fwd_sm90_ws): tensor maps over K and V, and a raw launch.

The kernel takes two CUtensorMap structs by value (128 bytes each, __grid_constant__), so it launches through
the core's Kernel.launch_packed (typed parameters, device context handled). Tensor maps are cached per (address, shape, strides, box): a model's K/V buffers repeat from call to
call, so the encode (a driver call) is paid once per buffer.
"""
from __future__ import annotations

import struct
import threading
from collections import OrderedDict

from rtckern.errors import LaunchError

_CACHE_SIZE = 512
_maps: "OrderedDict[tuple, bytes]" = OrderedDict()
_lock = threading.Lock()


def kv_tensor_map(dtype: str, t, box_rows: int) -> bytes:
    """CUtensorMap over a (batch, seqlen, heads, head_dim) array `t` (a Tensor4): dims innermost first
    (head_dim, seqlen, heads, batch), 128-byte swizzle, box (64, box_rows, 1, 1), zeros outside the tensor."""
    b, s, h, d = t.shape
    isz = t.itemsize
    row, head, batch = t.strides[1] * isz, t.strides[2] * isz, t.strides[0] * isz
    # Size-1 (or empty) dimensions may carry any stride in a view; TMA wants a legal one (a multiple of 16).
    if h <= 1:
        head = row * max(s, 1)
    if b <= 1:
        batch = head * max(h, 1)
    dims = (d, max(s, 1), max(h, 1), max(b, 1))
    key = (dtype, t.ptr, dims, row, head, batch, box_rows)
    with _lock:
        hit = _maps.get(key)
        if hit is not None:
            _maps.move_to_end(key)
            return hit
    from cuda.bindings import driver as drv

    dt = (drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if dtype == "bf16"
          else drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    err, tmap = drv.cuTensorMapEncodeTiled(
        dt, 4, t.ptr, [u64(x) for x in dims], [u64(row), u64(head), u64(batch)],
        [u32(64), u32(box_rows), u32(1), u32(1)], [u32(1)] * 4,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"cuTensorMapEncodeTiled failed ({err}) for a {dtype} tensor of shape {t.shape} at "
                          f"{t.ptr:#x}, byte strides (row {row}, head {head}, batch {batch}): TMA needs a 16-byte "
                          "aligned address and byte strides that are multiples of 16")
    raw = struct.pack("<16Q", *[int(x) for x in tmap.opaque])
    with _lock:
        _maps[key] = raw
        while len(_maps) > _CACHE_SIZE:
            _maps.popitem(last=False)
    return raw


def launch(kernel, grid, threads: int, smem: int, stream: int, params) -> None:
    """By-value TMA maps need typed parameters: the core's Kernel.launch_packed (device context handled);
    ("map", 128 bytes), ("u64"|"i64", int), ("f32", float)."""
    kernel.launch_packed(grid, (threads, 1, 1), params, smem, stream)
