"""The op registry: requests, candidates, probe-based selection, overrides, persisted decisions, explain.

    from rtckern.registry import OpRequest, Candidate, register, select, explain

Ops register `Candidate`s (and a request builder, for `explain`/`tune`/`selftest` from the command line, and a kernel
provider, for `rtckern prefill`) at `import rtckern.ops`; `select(req)` ranks the candidates that can serve by expected
cost (`Candidate.cost`, then priority), probes them in that order and returns the memoized `Selection`, or raises
`UnsupportedRequestError` with every candidate's reasons.
"""
from __future__ import annotations

from typing import Any, Mapping

from rtckern.errors import UnsupportedRequestError
from rtckern.registry.candidate import Candidate, Cost, Resources
from rtckern.registry.explain import Explanation, build_request as _build_request, device_for, \
    explain as _explain, parse_shape
from rtckern.registry.fallback import fallback_allowed, warn_fallback_once
from rtckern.registry.providers import kernel_providers, register_kernel_provider
from rtckern.registry.request import OpRequest
from rtckern.registry.results import ProbeResult, Reason, Selection
from rtckern.registry.selector import LimitProbe, Registry
from rtckern.registry.store import clear_decisions, decisions_dir

__all__ = ["OpRequest", "Candidate", "Cost", "Resources", "Registry", "Selection", "ProbeResult", "Reason", "Explanation",
           "UnsupportedRequestError", "register", "select", "explain", "register_request_builder",
           "build_request", "candidates", "default_registry", "parse_shape", "device_for", "fallback_allowed",
           "warn_fallback_once", "clear_decisions", "decisions_dir", "register_kernel_provider", "kernel_providers",
           "LimitProbe"]

_default = Registry()


def default_registry() -> Registry:
    return _default


def register(cand: Candidate, *, replace: bool = False) -> Candidate:
    return _default.register(cand, replace=replace)


def register_request_builder(op: str, fn: Any, *, help: str = "", example: str = "", replace: bool = False,
                             limits: LimitProbe | None = None) -> None:
    _default.register_request_builder(op, fn, help=help, example=example, replace=replace, limits=limits)


def candidates(op: str) -> tuple[Candidate, ...]:
    return _default.candidates(op)


def select(req: OpRequest) -> Selection:
    return _default.select(req)


def build_request(op: str, *, shape: Any, dtype: str | None = None, arch: str | None = None,
                  sm_count: int | None = None, device: Any = None,
                  options: Mapping[str, str] | None = None) -> OpRequest:
    dev = device_for(arch=arch, sm_count=sm_count, device=device)
    return _build_request(_default, op, shape=shape, dtype=dtype, device=dev, options=options)


def explain(op_or_request: str | OpRequest, *, dtype: str | None = None, shape: Any = None,
            arch: str | None = None, sm_count: int | None = None, device: Any = None,
            options: Mapping[str, str] | None = None, probe_all: bool = True,
            registry: Registry | None = None) -> Explanation:
    """Every candidate for the request, its expected cost and rank, accepted or rejected and why, the chosen one
    and why it won, its specs and cache keys.

    explain("rms_norm", dtype="bf16", shape="8192x4096", arch="sm_90", sm_count=132)  # no GPU needed
    explain(req)                       # an OpRequest built by the caller
    explain("rms_norm", dtype="bf16", shape="8192x4096", device=0)  # live device: the probe select runs
    """
    return _explain(registry or _default, op_or_request, dtype=dtype, shape=shape, arch=arch, sm_count=sm_count,
                    device=device, options=options, probe_all=probe_all)
