"""Loading binaries on a device and launching kernels."""

from .kernel import Kernel, load_kernel
from .prepared import PreparedLaunch, param_types_of
from .streams import core_stream, stream_handle

__all__ = ["Kernel", "load_kernel", "PreparedLaunch", "param_types_of", "core_stream", "stream_handle"]
