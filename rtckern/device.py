"""``DeviceInfo``: what rtckern needs to know about a GPU, from a live device or described by hand."""

from __future__ import annotations

import dataclasses
import functools
import threading

from .arch import Arch
from .errors import OptionError, RtckernError

# Typical limits per compute capability, for devices described by hand (prefill, tests, explain).
# (sm_count, max_smem_per_block_optin, max_threads_per_sm)
_TYPICAL = {
    (7, 5): (40, 65536, 1024),
    (8, 0): (108, 166912, 2048),
    (8, 6): (84, 101376, 1536),
    (8, 7): (16, 166912, 1536),
    (8, 9): (128, 101376, 1536),
    (9, 0): (132, 232448, 2048),
    (10, 0): (148, 232448, 2048),
    (12, 0): (188, 101376, 1536),
}


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    arch: Arch
    sm_count: int
    max_smem_per_block: int = 49152
    max_smem_per_block_optin: int = 49152
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_threads_per_block: int = 1024
    warp_size: int = 32
    name: str = ""
    ordinal: int | None = None  # None: not a live device (compile-only)

    @property
    def live(self) -> bool:
        return self.ordinal is not None

    @property
    def vendor(self) -> str:
        return self.arch.vendor

    @classmethod
    def for_arch(cls, arch: str | Arch, sm_count: int | None = None, **overrides) -> "DeviceInfo":
        """A typical device of an arch, described by hand (no GPU needed)."""
        if sm_count is not None and (isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1):
            raise OptionError(f"sm_count={sm_count!r}: a described device needs a positive SM count (e.g. 132), or "
                              "None for the arch's typical one")
        a = Arch.parse(arch) if isinstance(arch, str) else arch
        a = dataclasses.replace(a, ptx=False)
        if a.gfx:
            from .compiler.hiprtc import wavefront_size  # pure function; loads no library

            base = dict(sm_count=sm_count or 104, max_smem_per_block=65536, max_smem_per_block_optin=65536,
                        regs_per_sm=131072, max_threads_per_sm=2048, warp_size=wavefront_size(a.gfx),
                        name=f"AMD {a.gfx}")
        else:
            sms, optin, tpsm = _TYPICAL.get(a.cc, _TYPICAL[max(k for k in _TYPICAL if k <= a.cc)] if a.cc >= (7, 5)
                                           else (40, 49152, 1024))
            base = dict(sm_count=sm_count or sms, max_smem_per_block=49152, max_smem_per_block_optin=optin,
                        regs_per_sm=65536, max_threads_per_sm=tpsm, warp_size=32, name=f"described {a.sm}")
        base.update(overrides)
        return cls(arch=a, **base)

    @classmethod
    def from_device(cls, ordinal: int = 0) -> "DeviceInfo":
        return _live_device_info(ordinal)

    def target(self, needs_arch_specific: bool = False) -> Arch:
        """The compile target for this device: a cubin for its exact arch (``sm_90a`` when arch-specific
        instructions are needed); PTX only where the device is newer than NVRTC supports and the driver can
        load it (checked on a live device)."""
        if self.arch.gfx:
            return self.arch
        from .arch import choose_target
        from .compiler import compiler_for

        comp = compiler_for(self.arch)
        drv = None
        if self.live:
            from .runtime.driver import driver_version

            drv = driver_version()
        return choose_target(self.arch, comp.supported_archs(), arch_specific=needs_arch_specific,
                             nvrtc_version=comp.version(), driver_version=drv)

    def describe(self) -> str:
        where = f"device {self.ordinal}" if self.live else "described device"
        return (f"{where} {self.name or self.arch.sm} ({self.arch.sm}, {self.sm_count} SMs, "
                f"{self.max_smem_per_block_optin // 1024} KB smem/block opt-in)")


@functools.lru_cache(maxsize=None)
def _live_device_info(ordinal: int) -> DeviceInfo:
    from .runtime.driver import device_attributes

    attrs = device_attributes(ordinal)
    return DeviceInfo(
        arch=Arch(attrs["major"], attrs["minor"]),
        sm_count=attrs["sm_count"],
        max_smem_per_block=attrs["smem_per_block"],
        max_smem_per_block_optin=attrs["smem_per_block_optin"],
        regs_per_sm=attrs["regs_per_sm"],
        max_threads_per_sm=attrs["threads_per_sm"],
        max_threads_per_block=attrs["threads_per_block"],
        warp_size=attrs["warp_size"],
        name=attrs["name"],
        ordinal=ordinal,
    )


_count_lock = threading.Lock()
_count: int | None = None


def device_count() -> int:
    """Number of visible CUDA devices; 0 where there is no driver or no GPU (never raises)."""
    global _count
    with _count_lock:
        if _count is None:
            try:
                from .runtime.driver import count_devices

                _count = count_devices()
            except Exception:  # no driver library, no GPU: a machine for compiling only
                _count = 0
        return _count


def visible_archs() -> list[Arch]:
    return [DeviceInfo.from_device(i).arch for i in range(device_count())]


def current_device_info(ordinal: int | None = None) -> DeviceInfo:
    n = device_count()
    if n == 0:
        raise RtckernError("no CUDA device is visible; describe a device by hand with DeviceInfo.for_arch('sm_90') "
                           "for compile-only work")
    return DeviceInfo.from_device(0 if ordinal is None else ordinal)
