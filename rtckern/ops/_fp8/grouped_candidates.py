"""Registry candidates of grouped_gemm_fp8 (contiguous and masked groups: one op, the mode a request flag):

  grouped_gemm_fp8.sm90a_wgmma   sm_90a: gemm_fp8_wgmma_sm90 compiled with RTK_GEMM_GROUPED (TMA + wgmma e4m3 with
                                 128-K promotion, block scales, persistent over every group's tiles); 16-byte
                                 aligned operands

No other GPU has a grouped fp8 kernel: such a request is refused with the candidate's reason. A request holds the
output dtype, mode, groups, N, K and the rows per group as a power of two (grouped_geometry.py); the tile comes from
the tuned table `grouped_gemm_fp8` (grouped_configs.py; `explain` names the row), else the rule by rows per group.
"""
from __future__ import annotations

from typing import Any

from rtckern import tuning
from rtckern.caches import PlanCache
from rtckern.device import DeviceInfo
from rtckern.registry import OpRequest, select
from rtckern.registry import options as opts

from .. import _common_grouped as shared
from .._common import (ProblemCandidate, SelectionMemo, dtype_reason, WgmmaTileCandidate, register_missing_builder,
                       register_missing_candidates, run_once)
from . import geometry, grouped_configs
from . import grouped_geometry as gg
from .geometry import Sm90Fp8Config
from .grouped_geometry import OP, GroupedFp8Problem


def request(p: GroupedFp8Problem, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"a": p.dtype, "out": p.out_dtype},
                     shape={"groups": p.groups, "rows": p.rows, "n": p.n, "k": p.k},
                     flags={"mode": p.mode, "aligned": p.aligned}, device=device)


def problem(req: OpRequest) -> GroupedFp8Problem:
    return GroupedFp8Problem(mode=str(req.flag("mode")), groups=req.dim("groups"), rows=req.dim("rows"),
                             n=req.dim("n"), k=req.dim("k"), out_dtype=req.dtype("out"),
                             aligned=bool(req.flag("aligned")), dtype=req.dtype("a"))


def _reason(p: GroupedFp8Problem) -> str | None:
    why = (dtype_reason("input dtype", p.dtype, geometry.GROUPED_INPUT_DTYPES)
           or dtype_reason("output dtype", p.out_dtype, geometry.OUTPUT_DTYPES) or geometry.k_reason(p.k, OP))
    if why is None and not p.aligned:
        return "TMA needs 16-byte aligned bases of a and b and row / group strides that are multiples of 16 bytes"
    return why


_configs = PlanCache("grouped_gemm_fp8.candidate_configs")


class Sm90aWgmmaCandidate(WgmmaTileCandidate, ProblemCandidate):
    name = "grouped_gemm_fp8.sm90a_wgmma"
    op = OP
    tile_memo = _configs
    work = "wgmma e4m3 over the groups' tiles"
    problem, reason, invalid = staticmethod(problem), staticmethod(_reason), staticmethod(gg.invalid)
    spec, smem = staticmethod(gg.spec), staticmethod(gg.smem_bytes)

    def tiled(self, req: OpRequest) -> tuple[Sm90Fp8Config, Any]:
        return grouped_configs.tuned(problem(req), req.device)


CANDIDATES = (Sm90aWgmmaCandidate,)

# ---- selection, memoized per problem and device -----------------------------------------------------------------
_selections = SelectionMemo("grouped_gemm_fp8.selections")


def selection(p: GroupedFp8Problem, device: DeviceInfo) -> Any:
    """The registry's selection for p on device, memoized per settings object."""
    return _selections.get((p, device.ordinal), lambda: request(p, device), select)


# ---- explain -------------------------------------------------------------------------------------------------------
_OPTIONS = ("mode", "out", "aligned")


def build_request(shape, dtype, device, **options) -> OpRequest:
    """For `rtckern explain grouped_gemm_fp8`: shape GxMxNxK (groups, rows per group: the average token count, or
    the capacity with mode=masked; N, K); options mode=contiguous|masked, out=bf16|fp16|fp32, aligned=0|1."""
    dims = [int(x) for x in shape]
    if len(dims) != 4:
        raise ValueError(f"grouped_gemm_fp8: shape {shape!r} should be GxMxNxK (groups, rows per group, N, K), e.g. "
                         "256x64x4096x7168")
    opts.check_keys(OP, options, _OPTIONS)
    groups, rows, n, k = dims
    p = GroupedFp8Problem(mode=opts.parse_choice(OP, "mode", options.get("mode", "contiguous"), shared.MODES),
                          groups=groups, rows=shared.rows_class("masked", rows, 1), n=n, k=k,
                          out_dtype=opts.parse_choice(OP, "out", options.get("out", "bf16"), geometry.OUTPUT_DTYPES),
                          aligned=opts.flag(OP, options, "aligned", k % geometry.K_MULTIPLE == 0),
                          dtype=opts.parse_choice(OP, "dtype", dtype or "fp8_e4m3", geometry.GROUPED_INPUT_DTYPES))
    return request(p, device)


@run_once
def register_all() -> None:
    """Register the grouped fp8 GEMM candidates and request builder (idempotent)."""
    register_missing_candidates(CANDIDATES)
    tuning.defer_tuners(f"{__package__}.grouped_tune", "register_tuner")  # imported by `rtckern tune` only
    register_missing_builder(OP, build_request, help="shape: GxMxNxK (groups, rows per group, N, K; a, b e4m3 with "
                             "block scales); options mode=contiguous|masked, out=bf16|fp16|fp32, aligned=0|1",
                             example="--shape 256x64x4096x7168 --opt mode=masked")
