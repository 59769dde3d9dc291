"""The CPU harness's stand-ins for the GPU pieces (benchmarks op_overhead --stub, first_call --cpu): a fake `torch`
(tensors that carry a shape, strides, dtype and an address; empty/zeros; the current stream) and a fake libcuda
(rtckern.testing.use_fake_libcuda: an H200-like device, loads, attributes, occupancy, launches that do nothing), so
that rtckern's own code for devices, loading and launching runs as on a GPU host, through the real cuda.bindings
and the native launcher.
"""
from __future__ import annotations

import sys


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
def install_fake_driver() -> None:
    """rtckern.testing's fake libcuda behind the real cuda.bindings and the native launcher (an H200-like device;
    loads, attributes, occupancy; launches that do nothing). Launches through cuda.core (cooperative, cluster),
    which asks the driver for more than the fake answers, do nothing but import cuda.core: the cost a real one pays
    first."""
    from rtckern.runtime import kernel as kmod
    from rtckern.testing import use_fake_libcuda

    use_fake_libcuda()

    def launch_core(self, cfg, args, stream):
        import cuda.core  # noqa: F401

    kmod.Kernel._launch_core = launch_core


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
        return load_kernel(b"\x7fELF", "cubin", spec.name, DeviceInfo.from_device(0), spec.name)

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
