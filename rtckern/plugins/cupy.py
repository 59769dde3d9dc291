"""rtckern's ops for CuPy, and for any CUDA array CuPy can view, without torch.

    import rtckern.plugins.cupy as rkc
    y = rkc.rms_norm(x, w, eps=1e-6)           # x, w: cupy.ndarray, or e.g. JAX / Numba / PyCUDA device arrays
    o = rkc.attention(q, k, v, causal=True)

The ops in rtckern.ops already take CuPy arrays (launching on CuPy's current stream, allocating outputs with
CuPy's allocator); a DLPack-only object, though, goes through torch there and comes back as a torch tensor. Here
every array argument is first viewed as a CuPy array, zero-copy:
- `cupy.ndarray`: as is;
- `__cuda_array_interface__` (Numba, PyCUDA, ...): `cupy.asarray`, which honours the interface's stream field;
- `__dlpack__` (JAX, TensorFlow, torch, ...): `cupy.from_dlpack`, which hands the producer CuPy's current stream
  so the producer's pending work is ordered before the kernels.
so the results are CuPy arrays on the inputs' device, computed on CuPy's current stream (`with stream:` picks it),
and torch is never imported. dtypes: CuPy has fp32 and fp16; bfloat16 data needs the torch path (rtckern.torch)
or bf16 tensors viewed by rtckern.ops through DLPack.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

from rtckern.errors import InputError

# op family -> (function, names of its array arguments)
_OPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "rms_norm": ("norms", ("x", "weight", "residual")),
    "layer_norm": ("norms", ("x", "weight", "bias", "residual")),
    "rms_norm_backward": ("norms", ("dy", "x", "weight", "rstd", "dresidual")),
    "layer_norm_backward": ("norms", ("dy", "x", "weight", "bias", "mean", "rstd", "dresidual")),
    "softmax": ("softmax", ("x",)),
    "softmax_backward": ("softmax", ("y", "dy")),
    "scaled_masked_softmax": ("softmax", ("x", "mask")),
    "scaled_masked_softmax_backward": ("softmax", ("y", "dy")),
    "scaled_upper_triang_masked_softmax": ("softmax", ("x",)),
    "scaled_upper_triang_masked_softmax_backward": ("softmax", ("y", "dy")),
    "scaled_aligned_causal_masked_softmax": ("softmax", ("x",)),
    "scaled_aligned_causal_masked_softmax_backward": ("softmax", ("y", "dy")),
    "attention": ("attention", ("q", "k", "v")),
    "gemm": ("gemm", ("a", "b", "bias", "residual")),
}


def as_cupy(obj: Any, name: str = "array"):
    """obj as a cupy.ndarray without copying (None stays None); InputError for host or unknown arrays."""
    import cupy

    if obj is None or isinstance(obj, cupy.ndarray):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        return cupy.asarray(obj)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type = int(obj.__dlpack_device__()[0])
        if dev_type not in (2, 3):  # kDLCUDA, kDLCUDAHost
            raise InputError(f"{name} ({type(obj).__name__}) is on DLPack device type {dev_type}, not a CUDA GPU; "
                             "move it to the GPU first")
        return cupy.from_dlpack(obj)
    raise InputError(f"{name} has type {type(obj).__name__}; pass a CuPy array or a CUDA array with "
                     "__cuda_array_interface__ or __dlpack__ (host arrays: cupy.asarray(...) copies them over)")


def _make(op: str, family: str, array_args: tuple[str, ...]) -> Callable[..., Any]:
    fn = getattr(importlib.import_module(f"rtckern.ops._{family}.api"), op)
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        for name in array_args:
            if name in bound.arguments:
                bound.arguments[name] = as_cupy(bound.arguments[name], name)
        return fn(*bound.args, **bound.kwargs)

    return call


def __getattr__(name: str):  # ops are built on first use: importing this module imports no op family
    if name in _OPS:
        family, array_args = _OPS[name]
        fn = _make(name, family, array_args)
        globals()[name] = fn
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}; ops: {sorted(_OPS)}")


__all__ = ["as_cupy", *sorted(_OPS)]
