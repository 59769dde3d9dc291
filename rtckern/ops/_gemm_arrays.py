"""Array access for the GEMM op: torch tensors, CuPy arrays, and anything with ``__cuda_array_interface__``
(read through CuPy) or ``__dlpack__`` (read through torch). Reads shape, element strides, dtype, device and
address; refuses host memory and odd strides with an error that names the value and the fix.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

from rtckern.errors import InputError
from rtckern.runtime.streams import current_stream  # noqa: F401  (the family's arr.current_stream)

_TORCH_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_CUPY_NAMES = {"float16": "fp16", "float32": "fp32"}


@dataclasses.dataclass(frozen=True)
class Mat:
    """A device array as the kernels see it (strides in elements)."""

    obj: Any
    lib: str  # "torch" or "cupy"
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # "bf16", "fp16", "fp32", or the library's own name for anything else
    device: int
    itemsize: int

    @property
    def ndim(self) -> int:
        return len(self.shape)


def wrap(obj: Any, name: str) -> Mat:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            raise InputError(f"{name} is on {obj.device}, in host memory; rtckern.ops.gemm reads device memory: "
                             f"move it to the GPU ({name}.cuda())")
        name_ = str(obj.dtype).replace("torch.", "")
        return Mat(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()),
                   _TORCH_NAMES.get(name_, name_), obj.device.index, obj.element_size())
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        isz = obj.dtype.itemsize
        if any(s % isz for s in obj.strides):
            raise InputError(f"{name} has byte strides {obj.strides} that are not whole elements of {obj.dtype}")
        name_ = obj.dtype.name
        if name_ == "bfloat16" or "bfloat16" in str(obj.dtype):
            name_ = "bfloat16"
        return Mat(obj, "cupy", obj.data.ptr, tuple(obj.shape), tuple(s // isz for s in obj.strides),
                   {"bfloat16": "bf16", **_CUPY_NAMES}.get(name_, name_), obj.device.id, isz)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        raise InputError(f"{name} is a numpy array, in host memory; rtckern.ops.gemm reads device memory: pass a "
                         "torch CUDA tensor or a CuPy array")
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


def transpose_last(x: Mat) -> Mat:
    """The same memory viewed with its last two dimensions swapped (no copy)."""
    shape = x.shape[:-2] + (x.shape[-1], x.shape[-2])
    strides = x.strides[:-2] + (x.strides[-1], x.strides[-2])
    return dataclasses.replace(x, shape=shape, strides=strides)


def empty(like: Mat, shape: tuple[int, ...], dtype: str) -> tuple[Any, int]:
    """A new contiguous array of `dtype` ("fp16", "bf16", "fp32") on like's device and library:
    (object, address)."""
    if like.lib == "torch":
        import torch

        tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        out = torch.empty(shape, dtype=tdt, device=like.obj.device)
        return out, out.data_ptr()
    import cupy

    cdt = {"fp16": cupy.float16, "fp32": cupy.float32}.get(dtype)
    if cdt is None:  # CuPy has no bfloat16 dtype of its own; the caller's array carries one
        cdt = like.obj.dtype
    with cupy.cuda.Device(like.device):
        out = cupy.empty(shape, dtype=cdt)
    return out, out.data.ptr


def empty_bytes(like: Mat, nbytes: int) -> tuple[Any, int]:
    """Scratch device memory from like's library allocator (stream-ordered reuse): (object, address)."""
    n = max(1, (nbytes + 3) // 4)
    if like.lib == "torch":
        import torch

        out = torch.empty(n, dtype=torch.float32, device=like.obj.device)
        return out, out.data_ptr()
    import cupy

    with cupy.cuda.Device(like.device):
        out = cupy.empty(n, dtype=cupy.float32)
    return out, out.data.ptr
