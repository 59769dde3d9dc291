"""Arrays as the kernels see them, for every op family and for raw kernel launches.

`wrap(obj, name)` reads a torch tensor, a CuPy array, or anything with ``__cuda_array_interface__`` (read through
CuPy, else torch) or ``__dlpack__`` (through torch, else CuPy) into a `DeviceArray`: library, address, shape,
element strides, canonical dtype name (rtckern.dtypes), item size, device ordinal. Host memory, foreign devices
and unknown types are refused with the same line whatever the op. Views per family: `rows` (norms: [rows, n] with
one row stride), `DeviceArray.transpose_last` / `batched_matrix` (gemm); the (batch, seqlen, heads, head_dim)
arrays of attention are DeviceArrays as they are. `empty` / `zeros` / `workspace` allocate like an input (same
library and device); `current_stream` is the library's current stream there.

`device_pointer` / `convert_args` turn a raw `Kernel.launch`'s arguments into addresses (through cuda.core's
StridedMemoryView for DLPack producers). The ops' memoized hot paths read torch tensors directly and never come
here after a signature's first call.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from rtckern import dtypes
from rtckern.errors import InputError
from rtckern.runtime.streams import current_stream  # noqa: F401  (re-exported: the stream of an array's library)

__all__ = ["DeviceArray", "Rows", "wrap", "rows", "batched_matrix", "check_dtype", "check_contiguous",
           "check_same_place", "empty", "zeros", "workspace", "current_stream", "device_pointer", "convert_args"]

# DLPack device types whose memory a kernel reads (kDLCUDA, kDLROCM, kDLCUDAManaged); names for the others.
DLPACK_GPU = frozenset({2, 10, 13})
_DLPACK_NAMES = {1: "kDLCPU", 2: "kDLCUDA", 3: "kDLCUDAHost", 4: "kDLOpenCL", 7: "kDLVulkan", 8: "kDLMetal",
                 9: "kDLVPI", 10: "kDLROCM", 11: "kDLROCMHost", 13: "kDLCUDAManaged", 14: "kDLOneAPI"}


@dataclasses.dataclass(slots=True)
class DeviceArray:
    """A device array: `obj` the caller's object (a torch tensor or CuPy array; None in a detached view), `lib`
    "torch" or "cupy", `ptr` its address, `strides` in elements, `dtype` the canonical name ("fp32", "bf16",
    "bool", ...) or the library's own name for a dtype outside rtckern's table ("float64"), `device` the
    ordinal."""

    obj: Any
    lib: str
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    device: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def contiguous(self) -> bool:
        """C-contiguous (strides of size-1 dimensions do not matter; an empty array is contiguous)."""
        if 0 in self.shape:
            return True
        expect = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expect:
                return False
            expect *= size
        return True

    def at(self, ptr: int) -> "DeviceArray":
        """The same shape, strides and dtype at address `ptr`, without the array (what a memoized plan keeps: it
        must not keep a caller's tensor alive)."""
        return DeviceArray(None, self.lib, ptr, self.shape, self.strides, self.dtype, self.itemsize, self.device)

    def transpose_last(self) -> "DeviceArray":
        """The same memory with its last two dimensions swapped (no copy)."""
        return dataclasses.replace(self, shape=self.shape[:-2] + (self.shape[-1], self.shape[-2]),
                                   strides=self.strides[:-2] + (self.strides[-1], self.strides[-2]))


# ---- reading an array -------------------------------------------------------------------------------------------
def wrap(obj: Any, name: str) -> DeviceArray:
    """`obj` (argument `name` of an op) as a DeviceArray; InputError for host memory, a non-GPU DLPack device,
    byte strides that are not whole elements, or a type that is no array."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _from_torch(obj, name)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return _from_cupy(obj, name)
    if isinstance(obj, np.ndarray):
        raise InputError(f"{name} is a numpy array, in host memory; rtckern kernels read GPU memory: pass a torch "
                         f"CUDA tensor or a CuPy array (cupy.asarray({name}))")
    if hasattr(obj, "__cuda_array_interface__"):
        return _via_library(obj, name, "cupy")
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type = int(obj.__dlpack_device__()[0])
        if dev_type not in DLPACK_GPU:
            raise InputError(f"{name} ({type(obj).__name__}) lives on DLPack device type {dev_type} "
                             f"({_DLPACK_NAMES.get(dev_type, 'unknown')}), not in GPU memory; move it to the GPU "
                             "first")
        return _via_library(obj, name, "torch")
    raise InputError(f"{name} has type {type(obj).__name__}; pass a torch CUDA tensor, a CuPy array, or an object "
                     "with __cuda_array_interface__ or __dlpack__")


def _from_torch(t, name: str) -> DeviceArray:
    dev = t.device
    if dev.type != "cuda":
        where = "in host memory" if dev.type == "cpu" else "not on a CUDA GPU"
        raise InputError(f"{name} is on {dev}, {where}; rtckern kernels read GPU memory: move it to the GPU "
                         f"({name}.cuda())")
    return DeviceArray(t, "torch", t.data_ptr(), tuple(t.shape), tuple(t.stride()),
                       dtypes.name_of_torch(str(t.dtype)[6:]), t.element_size(), dev.index)


def _from_cupy(a, name: str) -> DeviceArray:
    isz = a.dtype.itemsize
    if any(s % isz for s in a.strides):
        raise InputError(f"{name} has byte strides {a.strides} that are not whole elements of {a.dtype}; pass "
                         f"cupy.ascontiguousarray({name})")
    return DeviceArray(a, "cupy", a.data.ptr, tuple(a.shape), tuple(s // isz for s in a.strides),
                       dtypes.name_of_numpy(a.dtype.name), isz, a.device.id)


def _via_library(obj, name: str, prefer: str) -> DeviceArray:
    """A foreign GPU array read without a copy: __cuda_array_interface__ through CuPy (else torch), DLPack through
    torch (else CuPy). The op's outputs are arrays of that library."""
    for lib in ((prefer, "torch") if prefer == "cupy" else (prefer, "cupy")):
        try:
            mod = __import__(lib)
        except ImportError:
            continue
        if lib == "torch":
            return _from_torch(mod.from_dlpack(obj) if prefer == "torch" else mod.as_tensor(obj, device="cuda"), name)
        return _from_cupy(mod.asarray(obj) if prefer == "cupy" else mod.from_dlpack(obj), name)
    raise InputError(f"{name} ({type(obj).__name__}) is a GPU array that rtckern reads through torch or CuPy, and "
                     "neither is installed: install one, or pass a torch tensor or a CuPy array")


# ---- checks shared by the families --------------------------------------------------------------------------------
def check_dtype(a: DeviceArray, name: str, allowed: tuple[str, ...]) -> None:
    """a's dtype is one of `allowed` (canonical names), else InputError with the fix in a's library."""
    if a.dtype not in allowed:
        to = dtypes.lookup(allowed[0])
        fix = f"{name}.to(torch.{to.torch})" if a.lib == "torch" else f"{name}.astype(cupy.{to.numpy})"
        raise InputError(f"{name} has dtype {a.dtype}; supported: {dtypes.describe(allowed)}: convert with {fix}")


def check_contiguous(a: DeviceArray, name: str) -> None:
    if not a.contiguous:
        raise InputError(f"{name} of shape {a.shape} is not contiguous; the kernels need contiguous rows: pass "
                         f"{name}.contiguous() (torch) or cupy.ascontiguousarray({name})")


def check_same_place(a: DeviceArray, b: DeviceArray, name_a: str, name_b: str) -> None:
    """a and b are arrays of one library on one device."""
    if a.lib != b.lib:
        raise InputError(f"{name_a} is a {a.lib} array but {name_b} a {b.lib} array; pass arrays of one library")
    if a.device != b.device:
        raise InputError(f"{name_a} is on cuda:{a.device} but {name_b} on cuda:{b.device}; put both on one device")


# ---- views --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class Rows(DeviceArray):
    """An array seen as `rows` rows of `n` contiguous elements, row r at ptr + r * row_stride elements."""

    rows: int = 0
    n: int = 0
    row_stride: int = 0


def flat_stride(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The one stride (elements) that walks dimensions of these sizes and strides as a flat vector, size-1 ones
    ignored: 0 when none is longer than 1 (or one is empty), None when they do not flatten to one stride."""
    if 0 in shape:
        return 0
    lead = [(sz, st) for sz, st in zip(shape, strides) if sz != 1]
    if not lead:
        return 0
    stride = expect = lead[-1][1]
    for sz, st in reversed(lead):
        if st != expect:
            return None
        expect = st * sz
    return stride


def rows(a: DeviceArray, name: str) -> Rows:
    """a as rows over its last dimension; InputError for a 0-d array, a strided last dimension, leading
    dimensions that do not flatten to one row stride, or overlapping rows."""
    shape, strides = a.shape, a.strides
    if not shape:
        raise InputError(f"{name} is a 0-d array; this op works over the last dimension, so {name} needs at least "
                         "one dimension")
    n = shape[-1]
    count = 1
    for s in shape[:-1]:
        count *= s
    if count == 0:  # no rows (a zero-size leading dimension): any strides will do
        return Rows(a.obj, a.lib, a.ptr, shape, strides, a.dtype, a.itemsize, a.device, 0, n, n)
    if n > 1 and strides[-1] != 1:
        raise InputError(f"{name} has stride {strides[-1]} in its last dimension (shape {shape}); the kernels need "
                         f"contiguous rows: pass {name}.contiguous() (torch) or cupy.ascontiguousarray({name})")
    row_stride = flat_stride(shape[:-1], strides[:-1])
    if row_stride is None:
        raise InputError(f"{name} of shape {shape} has strides {strides} (elements) whose leading dimensions "
                         f"do not flatten to [rows, {n}] with one row stride; pass {name}.contiguous()")
    if count == 1:  # one row: its stride never moves; n keeps it out of the vector-width rules
        row_stride = n
    if count > 1 and row_stride < n:
        raise InputError(f"{name} of shape {shape} has row stride {row_stride} < {n}: rows overlap; pass "
                         f"{name}.contiguous()")
    return Rows(a.obj, a.lib, a.ptr, shape, strides, a.dtype, a.itemsize, a.device, count, n, max(row_stride, 0))


def batched_matrix(a: DeviceArray) -> tuple[int, int, int]:
    """(row stride, batch stride, batch) of a 2-D (M, K) or 3-D (batch, M, K) array, strides in elements."""
    row = a.strides[-2] if a.shape[-2] > 1 else a.shape[-1]
    if a.ndim == 2:
        return row, 0, 1
    return row, a.strides[0], a.shape[0]


# ---- allocation like an input ---------------------------------------------------------------------------------
def empty(like: DeviceArray, shape: tuple[int, ...], dtype: str) -> tuple[Any, int]:
    """A new contiguous output array of `dtype` (a canonical name) on like's device and library: (object,
    address). The ops' outputs come from here (tests poison it to catch unwritten elements)."""
    return _alloc(like, shape, dtype, False)


def zeros(like: DeviceArray, shape: tuple[int, ...], dtype: str) -> tuple[Any, int]:
    """As `empty`, zero-filled (ordered on the library's current stream)."""
    return _alloc(like, shape, dtype, True)


def workspace(like: DeviceArray, nbytes: int) -> tuple[Any, int]:
    """Scratch memory of at least `nbytes` (fp32 words) from like's library allocator, stream-ordered: keep the
    object until the kernels that use it are launched. Not an output (tests do not poison it)."""
    return _alloc(like, (max(1, (nbytes + 3) // 4),), "fp32", False)


def _alloc(like: DeviceArray, shape, dtype: str, zero: bool) -> tuple[Any, int]:
    if like.lib == "torch":
        import torch

        device = like.obj.device if like.obj is not None else f"cuda:{like.device}"  # a view without its array
        out = (torch.zeros if zero else torch.empty)(shape, dtype=dtypes.torch_dtype(dtype), device=device)
        return out, out.data_ptr()
    import cupy

    if dtype == like.dtype and like.obj is not None:
        cdt = like.obj.dtype  # the caller's own dtype object (CuPy's bfloat16 comes from ml_dtypes)
    else:
        cdt = dtypes.numpy_dtype(dtype)
        if cdt is None:
            raise InputError(f"a {dtype} output for CuPy input needs ml_dtypes (CuPy's {dtypes.lookup(dtype).numpy} "
                             "dtype); install it, or pass torch tensors")
    with cupy.cuda.Device(like.device):
        out = (cupy.zeros if zero else cupy.empty)(shape, dtype=cdt)
    return out, out.data.ptr


# ---- raw kernel arguments ---------------------------------------------------------------------------------------
# Kernel arguments that pass through unchanged (ints are pointers or long long; numpy scalars keep their width).
SCALAR_TYPES = frozenset({int, np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64, np.int16,
                          np.uint16, np.int8, np.uint8, np.bool_, bool, float})


def device_pointer(obj) -> int:
    """The device address of an array object passed to Kernel.launch. Host arrays are refused with a clear
    error (TypeError: a kernel argument of the wrong kind)."""
    data_ptr = getattr(obj, "data_ptr", None)
    if data_ptr is not None and hasattr(obj, "is_cuda"):  # torch
        if not obj.is_cuda:
            raise TypeError(f"torch tensor on {obj.device} is in host memory; move it to the GPU (.cuda())")
        return int(data_ptr())
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    if hasattr(obj, "__dlpack__"):
        dev_type = int(obj.__dlpack_device__()[0])
        if dev_type not in DLPACK_GPU:
            raise TypeError(f"{type(obj).__name__} lives on DLPack device type {dev_type} "
                            f"({_DLPACK_NAMES.get(dev_type, 'unknown')}), not a CUDA device")
        from cuda.core.utils import StridedMemoryView

        return int(StridedMemoryView(obj, stream_ptr=-1).ptr)
    raise TypeError(f"kernel argument of type {type(obj).__name__} is not an int, a numpy scalar or a GPU array "
                    "(torch tensor, CuPy array, or an object with __cuda_array_interface__ / __dlpack__)")


def default_stream_for(obj):
    """The stream a library would use for ``obj``: torch's current stream for its device, CuPy's current stream."""
    if hasattr(obj, "is_cuda") and hasattr(obj, "device"):
        import torch

        return torch.cuda.current_stream(obj.device).cuda_stream
    mod = type(obj).__module__ or ""
    if mod.startswith("cupy"):
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return None


def convert_args(args) -> tuple[tuple, object]:
    """(args with arrays replaced by pointers, the default stream implied by the first array or None)."""
    out = []
    stream = None
    for a in args:
        if type(a) in SCALAR_TYPES:
            out.append(a)
        else:
            out.append(device_pointer(a))
            if stream is None:
                stream = default_stream_for(a)
    return tuple(out), stream
