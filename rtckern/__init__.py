"""rtckern: a runtime JIT kernel service for CUDA (NVRTC) and HIP (hiprtc)."""

from . import config, events, logs
from .arch import Arch, ArchFilter, parse_arch_list
from .device import DeviceInfo, device_count
from .errors import (ArchError, CacheError, CompileError, ConfigError, InputError, LaunchError, LoadError, RtckernError,
                     UnsupportedRequestError)
from .manager import KernelManager, get_manager, set_manager
from .spec import KernelSpec

__version__ = "0.1.0"


def _record_mode(event: events.SelectionEvent) -> None:
    """Record mode (RTCKERN_RECORD_MANIFEST): fleet appends each request the registry decides for the first time
    to the manifest. Installed here, where every program passes, so the registry imports nothing above it; fleet
    is imported only when recording."""
    if config.settings().record_manifest is not None:
        from .fleet.record import record_selection

        record_selection(event)


events.add_listener(_record_mode, events.SelectionEvent)
logs.register_torch()  # only where torch is already imported (rtckern.torch registers it otherwise)


def explain(*args, **kwargs):
    """Every candidate for an op request, accepted or rejected and why (see rtckern.registry.explain)."""
    from .registry import explain as _explain

    return _explain(*args, **kwargs)


def clear_caches() -> None:
    """Forget every in-memory cache: loaded kernels and binaries of the process-wide manager, op plans, registry
    selections, tile choices, tuning tables (the disk tier and persisted decisions stay)."""
    from .manager import get_manager

    get_manager().clear_memory()  # also empties every PlanCache (rtckern.caches)


__all__ = [
    "Arch", "ArchFilter", "ArchError", "CacheError", "CompileError", "ConfigError", "DeviceInfo", "InputError",
    "KernelManager", "KernelSpec", "LaunchError", "LoadError", "RtckernError", "UnsupportedRequestError", "device_count",
    "clear_caches", "explain", "get_manager", "parse_arch_list", "set_manager", "__version__",
]
