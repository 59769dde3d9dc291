"""The CPU harness's stand-ins for the GPU pieces (benchmarks op_overhead --stub, first_call --cpu): a fake `torch`
(tensors that carry a shape, strides, dtype and an address; empty/zeros; the current stream), a fake CUDA driver
behind rtckern.runtime.driver.driver() (an H200-like device, loads, attributes, occupancy, launches that do
nothing), and a fake libcuda for the native launcher (built with the C compiler, as the launcher itself is), so that
rtckern's own code for devices, loading and launching runs as it does on a GPU host.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile


# ---- torch --------------------------------------------------------------------------------------------------------
def install_fake_torch():
    """A fake `torch` in sys.modules (before rtckern.ops is imported)."""
    import types

    torch = types.ModuleType("torch")

    class dtype:
        def __init__(self, name, size):
            self.name, self.itemsize = name, size

        def __repr__(self):
            return f"torch.{self.name}"

        __str__ = __repr__

    torch.dtype = dtype
    torch.float32, torch.float16, torch.bfloat16 = dtype("float32", 4), dtype("float16", 2), dtype("bfloat16", 2)
    torch.int32, torch.bool, torch.float64 = dtype("int32", 4), dtype("bool", 1), dtype("float64", 8)

    class device:
        __slots__ = ("type", "index")

        def __init__(self, type, index=None):
            self.type, self.index = type, index

        def __repr__(self):
            return f"device(type='{self.type}', index={self.index})"

    class Size(tuple):
        pass

    next_ptr = [1 << 32]

    class Tensor:
        def __init__(self, shape, dtype, dev, strides=None, ptr=None):
            self._shape = Size(shape)
            self.dtype = dtype
            self._dev = dev
            if strides is None:
                strides, acc = [], 1
                for s in reversed(shape):
                    strides.append(acc)
                    acc *= max(s, 1)
                strides = tuple(reversed(strides))
            self._strides = tuple(strides)
            if ptr is None:
                ptr = next_ptr[0]
                next_ptr[0] += 1 << 20
            self._ptr = ptr

        # torch builds a new device / Size object on every access: so do we
        @property
        def device(self):
            return device(self._dev.type, self._dev.index)

        @property
        def shape(self):
            return Size(self._shape)

        def size(self, i=None):
            return self.shape if i is None else self._shape[i]

        def dim(self):
            return len(self._shape)

        @property
        def ndim(self):
            return len(self._shape)

        def stride(self, i=None):
            return tuple(self._strides) if i is None else self._strides[i]

        def data_ptr(self):
            return self._ptr

        def get_device(self):
            return self._dev.index if self._dev.type == "cuda" else -1

        def element_size(self):
            return self.dtype.itemsize

        def is_contiguous(self):
            return self._strides == Tensor(self._shape, self.dtype, self._dev, ptr=0)._strides

        @property
        def is_cuda(self):
            return self._dev.type == "cuda"

    torch.Tensor, torch.Size, torch.device = Tensor, Size, device

    def _dev(d):
        return d if isinstance(d, device) else device("cuda", 0)

    torch.empty = lambda shape, dtype=None, device=None: Tensor(tuple(shape), dtype or torch.float32, _dev(device))
    torch.empty_like = lambda t, dtype=None: Tensor(tuple(t.shape), dtype or t.dtype, t.device)
    torch.zeros = torch.empty

    class _Stream:
        def __init__(self, h):
            self.cuda_stream = h

    cuda = types.ModuleType("torch.cuda")
    cuda.current_stream = lambda device=None: _Stream(7)
    cuda.is_available = lambda: True
    torch.cuda = cuda
    c = types.ModuleType("torch._C")
    c._cuda_getCurrentRawStream = lambda index: 7
    torch._C = c
    sys.modules["torch"], sys.modules["torch.cuda"], sys.modules["torch._C"] = torch, cuda, c
    return torch



# ---- the CUDA driver ----------------------------------------------------------------------------------------------
DEVICE = {"COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0, "MULTIPROCESSOR_COUNT": 132,
          "MAX_SHARED_MEMORY_PER_BLOCK": 49152, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
          "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
          "MAX_THREADS_PER_BLOCK": 1024, "WARP_SIZE": 32, "COOPERATIVE_LAUNCH": 1}
FUNCTION = {"NUM_REGS": 64, "SHARED_SIZE_BYTES": 0, "LOCAL_SIZE_BYTES": 0, "MAX_THREADS_PER_BLOCK": 1024,
            "BINARY_VERSION": 90}
PRIMARY_CTX = 0xC0


class _Names:
    """An enum class of the bindings: every member is its own name."""

    def __getattr__(self, name):
        return name


class FakeDriver:
    """cuda.bindings.driver as far as rtckern's runtime calls it: one H200-like device, every call succeeds."""

    class CUresult:
        CUDA_SUCCESS = 0

    CUdevice_attribute = CUfunction_attribute = _Names()
    CUcontext = CUstream = staticmethod(lambda h: h)

    def __init__(self):
        self.current = 0
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):  # a call the fake does not know: succeed with nothing
        return lambda *a: (0,)

    def _n(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def cuInit(self, flags):
        return (0,)

    def cuDriverGetVersion(self):
        return 0, 13000

    def cuDeviceGetCount(self):
        return 0, 1

    def cuDeviceGet(self, ordinal):
        return 0, ordinal

    def cuDeviceGetAttribute(self, attr, dev):
        self._n("cuDeviceGetAttribute")
        return 0, DEVICE[attr.removeprefix("CU_DEVICE_ATTRIBUTE_")]

    def cuDeviceGetName(self, n, dev):
        return 0, b"NVIDIA H200\x00"

    def cuDeviceTotalMem(self, dev):
        return 0, 143771 << 20

    def cuDevicePrimaryCtxRetain(self, dev):
        return 0, PRIMARY_CTX

    def cuCtxGetCurrent(self):
        return 0, self.current

    def cuCtxSetCurrent(self, ctx):
        self.current = int(ctx)
        return (0,)

    def cuLibraryLoadData(self, code, *options):
        self._n("cuLibraryLoadData")
        return 0, 0x1000 + len(code)

    def cuLibraryGetKernel(self, lib, name):
        return 0, 0x2000

    def cuKernelGetFunction(self, kernel):
        return 0, 0x3000

    def cuKernelGetAttribute(self, attr, kernel, dev):
        return 0, FUNCTION[attr.removeprefix("CU_FUNC_ATTRIBUTE_")]

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, fn, block, smem):
        return 0, 2

    def cuOccupancyMaxPotentialBlockSize(self, fn, cb, smem, limit):
        return 0, 264, 1024


def install_fake_driver() -> FakeDriver:
    """rtckern's runtime talks to a FakeDriver; the native launcher (where a C compiler builds it) to a fake libcuda
    whose launches do nothing."""
    from rtckern.runtime import driver as drv_mod
    from rtckern.runtime import kernel as kmod
    from rtckern.runtime import library as lib_mod
    from rtckern.runtime import native

    fake = FakeDriver()
    drv_mod.driver = kmod.driver = lib_mod.driver = lambda: fake
    lib = fake_libcuda()
    if lib is not None:
        native._libcuda_path = lambda: lib

    # the launch through cuda.core (cooperative, cluster): its import is the cost a real one would pay first
    def launch_core(self, cfg, args, stream):
        import cuda.core  # noqa: F401

    kmod.Kernel._launch_core = launch_core
    # TMA tensor maps (attention on sm_90): a fixed 128-byte map.
    from cuda.bindings import driver as cbd

    class _Map:
        opaque = [0] * 16

    cbd.cuTensorMapEncodeTiled = lambda *a: (cbd.CUresult.CUDA_SUCCESS, _Map())
    return fake


FAKE_LIBCUDA = r"""
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void* stream, void** params, void** extra) { return 0; }
int cuCtxGetCurrent(void** c) { *c = (void*)0xC0; return 0; }
int cuCtxPushCurrent_v2(void* c) { return 0; }
int cuCtxPopCurrent_v2(void** c) { return 0; }
"""


def fake_libcuda() -> str | None:
    """A libcuda whose launches do nothing (built once per machine), or None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    digest = hashlib.sha256(FAKE_LIBCUDA.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"rtckern-fake-libcuda-{os.getuid()}-{digest}.so")
    if not os.path.exists(path):
        with tempfile.TemporaryDirectory() as d:
            src, out = os.path.join(d, "fake.c"), os.path.join(d, "fake.so")
            with open(src, "w") as f:
                f.write(FAKE_LIBCUDA)
            subprocess.run([cc, "-shared", "-fPIC", "-o", out, src], check=True, capture_output=True)
            os.replace(out, path)
    return path


# ---- the whole harness --------------------------------------------------------------------------------------------
def install_stubs(stub_registry: bool = True):
    """Fake torch and driver; must run before rtckern.ops is imported. stub_registry=True also replaces the
    registry's probe with "the first-ranked candidate" (cheap checks, expected cost, priority) whose kernels are
    loaded without a binary; False keeps the real probe (keys, cache tiers, decision store, loading). Returns a
    factory of kernels for specs (loaded from an empty image on the fake device)."""
    install_fake_torch()
    install_fake_driver()
    from rtckern.device import DeviceInfo
    from rtckern.runtime.kernel import load_kernel

    def stub_kernel(spec):
        return load_kernel(b"\0", "cubin", spec.name, DeviceInfo.from_device(0), spec.name)

    if stub_registry:
        from rtckern.registry import results as res_mod
        from rtckern.registry import selector as sel_mod

        def _decide(self, req, s):
            ranked, _ = self.rank(req, s)
            if not ranked:
                raise RuntimeError(f"no candidate for {req}")
            cand = ranked[0][0]
            specs = tuple(cand.kernel_specs(req))
            return res_mod.Selection(request=req, candidate=cand, specs=specs,
                                     kernels=tuple(stub_kernel(sp) for sp in specs))

        sel_mod.Registry._decide = _decide
    return stub_kernel
