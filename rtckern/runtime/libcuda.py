"""The driver calls of a first call's path made straight into libcuda through ctypes: device facts, the primary
context, loading a library, kernel attributes, occupancy. Each takes and returns what cuda.bindings.driver's
function of the same name does ((CUresult, value) tuples, handles as ints, which cuda.bindings accepts back), so
`runtime.driver.driver()` hands out one object: these functions, and cuda.bindings.driver's for everything else
(the enums' other members, types, streams, events, tensor maps, the cuda.core launch path).

Why: cuda.bindings.driver resolves every driver entry point (~500 cuGetProcAddress calls) on its first call in a
process, ~20 ms on an H100 host, the largest part of what rtckern's first call cost beyond torch's own. ctypes
looks up only the names used here, in the libcuda the process has loaded (torch's or cuda.bindings'). The names
are the entry points cuda.h maps them to (cuDeviceTotalMem is cuDeviceTotalMem_v2).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

_int, _uint, _ptr, _size = ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_size_t
_P = ctypes.POINTER

LIBCUDA = "libcuda.so.1"  # the driver library's soname, as cuda.bindings and the native launcher load it
# name -> argument types; every function returns a CUresult (int). The entry point is the name, but where cuda.h maps
# the name to a versioned one (_ENTRY_POINTS).
_ARGTYPES: dict[str, tuple] = {
    "cuInit": (_uint,),
    "cuDriverGetVersion": (_P(_int),),
    "cuDeviceGetCount": (_P(_int),),
    "cuDeviceGet": (_P(_int), _int),
    "cuDeviceGetAttribute": (_P(_int), _int, _int),
    "cuDeviceGetName": (ctypes.c_char_p, _int, _int),
    "cuDeviceTotalMem": (_P(_size), _int),
    "cuDevicePrimaryCtxRetain": (_P(_ptr), _int),
    "cuCtxGetCurrent": (_P(_ptr),),
    "cuCtxSetCurrent": (_ptr,),
    "cuLibraryLoadData": (_P(_ptr), ctypes.c_char_p, _ptr, _ptr, _uint, _ptr, _ptr, _uint),
    "cuLibraryUnload": (_ptr,),
    "cuLibraryGetKernel": (_P(_ptr), _ptr, ctypes.c_char_p),
    "cuKernelGetFunction": (_P(_ptr), _ptr),
    "cuKernelGetAttribute": (_P(_int), _int, _ptr, _int),
    "cuKernelSetAttribute": (_int, _int, _ptr, _int),
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": (_P(_int), _ptr, _int, _size),
    "cuGetErrorName": (_int, _P(ctypes.c_char_p)),
    "cuGetErrorString": (_int, _P(ctypes.c_char_p)),
}
_ENTRY_POINTS = {"cuDeviceTotalMem": "cuDeviceTotalMem_v2"}


class _Constants:
    """Some members of one of cuda.bindings.driver's enums as plain ints, the values cuda.h fixes (a CPU test checks
    them against cuda.bindings): the first-call path reads these without importing cuda.bindings.driver (~20 ms of
    enum building on an H100 host). Any other member is the enum's own."""

    def __init__(self, enum: str, prefix: str, values: dict[str, int]) -> None:
        self._enum = enum
        self.__dict__.update({prefix + k: v for k, v in values.items()})

    def __getattr__(self, name: str) -> Any:
        from cuda.bindings import driver as bindings

        return getattr(getattr(bindings, self._enum), name)


CUresult = _Constants("CUresult", "CUDA_", {"SUCCESS": 0})
CUdevice_attribute = _Constants("CUdevice_attribute", "CU_DEVICE_ATTRIBUTE_", {
    "MAX_THREADS_PER_BLOCK": 1, "MAX_SHARED_MEMORY_PER_BLOCK": 8, "WARP_SIZE": 10, "MULTIPROCESSOR_COUNT": 16,
    "MAX_THREADS_PER_MULTIPROCESSOR": 39, "COMPUTE_CAPABILITY_MAJOR": 75, "COMPUTE_CAPABILITY_MINOR": 76,
    "MAX_REGISTERS_PER_MULTIPROCESSOR": 82, "COOPERATIVE_LAUNCH": 95, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 97})
CUfunction_attribute = _Constants("CUfunction_attribute", "CU_FUNC_ATTRIBUTE_", {
    "MAX_THREADS_PER_BLOCK": 0, "SHARED_SIZE_BYTES": 1, "LOCAL_SIZE_BYTES": 3, "NUM_REGS": 4, "BINARY_VERSION": 6,
    "MAX_DYNAMIC_SHARED_SIZE_BYTES": 8, "NON_PORTABLE_CLUSTER_SIZE_ALLOWED": 14})


def _handle(h) -> int | None:
    """A handle argument as an address (cuda.bindings' handle objects, ints, None for NULL)."""
    return None if h is None else int(h) or None


class Driver:
    """libcuda's functions named in _ARGTYPES, with cuda.bindings.driver's calling convention; any other name is
    cuda.bindings.driver's own (imported on first such use)."""

    CUresult, CUdevice_attribute, CUfunction_attribute = CUresult, CUdevice_attribute, CUfunction_attribute

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for name, argtypes in _ARGTYPES.items():
            fn = getattr(lib, _ENTRY_POINTS.get(name, name))  # AttributeError: this libcuda lacks it (cuda.bindings)
            fn.argtypes, fn.restype = argtypes, _int
            self._fns[name] = fn

    def __getattr__(self, name: str) -> Any:
        from cuda.bindings import driver as bindings

        return getattr(bindings, name)

    def _out(self, name: str, ctype, *args) -> tuple[int, Any]:
        v = ctype()
        err = self._fns[name](ctypes.byref(v), *args)
        return err, v.value

    def cuInit(self, flags: int) -> tuple[int]:
        return (self._fns["cuInit"](int(flags)),)

    def cuDriverGetVersion(self):
        return self._out("cuDriverGetVersion", _int)

    def cuDeviceGetCount(self):
        return self._out("cuDeviceGetCount", _int)

    def cuDeviceGet(self, ordinal: int):
        return self._out("cuDeviceGet", _int, int(ordinal))

    def cuDeviceGetAttribute(self, attrib, dev):
        return self._out("cuDeviceGetAttribute", _int, int(attrib), int(dev))

    def cuDeviceGetName(self, length: int, dev):
        buf = ctypes.create_string_buffer(int(length))
        return self._fns["cuDeviceGetName"](buf, int(length), int(dev)), buf.raw

    def cuDeviceTotalMem(self, dev):
        return self._out("cuDeviceTotalMem", _size, int(dev))

    def cuDevicePrimaryCtxRetain(self, dev):
        err, ctx = self._out("cuDevicePrimaryCtxRetain", _ptr, int(dev))
        return err, ctx or 0

    def cuCtxGetCurrent(self):
        err, ctx = self._out("cuCtxGetCurrent", _ptr)
        return err, ctx or 0

    def cuCtxSetCurrent(self, ctx):
        return (self._fns["cuCtxSetCurrent"](_handle(ctx)),)

    def cuLibraryLoadData(self, code: bytes, jit_options, jit_values, n_jit: int, lib_options, lib_values,
                          n_lib: int):
        if jit_options or lib_options:  # rtckern passes none; the bindings' converter handles option lists
            from cuda.bindings import driver as bindings

            return bindings.cuLibraryLoadData(code, jit_options, jit_values, n_jit, lib_options, lib_values, n_lib)
        err, lib = self._out("cuLibraryLoadData", _ptr, code, None, None, 0, None, None, 0)
        return err, lib or 0

    def cuLibraryUnload(self, library):
        return (self._fns["cuLibraryUnload"](_handle(library)),)

    def cuLibraryGetKernel(self, library, name: bytes):
        err, k = self._out("cuLibraryGetKernel", _ptr, _handle(library), name)
        return err, k or 0

    def cuKernelGetFunction(self, kernel):
        err, f = self._out("cuKernelGetFunction", _ptr, _handle(kernel))
        return err, f or 0

    def cuKernelGetAttribute(self, attrib, kernel, dev):
        return self._out("cuKernelGetAttribute", _int, int(attrib), _handle(kernel), int(dev))

    def cuKernelSetAttribute(self, attrib, value: int, kernel, dev):
        return (self._fns["cuKernelSetAttribute"](int(attrib), int(value), _handle(kernel), int(dev)),)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, func, block_size: int, dynamic_smem: int):
        return self._out("cuOccupancyMaxActiveBlocksPerMultiprocessor", _int, _handle(func), int(block_size),
                         int(dynamic_smem))

    def cuGetErrorName(self, err):
        return self._text("cuGetErrorName", err)

    def cuGetErrorString(self, err):
        return self._text("cuGetErrorString", err)

    def _text(self, name: str, err) -> tuple[int, bytes | None]:
        s = ctypes.c_char_p()
        return self._fns[name](int(err), ctypes.byref(s)), s.value


def open_driver() -> Driver | None:
    """The ctypes driver over the process's libcuda.so.1 (loading it if nothing has), or None where it cannot be
    opened or lacks one of the functions (then cuda.bindings.driver serves every call)."""
    try:
        lib = ctypes.CDLL(LIBCUDA, mode=os.RTLD_NOW | getattr(os, "RTLD_GLOBAL", 0))
        return Driver(lib)
    except (OSError, AttributeError):
        return None
