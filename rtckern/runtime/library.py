"""A binary loaded through the driver's library API (cuLibraryLoadData), kept loaded while anything holds it.

The driver (runtime/driver.py), not cuda.core: importing cuda.core costs ~150 ms, more than everything else a first
call does (see runtime/kernel.py).
"""
from __future__ import annotations

import weakref

from .driver import check, driver, ensure_init


def _unload(d, handle) -> None:
    try:
        d.cuLibraryUnload(handle)
    except Exception:  # a driver torn down first (interpreter exit): nothing left to free
        pass


class Library:
    """A loaded cubin or PTX image. Unloaded when the last holder (its Kernels) is gone; not at interpreter exit,
    when the driver may be gone before it."""

    __slots__ = ("handle", "image", "__weakref__")

    def __init__(self, binary: bytes):
        ensure_init()
        d = driver()
        # context-independent loading: the image is checked now, and loaded into a context when a kernel of it
        # is first asked for there (Library.kernel + cuKernelGetFunction); with lazy loading the driver may read
        # it then, so it lives as long as the library (as cuda.core's ObjectCode keeps its image)
        self.image = binary
        self.handle = check(d.cuLibraryLoadData(binary, None, None, 0, None, None, 0), "cuLibraryLoadData")
        weakref.finalize(self, _unload, d, self.handle).atexit = False

    def kernel(self, name: str):
        """The CUkernel named `name` (a lowered name)."""
        return check(driver().cuLibraryGetKernel(self.handle, name.encode()), f"cuLibraryGetKernel({name})")
