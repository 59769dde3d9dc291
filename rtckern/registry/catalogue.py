"""The catalogue of ops behind `rtckern ops`: per op its candidates (arch range, vendors, priority), the dtypes
and the limits of one dimension (head dim, row length) they serve.

Nothing here is declared twice: dtypes and limits are found by building requests with the op's request builder
(its example, one dtype or one sampled value changed: ``LimitProbe``) and asking each candidate the questions
selection asks without compiling: its arch range, ``supports()`` and the static resource check. So the catalogue
says what selection would accept on a described device of each candidate's arch range.
"""
from __future__ import annotations

import argparse
import shlex
from typing import Any

from rtckern.arch import Arch
from rtckern.device import DeviceInfo
from rtckern.dtypes import TABLE
from rtckern.registry.candidate import Candidate, arch_filter, arch_reason
from rtckern.registry.explain import build_request
from rtckern.registry.probe import _resources, static_resource_reason


def parse_example(example: str) -> tuple[str | None, str | None, dict[str, str]]:
    """(shape, dtype, options) of a builder's example argument line (`--dtype bf16 --shape 8192x4096 --opt w=1`)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--shape")
    p.add_argument("--dtype")
    p.add_argument("--opt", action="append", default=[])
    ns, _ = p.parse_known_args(shlex.split(example))
    return ns.shape, ns.dtype, dict(kv.split("=", 1) for kv in ns.opt if "=" in kv)


def serves(cand: Candidate, req: Any) -> bool:
    """Whether selection would keep ``cand`` for ``req`` before compiling it: arch range, supports(), static
    resources. A candidate that raises on an odd request does not serve it."""
    try:
        if arch_reason(cand, req) is not None or cand.supports(req) is not None:
            return False
        specs = tuple(cand.kernel_specs(req))
        return bool(specs) and static_resource_reason(_resources(cand, req, len(specs)), req) is None
    except Exception:
        return False


def _device_for(cand: Candidate, device: DeviceInfo) -> DeviceInfo:
    """The described device, or a typical one of the candidate's lowest arch when the device is out of its range."""
    if arch_filter(cand).reason(device.arch) is None:
        return device
    return DeviceInfo.for_arch(cand.min_arch or device.arch.sm)


def _request(registry: Any, op: str, shape: str, dtype: str | None, device: DeviceInfo, opts: dict) -> Any:
    try:
        return build_request(registry, op, shape=shape, dtype=dtype, device=device, options=opts)
    except Exception:  # a dtype or value the op's builder refuses
        return None


def _arch_range(cands: tuple[Candidate, ...]) -> dict[str, Any]:
    lows = [Arch.parse(c.min_arch) for c in cands if c.min_arch]
    highs = [Arch.parse(c.max_arch) for c in cands if c.max_arch]
    return {"min": min(lows, key=Arch.sort_key).sm if lows and len(lows) == len(cands) else None,
            "max": max(highs, key=Arch.sort_key).sm if highs and len(highs) == len(cands) else None,
            "vendors": sorted({v for c in cands for v in c.vendors})}


def describe_op(registry: Any, op: str, device: DeviceInfo) -> dict[str, Any]:
    """One op's catalogue entry (see the module docstring); ``device``: the arch limits are probed on."""
    cands = registry.candidates(op)
    entry = registry.request_builder(op) if op in registry.builder_ops() else None
    out: dict[str, Any] = {"op": op, "shape": entry.help if entry else "", "example": entry.example if entry else "",
                           "archs": _arch_range(cands), "dtypes": [], "limits": None, "candidates": []}
    shape, ex_dtype, opts = parse_example(entry.example) if entry else (None, None, {})
    probe = entry.limits if entry else None
    for cand in cands:
        dev = _device_for(cand, device)
        row: dict[str, Any] = {"name": cand.name, "priority": cand.priority, "min_arch": cand.min_arch,
                               "max_arch": cand.max_arch, "arch_specific": cand.arch_specific,
                               "vendors": list(cand.vendors), "probed_on": dev.arch.sm, "dtypes": [], "limits": None}
        if shape is not None:
            for dt in TABLE:
                req = _request(registry, op, shape, dt, dev, opts)
                if req is not None and serves(cand, req):
                    row["dtypes"].append(dt)
        if probe is not None:
            row["limits"] = [v for v in probe.values
                             if (req := _request(registry, op, probe.shape.format(v), ex_dtype, dev, opts)) is not None
                             and serves(cand, req)]
        out["candidates"].append(row)
    out["dtypes"] = [dt for dt in TABLE if any(dt in c["dtypes"] for c in out["candidates"])]
    if probe is not None:
        served = {v for c in out["candidates"] for v in c["limits"]}
        out["limits"] = {"dim": probe.dim, "dtype": ex_dtype, "tested": list(probe.values),
                         "served": [v for v in probe.values if v in served]}
    return out


def catalogue(registry: Any, device: DeviceInfo) -> list[dict[str, Any]]:
    """Every op with candidates or a request builder, sorted by name."""
    return [describe_op(registry, op, device) for op in sorted(set(registry.ops()) | set(registry.builder_ops()))]
