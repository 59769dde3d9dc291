"""The HIP runtime side (AMD GPUs): a live device's ``DeviceInfo``, loading a hiprtc code object, kernel attributes,
occupancy and (cooperative) launch, through hip-python. It mirrors ``rtckern.runtime.kernel`` so ops and the registry
use one interface (``num_regs``, ``max_active_blocks_per_sm``, ``launch(grid, block, args, ...)``, and the hot paths'
``prepare(grid, block, kinds, ...)``).

NOT EXECUTED: no AMD GPU exists where rtckern is developed, and the hip-python releases on PyPI (6.2 and newer) need
ROCm 6 or newer at run time, while the machines here have Debian's ROCm 5.2 (enough for hiprtc compiles only).
This module is written against hip-python's documented API and imported lazily: nothing here runs on NVIDIA
machines or on compile-only machines. Unit tests cover the parts that need no GPU (argument packing, geometry checks).
"""

from __future__ import annotations

import ctypes
import operator
import threading
from typing import Any, Sequence

from ..arch import Arch
from ..device import DeviceInfo
from ..errors import LaunchError, LoadError, RtckernError
from .kernel import KernelAttributes, _dim3, check_geometry
from .streams import stream_handle

# hipModuleLoadData errors that mean "this code object is no good here" (quarantine and recompile, as on CUDA).
REFUSED_IMAGE_ERRORS = {"hipErrorInvalidImage", "hipErrorNoBinaryForGpu", "hipErrorInvalidKernelFile",
                        "hipErrorSharedObjectInitFailed", "hipErrorNotFound"}
_lock = threading.Lock()
# Kernel.prepare's parameter kinds as the ctypes values hip-python packs ('M', a CUDA tensor map, has no AMD form),
# with the integer ranges the native launcher enforces (ctypes itself wraps silently)
_KIND_CTYPES = {"P": ctypes.c_ulonglong, "q": ctypes.c_longlong, "i": ctypes.c_int, "I": ctypes.c_uint,
                "f": ctypes.c_float, "d": ctypes.c_double}
_KIND_RANGES = {"P": (0, 2**64), "q": (-2**63, 2**63), "i": (-2**31, 2**31), "I": (0, 2**32)}


class HipError(RtckernError):
    def __init__(self, msg: str, name: str = ""):
        super().__init__(msg)
        self.name = name


def hip():
    """hip-python's ``hip`` module; an error with the fix where it is not installed."""
    try:
        from hip import hip as h
    except ImportError as e:
        raise RtckernError("running kernels on AMD GPUs needs hip-python matching the installed ROCm (6.x or newer): "
                           f"`pip install hip-python~=<ROCm version>` ({e})") from e
    return h


def _text(v: Any) -> str:
    if isinstance(v, bytes):
        return v.split(b"\x00", 1)[0].decode(errors="replace")
    dec = getattr(v, "decode", None)
    return dec() if callable(dec) else str(v)


def check(result: tuple, what: str):
    """Raise on a non-success hipError_t; return the remaining values (one value unwrapped)."""
    h = hip()
    err = result[0]
    if err != h.hipError_t.hipSuccess:
        name = _text(h.hipGetErrorName(err)[1])
        text = _text(h.hipGetErrorString(err)[1]) if hasattr(h, "hipGetErrorString") else ""
        raise HipError(f"{what} failed: {name}: {text}", name=name)
    rest = result[1:]
    return rest[0] if len(rest) == 1 else (rest if rest else None)


class on_device:
    """Make ``ordinal`` HIP's current device for the block, then restore the previous one."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.prev: int | None = None

    def __enter__(self):
        h = hip()
        self.prev = int(check(h.hipGetDevice(), "hipGetDevice"))
        if self.prev != self.ordinal:
            check(h.hipSetDevice(self.ordinal), f"hipSetDevice({self.ordinal})")
        return self

    def __exit__(self, *exc):
        if self.prev is not None and self.prev != self.ordinal:
            check(hip().hipSetDevice(self.prev), f"hipSetDevice({self.prev})")
        return False


def count_devices() -> int:
    return int(check(hip().hipGetDeviceCount(), "hipGetDeviceCount"))


def device_info(ordinal: int) -> DeviceInfo:
    """A live AMD GPU as rtckern sees it. The gfx name comes from gcnArchName without its feature suffixes
    (``gfx90a:sramecc+:xnack-`` -> ``gfx90a``): rtckern's code objects are built feature-neutral ("any")."""
    h = hip()
    n = count_devices()
    if not 0 <= ordinal < n:
        raise RtckernError(f"HIP device {ordinal} does not exist; {n} device(s) are visible (0..{n - 1})")
    A = h.hipDeviceAttribute_t

    def attr(a) -> int:
        return int(check(h.hipDeviceGetAttribute(a, ordinal), f"hipDeviceGetAttribute({a})"))

    props = h.hipDeviceProp_t()
    check(h.hipGetDeviceProperties(props, ordinal), "hipGetDeviceProperties")
    gfx = _text(props.gcnArchName).split(":", 1)[0]
    smem = attr(A.hipDeviceAttributeMaxSharedMemoryPerBlock)
    try:
        optin = attr(A.hipDeviceAttributeSharedMemPerBlockOptin)
    except HipError:  # older HIP: no opt-in attribute, and no opt-in needed (all LDS is available per block)
        optin = smem
    return DeviceInfo(
        arch=Arch.parse(gfx), sm_count=attr(A.hipDeviceAttributeMultiprocessorCount),
        max_smem_per_block=smem, max_smem_per_block_optin=max(smem, optin),
        regs_per_sm=attr(A.hipDeviceAttributeMaxRegistersPerMultiprocessor),
        max_threads_per_sm=attr(A.hipDeviceAttributeMaxThreadsPerMultiProcessor),
        max_threads_per_block=attr(A.hipDeviceAttributeMaxThreadsPerBlock),
        warp_size=attr(A.hipDeviceAttributeWarpSize), name=_text(props.name), ordinal=ordinal)


def _pack_kind(kind: str, value):
    """`value` as the ctypes value of parameter kind `kind`; TypeError / ValueError / OverflowError when it is none."""
    bounds = _KIND_RANGES.get(kind)
    if bounds is not None:
        v = operator.index(value)  # ints and numpy integers; a float or str raises TypeError
        if not bounds[0] <= v < bounds[1]:
            raise ValueError(f"{v} out of range")
        return _KIND_CTYPES[kind](v)
    return _KIND_CTYPES[kind](float(value))


def pack_args(args: Sequence[Any]) -> tuple:
    """Kernel arguments as the ctypes values hip-python packs into the launch buffer. rtckern's convention
    (kernel_sources/README.md): Python ints are pointers or ``long long`` (8 bytes), ``numpy.float32`` is
    ``float``; anything else is refused rather than guessed."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, bool):
            raise LaunchError(f"argument {i} is a bool; kernel parameters are pointers, long long or float")
        if isinstance(a, int):
            out.append(ctypes.c_longlong(a))
            continue
        tname = type(a).__name__
        if tname == "float32":
            out.append(ctypes.c_float(float(a)))
        elif tname in ("int64", "uint64", "intp"):
            out.append(ctypes.c_longlong(int(a)))
        elif isinstance(a, (ctypes.c_float, ctypes.c_longlong, ctypes.c_void_p)):
            out.append(a)
        else:
            raise LaunchError(f"argument {i} has type {tname}; pass int (pointer or long long) or numpy.float32 "
                              "(float): a Python float has no fixed width")
    return tuple(out)


def load_kernel(binary: bytes, kind: str, lowered_name: str, device: DeviceInfo, label: str = "") -> "HipKernel":
    """Load a hiprtc code object on ``device`` and look up ``lowered_name`` (same contract as
    ``rtckern.runtime.kernel.load_kernel``: LoadError, with ``refused=True`` when HIP rejects the image)."""
    if kind != "hsaco":
        raise LoadError(f"cannot load a {kind} on AMD {device.describe()}: HIP loads hiprtc code objects (hsaco)")
    h = hip()
    image = bytes(binary)
    try:
        with on_device(device.ordinal):
            module = check(h.hipModuleLoadData(image), "hipModuleLoadData")
            func = check(h.hipModuleGetFunction(module, lowered_name.encode()), f"hipModuleGetFunction({lowered_name})")
    except HipError as e:
        err = LoadError(f"cannot load {label or lowered_name} on {device.describe()}: {e}")
        err.refused = e.name in REFUSED_IMAGE_ERRORS
        raise err from e
    return HipKernel(func, module, image, device, label or lowered_name)


class HipKernel(KernelAttributes):
    """A kernel on one AMD GPU; the same surface as ``rtckern.runtime.Kernel``."""

    __slots__ = ("_f", "_module", "_image", "device", "label", "_attrs", "_max_dyn_smem", "_checked")

    def __init__(self, func, module, image: bytes, device: DeviceInfo, label: str):
        self._f = func
        self._module = module  # keeps the code object loaded
        self._image = image
        self.device = device
        self.label = label
        self._attrs: dict[str, int] = {}
        self._max_dyn_smem = device.max_smem_per_block
        self._checked: set[tuple] = set()

    def __repr__(self) -> str:
        return f"<rtckern.HipKernel {self.label} on {self.device.describe()}>"

    def _attr(self, name: str) -> int:
        """A HIP_FUNC_ATTRIBUTE_<name> of the kernel (fixed once loaded: read once)."""
        v = self._attrs.get(name)
        if v is None:
            h = hip()
            full = f"HIP_FUNC_ATTRIBUTE_{name}"
            a = getattr(h.hipFunction_attribute, full)
            with on_device(self.device.ordinal):
                v = int(check(h.hipFuncGetAttribute(a, self._f), f"hipFuncGetAttribute({full})"))
            self._attrs[name] = v
        return v

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        """AMD needs no opt-in: every block may use the device's LDS up to its limit; refuse more, like CUDA."""
        limit = self.device.max_smem_per_block_optin - self.shared_size_bytes
        if nbytes > limit:
            raise LaunchError(f"{self.label}: {nbytes} bytes of dynamic shared memory (LDS) requested, but "
                              f"{self.device.describe()} allows at most {limit} "
                              f"({self.device.max_smem_per_block_optin} minus {self.shared_size_bytes} static)")
        self._max_dyn_smem = max(self._max_dyn_smem, int(nbytes))

    def _ensure_dynamic_smem(self, nbytes: int) -> None:
        if nbytes > self._max_dyn_smem:
            self.set_max_dynamic_shared_memory(nbytes)

    _OCCUPANCY_CALLS = {"blocks": ("hipModuleOccupancyMaxActiveBlocksPerMultiprocessor", ()),
                        "block_size": ("hipModuleOccupancyMaxPotentialBlockSize", ())}

    def _driver_api(self) -> tuple:
        return hip(), self._f, on_device, check

    def check_launch(self, grid, block, shared_mem: int, cooperative: bool) -> tuple[tuple, tuple]:
        """The geometry checks of the CUDA Kernel, memoized per configuration."""
        g, b = _dim3(grid), _dim3(block)
        key = (g, b, shared_mem, cooperative)
        if key in self._checked:
            return g, b
        check_geometry(self, g, b, shared_mem, cooperative, self.set_max_dynamic_shared_memory,
                       limit=f"__launch_bounds__ or registers: {self.num_regs} VGPRs", unit="CU", smem="dynamic LDS")
        with _lock:
            self._checked.add(key)
        return g, b

    def prepare(self, grid, block, kinds: str, shared_mem: int = 0, dependent: bool = False):
        """``rtckern.runtime.Kernel.prepare``'s surface on AMD, which the ops' hot paths call: ``f(stream, *args)``
        with one argument per character of ``kinds`` ('P' pointer, 'q' int64, 'i' int32, 'I' uint32, 'f' float32,
        'd' float64), each packed by its kind. ``dependent`` (a programmatic dependent launch on sm_90) has no
        counterpart here: an ordinary launch in stream order, where the kernels' wait for the previous grid is a
        no-op."""
        bad = sorted(set(kinds) - set(_KIND_CTYPES))
        if bad:
            raise LaunchError(f"{self.label}: parameter kinds {bad}; a HIP launch takes {' '.join(_KIND_CTYPES)} "
                              "(no tensor maps on AMD)")
        g, b = self.check_launch(grid, block, shared_mem, False)

        def call(stream, *args):
            if len(args) != len(kinds):
                raise TypeError(f"launch of {self.label} takes a stream and {len(kinds)} kernel arguments; got "
                                f"{len(args) + 1} arguments")
            packed = []
            for i, (k, a) in enumerate(zip(kinds, args)):
                try:
                    packed.append(_pack_kind(k, a))
                except (TypeError, ValueError, OverflowError):
                    raise TypeError(f"argument {i} of {self.label} (kind '{k}'): cannot convert {a!r}") from None
            self._launch_packed(g, b, tuple(packed), shared_mem, stream, False)
        return call

    def launch(self, grid, block, args: Sequence[Any] = (), shared_mem: int = 0, stream=None,
               cooperative: bool = False) -> None:
        """Launch on ``stream`` (int hipStream_t, a torch ROCm stream, or None for the default stream)."""
        g, b = self.check_launch(grid, block, shared_mem, cooperative)
        self._launch_packed(g, b, pack_args(args), shared_mem, stream, cooperative)

    def _launch_packed(self, g, b, packed: tuple, shared_mem: int, stream, cooperative: bool) -> None:
        h = hip()
        s = None if stream is None else (stream_handle(stream) or None)
        with on_device(self.device.ordinal):
            if cooperative:
                # hipModuleLaunchCooperativeKernel takes kernelParams (an array of argument addresses), not extra.
                params = (ctypes.c_void_p * max(1, len(packed)))(*[ctypes.addressof(v) for v in packed])
                check(h.hipModuleLaunchCooperativeKernel(self._f, *g, *b, int(shared_mem), s, params),
                      f"cooperative launch of {self.label}")
            else:
                check(h.hipModuleLaunchKernel(self._f, *g, *b, int(shared_mem), s, None, packed),
                      f"launch of {self.label} (grid {g}, block {b}, shared memory {shared_mem}, {len(packed)} args)")
