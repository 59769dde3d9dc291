"""Arrays for the norm ops: accept torch tensors, CuPy arrays and anything with ``__cuda_array_interface__``
(through CuPy) or ``__dlpack__`` (through torch); view them as [rows, N] with a row stride; check dtype, device
and layout with errors that name the value, what is accepted and the fix; allocate outputs like the input.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

from rtckern.errors import InputError
from rtckern.runtime.streams import current_stream  # noqa: F401  (the family's arr.current_stream)

SUPPORTED = "fp32, fp16, bf16 (float32, float16, bfloat16)"
_CUPY_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _torch_names() -> dict:
    import torch

    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclasses.dataclass(frozen=True)
class Rows:
    """An array seen as `rows` rows of `n` contiguous elements, row r at ptr + r * row_stride elements."""

    obj: Any
    lib: str  # "torch" or "cupy"
    ptr: int
    shape: tuple[int, ...]
    dtype: str  # "fp32" / "fp16" / "bf16" or the library's own name for anything else
    itemsize: int
    device: int
    rows: int
    n: int
    row_stride: int  # elements


def wrap(obj: Any, name: str) -> Rows:
    """`obj` (argument `name`) as Rows over its last dimension; InputError for host memory, an unsupported type,
    a strided last dimension or leading dimensions that do not flatten to one row stride."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            raise InputError(f"{name} is on {obj.device} (host memory); the norm kernels read GPU memory: move it "
                             f"with {name}.cuda()")
        dt = _torch_names().get(obj.dtype, str(obj.dtype).replace("torch.", ""))
        return _rows(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), dt, obj.element_size(),
                     obj.device.index, name)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        isz = obj.dtype.itemsize
        strides = tuple(s // isz if s % isz == 0 else -1 for s in obj.strides)
        dt = _CUPY_NAMES.get(obj.dtype.name, obj.dtype.name)
        return _rows(obj, "cupy", obj.data.ptr, tuple(obj.shape), strides, dt, isz, obj.device.id, name)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        raise InputError(f"{name} is a numpy array (host memory); the norm kernels read GPU memory: pass a torch "
                         "CUDA tensor or a CuPy array (cupy.asarray(...))")
    if hasattr(obj, "__cuda_array_interface__"):
        import cupy as cp

        return wrap(cp.asarray(obj), name)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type = int(obj.__dlpack_device__()[0])
        if dev_type not in (2, 3):  # kDLCUDA, kDLCUDAHost
            raise InputError(f"{name} ({type(obj).__name__}) is on DLPack device type {dev_type}, not a CUDA GPU; "
                             "move it to the GPU first")
        import torch as th

        return wrap(th.from_dlpack(obj), name)
    raise InputError(f"{name} has type {type(obj).__name__}; pass a torch CUDA tensor, a CuPy array, or an object "
                     "with __cuda_array_interface__ or __dlpack__")


def _rows(obj, lib, ptr, shape, strides, dtype, itemsize, device, name) -> Rows:
    if len(shape) == 0:
        raise InputError(f"{name} is a 0-d array; the norms normalize over the last dimension, so {name} needs at "
                         "least one dimension")
    n = shape[-1]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    if n > 1 and rows > 0 and strides[-1] != 1:
        raise InputError(f"{name} has stride {strides[-1]} in its last dimension (shape {shape}); the norm kernels "
                         f"need contiguous rows: pass {name}.contiguous() (torch) or cupy.ascontiguousarray({name})")
    # Leading dimensions must collapse to one row stride (size-1 dimensions do not matter).
    lead = [(sz, st) for sz, st in zip(shape[:-1], strides[:-1]) if sz != 1]
    row_stride = lead[-1][1] if lead else n
    expect = row_stride
    for sz, st in reversed(lead):
        if st != expect:
            raise InputError(f"{name} of shape {shape} has strides {strides} (elements) whose leading dimensions "
                             f"do not flatten to [rows, {n}] with one row stride; pass {name}.contiguous()")
        expect = st * sz
    if rows > 1 and row_stride < n:
        raise InputError(f"{name} of shape {shape} has row stride {row_stride} < {n}: rows overlap; pass "
                         f"{name}.contiguous()")
    return Rows(obj, lib, ptr, tuple(shape), dtype, itemsize, device, rows, n, max(row_stride, 0))


def check_float(a: Rows, name: str) -> None:
    if a.dtype not in ("fp32", "fp16", "bf16"):
        raise InputError(f"{name} has dtype {a.dtype}; supported: {SUPPORTED}")


def check_same_place(a: Rows, b: Rows, name_a: str, name_b: str) -> None:
    if a.lib != b.lib:
        raise InputError(f"{name_a} is a {a.lib} array but {name_b} a {b.lib} array; pass one kind of array")
    if a.device != b.device:
        raise InputError(f"{name_a} is on cuda:{a.device} but {name_b} on cuda:{b.device}; put both on one device")


def check_vector(v: Rows, x: Rows, name: str, allowed: tuple[str, ...]) -> None:
    """A per-column parameter (weight, bias): shape (N,), dtype in `allowed`, same device as x."""
    check_same_place(x, v, "x", name)
    if v.shape != (x.n,):
        raise InputError(f"{name} has shape {v.shape}; it must be ({x.n},), the size of x's last dimension "
                         f"(x has shape {x.shape})")
    if v.dtype not in allowed:
        raise InputError(f"{name} has dtype {v.dtype}; with x in {x.dtype} it must be one of {', '.join(allowed)}")


def check_like(a: Rows, x: Rows, name: str, dtypes: tuple[str, ...]) -> None:
    """An array with x's shape (residual, dy, dresidual)."""
    check_same_place(x, a, "x", name)
    if a.shape != x.shape:
        raise InputError(f"{name} has shape {a.shape} but x has {x.shape}; they must match")
    if a.dtype not in dtypes:
        raise InputError(f"{name} has dtype {a.dtype}; supported here: {', '.join(dtypes)}")


def check_stats(s: Rows, x: Rows, name: str) -> None:
    check_same_place(x, s, "x", name)
    if s.dtype != "fp32":
        raise InputError(f"{name} has dtype {s.dtype}; the saved statistics are fp32 (as the forward returns them)")
    if s.rows * s.n != x.rows or (s.rows > 1 and s.row_stride != s.n):
        raise InputError(f"{name} has shape {s.shape}; it must hold one contiguous value per row of x "
                         f"({x.rows} rows, x shape {x.shape})")


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def empty(like: Rows, shape: tuple[int, ...], dtype: str) -> tuple[Any, int]:
    """A new contiguous array on like's device and library: (object, address)."""
    if like.lib == "torch":
        import torch

        out = torch.empty(shape, dtype=_torch_dtype(dtype), device=like.obj.device)
        return out, out.data_ptr()
    import cupy

    if dtype == "bf16":
        raise InputError("bf16 output from CuPy input: CuPy has no bfloat16 dtype; pass torch tensors for bf16")
    with cupy.cuda.Device(like.device):
        out = cupy.empty(shape, dtype={"fp32": cupy.float32, "fp16": cupy.float16}[dtype])
    return out, out.data.ptr


def zeros_u32(like: Rows, count: int) -> tuple[Any, int]:
    """Zeroed uint32 counters (the cooperative kernels' barriers), ordered on the library's current stream."""
    if like.lib == "torch":
        import torch

        out = torch.zeros((count,), dtype=torch.int32, device=like.obj.device)
        return out, out.data_ptr()
    import cupy

    with cupy.cuda.Device(like.device):
        out = cupy.zeros((count,), dtype=cupy.uint32)
    return out, out.data.ptr


def zeros(like: Rows, shape: tuple[int, ...], dtype: str) -> tuple[Any, int]:
    if like.lib == "torch":
        import torch

        out = torch.zeros(shape, dtype=_torch_dtype(dtype), device=like.obj.device)
        return out, out.data_ptr()
    out, ptr = empty(like, shape, dtype)
    out.fill(0)
    return out, ptr
