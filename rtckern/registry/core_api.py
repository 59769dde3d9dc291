"""The few core calls the registry makes, in one place: compile, load, cache key, toolchain identity."""
from __future__ import annotations

from typing import Any

from rtckern.manager import get_manager


def compile(spec: Any) -> bytes:  # noqa: A001 - mirrors KernelManager.compile
    return get_manager().compile(spec)


def load(spec: Any, ordinal: int) -> Any:
    return get_manager().get(spec, device=ordinal)


def cache_key(spec: Any) -> str:
    return get_manager().key(spec)


def compile_error_summary(exc: Exception, max_lines: int = 6) -> str:
    """The compiler's error lines (not the whole log): enough to see why, short enough to list per candidate."""
    log = getattr(exc, "log", "") or ""
    lines = [ln.strip() for ln in log.splitlines() if "error" in ln.lower()]
    if not lines:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    more = len(lines) - max_lines
    text = "; ".join(lines[:max_lines])
    return text + (f"; (+{more} more lines)" if more > 0 else "")


def target_for(device: Any, arch_specific: bool = False) -> Any:
    """The compile target for a device: DeviceInfo.target() where the core has it, else the core's
    choose_target() with this NVRTC's supported archs (and the driver's version on a live device)."""
    fn = getattr(device, "target", None)
    if fn is not None:
        return fn(needs_arch_specific=arch_specific)
    from rtckern.arch import choose_target
    from rtckern.compiler import compiler_for

    if device.arch.gfx:
        return device.arch
    comp = compiler_for(device.arch)
    drv = None
    if device.ordinal is not None:
        from rtckern.runtime.driver import driver_version

        drv = driver_version()
    return choose_target(device.arch, comp.supported_archs(), arch_specific=arch_specific,
                         nvrtc_version=comp.version(), driver_version=drv)


def toolchain(mode: str, device: Any) -> dict[str, Any]:
    """What, besides the kernels' cache keys, can change a probe outcome: rtckern's version (candidate code),
    and on a live device the driver version (loading, occupancy)."""
    import rtckern

    out: dict[str, Any] = {"rtckern": getattr(rtckern, "__version__", "0")}
    if mode == "live":
        from rtckern.runtime.driver import driver_version

        out["driver"] = "%d.%d" % driver_version()
    return out
