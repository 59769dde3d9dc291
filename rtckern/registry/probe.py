"""Probing one candidate for one request: the stages, in order, each turning a failure into a `Reason`.

    arch -> supports                                            (cheap_check: before ranking)
    -> specs -> compile (through the manager's caches) -> [live device] load -> resources
         -> [numeric probe on] numeric                          (probe_ranked: in rank order)

A hand-described device (no ordinal) gets a compile-only probe plus the resource checks that need no loaded
kernel (block size, dynamic shared memory vs the opt-in limit). Bugs in a candidate (supports() or
kernel_specs() raising) propagate: a broken candidate should fail its tests, not vanish into a reason.
"""
from __future__ import annotations

from typing import Any

from rtckern.errors import CompileError, RtckernError
from rtckern.registry import core_api
from rtckern.registry.candidate import Candidate, Resources, arch_reason
from rtckern.registry.request import OpRequest
from rtckern.registry.results import ProbeResult, Reason
from rtckern.registry.store import entry_matches, entry_reasons

LIVE = "live"
COMPILE_ONLY = "compile-only"
MAX_THREADS_PER_BLOCK = 1024  # every NVIDIA arch rtckern targets; AMD too


def mode_of(req: OpRequest) -> str:
    return LIVE if req.is_live else COMPILE_ONLY


def required_checks(mode: str, numeric: bool) -> tuple[str, ...]:
    if mode == COMPILE_ONLY:
        return ("compile", "resources")
    return ("compile", "load", "resources") + (("numeric",) if numeric else ())


def cheap_check(cand: Candidate, req: OpRequest) -> ProbeResult | None:
    """The checks that rank nothing and compile nothing (arch range, supports()): None when cand can serve req,
    else its rejection."""
    why = arch_reason(cand, req)
    if why is not None:
        return ProbeResult(cand.name, cand.priority, accepted=False, reasons=(Reason("arch", why),), checks=("arch",))
    why = cand.supports(req)
    if why is not None:
        return ProbeResult(cand.name, cand.priority, accepted=False, reasons=(Reason("supports", str(why)),),
                           checks=("arch", "supports"))
    return None


def probe_ranked(cand: Candidate, req: OpRequest, *, numeric: bool, stored: dict[str, Any] | None,
                 cost: Any = None, rank: int | None = None) -> tuple[ProbeResult, tuple[Any, ...]]:
    """The costly stages for a candidate that passed cheap_check (specs, compile, load, resources, numeric)."""
    base: dict[str, Any] = dict(name=cand.name, priority=cand.priority, cost=cost, rank=rank)
    specs = tuple(cand.kernel_specs(req))
    if not specs:
        raise ValueError(f"candidate {cand.name!r}: kernel_specs({req.describe()}) returned no KernelSpec")
    keys = tuple(core_api.cache_key(s) for s in specs)
    base.update(specs=specs, cache_keys=keys)
    mode = mode_of(req)
    needed = required_checks(mode, numeric and cand.has_selftest)

    if entry_matches(stored, keys, needed):
        reasons = entry_reasons(stored)
        checks = tuple(stored.get("checks", ()))
        if not stored.get("accepted"):
            return ProbeResult(accepted=False, reasons=reasons, checks=checks, from_store=True, **base), ()
        kernels: tuple[Any, ...] = ()
        try:
            if mode == LIVE:  # the stored outcome saves the checks, not the load: kernels come from the caches
                kernels = tuple(core_api.load(s, req.device.ordinal) for s in specs)
                _raise_smem_limits(kernels, _resources(cand, req, len(specs)), req)
        except RtckernError:
            pass  # stored as fine, but it no longer loads here: probe it afresh below, which records why
        else:
            return ProbeResult(accepted=True, checks=checks, from_store=True, **base), kernels

    checks = ["arch", "supports", "specs", "compile"]
    for spec in specs:
        try:
            core_api.compile(spec)
        except CompileError as exc:
            return _rejected(base, checks, Reason("compile", core_api.compile_error_summary(exc))), ()
    resources = _resources(cand, req, len(specs))
    if mode == COMPILE_ONLY:
        checks.append("resources")
        why = static_resource_reason(resources, req)
        if why is not None:
            return _rejected(base, checks, Reason("resources", why)), ()
        return ProbeResult(accepted=True, checks=tuple(checks), **base), ()

    checks.append("load")
    try:
        kernels = tuple(core_api.load(s, req.device.ordinal) for s in specs)
    except RtckernError as exc:
        return _rejected(base, checks, Reason("load", str(exc).strip().splitlines()[0])), ()
    checks.append("resources")
    _raise_smem_limits(kernels, resources, req)
    for spec, kernel, res in zip(specs, kernels, resources):
        why = live_resource_reason(kernel, res, req) if res is not None else None
        if why is not None:
            return _rejected(base, checks, Reason("resources", f"{spec.name}: {why}")), ()
    why = cand.check_resources(req, kernels)
    if why is not None:
        return _rejected(base, checks, Reason("resources", str(why))), ()
    if "numeric" in needed:
        checks.append("numeric")
        why = cand.selftest(req, kernels)
        if why is not None:
            return _rejected(base, checks, Reason("numeric", str(why))), ()
    return ProbeResult(accepted=True, checks=tuple(checks), **base), kernels


def _rejected(base: dict[str, Any], checks: list[str], reason: Reason) -> ProbeResult:
    return ProbeResult(accepted=False, reasons=(reason,), checks=tuple(checks), **base)


def _resources(cand: Candidate, req: OpRequest, n: int) -> tuple[Resources | None, ...]:
    res = cand.launch_resources(req)
    if res is None:
        return (None,) * n
    res = tuple(res)
    if len(res) != n:
        raise ValueError(f"candidate {cand.name!r}: launch_resources() gave {len(res)} entries for {n} kernels")
    return res


def static_resource_reason(resources: tuple[Resources | None, ...], req: OpRequest) -> str | None:
    """The checks that need no loaded kernel: block size and dynamic shared memory vs the device's limits."""
    dev = req.device
    for i, res in enumerate(resources):
        if res is None:
            continue
        if not 0 < res.block <= MAX_THREADS_PER_BLOCK:
            return f"kernel {i}: block of {res.block} threads; allowed 1..{MAX_THREADS_PER_BLOCK}"
        if res.dynamic_smem > dev.max_smem_per_block_optin:
            return (f"kernel {i}: {res.dynamic_smem} B dynamic shared memory > {dev.max_smem_per_block_optin} B, "
                    f"the per-block limit of {dev.arch.sm}")
    return None


def live_resource_reason(kernel: Any, res: Resources, req: OpRequest) -> str | None:
    """Registers x threads, static + dynamic smem vs the limit, occupancy >= 1, cooperative grid co-resident."""
    dev = req.device
    why = static_resource_reason((res,), req)
    if why is not None:
        return why.split(": ", 1)[1]
    if res.block > kernel.max_threads_per_block:
        return (f"block of {res.block} threads > {kernel.max_threads_per_block}, the kernel's limit "
                f"({kernel.num_regs} registers/thread)")
    regs = kernel.num_regs * res.block
    if regs > dev.regs_per_sm:
        return f"{kernel.num_regs} registers x {res.block} threads = {regs} > {dev.regs_per_sm} per SM"
    smem = kernel.shared_size_bytes + res.dynamic_smem
    if smem > dev.max_smem_per_block_optin:
        return (f"{kernel.shared_size_bytes} B static + {res.dynamic_smem} B dynamic shared memory = {smem} B > "
                f"{dev.max_smem_per_block_optin} B per block")
    occupancy = kernel.max_active_blocks_per_sm(res.block, res.dynamic_smem)
    if occupancy < 1:
        return (f"occupancy 0 blocks/SM at {res.block} threads, {res.dynamic_smem} B dynamic smem "
                f"({kernel.num_regs} regs/thread, {kernel.shared_size_bytes} B static smem)")
    if res.cooperative_grid is not None and res.cooperative_grid > occupancy * dev.sm_count:
        return (f"cooperative grid of {res.cooperative_grid} blocks > {occupancy} blocks/SM x {dev.sm_count} SMs "
                f"= {occupancy * dev.sm_count} co-resident")
    return None


def _raise_smem_limits(kernels: tuple[Any, ...], resources: tuple[Resources | None, ...], req: OpRequest) -> None:
    """Opt a kernel into more than the default dynamic shared memory before the occupancy query and launch."""
    for kernel, res in zip(kernels, resources):
        if res is None or res.dynamic_smem + 0 <= req.device.max_smem_per_block:
            continue
        if res.dynamic_smem <= req.device.max_smem_per_block_optin - kernel.shared_size_bytes:
            kernel.set_max_dynamic_shared_memory(res.dynamic_smem)
