"""Device pointers (and the stream to use) from array objects: torch tensors, CuPy arrays, anything with
``__cuda_array_interface__`` or ``__dlpack__``."""

from __future__ import annotations

import numpy as np

# Kernel arguments that pass through unchanged (ints are pointers or long long; numpy scalars keep their width).
SCALAR_TYPES = frozenset({int, np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64, np.int16,
                          np.uint16, np.int8, np.uint8, np.bool_, bool, float})


def device_pointer(obj) -> int:
    """The device address of an array object. Host arrays are refused with a clear error."""
    data_ptr = getattr(obj, "data_ptr", None)
    if data_ptr is not None and hasattr(obj, "is_cuda"):  # torch
        if not obj.is_cuda:
            raise TypeError(f"torch tensor on {obj.device} is in host memory; move it to the GPU (.cuda())")
        return int(data_ptr())
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    if hasattr(obj, "__dlpack__"):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
            raise TypeError(f"{type(obj).__name__} lives on DLPack device type {int(dev_type)}, not a CUDA device")
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
