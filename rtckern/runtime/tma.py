"""TMA tensor maps (sm_90+): the 128-byte CUtensorMap that `cp.async.bulk.tensor` reads, encoded by the driver and
passed to kernels by value (`Kernel.launch_packed`). One encoder for every family: 32-bit, 16-bit or 8-bit (fp8, as
uint8) elements, 128-byte
swizzle, L2 256-byte promotion, zero fill outside the tensor. Maps are cached per (dtype, address, dims, strides,
box): a model's buffers repeat from call to call, so the driver call is paid once per buffer.
"""
from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from typing import Sequence

from rtckern.errors import LaunchError

CACHE_SIZE = 512
_cache: "OrderedDict[tuple, bytes]" = OrderedDict()
_lock = threading.Lock()
_TYPES = {"bf16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "fp16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
          "fp32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32",
          "fp8_e4m3": "CU_TENSOR_MAP_DATA_TYPE_UINT8", "fp8_e5m2": "CU_TENSOR_MAP_DATA_TYPE_UINT8",
          "uint8": "CU_TENSOR_MAP_DATA_TYPE_UINT8"}


def encode_tiled(dtype: str, ptr: int, dims: Sequence[int], byte_strides: Sequence[int],
                 box: Sequence[int]) -> bytes:
    """128 bytes of a tiled CUtensorMap over `ptr`: `dims` innermost first, `byte_strides` of dims 1.. (one fewer than
    dims), `box` per dim. dtype: "fp32", "bf16", "fp16" or an 8-bit type ("fp8_e4m3", "fp8_e5m2", "uint8": TMA moves
    them as uint8). Raises LaunchError naming the values TMA refused."""
    dims, byte_strides, box = tuple(map(int, dims)), tuple(map(int, byte_strides)), tuple(map(int, box))
    if dtype not in _TYPES or len(byte_strides) != len(dims) - 1 or len(box) != len(dims):
        raise ValueError(f"tensor map of dtype {dtype!r}, dims {dims}, strides {byte_strides}, box {box}: "
                         f"dtype one of {sorted(_TYPES)}, one stride fewer than dims and one box size per dim")
    key = (dtype, int(ptr), dims, byte_strides, box)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    from cuda.bindings import driver as drv

    dt = getattr(drv.CUtensorMapDataType, _TYPES[dtype])
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t  # older cuda-bindings refuse plain ints here
    args = (dt, len(dims), int(ptr), [u64(x) for x in dims], [u64(x) for x in byte_strides], [u32(x) for x in box],
            [u32(1)] * len(dims),
            drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    err, tmap = drv.cuTensorMapEncodeTiled(*args)
    if err == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        # A thread with no current context (autograd's device threads run a backward before any CUDA runtime call
        # there): the driver wants one, though the map does not depend on it.
        from rtckern.runtime.driver import pushed, retained_ordinal

        with pushed(retained_ordinal()):  # popped after: the thread is left with no context, as it was
            err, tmap = drv.cuTensorMapEncodeTiled(*args)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"cuTensorMapEncodeTiled failed ({err}) for a {dtype} tensor at {int(ptr):#x}, dims {dims} "
                          f"(innermost first), byte strides {byte_strides}, box {box}: TMA needs a 16-byte aligned "
                          "address and byte strides that are multiples of 16")
    raw = struct.pack("<16Q", *[int(x) for x in tmap.opaque])
    with _lock:
        _cache[key] = raw
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return raw
