"""Host cost of each step of a small op's call, on the GPU: what a launch through each available path costs
(cuda.core's launch, cuda.bindings' cuLaunchKernel with a tuple or a prebuilt parameter array, ctypes straight
into libcuda) next to torch's own pieces (an op, an allocation, the current stream). A profiling helper for the
hot path (docs/performance.md); not shipped.

    PYTHONPATH=. python3 tools/launch_paths.py [--json FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np

SRC = r"""
extern "C" __global__ void touch(const unsigned short* x, unsigned short* y, const unsigned short* w, float eps,
                                 long long rows, long long cols) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && rows < 0) y[0] = x[0] + w[0] + (unsigned short)eps + cols;
}
"""


def per_call_us(fn, n=20000, rounds=5, sync=None) -> float:
    for _ in range(500):
        fn()
    if sync:
        sync()
    res = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if sync:
            sync()
        res.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(res)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    import rtckern
    import rtckern.ops as ops
    from rtckern.runtime import driver as drv
    from rtckern.spec import KernelSpec

    dev = torch.device("cuda", 0)
    x = torch.randn(4, 4096, dtype=torch.bfloat16, device=dev)
    w = torch.randn(4096, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    sync = torch.cuda.synchronize
    rows = {}

    def put(name, fn, synced=True):
        rows[name] = round(per_call_us(fn, sync=sync if synced else None), 2)
        print(f"{name:60s} {rows[name]:8.2f} us", flush=True)

    arch = "sm_%d%d" % torch.cuda.get_device_capability(0)
    k = rtckern.get_manager().get(KernelSpec(source="touch.cu", name="touch", arch=arch, code=SRC))
    core = k.core
    from cuda.core import LaunchConfig, launch
    from cuda.bindings import driver as d

    cfg = LaunchConfig(grid=(1, 1, 1), block=(32, 1, 1), shmem_size=0)
    raw = torch._C._cuda_getCurrentRawStream
    from rtckern.runtime.streams import core_stream
    s = core_stream(raw(0))
    xp, yp, wp = x.data_ptr(), y.data_ptr(), w.data_ptr()
    eps = np.float32(1e-6)
    r, c = np.int64(4), np.int64(4096)

    put("python: empty function call", lambda: None, synced=False)
    put("torch: F.rms_norm [4,4096] bf16", lambda: F.rms_norm(x, (4096,), w, 1e-6))
    put("torch: torch.empty((4,4096), bf16, cuda)", lambda: torch.empty((4, 4096), dtype=torch.bfloat16, device=dev))
    put("torch: torch.empty_like(x)", lambda: torch.empty_like(x))
    put("torch: x.new_empty((4,4096))", lambda: x.new_empty((4, 4096)))
    put("torch: x.data_ptr()", lambda: x.data_ptr(), synced=False)
    put("torch: _cuda_getCurrentRawStream(0)", lambda: raw(0), synced=False)
    put("torch: x.dtype, x.shape, x.stride(), x.is_cuda, get_device()",
        lambda: (x.dtype, x.shape, x.stride(), x.is_cuda, x.get_device()), synced=False)
    put("rtckern: core_stream(handle)", lambda: core_stream(raw(0)), synced=False)
    put("cuda.core: launch(s, cfg, k, ptrs, np.float32, np.int64 x2)",
        lambda: launch(s, cfg, core, xp, yp, wp, eps, r, c))
    put("rtckern: Kernel.launch(grid, block, args, stream=handle)",
        lambda: k.launch((1, 1, 1), (32, 1, 1), (xp, yp, wp, eps, r, c), stream=raw(0)))

    handle = core.handle
    hs = d.CUstream(raw(0))
    vals = (xp, yp, wp, 1e-6, 4, 4096)
    types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_longlong, ctypes.c_longlong)
    put("cuda.bindings: cuLaunchKernel((vals), (types))",
        lambda: d.cuLaunchKernel(handle, 1, 1, 1, 32, 1, 1, 0, hs, (vals, types), 0))
    holders = [ctypes.c_void_p(xp), ctypes.c_void_p(yp), ctypes.c_void_p(wp), ctypes.c_float(1e-6),
               ctypes.c_longlong(4), ctypes.c_longlong(4096)]
    arr = (ctypes.c_void_p * 6)(*[ctypes.addressof(h) for h in holders])
    addr = ctypes.addressof(arr)
    put("cuda.bindings: cuLaunchKernel(int address of void**)",
        lambda: d.cuLaunchKernel(handle, 1, 1, 1, 32, 1, 1, 0, hs, addr, 0))
    h0 = holders[0]

    def bindings_set_ptr():
        h0.value = x.data_ptr()
        d.cuLaunchKernel(handle, 1, 1, 1, 32, 1, 1, 0, hs, addr, 0)
    put("cuda.bindings: set one pointer + cuLaunchKernel(address)", bindings_set_ptr)

    # ctypes straight into libcuda (the handle is a CUkernel; cuLaunchKernel accepts it as a CUfunction)
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuLaunchKernel
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                  ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    hk, hst = int(handle), raw(0)
    put("ctypes: libcuda.cuLaunchKernel(argtypes set)", lambda: f(hk, 1, 1, 1, 32, 1, 1, 0, hst, addr, None))
    g = lib.cuLaunchKernel
    g2 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                          ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_void_p)(ctypes.cast(g, ctypes.c_void_p).value)
    put("ctypes: CFUNCTYPE cuLaunchKernel", lambda: g2(hk, 1, 1, 1, 32, 1, 1, 0, hst, addr, None))

    prep = k.prepare((1, 1, 1), (32, 1, 1), "PPPfqq")
    put(f"rtckern: Kernel.prepare launch ({type(prep).__name__})", lambda: prep(hst, xp, yp, wp, eps, 4, 4096))

    from rtckern.runtime import native
    from rtckern.runtime.kernel import _primary_ctx
    err, cufn = d.cuKernelGetFunction(handle)
    prep_fn = native.module().Prepared(int(cufn), _primary_ctx[0], (1, 1, 1), (32, 1, 1), 0, "PPPfqq", "touch")
    put("rtckern: native Prepared on the CUfunction (cuKernelGetFunction)",
        lambda: prep_fn(hst, xp, yp, wp, eps, 4, 4096))
    k8 = rtckern.get_manager().get(KernelSpec(source="core/axpy.cuh", name="noop0", arch=arch))
    p0 = k8.prepare(1, 32, "")
    put("rtckern: native Prepared, kernel without parameters", lambda: p0(hst))
    put("torch: x.zero_() on [4,4096] (one torch kernel launch)", lambda: x.zero_())
    put("torch: torch.cuda._sleep(0)", lambda: torch.cuda._sleep(0))

    def prepared_full():
        out = torch.empty_like(x)
        prep(raw(0), x.data_ptr(), out.data_ptr(), wp, eps, 4, 4096)
        return out
    put("rtckern: empty_like + stream + prepared launch", prepared_full)

    def ctypes_full():
        h0.value = x.data_ptr()
        out = torch.empty_like(x)
        holders[1].value = out.data_ptr()
        f(hk, 1, 1, 1, 32, 1, 1, 0, raw(0), addr, None)
        return out
    put("ctypes: empty_like + 2 ptrs + stream + launch", ctypes_full)

    def cudacore_full():
        out = torch.empty_like(x)
        launch(core_stream(raw(0)), cfg, core, x.data_ptr(), out.data_ptr(), wp, eps, r, c)
        return out
    put("cuda.core: empty_like + stream + launch", cudacore_full)

    put("rtckern.ops.rms_norm", lambda: ops.rms_norm(x, w, 1e-6))
    try:
        import rtckern.torch  # noqa: F401
        put("torch.ops.rtckern.rms_norm", lambda: torch.ops.rtckern.rms_norm(x, w, 1e-6))
    except Exception as e:  # report, do not stop
        print("torch.ops.rtckern.rms_norm:", e)
    put("rtckern.ops.softmax [1,32,1,1024]", (lambda t: lambda: ops.softmax(t))(
        torch.randn(1, 32, 1, 1024, dtype=torch.bfloat16, device=dev)))
    put("torch: softmax [1,32,1,1024]", (lambda t: lambda: torch.softmax(t, -1))(
        torch.randn(1, 32, 1, 1024, dtype=torch.bfloat16, device=dev)))
    import cProfile
    import pstats
    for name, fn in (("rms_norm", lambda: ops.rms_norm(x, w, 1e-6)),
                     ("torch.ops.rtckern.rms_norm", lambda: torch.ops.rtckern.rms_norm(x, w, 1e-6))):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20000):
            fn()
        pr.disable()
        print(f"---- profile: {name} x 20000")
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "driver": drv.driver_version()
            if hasattr(drv, "driver_version") else None}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "us_per_call": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
