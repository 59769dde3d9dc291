"""`Candidate`: one implementation of an op, and the generic checks the registry runs before its own.

An op family subclasses `Candidate` once per implementation and registers an instance. The registry checks
vendor and arch range itself (so every candidate words those reasons the same way), then calls the candidate's
cheap `supports()`, compiles `kernel_specs()`, and on a live device loads them and checks `launch_resources()`
and `check_resources()` against the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rtckern.arch import Arch, ArchFilter

if TYPE_CHECKING:  # pragma: no cover
    from rtckern.registry.request import OpRequest
    from rtckern.spec import KernelSpec


@dataclass(frozen=True)
class Resources:
    """What one kernel of a candidate needs at launch, for the generic resource check.

    block: threads per block. dynamic_smem: dynamic shared memory bytes per block.
    cooperative_grid: the grid size in blocks when the launch is cooperative (all blocks co-resident), else None.
    """

    block: int
    dynamic_smem: int = 0
    cooperative_grid: int | None = None


class Candidate:
    """Base class of an op implementation. Class attributes describe it; methods are called by the registry.

    name: unique, "<op>.<variant>" by convention. priority: higher is tried first.
    min_arch / max_arch: inclusive compute-capability range ("sm_80"), None for open. arch_specific: the kernels
    need the device's arch-specific target (sm_90a: wgmma, setmaxnreg), whose binaries run only on that exact
    compute capability. vendors: which GPU vendors the sources serve.
    """

    name: str = ""
    op: str = ""
    priority: int = 0
    min_arch: str | None = None
    max_arch: str | None = None
    arch_specific: bool = False
    vendors: tuple[str, ...] = ("nvidia",)

    # -- to implement -------------------------------------------------------------------------------------------
    def supports(self, req: "OpRequest") -> str | None:
        """Cheap check (no compile): None when this candidate can serve req, else the reason, as data."""
        return None

    def kernel_specs(self, req: "OpRequest") -> tuple["KernelSpec", ...]:
        """The kernels this candidate launches for req, built for `self.target(req)`."""
        raise NotImplementedError(f"{type(self).__name__}.kernel_specs")

    def launch_resources(self, req: "OpRequest") -> tuple[Resources | None, ...] | None:
        """Optional: per kernel of kernel_specs(req), what its launch needs (block, dynamic smem, cooperative
        grid), checked generically: registers x threads, static + dynamic smem vs the limit, occupancy >= 1,
        cooperative grid co-resident. None skips the generic check."""
        return None

    def check_resources(self, req: "OpRequest", kernels: tuple[Any, ...]) -> str | None:
        """Optional extra check on the loaded kernels (live device only): None if fine, else the reason."""
        return None

    def selftest(self, req: "OpRequest", kernels: tuple[Any, ...]) -> str | None:
        """Optional numerical probe: launch on a small input shaped like req, compare with a reference; None if
        it matches, else the reason (with the error measured). Run by `rtckern selftest` and, when the
        numeric-probe setting is on, during selection."""
        return None

    def launch(self, req: "OpRequest", kernels: tuple[Any, ...], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.launch")

    # -- helpers --------------------------------------------------------------------------------------------------
    @property
    def has_selftest(self) -> bool:
        return type(self).selftest is not Candidate.selftest

    def target(self, req: "OpRequest") -> Arch:
        """The compile target for req's device: its arch-specific one (sm_90a) when this candidate needs it."""
        from rtckern.registry.core_api import target_for

        return target_for(req.device, self.arch_specific)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} op={self.op!r} priority={self.priority}>"


def check_declaration(cand: Candidate) -> None:
    """Reject a malformed candidate at register() time, naming the attribute and the fix."""
    cls = type(cand).__name__
    if not cand.name or not isinstance(cand.name, str):
        raise ValueError(f"candidate class {cls} has no name; set name = '<op>.<variant>'")
    if not cand.op or not isinstance(cand.op, str):
        raise ValueError(f"candidate {cand.name!r} ({cls}) has no op; set op = '<op name>'")
    if not isinstance(cand.priority, int) or isinstance(cand.priority, bool):
        raise ValueError(f"candidate {cand.name!r}: priority must be an int, got {cand.priority!r}")
    for attr in ("min_arch", "max_arch"):
        val = getattr(cand, attr)
        if val is not None:
            try:
                Arch.parse(val)
            except Exception as exc:  # the arch parser's own error names the accepted forms
                raise ValueError(f"candidate {cand.name!r}: {attr}={val!r} does not parse: {exc}") from exc
    bad = [v for v in cand.vendors if v not in ("nvidia", "amd")]
    if bad or not cand.vendors:
        raise ValueError(f"candidate {cand.name!r}: vendors={cand.vendors!r}; allowed: 'nvidia', 'amd'")
    if type(cand).kernel_specs is Candidate.kernel_specs:
        raise ValueError(f"candidate {cand.name!r} ({cls}) does not implement kernel_specs(req)")


def arch_filter(cand: Candidate) -> ArchFilter:
    return ArchFilter.of(cand.min_arch, cand.max_arch, cand.arch_specific, cand.vendors)


def arch_reason(cand: Candidate, req: "OpRequest") -> str | None:
    """Vendor, arch range and arch-specific target checks (the core's ArchFilter, so prefill and selection
    agree); None when the device is served."""
    why = arch_filter(cand).reason(req.device.arch)
    if why is None:
        return None
    lo, hi = cand.min_arch or "any", cand.max_arch or "any"
    kind = ", arch-specific target" if cand.arch_specific else ""
    return f"{why} (candidate serves {lo} .. {hi}{kind}; device: {req.device.name or req.device.arch.sm})"
