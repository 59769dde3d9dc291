"""`explain`: which candidate a request gets, and why: each candidate's expected cost (and where it comes from: a
tuned table's row or the family's rule), the ranking, and why every other one was or would be rejected.

Works without a GPU for a hand-described device (`arch=`, `sm_count=`): the probe is then compile-only (no
load, no occupancy), which the report says. On a live device (`device=0`) it runs the same probe `select` does.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from rtckern.device import DeviceInfo
from rtckern.registry.probe import COMPILE_ONLY, mode_of
from rtckern.registry.request import OpRequest
from rtckern.registry.results import ProbeResult, spec_to_dict
from rtckern.registry.selector import Registry

_SHAPE = re.compile(r"[0-9]+(x[0-9]+)*", re.ASCII)


def parse_shape(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """'8192x4096' -> (8192, 4096). Sequences of ints pass through."""
    if isinstance(text, (tuple, list)):
        dims = tuple(int(d) for d in text)
    else:
        t = text.strip().lower().replace("×", "x").replace(",", "x")
        if not _SHAPE.fullmatch(t):
            raise ValueError(f"shape {text!r}: write dimensions joined by 'x', e.g. 8192x4096")
        dims = tuple(int(d) for d in t.split("x"))
    if any(d <= 0 for d in dims):
        raise ValueError(f"shape {text!r}: every dimension must be positive")
    return dims


def device_for(*, arch: str | None = None, sm_count: int | None = None, device: Any = None) -> DeviceInfo:
    """A DeviceInfo from explain's arguments: a DeviceInfo, a live ordinal, or a hand-described arch."""
    if isinstance(device, DeviceInfo):
        if arch is not None or sm_count is not None:
            raise ValueError("give either device= (a DeviceInfo) or arch=/sm_count=, not both")
        return device
    if device is not None:
        if arch is not None:
            raise ValueError(f"give either device={device!r} (a live GPU) or arch={arch!r} (described), not both")
        live = DeviceInfo.from_device(int(device))
        return dataclasses.replace(live, sm_count=sm_count) if sm_count else live
    if arch is None:
        raise ValueError("explain needs a device: arch='sm_90' (described, no GPU needed) or device=0 (live)")
    return DeviceInfo.for_arch(arch, sm_count=sm_count)


def build_request(registry: Registry, op: str, *, shape: Any, dtype: str | None, device: DeviceInfo,
                  options: Mapping[str, str] | None = None) -> OpRequest:
    entry = registry.request_builder(op)
    dims = parse_shape(shape)
    opts = dict(options or {})
    params = inspect.signature(entry.fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
             or (p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and n not in ("shape", "dtype", "device"))]
    unknown = sorted(set(opts) - set(named)) if not takes_any else []
    if unknown:
        raise ValueError(f"op {op!r} takes no option(s) {unknown}; its options: {named or 'none'}"
                         + (f" ({entry.help})" if entry.help else ""))
    req = entry.fn(dims, dtype, device, **opts)
    if not isinstance(req, OpRequest) or req.op != op:
        raise TypeError(f"request builder of {op!r} returned {req!r}, expected an OpRequest with op={op!r}")
    return req


@dataclass(frozen=True)
class Explanation:
    request: OpRequest
    mode: str
    chosen: str | None
    results: tuple[ProbeResult, ...]

    @property
    def chosen_result(self) -> ProbeResult | None:
        return next((r for r in self.results if r.name == self.chosen), None)

    def to_dict(self) -> dict[str, Any]:
        ch = self.chosen_result
        return {
            "op": self.request.op,
            "request": self.request.to_dict(),
            "mode": self.mode,
            "chosen": self.chosen,
            "why": self.why(),
            "ranking": [r.name for r in sorted(self.results, key=_rank) if r.rank is not None],
            "chosen_specs": [spec_to_dict(s) for s in ch.specs] if ch else [],
            "cache_keys": list(ch.cache_keys) if ch else [],
            "candidates": [r.to_dict() for r in self.results],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def format(self) -> str:
        lines = [f"request: {self.request.describe()}",
                 f"probe:   {self.mode}" + (" (no live device: no load, occupancy or numerical checks)"
                                            if self.mode == COMPILE_ONLY else "")]
        lines.append("candidates (those that can serve ranked by expected cost, then priority; then the others):")
        for r in self.results:
            mark = "chosen  " if r.name == self.chosen else ("accepted" if r.accepted else
                                                             ("skipped " if not r.probed else "rejected"))
            src = " [from stored decisions]" if r.from_store else ""
            rank = "" if r.rank is None else f" rank {r.rank}, " + (
                f"expected cost {r.cost.describe()}" if r.cost is not None else "no cost estimate")
            lines.append(f"  {mark} {r.name} (priority {r.priority}){rank}{src}")
            for reason in r.reasons:
                lines.append(f"           - {reason}")
            if not r.probed and not r.reasons:
                lines.append("           - not probed: a better-ranked candidate was chosen")
        ch = self.chosen_result
        if ch is None:
            lines.append("chosen: none (the op would raise UnsupportedRequestError)")
        else:
            lines.append(f"chosen: {ch.name}")
            lines.append(f"why:    {self.why()}")
            for spec, key in zip(ch.specs, ch.cache_keys):
                lines.append(f"  kernel: {spec.describe()}")
                if spec.defines or spec.options:
                    lines.append(f"          defines {list(spec.defines)} options {list(spec.options)}")
                lines.append(f"  cache key: {key}")
        return "\n".join(lines)


    def why(self) -> str:
        """One line: why the chosen candidate won (its rank and cost, the runner-up, better-ranked failures)."""
        ch = self.chosen_result
        if ch is None:
            return "no candidate serves the request"
        ranked = sorted((r for r in self.results if r.rank is not None), key=_rank)
        if ch.cost is not None:
            text = f"expected cost {ch.cost.describe()}"
        else:
            text = f"no cost estimate, priority {ch.priority}"
        text = f"ranked {ch.rank} of {len(ranked)} that can serve ({text})"
        failed = [r for r in ranked if r.rank < ch.rank]
        if failed:
            text += "; better-ranked " + ", ".join(
                f"{r.name} failed its probe ({r.reasons[0].stage if r.reasons else 'rejected'})" for r in failed)
        nxt = next((r for r in ranked if r.rank == ch.rank + 1), None)
        if nxt is not None:
            cost = f"expected cost {nxt.cost.describe()}" if nxt.cost is not None else "no cost estimate"
            text += f"; next in line: {nxt.name} ({cost}, priority {nxt.priority})"
        return text


def _rank(r: ProbeResult) -> int:
    return r.rank if r.rank is not None else 1 << 30


def explain_request(registry: Registry, req: OpRequest, *, probe_all: bool = True) -> Explanation:
    results, chosen, _ = registry.probe(req, stop_at_first=not probe_all)
    return Explanation(request=req, mode=mode_of(req), chosen=chosen.name if chosen else None,
                       results=tuple(results))


def explain(registry: Registry, op_or_request: str | OpRequest, *, dtype: str | None = None,
            shape: Any = None, arch: str | None = None, sm_count: int | None = None, device: Any = None,
            options: Mapping[str, str] | None = None, probe_all: bool = True) -> Explanation:
    if isinstance(op_or_request, OpRequest):
        return explain_request(registry, op_or_request, probe_all=probe_all)
    if shape is None:
        raise ValueError(f"explain({op_or_request!r}) needs shape=, e.g. shape='8192x4096'")
    dev = device_for(arch=arch, sm_count=sm_count, device=device)
    req = build_request(registry, op_or_request, shape=shape, dtype=dtype, device=dev, options=options)
    return explain_request(registry, req, probe_all=probe_all)
