"""Small test candidates for the registry, built on the core's test kernels (kernel_sources/core/axpy.cuh).

Op "axpy" (y = a*x + y over n elements). Candidates, highest priority first:
    axpy.hopper      200  sm_90a arch-specific, bf16 only
    axpy.broken      150  sm_75+, does not compile (inline source with an error)
    axpy.persistent  130  sm_80+, needs n >= sm_count * 1024 (enough work for one pass over every SM)
    axpy.bigsmem     120  sm_80+, needs 200 KB of dynamic shared memory (sm_90's 227 KB fits; sm_80/86 do not)
    axpy.wide        100  sm_80+, needs n % 4 == 0 (flag "aligned")
    axpy.fallback      0  sm_75+, anything
Importable from a subprocess: `sys.path.insert(0, "tests/unit"); import registry_testkit`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rtckern import tuning
from rtckern.dtypes import FLOATS, ctypes
from rtckern.manager import get_manager
from rtckern.registry import Candidate, OpRequest, Registry, Resources
from rtckern.tuning import Tuner, time_launches
from rtckern.spec import KernelSpec

OP = "axpy"
_CTYPE = ctypes(FLOATS)
BIG_SMEM = 200 * 1024


def axpy_request(device, *, n: int = 1 << 20, dtype: str = "bf16", aligned: bool | None = None) -> OpRequest:
    return OpRequest(op=OP, dtypes={"x": dtype, "y": dtype}, shape={"n": n},
                     flags={"aligned": (n % 4 == 0) if aligned is None else aligned}, device=device)


def build_axpy_request(shape, dtype, device, *, aligned: str | None = None) -> OpRequest:
    (n,) = shape if len(shape) == 1 else (int(np.prod(shape)),)
    al = None if aligned is None else aligned.lower() in ("1", "true", "yes")
    return axpy_request(device, n=n, dtype=dtype or "bf16", aligned=al)


class _Axpy(Candidate):
    op = OP
    kernel = "axpy"
    block = 256

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        return (KernelSpec("core/axpy.cuh", self.kernel, self.target(req),
                           template_args=(_CTYPE[req.dtype("x")],), defines=(("RTK_TEST_VARIANT", self.variant),),
                           op=OP),)

    @property
    def variant(self) -> str:
        return self.name.split(".")[1]

    def block_for(self, req: OpRequest) -> int:
        """The tuned block size (user table, shipped table, nearest shape) or the heuristic's."""
        return int(TUNER.best(req).config["block"])

    def launch_resources(self, req):
        return (Resources(block=self.block_for(req)),)

    def launch(self, req, kernels, x: int, y: int, a: float, stream=None, block: int | None = None):
        n = req.dim("n")
        block = block or self.block_for(req)
        kernels[0].launch((n + block - 1) // block, block, (x, y, np.float32(a), n), stream=stream)

    def selftest(self, req, kernels) -> str | None:
        return axpy_selftest(self, req, kernels)


class Hopper(_Axpy):
    name, priority, min_arch, arch_specific = "axpy.hopper", 200, "sm_90", True

    def supports(self, req):
        return None if req.dtype("x") == "bf16" else f"bf16 only, got x={req.dtype('x')}"


class Broken(_Axpy):
    name, priority, min_arch = "axpy.broken", 150, "sm_75"

    def kernel_specs(self, req):
        code = '#include "core/axpy.cuh"\n__global__ void broken_axpy() { int x = undeclared_symbol; }\n'
        return (KernelSpec("test/broken_axpy.cu", "broken_axpy", self.target(req), code=code, op=OP),)


class Persistent(_Axpy):
    name, priority, min_arch = "axpy.persistent", 130, "sm_80"

    def supports(self, req):
        need = req.device.sm_count * 1024
        n = req.dim("n")
        return None if n >= need else f"n={n} < {need} (1024 per SM x {req.device.sm_count} SMs)"


class BigSmem(_Axpy):
    name, priority, min_arch, kernel = "axpy.bigsmem", 120, "sm_80", "smem_reverse"

    def supports(self, req):
        return None if req.dtype("x") == "fp32" else f"fp32 only, got x={req.dtype('x')}"

    def kernel_specs(self, req):
        return (KernelSpec("core/axpy.cuh", "smem_reverse", self.target(req), op=OP),)

    def launch_resources(self, req):
        return (Resources(block=256, dynamic_smem=BIG_SMEM),)

    def selftest(self, req, kernels):
        return None


class Wide(_Axpy):
    name, priority, min_arch = "axpy.wide", 100, "sm_80"

    def supports(self, req):
        return None if req.flag("aligned") else f"needs n % 4 == 0 (aligned), n={req.dim('n')}"


class Fallback(_Axpy):
    name, priority, min_arch = "axpy.fallback", 0, "sm_75"


ALL = (Hopper, Broken, Persistent, BigSmem, Wide, Fallback)


class AxpyTuner(Tuner):
    """Block size per (dtype, n): the table's key fields are the dtype and n."""

    op = OP
    key_fields = ("dtype", "n")
    blocks = (64, 128, 256, 512, 1024)

    def key(self, req):
        return {"dtype": req.dtype("x"), "n": req.dim("n")}

    def configs(self, req):
        return [{"block": b} for b in self.blocks]

    def heuristic(self, key, device):
        return {"block": 256}

    def measure(self, req, config):
        import cupy as cp

        cand = Fallback()
        kernels = tuple(get_manager().get(s, req.device.ordinal) for s in cand.kernel_specs(req))
        n = req.dim("n")
        item = 4 if req.dtype("x") == "fp32" else 2
        with cp.cuda.Device(req.device.ordinal):
            # Several buffer pairs, rotated, so a small n is not timed out of L2 alone.
            sets = max(1, min(8, (256 << 20) // max(1, 2 * n * item)))
            bufs = [(_random_dev(n, req.dtype("x")), _random_dev(n, req.dtype("x"))) for _ in range(sets)]
            cp.cuda.Device().synchronize()
            turn = [0]

            def launch(stream: int) -> None:
                x, y = bufs[turn[0] % sets]
                turn[0] += 1
                cand.launch(req, kernels, x.data.ptr, y.data.ptr, 0.5, stream=stream, block=config["block"])

            return time_launches(launch, req.device.ordinal, warmup=5, reps=30)


def _random_dev(n: int, dtype: str):
    """Normal random values in the storage type (bf16 as the high half of float32 bit patterns)."""
    import cupy as cp

    v = cp.random.standard_normal(n, dtype=cp.float32)
    if dtype == "bf16":
        return (v.view(cp.uint32) >> 16).astype(cp.uint16)
    return v.astype(cp.float16) if dtype == "fp16" else v


TUNER = AxpyTuner()


def register_tuner() -> None:
    tuning.register_tuner(TUNER, replace=True)


def make_registry(store_dir, *, numeric: bool | None = None, classes=ALL) -> Registry:
    reg = Registry(store_dir, numeric=numeric)
    for cls in classes:
        reg.register(cls())
    reg.register_request_builder(OP, build_axpy_request, help="shape: n (or any shape, flattened); "
                                 "--opt aligned=0/1", example="--dtype bf16 --shape 1048576")
    return reg


def axpy_selftest(cand: _Axpy, req: OpRequest, kernels: tuple[Any, ...]) -> str | None:
    """Launch on a small input (n from the request capped at 1<<16) and compare with a float64 reference."""
    import cupy as cp

    n = min(req.dim("n"), 1 << 16)
    small = OpRequest(op=req.op, dtypes=req.dtypes, shape={"n": n}, flags=req.flags, device=req.device)
    rng = np.random.default_rng(1234)
    x64, y64 = rng.standard_normal(n), rng.standard_normal(n)
    dt = {"fp32": np.float32, "fp16": np.float16}.get(req.dtype("x"))
    with cp.cuda.Device(req.device.ordinal):
        if dt is None:  # bf16: store as uint16 bit patterns
            def to_dev(v):
                b = np.asarray(v, np.float32).view(np.uint32)
                return cp.asarray(((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16))

            def to_host(d):
                return (cp.asnumpy(d).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        else:
            def to_dev(v):
                return cp.asarray(np.asarray(v, dt))

            def to_host(d):
                return cp.asnumpy(d).astype(np.float64)
        x, y = to_dev(x64), to_dev(y64)
        xr, yr = to_host(x), to_host(y)
        cand.launch(small, kernels, x.data.ptr, y.data.ptr, 1.5)
        cp.cuda.Device().synchronize()
        out = to_host(y)
    ref = 1.5 * xr + yr
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    tol = 1e-2 if req.dtype("x") != "fp32" else 1e-6
    return None if err <= tol else f"relative error {err:.3g} > {tol:g} at n={n}"
