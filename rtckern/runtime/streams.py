"""Turning whatever the caller passes as a stream into a cuda.core ``Stream``, cheaply on repeat."""

from __future__ import annotations

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
