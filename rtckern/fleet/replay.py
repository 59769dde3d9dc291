"""Prefill from a manifest: compile what each (line, device arch) will ask for, in parallel, deterministically.

Rounds: compile the first viable candidate's kernels of every request (all requests' kernels together,
deduplicated, in a fixed order, over ``jobs`` processes); a request whose kernels all compiled is served; one
whose compile failed moves to its next candidate, as the runtime's probe would, and the next round compiles
those. The outcome depends only on the manifest, the arch list and the toolchain, never on ``jobs`` or timing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

from ..arch import Arch
from ..prefill import PrefillResult, prefill, spec_order
from ..spec import KernelSpec
from .manifest import ManifestEntry
from .plan import PlannedRequest, plan


@dataclasses.dataclass
class RequestOutcome:
    planned: PlannedRequest
    served_by: str = ""
    keys: tuple[str, ...] = ()
    tried: list[str] = dataclasses.field(default_factory=list)  # "<candidate>: <why it failed>"

    @property
    def ok(self) -> bool:
        return bool(self.served_by)

    def error(self) -> str:
        if self.planned.error:
            return self.planned.error
        return "every viable candidate failed: " + "; ".join(self.tried)


@dataclasses.dataclass
class ReplayResult:
    requests: list[RequestOutcome]
    kernels: list[PrefillResult]  # every kernel compiled or found, in a deterministic order
    seconds: float

    def keys(self) -> list[str]:
        """Cache keys of every kernel that is now in the cache (what a bundle of this manifest holds)."""
        return sorted({r.key for r in self.kernels if r.status != "failed" and r.key})


def short_error(text: str, limit: int = 3) -> str:
    """The lines of a compile error that say why (not the whole log)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower()][:limit]
    return "; ".join(errs or lines[:1])


def replay(entries: Sequence[ManifestEntry], archs: Sequence[Arch], *, jobs: int = 1, cache_dir: str | None = None,
           registry: Any = None, all_candidates: bool = False,
           progress: Callable[[PrefillResult], None] | None = None,
           on_round: Callable[[int], None] | None = None) -> ReplayResult:
    """progress(result) after each kernel; on_round(n) before each round with the number of kernels it compiles
    (the first round's is most of the work; later rounds are fallbacks), so a display can show a total."""
    t0 = time.perf_counter()
    planned = plan(entries, archs, registry)
    outcomes = [RequestOutcome(p) for p in planned]
    done: dict[KernelSpec, PrefillResult] = {}
    pos = [0] * len(outcomes)
    pending = [i for i, o in enumerate(outcomes) if not o.planned.error]
    while pending:
        want: dict[KernelSpec, None] = {}
        for i in pending:
            chain = outcomes[i].planned.chain
            for link in (chain[pos[i]:] if all_candidates else chain[pos[i]:pos[i] + 1]):
                for s in link.specs:
                    if s not in done:
                        want.setdefault(s, None)
        if on_round:
            on_round(len(want))
        for r in prefill(sorted(want, key=spec_order), jobs=jobs, cache_dir=cache_dir, progress=progress):
            done[r.spec] = r
        still = []
        for i in pending:
            o, link = outcomes[i], outcomes[i].planned.chain[pos[i]]
            bad = [done[s] for s in link.specs if done[s].status == "failed"]
            if not bad:
                o.served_by, o.keys = link.candidate, tuple(done[s].key for s in link.specs)
                continue
            o.tried.append(f"{link.candidate}: {bad[0].spec.name_expression}: {short_error(bad[0].error)}")
            pos[i] += 1
            if pos[i] < len(o.planned.chain):
                still.append(i)
        pending = still
    kernels = sorted(done.values(), key=lambda r: spec_order(r.spec))
    return ReplayResult(outcomes, kernels, time.perf_counter() - t0)


def summarize(result: ReplayResult, arch_failures: dict[str, str] | None = None) -> dict:
    """Counts per device arch and in total. ``failed`` counts requests no candidate serves (and archs no compiler
    targets); a kernel that failed while a lower-priority candidate served its request counts as ``rejected``."""
    arch_failures = arch_failures or {}
    per_arch: dict[str, dict[str, int]] = {}

    def row(sm: str) -> dict[str, int]:
        return per_arch.setdefault(sm, {"requests": 0, "served": 0, "failed": 0, "compiled": 0, "cached": 0,
                                        "rejected": 0})

    for o in result.requests:
        r = row(o.planned.device.arch.sm)
        r["requests"] += 1
        r["served" if o.ok else "failed"] += 1
    for k in result.kernels:
        row(k.spec.arch.base().sm)["rejected" if k.status == "failed" else k.status] += 1
    failures = [{"request": f"every request for {a}", "error": e} for a, e in arch_failures.items()]
    failures += [{"request": o.planned.describe(), "error": o.error()} for o in result.requests if not o.ok]
    total = {f: sum(r[f] for r in per_arch.values()) for f in ("requests", "served", "compiled", "cached", "rejected")}
    return {
        "requests": total["requests"], "served": total["served"], "failed": len(failures),
        "total": len(result.kernels), "compiled": total["compiled"], "cached": total["cached"],
        "rejected": total["rejected"], "seconds": round(result.seconds, 3),
        "compile_ms": round(sum(k.ms for k in result.kernels if k.status == "compiled"), 1),
        "per_arch": per_arch, "failures": failures,
        "served_by": {o.planned.describe(): o.served_by for o in result.requests if o.ok},
    }
