"""A fake cuda.bindings.driver for the runtime's CPU tests: one sm_90 device, a record of every call, and errors on
demand. `install(monkeypatch)` puts it behind rtckern.runtime's driver() and gives the runtime fresh process state
(driver initialized, primary contexts), all restored by monkeypatch."""
from __future__ import annotations

PRIMARY = 0xC0
FUNCTION = {"NUM_REGS": 40, "SHARED_SIZE_BYTES": 1024, "LOCAL_SIZE_BYTES": 0, "MAX_THREADS_PER_BLOCK": 1024,
            "BINARY_VERSION": 90}
ERRORS = {200: "CUDA_ERROR_INVALID_IMAGE", 500: "CUDA_ERROR_NOT_FOUND", 1: "CUDA_ERROR_INVALID_VALUE",
          101: "CUDA_ERROR_INVALID_DEVICE"}
DEVICE = {"COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0, "MULTIPROCESSOR_COUNT": 132,
          "MAX_SHARED_MEMORY_PER_BLOCK": 49152, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
          "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
          "MAX_THREADS_PER_BLOCK": 1024, "WARP_SIZE": 32, "COOPERATIVE_LAUNCH": 1}


class _Names:
    def __getattr__(self, name):
        return name


class FakeDriver:
    class CUresult:
        CUDA_SUCCESS = 0

    CUfunction_attribute = CUdevice_attribute = _Names()
    CUcontext = CUstream = staticmethod(lambda h: h)

    def __init__(self):
        self.current = 0  # the calling thread's current context
        self.calls: list[tuple] = []
        self.fail: dict[str, int] = {}  # call name -> CUresult to return

    def _call(self, name, *args, result=()):
        self.calls.append((name, *args))
        err = self.fail.get(name, 0)
        return (err, *([None] * len(result))) if err else (0, *result)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def cuGetErrorName(self, err):
        return 0, ERRORS.get(int(err), "CUDA_ERROR_UNKNOWN").encode()

    def cuGetErrorString(self, err):
        return 0, b"fake driver error"

    def cuInit(self, flags):
        return self._call("cuInit", flags)

    def cuDeviceGetCount(self):
        return self._call("cuDeviceGetCount", result=(1,))

    def cuDeviceGet(self, ordinal):
        if ordinal != 0:
            return 101, None
        return self._call("cuDeviceGet", ordinal, result=(ordinal,))

    def cuDeviceGetAttribute(self, attr, dev):
        value = DEVICE[attr.removeprefix("CU_DEVICE_ATTRIBUTE_")]
        return self._call("cuDeviceGetAttribute", attr, dev, result=(value,))

    def cuDeviceGetName(self, n, dev):
        return self._call("cuDeviceGetName", dev, result=(b"NVIDIA H200\x00\x00",))

    def cuDeviceTotalMem(self, dev):
        return self._call("cuDeviceTotalMem", dev, result=(143771 << 20,))

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._call("cuDevicePrimaryCtxRetain", dev, result=(PRIMARY,))

    def cuCtxGetCurrent(self):
        return 0, self.current

    def cuCtxSetCurrent(self, ctx):
        self.current = int(ctx)
        return self._call("cuCtxSetCurrent", int(ctx))

    def cuLibraryLoadData(self, code, *options):
        return self._call("cuLibraryLoadData", bytes(code), result=(0x1000,))

    def cuLibraryGetKernel(self, lib, name):
        return self._call("cuLibraryGetKernel", lib, name, result=(0x2000,))

    def cuLibraryUnload(self, lib):
        return self._call("cuLibraryUnload", lib)

    def cuKernelGetFunction(self, kernel):
        return self._call("cuKernelGetFunction", kernel, self.current, result=(0x3000,))

    def cuKernelGetAttribute(self, attr, kernel, dev):
        return self._call("cuKernelGetAttribute", attr, kernel, dev,
                          result=(FUNCTION[attr.removeprefix("CU_FUNC_ATTRIBUTE_")],))

    def cuKernelSetAttribute(self, attr, value, kernel, dev):
        return self._call("cuKernelSetAttribute", attr, value, kernel, dev)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, fn, block, smem):
        return self._call("cuOccupancyMaxActiveBlocksPerMultiprocessor", fn, block, smem, self.current,
                          result=(3,))

    def cuOccupancyMaxPotentialBlockSize(self, fn, cb, smem, limit):
        return self._call("cuOccupancyMaxPotentialBlockSize", fn, cb, smem, limit, result=(264, 512))


def install(monkeypatch) -> FakeDriver:
    from rtckern.runtime import driver as drv_mod
    from rtckern.runtime import kernel as kmod
    from rtckern.runtime import library as lib_mod

    fake = FakeDriver()
    for mod in (drv_mod, kmod, lib_mod):
        monkeypatch.setattr(mod, "driver", lambda: fake)
    monkeypatch.setattr(drv_mod, "_initialized", False)
    monkeypatch.setattr(drv_mod, "_primary", {})
    monkeypatch.setattr(kmod, "_primary_ctx", {})
    return fake
