"""From manifest lines to the kernels a device will ask for: line x device arch -> OpRequest -> candidates.

The registry's request builders turn a line into an ``OpRequest`` for a hand-described device of each target
arch (no GPU). The candidates are then walked the way ``Registry.probe`` walks them, minus the compile: the overrides of
the settings (``RTCKERN_FORCE_IMPL``, ``RTCKERN_DISABLE_OPS``), the arch range, ``supports()`` and the resource checks
that need no loaded kernel. What survives is the request's *chain*: its viable candidates in the registry's rank order
(expected cost, then priority), each with its ``KernelSpec``s. Prefill compiles the head of each chain and moves down a
chain only when a compile fails, as the runtime's compile-only probe would.

An arch entry names a kind of device: ``9.0`` and ``9.0a`` both mean an sm_90 device, whose candidates pick their
own targets (``sm_90a`` for arch-specific ones), exactly as at runtime.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..arch import Arch
from ..device import DeviceInfo
from ..spec import KernelSpec
from .manifest import ManifestEntry


@dataclasses.dataclass
class Link:
    candidate: str
    specs: tuple[KernelSpec, ...]


@dataclasses.dataclass
class PlannedRequest:
    entry: ManifestEntry
    device: DeviceInfo
    request: Any = None  # OpRequest, None when it could not be built
    chain: list[Link] = dataclasses.field(default_factory=list)
    rejected: list[str] = dataclasses.field(default_factory=list)  # "<candidate>: <reason>" (cheap checks)
    error: str = ""  # why the request could not be built or has no viable candidate

    def describe(self) -> str:
        return f"{self.entry.describe()} on {self.device.arch.sm}"


def device_archs(archs: Sequence[Arch]) -> list[Arch]:
    """The distinct device archs of an arch list (suffix and +PTX dropped), sorted."""
    out = {dataclasses.replace(a.base(), ptx=False) for a in archs}
    return sorted(out, key=lambda a: a.sort_key())


_DEVICE_FIELDS = {f.name for f in dataclasses.fields(DeviceInfo)} - {"arch", "ordinal"}


def device_for(entry: ManifestEntry, arch: Arch) -> DeviceInfo:
    """The recorded device when the line was recorded on this arch (its SM count and limits can change the
    kernels: tuned configs are keyed by SM count), else a typical device of the arch."""
    rec = entry.device
    if rec:
        try:
            rec_arch = Arch.parse(rec["arch"]).base()
        except Exception:
            rec_arch = None
        if rec_arch == arch:
            base = dataclasses.asdict(DeviceInfo.for_arch(arch))
            base.pop("arch")
            base.update({k: v for k, v in rec.items() if k in _DEVICE_FIELDS})
            base["ordinal"] = None
            return DeviceInfo(arch=arch, **base)
    return DeviceInfo.for_arch(arch)


def build_request(registry: Any, entry: ManifestEntry, device: DeviceInfo) -> Any:
    from ..registry import OpRequest
    from ..registry.explain import build_request as builder_request

    if entry.request is not None:
        r = entry.request
        return OpRequest(op=entry.op, dtypes=r.get("dtypes", {}), shape=r.get("shape", {}),
                         flags=r.get("flags", {}), device=device)
    if entry.op not in registry.builder_ops():
        known = list(registry.builder_ops())
        raise LookupError(f"op {entry.op!r} has no request builder: its op family is not installed or has not "
                          f"registered yet (ops with a builder: {', '.join(known) or 'none'}); add "
                          f"--import MODULE for your own op family, or record the workload with "
                          f"RTCKERN_RECORD_MANIFEST")
    return builder_request(registry, entry.op, shape=entry.shape, dtype=entry.dtype, device=device,
                           options=dict(entry.options))


def chain_for(registry: Any, req: Any, settings: Any) -> tuple[list[Link], list[str]]:
    """The viable candidates of ``req`` in the registry's rank order, and the others with their reasons."""
    from ..registry.probe import _resources, static_resource_reason

    # The same overrides and ranking select() applies (a forced candidate that does not exist raises, as at runtime).
    ranked, rejected_results = registry.rank(req, settings)
    chain: list[Link] = []
    rejected = [f"{r.name}: {_reason_text(r)}" for r in rejected_results]
    for cand, _cost in ranked:
        specs = tuple(cand.kernel_specs(req))
        why = "kernel_specs() returned no kernel" if not specs else \
            static_resource_reason(_resources(cand, req, len(specs)), req)
        if why is not None:
            rejected.append(f"{cand.name}: {why}")
        else:
            chain.append(Link(cand.name, specs))
    return chain, rejected


def _reason_text(result: Any) -> str:
    reason = result.reasons[0]
    return str(reason) if reason.stage == "override" else reason.message


def plan(entries: Sequence[ManifestEntry], archs: Sequence[Arch], registry: Any = None,
         settings: Any = None) -> list[PlannedRequest]:
    """Every line for every device arch, in a deterministic order (line order, then arch)."""
    from .. import config
    from ..registry import default_registry

    registry = registry or default_registry()
    settings = settings or config.settings()
    registry.check_overrides(settings)  # a bad RTCKERN_FORCE_IMPL / DISABLE_OPS is one ConfigError, not one per line
    out: list[PlannedRequest] = []
    for entry in entries:
        for arch in device_archs(archs):
            p = PlannedRequest(entry, device_for(entry, arch))
            try:
                p.request = build_request(registry, entry, p.device)
                if not registry.candidates(entry.op):
                    p.error = (f"no candidate is registered for op {entry.op!r}: its op family has not registered "
                               "any (import rtckern.ops, or --import your module)")
                else:
                    p.chain, p.rejected = chain_for(registry, p.request, settings)
                    if not p.chain:
                        p.error = "no candidate serves it: " + "; ".join(p.rejected)
            except Exception as e:  # one bad line never stops the others; the reason is reported
                p.error = f"{type(e).__name__}: {e}" if not isinstance(e, LookupError) else str(e).strip("'\"")
            out.append(p)
    return out
