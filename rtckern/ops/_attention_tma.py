"""Host side of the TMA attention kernel (flash_fwd_sm90_ws): tensor maps over K and V, and a raw launch.

The kernel takes two CUtensorMap structs by value (128 bytes each, __grid_constant__). rtckern's Kernel.launch
passes ints and numpy scalars only, so this kernel goes through cuLaunchKernel with one host buffer per
parameter. Tensor maps are cached per (address, shape, strides, box): a model's K/V buffers repeat from call to
call, so the encode (a driver call) is paid once per buffer.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from collections import OrderedDict

from rtckern.errors import LaunchError

_CACHE_SIZE = 512
_maps: "OrderedDict[tuple, bytes]" = OrderedDict()
_funcs: dict[int, object] = {}
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


def _function(kernel, smem: int):
    """The CUfunction of a loaded rtckern Kernel in the current context, with its dynamic shared memory limit."""
    key = (id(kernel), smem)
    f = _funcs.get(key)
    if f is not None:
        return f
    from cuda.bindings import driver as drv

    from rtckern.runtime.driver import on_device

    kernel.set_max_dynamic_shared_memory(smem)  # on the CUkernel, for this device
    handle = kernel.core.handle
    try:
        with on_device(kernel.device.ordinal):  # the function of the kernel's device, whatever is current
            err, f = drv.cuKernelGetFunction(handle)
    except Exception:  # a handle type this binding does not take here: cuLaunchKernel takes a CUkernel too
        err, f = None, handle
    if err == drv.CUresult.CUDA_SUCCESS:
        err, = drv.cuFuncSetAttribute(f, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      int(smem))
        if err != drv.CUresult.CUDA_SUCCESS:
            raise LaunchError(f"cuFuncSetAttribute(max dynamic shared memory = {smem}) failed ({err}) for "
                              f"{kernel.label}")
    elif err is not None:
        f = handle
    _funcs[key] = f
    return f


def launch(kernel, grid, threads: int, smem: int, stream: int, params) -> None:
    """cuLaunchKernel with each parameter in its own host buffer: ("map", 128 bytes), ("u64"|"i64", int),
    ("f32", float)."""
    from cuda.bindings import driver as drv

    holders = []
    for kind, val in params:
        if kind == "map":
            holders.append((ctypes.c_uint64 * 16).from_buffer_copy(val))
        elif kind == "u64":
            holders.append(ctypes.c_uint64(int(val)))
        elif kind == "i64":
            holders.append(ctypes.c_int64(int(val)))
        else:
            holders.append(ctypes.c_float(float(val)))
    ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    f = _function(kernel, smem)
    err, = drv.cuLaunchKernel(f, grid[0], grid[1], grid[2], threads, 1, 1, int(smem), drv.CUstream(int(stream)),
                              ctypes.addressof(ptrs), 0)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"launch of {kernel.label} failed: {err} (grid {grid}, block {threads}, shared memory "
                          f"{smem})")
