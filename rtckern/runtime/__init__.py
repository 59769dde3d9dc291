"""Loading binaries on a device and launching kernels."""

from .kernel import Kernel, load_kernel
from .streams import core_stream, stream_handle

__all__ = ["Kernel", "load_kernel", "core_stream", "stream_handle"]
