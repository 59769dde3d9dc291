"""The grouped GEMM tuner behind `rtckern tune grouped_gemm --shapes GxMxNxK,... [--opt mode=masked]`: times every
wgmma tile of `sweep_configs` on the live GPU (every group M rows: the contiguous offsets, or full groups of capacity
M; CUDA-graph replays), checks each result against an fp32 GEMM of a spread of groups (and every output for NaN)
before it may win, and writes the fastest per shape into the `grouped_gemm` table (grouped_configs.py reads it).

Which tile wins depends on the rows per group more than on the dense GEMM's shape rules: at 128 rows an expert's
weights are read once per 128 tokens, so the kernel streams B, and the tile decides how many times each A byte comes
back from L2 (once per n-tile) and how many bytes are in flight per SM.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Mapping

from rtckern import tuning

from .. import _common_grouped as shared
from . import grouped_geometry as gg
from .geometry import Sm90Config
from .grouped_candidates import problem
# what shared.GroupedTuner reads from this module besides the functions below
from .grouped_configs import KEY_FIELDS, config_from_dict, key_of, serves  # noqa: F401
from .grouped_geometry import OP, spec  # noqa: F401

rule = gg.sm90_config  # the tile where no row serves: the tuner's heuristic

# (bm, bn, consumers, pingpong) x ring depths tried where the ring and the tile prefix fit; each stores its outputs
# with TMA where the store boxes fit beside them too (geometry.tma_store), from registers otherwise
TILES = (((64, 64, 1, False), (8, 10)), ((64, 128, 1, False), (6, 8)), ((64, 256, 1, False), (4, 5)),
         ((128, 64, 2, False), (6, 8)), ((128, 128, 2, False), (4, 6)), ((128, 192, 2, False), (4, 5)),
         ((128, 256, 2, False), (3, 4)), ((256, 128, 2, False), (3, 4)), ((128, 128, 2, True), (4, 6)))


def sweep_configs(p: gg.GroupedProblem) -> list[Sm90Config]:
    """Every tile of TILES that can serve p, in a fixed order, but tiles of twice the rows per group or more (half
    padding or worse): 128-row tiles are timed from 65 rows per group up, 256-row tiles from 129."""
    out = []
    for (bm, bn, consumers, pingpong), depths in TILES:
        if bm > 64 and p.rows <= bm // 2:
            continue
        for stages in depths:
            cfg = Sm90Config(bm, bn, stages, consumers, pingpong=pingpong)
            if gg.invalid(p, cfg) is None:
                out.append(cfg)
    return out


def validate(req) -> None:
    """What `rtckern tune` refuses before touching the GPU (ValueError)."""
    p = problem(req)
    shared.check_sm90(req, OP, "runs the mma.sync kernel by its rule")
    if not p.aligned:
        raise ValueError(f"{OP} {p.groups}x{p.rows}x{p.n}x{p.k}: rows are timed on 16-byte aligned operands (K a "
                         "multiple of 8); this shape runs the mma.sync fallback")


def problem_of_key(key: Mapping[str, Any]) -> gg.GroupedProblem:
    return gg.GroupedProblem(mode=str(key["mode"]), groups=int(key["groups"]), rows=int(key["rows"]),
                             n=int(key["n"]), k=int(key["k"]), dtype=str(key["dtype"]), out_dtype=str(key["out"]),
                             trans_b=key["layout"] == "tn")


def inputs(p: gg.GroupedProblem, device):
    """(a, b, index, c, {group: fp32 reference}) for p on the live device: random inputs, every group p.rows
    rows, the references of `checked_groups`."""
    import torch

    from rtckern.dtypes import torch_dtype

    from .tune import reference

    dev = torch.device("cuda", device.ordinal)
    g = torch.Generator(device=dev)
    g.manual_seed(1234)
    dt = torch_dtype(p.dtype)
    masked = p.mode == "masked"
    a = shared.tuner_randn(((p.groups, p.rows) if masked else (p.groups * p.rows,)) + (p.k,), 1.0, dt, g, dev)
    bshape = (p.groups, p.n, p.k) if p.trans_b else (p.groups, p.k, p.n)
    b = shared.tuner_randn(bshape, 1 / math.sqrt(p.k), dt, g, dev)
    c = torch.empty(*((p.groups, p.rows) if masked else (p.groups * p.rows,)), p.n, device=dev,
                    dtype=torch_dtype(p.out_dtype))
    dense = p.dense()
    refs = {i: reference(dense, shared.group_rows(a, p.mode, p.rows, i), b[i], None, None)
            for i in shared.checked_groups(p.groups)}
    return a, b, shared.tuner_index(p.mode, p.groups, p.rows, dev), c, refs


def measure_config(p: gg.GroupedProblem, cfg: Sm90Config, device, *, check: bool = True, data=None) -> float:
    """Median seconds of one grouped GEMM with tile `cfg` on the live device (torch needed for buffers and graphs;
    `data`: p's `inputs`, made here when not given). With `check`, NaN in any output or a checked group off its fp32
    reference by more than the dense tuner's bound raises (shared.time_checked): the config does not win."""
    import torch

    from .grouped_plan import GroupedLaunch, Layout
    from .tune import error_bound

    kernel = shared.kernel_for(p, cfg, device, gg.spec, gg.invalid, OP)
    dev = torch.device("cuda", device.ordinal)
    a, b, index, c, refs = data if data is not None else inputs(p, device)
    masked = p.mode == "masked"
    lay = Layout(rows=p.rows if masked else p.groups * p.rows, lda=p.k, stride_a=p.rows * p.k if masked else 0,
                 ldb=b.stride(1), stride_b=b.stride(0), stride_c=p.rows * p.n if masked else 0)
    launch = GroupedLaunch(kernel, p, cfg, lay, device.sm_count)
    ptrs = (a.data_ptr(), b.data_ptr(), c.data_ptr(), index.data_ptr())
    return shared.time_checked(p, cfg, dev, lambda: launch.run(*ptrs, torch.cuda.current_stream(dev).cuda_stream), c,
                               refs, error_bound(p.dense()), check)


def register_tuner() -> shared.GroupedTuner:
    """The family's tuner, registered on first use (the registry keeps the one instance)."""
    return tuning.register_or_get_tuner(shared.GroupedTuner(sys.modules[__name__]))  # type: ignore[return-value]
