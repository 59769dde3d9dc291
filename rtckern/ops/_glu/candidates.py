"""The registry candidate of the SwiGLU ops:

  swiglu.rows   any NVIDIA GPU from sm_75 and AMD (portable source): V-element pieces of rows, fp32 arithmetic

A request carries what decides the compiled code: the dtype, the vector width and the direction; n (the row
length) for `rtckern explain` (one kernel serves every n its vector divides).
"""
from __future__ import annotations

from typing import Any

from rtckern.device import DeviceInfo
from rtckern.registry import OpRequest, register_kernel_provider
from rtckern.registry import options as opts

from .._common import (OnePassCandidate, SelectionMemo, dtype_reason, register_missing_builder,
                       register_missing_candidates, rows_reason, run_once, vector_reason)
from . import geometry
from .geometry import OP, GluKernel


def request(kernel: GluKernel, n: int, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"x": kernel.dtype}, shape={"n": n, "vec": kernel.vec},
                     flags={"backward": kernel.backward}, device=device)


def kernel_of(req: OpRequest) -> GluKernel:
    return GluKernel(req.dtype("x"), req.dim("vec"), bool(req.flag("backward")))


class RowsCandidate(OnePassCandidate):
    name = "swiglu.rows"
    op = OP
    threads = geometry.THREADS

    kernel_of = staticmethod(kernel_of)

    def supports(self, req: OpRequest) -> str | None:
        kern, n = kernel_of(req), req.dim("n")
        return (dtype_reason("dtype", kern.dtype, geometry.DTYPES)
                or vector_reason(kern.vec, geometry.max_vector(kern.dtype), kern.dtype, geometry.VECTORS)
                or rows_reason(n, kern.vec))


CANDIDATES = (RowsCandidate,)

_selections = SelectionMemo("swiglu.selections")


def selection(kernel: GluKernel, n: int, device: DeviceInfo, ordinal: int) -> Any:
    """The registry's selection for this kernel and n on the device (memoized per settings object)."""
    return _selections.get((kernel, n, ordinal), lambda: request(kernel, n, device))


# ---- explain / prefill ---------------------------------------------------------------------------------------------
def build_request(shape, dtype, device, **options) -> OpRequest:
    """For `rtckern explain swiglu`: shape ROWSxN or N (the MLP's intermediate size); options vec=8|4|2|1 (the
    widest that fits by default), backward=0|1."""
    dims = [int(x) for x in shape]
    if len(dims) not in (1, 2):
        raise ValueError(f"swiglu: shape {shape!r} should be ROWSxN or N (the intermediate size), e.g. 4096x14336")
    opts.check_keys(OP, options, ("vec", "backward"))
    dt = opts.parse_choice(OP, "dtype", dtype or "bf16", geometry.DTYPES)
    n = dims[-1]
    widest = geometry.vector_width(dt, n, (), ())
    vec = opts.parse_int(OP, "vec", options["vec"]) if options.get("vec") is not None else widest
    return request(GluKernel(dt, vec, opts.flag(OP, options, "backward", False)), n, device)


def prefill_specs(archs):
    """The kernels of the common requests on every arch the candidate serves (prefill provider): forward and
    backward at the widest vector for each dtype."""
    return RowsCandidate().prefill_specs(archs, [GluKernel(dt, geometry.max_vector(dt), bwd)
                                                for dt in geometry.DTYPES for bwd in (False, True)])


@run_once
def register_all() -> None:
    """Register the SwiGLU candidate, its request builder and its kernel provider (idempotent)."""
    register_missing_candidates(CANDIDATES)
    register_missing_builder(OP, build_request, help="shape: ROWSxN or N; dtype fp32|fp16|bf16; options "
                             "vec=8|4|2|1, backward=0|1", example="--dtype bf16 --shape 4096x14336")
    register_kernel_provider(OP, prefill_specs)
