"""Target architectures: the ``Arch`` value type, arch-list parsing, per-op filters and target choice.

Accepted spellings (as they appear in the wild): ``7.5``, ``8.6+PTX``, ``9.0a``, ``sm_90a``, ``compute_90``,
``90``, ``gfx90a``, and ``native`` (the visible devices), separated by ``;``, ``,`` or spaces.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Sequence

from .errors import ArchError

ONE_ARCH_FORMS = "'7.5', '8.6+PTX', '9.0a', 'sm_90a', 'compute_90', '90', 'gfx90a'"  # Arch.parse's
ACCEPTED_FORMS = ONE_ARCH_FORMS + ", 'native'"  # an arch list's entries (parse_arch_list)

# What `rtckern prefill` compiles for without --arch (RTCKERN_ARCH_LIST replaces it): Turing to Hopper, sm_90a for the
# wgmma kernels, and Blackwell: sm_100 (B200 / GB200) and sm_120 (RTX 50 / RTX PRO), where the portable (sm_80-class)
# kernels serve, since the sm_90a ones run on sm_90 only.
DEFAULT_ARCH_LIST = "7.5;8.0;8.6;8.9;9.0a;10.0;12.0"

# Arch-specific ("a") feature sets exist only for these NVIDIA archs.
_ARCH_SPECIFIC_OK = {(9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1)}

_RE_DOTTED = re.compile(r"([0-9]+)\.([0-9])([af]?)(\+ptx)?", re.ASCII)
_RE_SM = re.compile(r"(sm|compute)_([0-9]+?)([0-9])([af]?)", re.ASCII)
_RE_BARE = re.compile(r"([0-9]+?)([0-9])([af]?)(\+ptx)?", re.ASCII)
_RE_GFX = re.compile(r"gfx[0-9a-f]{3,4}", re.ASCII)


@dataclasses.dataclass(frozen=True, order=True)
class Arch:
    """One compile target. NVIDIA: compute capability ``major.minor`` with an optional ``a``/``f`` feature
    suffix and a ``ptx`` flag (also emit PTX). AMD: a ``gfx`` name."""

    major: int = 0
    minor: int = 0
    suffix: str = ""
    ptx: bool = False
    gfx: str = ""

    # ---- construction ----
    @classmethod
    def parse(cls, text: str) -> "Arch":
        s = text.strip().lower()
        if not s:
            raise ArchError(f"empty arch entry; accepted forms: {ACCEPTED_FORMS}")
        if _RE_GFX.fullmatch(s):
            return cls(gfx=s)
        m = _RE_DOTTED.fullmatch(s)
        if m:
            return cls(int(m.group(1)), int(m.group(2)), m.group(3), bool(m.group(4)))
        m = _RE_SM.fullmatch(s)
        if m:
            return cls(int(m.group(2)), int(m.group(3)), m.group(4), m.group(1) == "compute")
        m = _RE_BARE.fullmatch(s)
        if m and int(m.group(1)) >= 1:
            return cls(int(m.group(1)), int(m.group(2)), m.group(3), bool(m.group(4)))
        if s == "native" or re.search(r"[;,\s]", s):  # what an arch list takes, where one arch is asked for
            raise ArchError(f"{text!r} names {'the visible GPUs' if s == 'native' else 'several archs'}, as an arch "
                            f"list does; give one arch here: {ONE_ARCH_FORMS}")
        raise ArchError(f"unknown arch entry {text!r}; accepted forms: {ACCEPTED_FORMS}")

    # ---- properties ----
    @property
    def vendor(self) -> str:
        return "amd" if self.gfx else "nvidia"

    @property
    def cc(self) -> tuple[int, int]:
        return (self.major, self.minor)

    @property
    def number(self) -> int:
        """``90`` for 9.0 (NVIDIA only)."""
        return self.major * 10 + self.minor

    @property
    def sm(self) -> str:
        """Real-architecture name: ``sm_90a`` (or ``gfx90a``)."""
        return self.gfx or f"sm_{self.number}{self.suffix}"

    @property
    def compute(self) -> str:
        """Virtual-architecture name: ``compute_90a``."""
        return self.gfx or f"compute_{self.number}{self.suffix}"

    @property
    def arch_specific(self) -> bool:
        return self.suffix == "a"

    def base(self) -> "Arch":
        """The same arch without the feature suffix and PTX flag."""
        return dataclasses.replace(self, suffix="", ptx=False)

    def cubin_target(self) -> "Arch":
        return dataclasses.replace(self, ptx=False)

    def with_specific(self) -> "Arch":
        if self.gfx:
            raise ArchError(f"{self.gfx} has no arch-specific variant")
        if self.cc not in _ARCH_SPECIFIC_OK:
            raise ArchError(f"{self} has no arch-specific ('a') variant; those exist for "
                            + ", ".join(f"{a}.{b}a" for a, b in sorted(_ARCH_SPECIFIC_OK)))
        return dataclasses.replace(self, suffix="a")

    def can_run_on(self, device: "Arch") -> bool:
        """Whether a cubin for this target runs on a device of arch ``device``."""
        if self.gfx or device.gfx:
            return self.gfx == device.gfx
        if self.suffix == "a":
            return self.cc == device.cc
        # Same major, minor not above the device's (binary compatibility within a major version).
        return self.major == device.major and self.minor <= device.minor

    def __str__(self) -> str:
        if self.gfx:
            return self.gfx
        return f"{self.major}.{self.minor}{self.suffix}" + ("+PTX" if self.ptx else "")

    def sort_key(self) -> tuple:
        return (self.vendor, self.major, self.minor, self.suffix, self.gfx, self.ptx)


def parse_arch_list(text: str | Iterable[str], native: Callable[[], Sequence[Arch]] | None = None) -> list[Arch]:
    """Parse an arch list; remove duplicates; return a deterministic (sorted) order.

    ``8.6`` and ``8.6+PTX`` merge into ``8.6+PTX`` (a cubin plus PTX). ``native`` expands to the archs of
    the visible devices (``native`` is a callable so tests can describe devices by hand).
    """
    if isinstance(text, str):
        entries = [e for e in re.split(r"[;,\s]+", text.strip()) if e]
    else:
        entries = [str(e).strip() for e in text if str(e).strip()]
    if not entries:
        raise ArchError(f"empty arch list; give at least one entry, e.g. '8.0;9.0a' (accepted forms: {ACCEPTED_FORMS})")
    out: dict[tuple, Arch] = {}
    for entry in entries:
        if entry.lower() == "native":
            if native is None:
                from .device import visible_archs

                native = visible_archs
            found = list(native())
            if not found:
                raise ArchError("'native' was asked for but no GPU is visible; name the archs instead, e.g. '9.0'")
            archs = found
        else:
            archs = [Arch.parse(entry)]
        for a in archs:
            key = (a.vendor, a.major, a.minor, a.suffix, a.gfx)
            prev = out.get(key)
            out[key] = a if prev is None else dataclasses.replace(a, ptx=prev.ptx or a.ptx)
    return sorted(out.values(), key=Arch.sort_key)


def format_arch_list(archs: Iterable[Arch]) -> str:
    return ";".join(str(a) for a in archs)


@dataclasses.dataclass(frozen=True)
class ArchFilter:
    """What an op (or a candidate) can be compiled for. Applied before compiling, so no op ever compiles
    for an arch it excludes and no compile receives duplicate or contradicting targets."""

    min_arch: Arch | None = None
    max_arch: Arch | None = None
    arch_specific: bool = False  # needs the 'a' target (wgmma, setmaxnreg)
    vendors: tuple[str, ...] = ("nvidia",)

    @classmethod
    def of(cls, min_arch: str | Arch | None = None, max_arch: str | Arch | None = None,
           arch_specific: bool = False, vendors: Sequence[str] = ("nvidia",)) -> "ArchFilter":
        conv = lambda a: Arch.parse(a) if isinstance(a, str) else a  # noqa: E731
        return cls(conv(min_arch), conv(max_arch), arch_specific, tuple(vendors))

    def reason(self, arch: Arch) -> str | None:
        """None if ``arch`` is served, else why not."""
        if arch.vendor not in self.vendors:
            return f"{arch} is {arch.vendor}; this serves {'/'.join(self.vendors)} only"
        if arch.gfx:
            return None
        if self.min_arch is not None and arch.cc < self.min_arch.cc:
            return f"{arch.sm} is below the minimum {self.min_arch.sm}"
        if self.max_arch is not None and arch.cc > self.max_arch.cc:
            return f"{arch.sm} is above the maximum {self.max_arch.sm}"
        if self.arch_specific and arch.cc not in _ARCH_SPECIFIC_OK:
            return f"needs an arch-specific target ('a' features), which {arch.sm} does not have"
        return None

    def targets(self, archs: Iterable[Arch]) -> list[Arch]:
        """The compile targets among ``archs`` this filter serves, deduplicated, in order."""
        out: dict[tuple, Arch] = {}
        for a in archs:
            if self.reason(a) is not None:
                continue
            t = a.with_specific() if (self.arch_specific and not a.gfx) else a
            if not self.arch_specific and t.suffix == "a":
                # A portable kernel needs no 'a' target; compile it for the base arch once.
                t = t.base() if not a.ptx else dataclasses.replace(t.base(), ptx=True)
            key = (t.vendor, t.major, t.minor, t.suffix, t.gfx)
            prev = out.get(key)
            out[key] = t if prev is None else dataclasses.replace(t, ptx=prev.ptx or t.ptx)
        return sorted(out.values(), key=Arch.sort_key)


def nvrtc_unsupported_message(arch: Arch, supported: Sequence[int], nvrtc_version: tuple[int, int]) -> str:
    listed = ", ".join(f"sm_{n}" for n in supported)
    msg = f"NVRTC {nvrtc_version[0]}.{nvrtc_version[1]} cannot target {arch.sm}; it supports {listed}."
    if arch.cc == (7, 0) or arch.cc == (7, 2):
        msg += (" NVRTC 13 dropped Volta (sm_70/sm_72), and rtckern needs CUDA 13 (cuda-bindings 13.x): Volta is not "
                "supported; run torch's own ops there (RTCKERN_DISABLE_OPS=all makes the torch plugin do so).")
    return msg


def choose_target(device: Arch, supported: Sequence[int], *, arch_specific: bool = False,
                  nvrtc_version: tuple[int, int] = (0, 0), driver_version: tuple[int, int] | None = None) -> Arch:
    """The compile target for a live device: a cubin for its exact arch (``sm_90a`` when arch-specific
    instructions are used). PTX only when the device is newer than NVRTC supports, and only if the driver is
    at least as new as NVRTC (the driver refuses newer PTX)."""
    if device.gfx:
        return device
    if device.number in supported:
        t = Arch(device.major, device.minor)
        return t.with_specific() if arch_specific else t
    if arch_specific:
        raise ArchError(nvrtc_unsupported_message(device, supported, nvrtc_version)
                        + " Arch-specific kernels need an exact cubin; upgrade NVRTC.")
    older = [n for n in supported if n <= device.number]
    if not older or device.number < min(supported):
        raise ArchError(nvrtc_unsupported_message(device, supported, nvrtc_version))
    if driver_version is not None and driver_version < nvrtc_version:
        raise ArchError(
            f"the device ({device.sm}) is newer than NVRTC {nvrtc_version[0]}.{nvrtc_version[1]} supports, so only "
            f"PTX could serve it, but the driver (CUDA {driver_version[0]}.{driver_version[1]}) refuses PTX from a "
            "newer NVRTC (CUDA_ERROR_UNSUPPORTED_PTX_VERSION). Upgrade the driver or install an NVRTC that "
            f"targets {device.sm}.")
    n = max(older)
    return Arch(n // 10, n % 10, ptx=True)
