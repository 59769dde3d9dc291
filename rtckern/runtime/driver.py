"""Thin helpers over the CUDA driver API (runtime/libcuda.py, cuda-bindings): initialization, device attributes, error
checks."""

from __future__ import annotations

import contextlib
import functools
import threading

from ..errors import RtckernError

_init_lock = threading.Lock()
_initialized = False


_driver = None


def driver():
    """The driver API: runtime/libcuda.py's ctypes functions for a first call's path, cuda.bindings.driver for the
    rest (and for all of it where libcuda cannot be opened through ctypes)."""
    global _driver
    if _driver is None:
        from .libcuda import open_driver

        d = open_driver()
        if d is None:
            from cuda.bindings import driver as d
        _driver = d
    return _driver


def check(result, what: str):
    """Raise on a non-success CUresult; return the remaining values (one value unwrapped)."""
    d = driver()
    err = result[0]
    if err != d.CUresult.CUDA_SUCCESS:
        _, name = d.cuGetErrorName(err)
        _, text = d.cuGetErrorString(err)
        n = name.decode() if isinstance(name, bytes) else name
        t = text.decode() if isinstance(text, bytes) else text
        raise DriverError(f"{what} failed: {n}: {t}", code=int(err), name=str(n))
    rest = result[1:]
    return rest[0] if len(rest) == 1 else (rest if rest else None)


class DriverError(RtckernError):
    def __init__(self, msg: str, code: int = 0, name: str = ""):
        super().__init__(msg)
        self.code = code
        self.name = name


def ensure_init() -> None:
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if not _initialized:
            check(driver().cuInit(0), "cuInit")
            _initialized = True


def count_devices() -> int:
    ensure_init()
    return int(check(driver().cuDeviceGetCount(), "cuDeviceGetCount"))


@functools.lru_cache(maxsize=1)
def driver_version() -> tuple[int, int]:
    """The driver's CUDA version, e.g. (13, 0)."""
    v = int(check(driver().cuDriverGetVersion(), "cuDriverGetVersion"))
    return v // 1000, (v % 1000) // 10


def device_attributes(ordinal: int) -> dict:
    ensure_init()
    d = driver()
    err, dev = d.cuDeviceGet(ordinal)
    if err != d.CUresult.CUDA_SUCCESS:  # the device count only to say what exists
        n = count_devices()
        if not 0 <= ordinal < n:
            raise RtckernError(f"device {ordinal} does not exist; {n} device(s) are visible (0..{n - 1})")
        check((err, dev), "cuDeviceGet")
    A = d.CUdevice_attribute

    def attr(a):
        return int(check(d.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a})"))

    name = check(d.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = name.split(b"\x00", 1)[0].decode() if isinstance(name, bytes) else str(name)
    return {
        "major": attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
        "minor": attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        "sm_count": attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        "smem_per_block": attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
        "smem_per_block_optin": attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        "regs_per_sm": attr(A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR),
        "threads_per_sm": attr(A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR),
        "threads_per_block": attr(A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
        "warp_size": attr(A.CU_DEVICE_ATTRIBUTE_WARP_SIZE),
        "cooperative": attr(A.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH),
        "name": name,
        "memory_bytes": _total_memory(d, dev),
    }


def _total_memory(d, dev) -> int:
    """Total device memory in bytes (0 where the binding or driver cannot say: the device class then comes from
    the name alone)."""
    try:
        return int(check(d.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))
    except Exception:  # an older binding without cuDeviceTotalMem: memory stays unknown
        return 0


_primary: dict[int, object] = {}  # ordinal -> its primary context, retained once for the process's lifetime


def primary_context(ordinal: int):
    """The device's primary context (the one torch and cuda.core use), retained on first use."""
    c = _primary.get(ordinal)
    if c is None:
        ensure_init()
        d = driver()
        dev = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
        c = _primary.setdefault(ordinal, check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain"))
    return c


def retained_ordinal() -> int:
    """A device whose primary context this process already retained (0 when none is): for driver calls that need
    some current context but do not depend on the device, in a thread where none is current yet."""
    return next(iter(_primary), 0)


@contextlib.contextmanager
def pushed(ordinal: int):
    """The device's primary context pushed for the block and popped after, whatever was current (none included)."""
    d = driver()
    check(d.cuCtxPushCurrent(d.CUcontext(int(primary_context(ordinal)))), "cuCtxPushCurrent")
    try:
        yield
    finally:
        d.cuCtxPopCurrent()


@contextlib.contextmanager
def on_device(ordinal: int):
    """Make the device's primary context current for the block, then restore whatever was current
    (so torch's idea of the current device is left alone)."""
    d = driver()
    ctx = primary_context(ordinal)
    prev = check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
    switch = prev is None or int(prev) != int(ctx)
    if switch:
        check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    try:
        yield ctx
    finally:
        if switch and prev is not None and int(prev) != 0:
            check(d.cuCtxSetCurrent(prev), "cuCtxSetCurrent")
