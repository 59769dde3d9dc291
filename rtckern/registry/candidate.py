"""`Candidate`: one implementation of an op, and the generic checks the registry runs before its own.

An op family subclasses `Candidate` once per implementation and registers an instance. The registry checks
vendor and arch range itself (so every candidate words those reasons the same way), then calls the candidate's
cheap `supports()` (can it serve this request at all?) and `cost()` (at what expected cost?), ranks the candidates
that can serve by (cost, then priority), and probes them in that order: it compiles `kernel_specs()`, and on a
live device loads them and checks `launch_resources()` and `check_resources()` against the device. A candidate
never declines because another one is faster: that is what its cost says.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rtckern.arch import Arch, ArchFilter

if TYPE_CHECKING:  # pragma: no cover
    from rtckern.registry.request import OpRequest
    from rtckern.spec import KernelSpec


@dataclass(frozen=True)
class Cost:
    """A candidate's expected cost for one request: lower ranks first. Comparable among one op's candidates only
    (each family says what its unit is, e.g. time relative to the fastest kind known for the request).

    source: where the number comes from: "table" (a tuned table's measurement) or "rule" (the family's rule where
    no table covers the request). detail: one line naming the table row or the rule, for `explain`.
    """

    value: float
    source: str = "rule"
    detail: str = ""

    def __post_init__(self) -> None:
        if self.source not in ("table", "rule"):
            raise ValueError(f"Cost.source must be 'table' or 'rule', got {self.source!r}")
        if not isinstance(self.value, (int, float)) or isinstance(self.value, bool) or self.value != self.value:
            raise ValueError(f"Cost.value must be a number, got {self.value!r}")

    def describe(self) -> str:
        return f"{self.value:.3g} ({self.source}{': ' + self.detail if self.detail else ''})"


def rank_key(cand: "Candidate", cost: Cost | None) -> tuple:
    """The registry's order: candidates with an expected cost first, cheapest first; then those without one; ties
    (and families without costs) by priority, then name."""
    if cost is None:
        return (1, 0.0, -cand.priority, cand.name)
    return (0, float(cost.value), -cand.priority, cand.name)


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

    name: unique, "<op>.<variant>" by convention. priority: the tie-break among candidates of equal expected cost
    (or without one): higher is tried first.
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
        """Cheap check (no compile): None when this candidate can serve req, else the reason, as data. Whether
        another candidate would be faster is not a reason: say that with cost()."""
        return None

    def cost(self, req: "OpRequest") -> Cost | None:
        """Optional: the expected cost of serving req (called only when supports(req) is None), from the tuned
        tables where they cover req, else a rule; None when there is no estimate (ranked after those with one,
        by priority)."""
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
    why = f"{why} (candidate serves {lo} .. {hi}{kind}; device: {req.device.name or req.device.arch.sm})"
    if cand.arch_specific and cand.max_arch is not None and req.device.arch.cc > Arch.parse(cand.max_arch).cc:
        # Blackwell and later: say why an sm_90a kernel is no use there, so the portable pick is not a surprise
        target = Arch.parse(cand.max_arch).with_specific().sm
        why += (f"; {target} code (arch-specific instructions such as wgmma) runs on {Arch.parse(cand.max_arch).sm} "
                "GPUs only: newer ones take a portable candidate")
    return why
