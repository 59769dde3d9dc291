"""Array checks of the attention op: accept torch tensors, CuPy arrays and anything with
``__cuda_array_interface__`` (through CuPy) or ``__dlpack__`` (through torch); read shape, element strides, dtype,
device and address; refuse what the kernels cannot read with an error that names the value and the fix.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

from rtckern.errors import InputError
from rtckern.runtime.streams import current_stream  # noqa: F401  (the family's arr.current_stream)

_CUPY_DTYPES = {"float16": "fp16", "float32": "fp32", "float64": "fp64"}


@dataclasses.dataclass(frozen=True)
class Tensor4:
    """A (batch, seqlen, heads, head_dim) device array as the kernels see it (strides in elements)."""

    obj: Any
    lib: str  # "torch" or "cupy"
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # "bf16", "fp16", or the library's own name for anything else
    device: int
    itemsize: int


def wrap(obj: Any, name: str) -> Tensor4:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            raise InputError(f"{name} is on {obj.device}, in host memory; attention kernels read device memory: "
                             f"move it to the GPU ({name}.cuda())")
        dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(obj.dtype, str(obj.dtype).replace("torch.", ""))
        return Tensor4(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), dt, obj.device.index,
                       obj.element_size())
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        isz = obj.dtype.itemsize
        dt = _CUPY_DTYPES.get(obj.dtype.name, obj.dtype.name)
        if any(s % isz for s in obj.strides):
            raise InputError(f"{name} has byte strides {obj.strides} that are not whole elements")
        return Tensor4(obj, "cupy", obj.data.ptr, tuple(obj.shape), tuple(s // isz for s in obj.strides), dt,
                       obj.device.id, isz)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        raise InputError(f"{name} is a numpy array, in host memory; attention kernels read device memory: pass a "
                         "torch CUDA tensor or a CuPy array (cupy.asarray(...))")
    if hasattr(obj, "__cuda_array_interface__"):
        import cupy as cp

        return wrap(cp.asarray(obj), name)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type = int(obj.__dlpack_device__()[0])
        if dev_type != 2:  # kDLCUDA
            raise InputError(f"{name} ({type(obj).__name__}) lives on DLPack device type {dev_type}, not CUDA "
                             "device memory; move it to the GPU first")
        import torch as th

        return wrap(th.from_dlpack(obj), name)
    raise InputError(f"{name} has type {type(obj).__name__}; pass a torch CUDA tensor, a CuPy array, or an object "
                     "with __cuda_array_interface__ or __dlpack__")


def empty(like: Tensor4, shape: tuple[int, ...], fp32: bool = False) -> tuple[Any, int]:
    """A new contiguous array on like's device and library: like's dtype, or float32. (object, address)."""
    if like.lib == "torch":
        import torch

        out = torch.empty(shape, dtype=torch.float32 if fp32 else like.obj.dtype, device=like.obj.device)
        return out, out.data_ptr()
    import cupy

    with cupy.cuda.Device(like.device):
        out = cupy.empty(shape, dtype=cupy.float32 if fp32 else like.obj.dtype)
    return out, out.data.ptr
