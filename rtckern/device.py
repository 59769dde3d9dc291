"""``DeviceInfo``: what rtckern needs to know about a GPU, from a live device or described by hand."""

from __future__ import annotations

import dataclasses
import functools
import re
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
    """A GPU as rtckern needs to know it: live (from_device) or described by hand (for_arch)."""
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
    memory_bytes: int = 0  # total device memory (0: not known, e.g. a described device)
    # The tuning tables' device class (``device_class``): given by hand for a described device ("h100-sxm");
    # empty: derived from the name and memory where they are known (a live device), else none.
    device_class: str = ""

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
        if base.get("device_class"):
            base["device_class"] = check_device_class(base["device_class"])
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
        cls = device_class(self)
        return (f"{where} {self.name or self.arch.sm} ({self.arch.sm}, {self.sm_count} SMs, "
                f"{self.max_smem_per_block_optin // 1024} KB smem/block opt-in"
                + (f", class {cls}" if cls else "") + ")")


# -- device classes ---------------------------------------------------------------------------------------------
# (arch, SM count) does not tell an H100 SXM from an H200 (both sm_90, 132 SMs; 3.35 vs 4.8 TB/s): the tuning
# tables key rows by a device class too. A class is a short stable name: a known product's (below), else the
# device name normalized. Known classes carry their memory bandwidth (TB/s), which orders the fallback to rows of
# another class (rtckern/tuning.py).
CLASS_BANDWIDTH_TBPS = {
    "h100-sxm": 3.35, "h100-pcie": 2.0, "h100-nvl": 3.9, "h800": 3.35, "h20": 4.0, "gh200": 4.0,
    "h200": 4.8, "h200-nvl": 4.8,
    "a100-80g": 2.04, "a100-40g": 1.55, "a800": 2.04, "a10": 0.6, "a10g": 0.6, "l4": 0.3, "l40": 0.864,
    "l40s": 0.864, "b200": 8.0, "b100": 8.0, "gb200": 8.0,
    "mi300x": 5.3, "mi325x": 6.0, "mi250x": 3.2, "mi210": 1.6,
}
_CLASS_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}", re.ASCII)


def check_device_class(text: str) -> str:
    """A class name as given by a user (--device-class, DeviceInfo(device_class=...)): lowercase letters, digits,
    '.', '_' and '-'; OptionError otherwise."""
    t = str(text).strip().lower()
    if not _CLASS_RE.fullmatch(t):
        known = ", ".join(sorted(CLASS_BANDWIDTH_TBPS))
        raise OptionError(f"device class {text!r}: use lowercase letters, digits, '.', '_' or '-' (up to 64), e.g. "
                          f"one of {known}")
    return t


@functools.lru_cache(maxsize=64)  # asked by every tuning lookup (the device's class) with the same name
def class_of_name(name: str, memory_bytes: int = 0) -> str | None:
    """The device class of a device name as the driver reports it ("NVIDIA H100 80GB HBM3" -> "h100-sxm",
    "NVIDIA H200" -> "h200", "NVIDIA A100-SXM4-40GB" -> "a100-40g"); memory_bytes (when known) tells the A100
    sizes apart. A name of no known product gives the name normalized ("NVIDIA GeForce RTX 4090" ->
    "geforce-rtx-4090"); an empty name gives None."""
    n = re.sub(r"[^a-z0-9]+", " ", (name or "").lower()).strip()
    if not n:
        return None
    words = n.split()
    w = set(words)
    gib = memory_bytes / 2 ** 30 if memory_bytes else 0.0
    if "gh200" in w:
        return "gh200"
    if "h200" in w:
        return "h200-nvl" if "nvl" in w else "h200"
    if "h100" in w:
        if "pcie" in w:
            return "h100-pcie"
        return "h100-nvl" if "nvl" in w else "h100-sxm"
    for product in ("h800", "h20", "a800", "b200", "b100", "gb200", "l40s", "l40", "l4", "a10g", "a10",
                    "mi300x", "mi325x", "mi250x", "mi210"):
        if product in w:
            return product
    if "a100" in w:
        big = gib > 60 if gib else ("80gb" in w or "80g" in w)
        return "a100-80g" if big else "a100-40g"
    drop = {"nvidia", "amd", "instinct", "tesla"}
    rest = [x for x in words if x not in drop] or words
    return "-".join(rest)[:64]


def device_class(device: "DeviceInfo") -> str | None:
    """The device's class for the tuning tables: the one given by hand (DeviceInfo.device_class), else the class of
    its name when the name is a real one (a live device, or one recorded from a live device); None for a device
    described by arch alone (its rows are then those of its arch and SM count, of any class)."""
    if device.device_class:
        return device.device_class
    name = device.name or ""
    if not name or name == f"described {device.arch.sm}" or (device.arch.gfx and name == f"AMD {device.arch.gfx}"):
        return None
    return class_of_name(name, device.memory_bytes)


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
        memory_bytes=attrs.get("memory_bytes", 0),
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
