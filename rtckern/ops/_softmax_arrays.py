"""Array handling for the softmax ops: accept torch tensors, CuPy arrays and anything with
``__cuda_array_interface__`` (through CuPy) or ``__dlpack__`` (through torch); check device, dtype, shape and
layout with errors that name the value and the fix; allocate outputs like the input; find the stream to use.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

from rtckern.errors import InputError
from rtckern.runtime.streams import current_stream  # noqa: F401  (the family's arr.current_stream)

_TORCH_DTYPES: dict | None = None


def _torch_dtypes() -> dict:
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        import torch

        _TORCH_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.bool: "bool"}
    return _TORCH_DTYPES


_CUPY_DTYPES = {"float32": "fp32", "float16": "fp16", "bool": "bool"}


@dataclasses.dataclass(frozen=True)
class DeviceArray:
    """A device array as the kernels see it: address, shape, dtype name, device ordinal, C-contiguity."""

    obj: Any
    lib: str  # "torch" or "cupy"
    ptr: int
    shape: tuple[int, ...]
    dtype: str  # "fp32", "fp16", "bf16", "bool", or the library's own name for anything else
    device: int
    contiguous: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def device_array(obj: Any, name: str) -> DeviceArray:
    """Wrap `obj` (argument `name` of an op); raise InputError for host memory or an unsupported array type."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            raise InputError(f"{name} is on {obj.device}, in host memory; softmax kernels read device memory: "
                             f"move it to the GPU ({name}.cuda())")
        dt = _torch_dtypes().get(obj.dtype, str(obj.dtype).replace("torch.", ""))
        return DeviceArray(obj, "torch", obj.data_ptr(), tuple(obj.shape), dt, obj.device.index,
                           obj.is_contiguous())
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        dt = _CUPY_DTYPES.get(obj.dtype.name, obj.dtype.name)
        return DeviceArray(obj, "cupy", obj.data.ptr, tuple(obj.shape), dt, obj.device.id,
                           bool(obj.flags.c_contiguous))
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        raise InputError(f"{name} is a numpy array, in host memory; softmax kernels read device memory: pass a "
                         "torch CUDA tensor or a CuPy array (cupy.asarray(...))")
    if hasattr(obj, "__cuda_array_interface__"):
        import cupy as cp

        return device_array(cp.asarray(obj), name)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type = int(obj.__dlpack_device__()[0])
        if dev_type not in (2, 3):  # kDLCUDA, kDLCUDAHost
            raise InputError(f"{name} ({type(obj).__name__}) lives on DLPack device type {dev_type}, not a CUDA "
                             "GPU; move it to the GPU first")
        import torch as th

        return device_array(th.from_dlpack(obj), name)
    raise InputError(f"{name} has type {type(obj).__name__}; pass a torch CUDA tensor, a CuPy array, or an object "
                     "with __cuda_array_interface__ or __dlpack__")


def check_float(a: DeviceArray, name: str) -> None:
    if a.dtype not in ("fp32", "fp16", "bf16"):
        raise InputError(f"{name} has dtype {a.dtype}; supported: fp32, fp16, bf16 (float32, float16, bfloat16)")


def check_contiguous(a: DeviceArray, name: str) -> None:
    if not a.contiguous:
        raise InputError(f"{name} of shape {a.shape} is not contiguous; the kernels need contiguous rows: pass "
                         f"{name}.contiguous() (torch) or cupy.ascontiguousarray({name})")


def check_same(a: DeviceArray, b: DeviceArray, name_a: str, name_b: str) -> None:
    if a.device != b.device:
        raise InputError(f"{name_a} is on cuda:{a.device} but {name_b} on cuda:{b.device}; put both on one device")
    if a.shape != b.shape:
        raise InputError(f"{name_b} has shape {b.shape} but {name_a} has {a.shape}; they must match")
    if a.dtype != b.dtype:
        raise InputError(f"{name_b} has dtype {b.dtype} but {name_a} has {a.dtype}; they must match")
    if a.lib != b.lib:
        raise InputError(f"{name_a} is a {a.lib} array but {name_b} a {b.lib} array; pass one kind")


def empty_like(a: DeviceArray) -> tuple[Any, int]:
    """A new contiguous array of a's shape, dtype, library and device: (object, address)."""
    if a.lib == "torch":
        import torch

        out = torch.empty(a.shape, dtype=a.obj.dtype, device=a.obj.device)
        return out, out.data_ptr()
    import cupy

    with cupy.cuda.Device(a.device):
        out = cupy.empty(a.shape, dtype=a.obj.dtype)
    return out, out.data.ptr


def empty_floats(a: DeviceArray, count: int) -> tuple[Any, int]:
    """fp32 workspace of `count` elements on a's device, from a's library (so its allocator and stream order
    keep it alive until the kernels that use it have run)."""
    if a.lib == "torch":
        import torch

        ws = torch.empty((count,), dtype=torch.float32, device=a.obj.device)
        return ws, ws.data_ptr()
    import cupy

    with cupy.cuda.Device(a.device):
        ws = cupy.empty((count,), dtype=cupy.float32)
    return ws, ws.data.ptr
