"""rtckern: a runtime JIT kernel service for CUDA (NVRTC) and HIP (hiprtc)."""

from .arch import Arch, ArchFilter, parse_arch_list
from .device import DeviceInfo, device_count
from .errors import (ArchError, CacheError, CompileError, InputError, LaunchError, LoadError, RtckernError,
                     UnsupportedRequestError)
from .manager import KernelManager, get_manager, set_manager
from .spec import KernelSpec

__version__ = "0.1.0"

__all__ = [
    "Arch", "ArchFilter", "ArchError", "CacheError", "CompileError", "DeviceInfo", "InputError", "KernelManager",
    "KernelSpec", "LaunchError", "LoadError", "RtckernError", "UnsupportedRequestError", "device_count",
    "get_manager", "parse_arch_list", "set_manager", "__version__",
]
