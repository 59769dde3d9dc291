"""The registry candidate of the cross-entropy ops:

  cross_entropy.rows   any NVIDIA GPU from sm_75 and AMD (portable source): one block per row forward (online max and
                       sum of exponentials), V-element pieces of rows backward, fp32 arithmetic

A request carries what decides the compiled code: the logits' and labels' dtypes, the vector width, the forward's
block size and the direction; n (the vocabulary) for `rtckern explain`.
"""
from __future__ import annotations

from typing import Any

from rtckern.device import DeviceInfo
from rtckern.registry import OpRequest, Resources, register_kernel_provider
from rtckern.registry import options as opts

from .._common import (OnePassCandidate, SelectionMemo, dtype_reason, register_missing_builder,
                       register_missing_candidates, rows_reason, run_once, vector_reason)
from . import geometry
from .geometry import OP, CeKernel


def request(kernel: CeKernel, n: int, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"x": kernel.dtype, "labels": kernel.label_dtype},
                     shape={"n": n, "vec": kernel.vec, "threads": kernel.threads},
                     flags={"backward": kernel.backward, "reduce": kernel.reduce}, device=device)


def kernel_of(req: OpRequest) -> CeKernel:
    return CeKernel(req.dtype("x"), req.dtype("labels"), req.dim("vec"), req.dim("threads"),
                    bool(req.flag("backward")), bool(req.flag("reduce")))


class RowsCandidate(OnePassCandidate):
    name = "cross_entropy.rows"
    op = OP

    def kernel_of(self, req: OpRequest) -> CeKernel:
        return kernel_of(req)

    def kernel_specs(self, req: OpRequest):
        return self.kernel_of(req).specs(self.target(req))

    def launch_resources(self, req: OpRequest):
        kern = kernel_of(req)
        return (Resources(block=kern.threads),) + ((Resources(block=geometry.REDUCE_THREADS),) if kern.reduce else ())

    def supports(self, req: OpRequest) -> str | None:
        kern, n = kernel_of(req), req.dim("n")
        why = (dtype_reason("logits dtype", kern.dtype, geometry.DTYPES)
               or dtype_reason("labels dtype", kern.label_dtype, geometry.LABEL_DTYPES)
               or vector_reason(kern.vec, geometry.max_vector(kern.dtype), kern.dtype, geometry.VECTORS))
        if why:
            return why
        threads = (geometry.BWD_THREADS,) if kern.backward else geometry.FWD_THREADS
        if kern.threads not in threads:
            return f"{kern.threads} threads per block not supported; supported: {list(threads)}"
        return rows_reason(n, kern.vec)


CANDIDATES = (RowsCandidate,)

_selections = SelectionMemo("cross_entropy.selections")


def selection(kernel: CeKernel, n: int, device: DeviceInfo, ordinal: int) -> Any:
    """The registry's selection for this kernel and n on the device (memoized per settings object)."""
    return _selections.get((kernel, n, ordinal), lambda: request(kernel, n, device))


# ---- explain / prefill ---------------------------------------------------------------------------------------------
def build_request(shape, dtype, device, **options) -> OpRequest:
    """For `rtckern explain cross_entropy`: shape ROWSxN or N (the vocabulary size); options labels=int64|int32,
    vec=8|4|2|1 (the widest that fits by default), backward=0|1, reduction=none|mean|sum (a forward's)."""
    dims = [int(x) for x in shape]
    if len(dims) not in (1, 2):
        raise ValueError(f"cross_entropy: shape {shape!r} should be ROWSxN or N (the vocabulary size), e.g. "
                         "8192x128256")
    opts.check_keys(OP, options, ("labels", "vec", "backward", "reduction"))
    dt = opts.parse_choice(OP, "dtype", dtype or "bf16", geometry.DTYPES)
    lt = opts.parse_choice(OP, "labels", options.get("labels") or "int64", geometry.LABEL_DTYPES)
    n = dims[-1]
    widest = geometry.vector_width(dt, n, (), ())
    vec = opts.parse_int(OP, "vec", options["vec"]) if options.get("vec") is not None else widest
    red = opts.parse_choice(OP, "reduction", options.get("reduction") or "none", geometry.REDUCTIONS)
    return request(geometry.kernel(dt, lt, vec, n, opts.flag(OP, options, "backward", False), red != "none"), n,
                   device)


def prefill_specs(archs):
    """The kernels of the common requests on every arch the candidate serves (prefill provider): int64 labels (what
    torch's data pipelines make), the widest vector, every forward block size with the reduction, and the backward,
    for each dtype."""
    kernels = []
    for dt in geometry.DTYPES:
        v = geometry.max_vector(dt)
        kernels += [CeKernel(dt, "int64", v, t, False, True) for t in geometry.FWD_THREADS]
        kernels.append(CeKernel(dt, "int64", v, geometry.BWD_THREADS, True))
    return RowsCandidate().prefill_specs(archs, kernels)


@run_once
def register_all() -> None:
    """Register the cross-entropy candidate, its request builder and its kernel provider (idempotent)."""
    register_missing_candidates(CANDIDATES)
    register_missing_builder(OP, build_request, help="shape: ROWSxN or N; dtype fp32|fp16|bf16; options "
                             "labels=int64|int32, vec=8|4|2|1, backward=0|1, reduction=none|mean|sum",
                             example="--dtype bf16 --shape 8192x128256")
    register_kernel_provider(OP, prefill_specs)
