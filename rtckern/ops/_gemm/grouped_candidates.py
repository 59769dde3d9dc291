"""Registry candidates of grouped_gemm (contiguous and masked groups: one op, the mode a request flag), cheapest first:

  grouped_gemm.sm90a_wgmma   sm_90a: gemm_wgmma_sm90 compiled with RTK_GEMM_GROUPED (TMA + wgmma, warp-specialized,
                             persistent over every group's tiles); 16-byte aligned operands
  grouped_gemm.sm80_mma      sm_80+: gemm_mma_sm80 compiled with RTK_GEMM_GROUPED (mma.sync + cp.async, one unit per
                             block, each block building the tile prefix); any alignment (element loads otherwise):
                             the fallback on A100 / Ada and for unaligned operands on H100 / H200

Older GPUs (sm_75) have no grouped kernel: such a request is refused with the candidates' reasons. A request holds
dtypes, layout, mode, groups, N, K and the rows per group as a power of two (grouped_geometry.py). The wgmma tile
comes from the tuned table `grouped_gemm` (grouped_configs.py; `explain` names the row), else the rule by rows per
group; the mma.sync fallback's tile from its rule.
"""
from __future__ import annotations

from typing import Any

from rtckern import tuning
from rtckern.caches import PlanCache
from rtckern.device import DeviceInfo
from rtckern.registry import Cost, OpRequest, select
from rtckern.registry import options as opts

from .. import _common_grouped as shared
from .._common import (MemoizedConfigCandidate, ProblemCandidate, SelectionMemo, WgmmaTileCandidate, dtype_reason,
                       register_missing_builder, register_missing_candidates, run_once, tma_coordinates_reason)
from . import geometry, grouped_configs
from . import grouped_geometry as gg
from .grouped_geometry import OP, GroupedProblem


def request(p: GroupedProblem, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"a": p.dtype, "out": p.out_dtype},
                     shape={"groups": p.groups, "rows": p.rows, "n": p.n, "k": p.k},
                     flags={"mode": p.mode, "trans_b": p.trans_b, "aligned": p.aligned}, device=device)


def problem(req: OpRequest) -> GroupedProblem:
    return GroupedProblem(mode=str(req.flag("mode")), groups=req.dim("groups"), rows=req.dim("rows"),
                          n=req.dim("n"), k=req.dim("k"), dtype=req.dtype("a"), out_dtype=req.dtype("out"),
                          trans_b=bool(req.flag("trans_b")), aligned=bool(req.flag("aligned")))


def _dtype_reason(p: GroupedProblem) -> str | None:
    return (dtype_reason("input dtype", p.dtype, geometry.INPUT_DTYPES)
            or dtype_reason("output dtype", p.out_dtype, geometry.OUTPUT_DTYPES))


_configs = PlanCache("grouped_gemm.candidate_configs")


class _GroupedCandidate(MemoizedConfigCandidate, ProblemCandidate):
    op = OP
    config_memo = _configs
    problem, reason, invalid = staticmethod(problem), staticmethod(_dtype_reason), staticmethod(gg.invalid)
    spec, smem = staticmethod(gg.spec), staticmethod(gg.smem_bytes)


def _tma_reason(p: GroupedProblem) -> str | None:
    why = _dtype_reason(p)
    if why is None and not p.aligned:
        return ("TMA needs 16-byte aligned operands: base addresses, row strides and group strides that are "
                "multiples of 8 elements, K a multiple of 8 and, with trans_b=False, N a multiple of 8")
    return why or tma_coordinates_reason(n=p.n, k=p.k)


class Sm90aWgmmaCandidate(WgmmaTileCandidate, _GroupedCandidate):
    name = "grouped_gemm.sm90a_wgmma"
    tile_memo = _configs
    work = "wgmma + TMA over the groups' tiles"
    reason = staticmethod(_tma_reason)

    def tiled(self, req: OpRequest) -> tuple[Any, Any]:
        return grouped_configs.tuned(problem(req), req.device)


class Sm80MmaCandidate(_GroupedCandidate):
    name = "grouped_gemm.sm80_mma"
    priority = 200
    min_arch = "sm_80"

    def _config(self, req: OpRequest):
        return gg.sm80_config(problem(req), req.device)

    def cost(self, req: OpRequest) -> Cost:
        # No measurement behind it: the dense GEMM's tables rank wgmma well ahead of mma.sync on sm_90.
        return Cost(2.0, "rule", f"mma.sync, one unit per block, tile {self.config(req).as_dict()} (the fallback "
                                 "where the wgmma kernel does not serve)")


CANDIDATES = (Sm90aWgmmaCandidate, Sm80MmaCandidate)

# ---- selection, memoized per problem and device -----------------------------------------------------------------
_selections = SelectionMemo("grouped_gemm.selections")


def selection(p: GroupedProblem, device: DeviceInfo) -> Any:
    """The registry's selection for p on device, memoized per settings object."""
    return _selections.get((p, device.ordinal), lambda: request(p, device), select)


# ---- explain ------------------------------------------------------------------------------------------------------
_OPTIONS = ("mode", "trans_b", "out", "aligned")


def build_request(shape, dtype, device, **options) -> OpRequest:
    """For `rtckern explain grouped_gemm`: shape GxMxNxK (groups, rows per group: the average token count, or the
    capacity with mode=masked; N, K); options mode=contiguous|masked, trans_b=0|1 (default 1: b is (G, N, K)),
    out=fp16|bf16|fp32, aligned=0|1."""
    dims = [int(x) for x in shape]
    if len(dims) != 4:
        raise ValueError(f"grouped_gemm: shape {shape!r} should be GxMxNxK (groups, rows per group, N, K), e.g. "
                         "256x64x4096x7168")
    opts.check_keys(OP, options, _OPTIONS)
    groups, rows, n, k = dims
    dt = opts.parse_choice(OP, "dtype", dtype or "bf16", geometry.INPUT_DTYPES)
    trans_b = opts.flag(OP, options, "trans_b", True)
    p = GroupedProblem(mode=opts.parse_choice(OP, "mode", options.get("mode", "contiguous"), shared.MODES),
                       groups=groups, rows=shared.rows_class("masked", rows, 1), n=n, k=k, dtype=dt,
                       out_dtype=opts.parse_choice(OP, "out", options.get("out", dt), geometry.OUTPUT_DTYPES),
                       trans_b=trans_b,
                       aligned=opts.flag(OP, options, "aligned", k % 8 == 0 and (trans_b or n % 8 == 0)))
    return request(p, device)


@run_once
def register_all() -> None:
    """Register the grouped GEMM candidates and request builder (idempotent)."""
    register_missing_candidates(CANDIDATES)
    tuning.defer_tuners(f"{__package__}.grouped_tune", "register_tuner")  # imported by `rtckern tune` only
    register_missing_builder(OP, build_request, help="shape: GxMxNxK (groups, rows per group, N, K); options "
                             "mode=contiguous|masked, trans_b=0|1 (default 1: b is (G, N, K)), out=fp16|bf16|fp32, "
                             "aligned=0|1", example="--dtype bf16 --shape 256x64x4096x7168 --opt mode=contiguous")
