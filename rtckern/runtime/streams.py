"""Turning whatever the caller passes as a stream into a cuda.core ``Stream``, cheaply on repeat."""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_by_handle: dict[int, object] = {}


def stream_handle(stream) -> int:
    """An int handle from: an int, an object with ``__cuda_stream__``, a torch stream (``cuda_stream``), or
    a CuPy stream (``ptr``)."""
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    for attr in ("cuda_stream", "ptr", "handle"):
        h = getattr(stream, attr, None)
        if h is not None:
            return int(h)
    raise TypeError(f"cannot use {type(stream).__name__} as a stream; pass an int handle, a torch or CuPy stream, "
                    "or an object with __cuda_stream__")


def core_stream(stream):
    """The cuda.core Stream for ``stream`` (cached by handle)."""
    h = stream_handle(stream)
    s = _by_handle.get(h)
    if s is None:
        from cuda.core import Stream

        with _lock:
            s = _by_handle.get(h)
            if s is None:
                s = Stream.from_handle(h)
                _by_handle[h] = s
    return s


# ---- the caller's current stream ----------------------------------------------------------------------------------
_raw_stream = None  # torch's C accessor (or a fallback), found on first use


def torch_stream_getter():
    """f(index) -> torch's current stream handle on device `index`: torch._C._cuda_getCurrentRawStream where this
    torch has it (one C call), else torch.cuda.current_stream(index).cuda_stream (builds a Stream object per call).
    For hot paths that already know torch is imported: they keep f and call it."""
    global _raw_stream
    f = _raw_stream
    if f is None:
        torch = sys.modules["torch"]
        f = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
        if f is None:
            def f(i, _cs=torch.cuda.current_stream):
                return _cs(i).cuda_stream
        _raw_stream = f
    return f


def torch_stream(index: int) -> int:
    """torch's current stream handle on device `index` (see torch_stream_getter)."""
    f = _raw_stream
    return (f or torch_stream_getter())(index)


def current_stream(like) -> int:
    """The handle of the library's current stream on the device of `like` (an op family's array view: `lib`
    "torch" or "cupy", `obj` the array, `device` its ordinal): launches order with the caller's work."""
    if like.lib == "torch":
        import torch

        return torch.cuda.current_stream(like.obj.device).cuda_stream
    import cupy

    with cupy.cuda.Device(like.device):
        return cupy.cuda.get_current_stream().ptr
