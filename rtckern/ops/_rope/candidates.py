"""The registry candidate of the rope op:

  rope.rows    any NVIDIA GPU from sm_75 and AMD (portable source): one block per (batch, position) over the heads
               of q and k, V-element accesses

A request carries what decides the compiled code: the q / k and cos / sin dtypes, the vector width, the direction
(forward or backward), and the head dim (for `rtckern explain`; one kernel serves every head dim its vector
divides).
"""
from __future__ import annotations

from typing import Any

from rtckern.device import DeviceInfo
from rtckern.registry import OpRequest, register_kernel_provider
from rtckern.registry import options as opts

from .._common import (OnePassCandidate, SelectionMemo, dtype_reason, register_missing_builder,
                       register_missing_candidates, run_once, vector_reason)
from . import geometry
from .geometry import OP, RopeKernel


def request(kernel: RopeKernel, head_dim: int, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"x": kernel.dtype, "cos": kernel.cos_dtype},
                     shape={"head_dim": head_dim, "vec": kernel.vec}, flags={"backward": kernel.backward},
                     device=device)


def kernel_of(req: OpRequest) -> RopeKernel:
    return RopeKernel(req.dtype("x"), req.dtype("cos"), req.dim("vec"), bool(req.flag("backward")))


class RowsCandidate(OnePassCandidate):
    name = "rope.rows"
    op = OP
    threads = geometry.MAX_THREADS

    kernel_of = staticmethod(kernel_of)

    def supports(self, req: OpRequest) -> str | None:
        kern, d = kernel_of(req), req.dim("head_dim")
        why = (dtype_reason("q / k dtype", kern.dtype, geometry.DTYPES)
               or dtype_reason(f"with {kern.dtype} q / k, cos / sin dtype", kern.cos_dtype,
                               geometry.cos_dtypes(kern.dtype))
               or vector_reason(kern.vec, geometry.max_vector(kern.dtype, kern.cos_dtype),
                                f"{kern.dtype} / {kern.cos_dtype}", geometry.VECTORS))
        if why:
            return why
        if d < 2 or d % 2 or (d // 2) % kern.vec:
            return f"head_dim={d} must be even with half of it a multiple of the vector width {kern.vec}"
        return None


CANDIDATES = (RowsCandidate,)

_selections = SelectionMemo("rope.selections")


def selection(kernel: RopeKernel, head_dim: int, device: DeviceInfo, ordinal: int) -> Any:
    """The registry's selection for this kernel and head dim on the device (memoized per settings object)."""
    return _selections.get((kernel, head_dim, ordinal), lambda: request(kernel, head_dim, device))


# ---- explain / prefill ---------------------------------------------------------------------------------------------
def build_request(shape, dtype, device, **options) -> OpRequest:
    """For `rtckern explain rope`: shape HEAD_DIM; options cos=<q's dtype>|fp32, vec=8|4|2|1 (the widest that fits
    by default), backward=0|1."""
    dims = [int(x) for x in shape]
    if len(dims) != 1:
        raise ValueError(f"rope: shape {shape!r} should be the head dim, e.g. 128")
    opts.check_keys(OP, options, ("cos", "vec", "backward"))
    dt = opts.parse_choice(OP, "dtype", dtype or "bf16", geometry.DTYPES)
    ct = opts.parse_choice(OP, "cos", options.get("cos", dt), geometry.cos_dtypes(dt))
    half = dims[0] // 2
    widest = geometry.vector_width(dt, ct, half, (), (), (), ())
    vec = opts.parse_int(OP, "vec", options["vec"]) if options.get("vec") is not None else widest
    return request(RopeKernel(dt, ct, vec, opts.flag(OP, options, "backward", False)), dims[0], device)


def prefill_specs(archs):
    """The kernels of the common requests on every arch the candidate serves (prefill provider): forward and
    backward at the widest vector for each dtype with its own-dtype cos / sin (what transformers passes)."""
    return RowsCandidate().prefill_specs(archs, [RopeKernel(dt, dt, geometry.max_vector(dt, dt), bwd)
                                                for dt in geometry.DTYPES for bwd in (False, True)])


@run_once
def register_all() -> None:
    """Register the rope candidate, its request builder and its kernel provider (idempotent)."""
    register_missing_candidates(CANDIDATES)
    register_missing_builder(OP, build_request, help="shape: HEAD_DIM; dtype fp32|fp16|bf16 (q and k); options "
                             "cos=<dtype>|fp32, vec=8|4|2|1, backward=0|1", example="--dtype bf16 --shape 128")
    register_kernel_provider(OP, prefill_specs)
