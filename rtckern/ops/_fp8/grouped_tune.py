"""The grouped fp8 GEMM tuner behind `rtckern tune grouped_gemm_fp8 --shapes GxMxNxK,... [--opt mode=masked]`: times
every tile of `sweep_configs` on the live GPU (e4m3 inputs with the block scales of the DeepSeek-V3 recipe, every
group M rows: the contiguous offsets, or full groups of capacity M; CUDA-graph replays), checks each result against a
float32 GEMM of the dequantized inputs of a spread of groups (and every output for NaN) before it may win, and writes
the fastest per shape into the `grouped_gemm_fp8` table (grouped_configs.py reads it).
"""
from __future__ import annotations

import sys
from typing import Any, Mapping

from rtckern import tuning

from .. import _common_grouped as shared
from . import geometry
from . import grouped_geometry as gg
from .geometry import Sm90Fp8Config
from .grouped_candidates import problem
# what shared.GroupedTuner reads from this module besides the functions below
from .grouped_configs import KEY_FIELDS, config_from_dict, key_of, serves  # noqa: F401
from .grouped_geometry import OP, spec  # noqa: F401

rule = gg.config  # the tile where no row serves: the tuner's heuristic

# (bm, bn, consumers) x ring depths tried (the deepest that fit with the store boxes and the tile prefix, where a
# depth does not fit), one or two partials where bn <= 128
TILES = (((64, 64, 1), (8, 12)), ((64, 128, 1), (6, 8)), ((128, 64, 2), (6, 8)), ((128, 128, 2), (4, 6)),
         ((256, 64, 2), (4, 5)), ((128, 256, 2), (3, 4)))
PARTIALS = (1, 2)


def sweep_configs(p: gg.GroupedFp8Problem) -> list[Sm90Fp8Config]:
    """Every tile of TILES that can serve p, in a fixed order, but tiles of twice the rows per group or more (half
    padding or worse): 128-row tiles are timed from 65 rows per group up, 256-row tiles from 129."""
    out: list[Sm90Fp8Config] = []
    for (bm, bn, consumers), depths in TILES:
        if bm > 64 and p.rows <= bm // 2:
            continue
        for partials in PARTIALS:
            for stages in depths:
                cfg = Sm90Fp8Config(bm, bn, stages, consumers, partials=partials)
                while cfg.stages > 2 and gg.smem_bytes(p, cfg) > gg.GROUPED_SMEM_LIMIT:
                    cfg = Sm90Fp8Config(bm, bn, cfg.stages - 1, consumers, partials=partials)
                if gg.invalid(p, cfg) is None and cfg not in out:
                    out.append(cfg)
    return out


def validate(req) -> None:
    """What `rtckern tune` refuses before touching the GPU (ValueError)."""
    p = problem(req)
    shared.check_sm90(req, OP, "has no grouped fp8 kernel")
    if not p.aligned or p.k % geometry.K_MULTIPLE:
        raise ValueError(f"{OP} {p.groups}x{p.rows}x{p.n}x{p.k}: rows are timed on 16-byte aligned operands with K a "
                         f"multiple of {geometry.K_MULTIPLE}")
    if p.dtype != "fp8_e4m3":
        raise ValueError(f"{OP} rows are timed with e4m3 a and serve {p.dtype} a too (the same tiles and instruction "
                         "rate): tune without --dtype")


def problem_of_key(key: Mapping[str, Any]) -> gg.GroupedFp8Problem:
    return gg.GroupedFp8Problem(mode=str(key["mode"]), groups=int(key["groups"]), rows=int(key["rows"]),
                                n=int(key["n"]), k=int(key["k"]), out_dtype=str(key["out"]))


def inputs(p: gg.GroupedFp8Problem, device):
    """(a, b, a_scale, b_scale, index, c, {group: fp32 reference}) for p on the live device: random e4m3 operands and
    block scales, every group p.rows rows, the references of `checked_groups` from the dequantized inputs."""
    import torch

    from rtckern.dtypes import torch_dtype

    from .tune import reference

    dev = torch.device("cuda", device.ordinal)
    g = torch.Generator(device=dev)
    g.manual_seed(1234)
    masked = p.mode == "masked"
    lead = (p.groups, p.rows) if masked else (p.groups * p.rows,)
    kb, nb = geometry.kb_count(p.k), (p.n + geometry.SCALE_BLOCK - 1) // geometry.SCALE_BLOCK
    a = shared.tuner_randn(lead + (p.k,), 4.0, torch.float8_e4m3fn, g, dev)
    b = shared.tuner_randn((p.groups, p.n, p.k), 4.0, torch.float8_e4m3fn, g, dev)
    sa = torch.rand(*lead, kb, device=dev, generator=g) / 64 + 1e-3
    sb = torch.rand(p.groups, nb, kb, device=dev, generator=g) / 64 + 1e-3
    c = torch.empty(*lead, p.n, device=dev, dtype=torch_dtype(p.out_dtype))
    dense = p.dense()
    refs = {i: reference(dense, shared.group_rows(a, p.mode, p.rows, i), b[i], shared.group_rows(sa, p.mode, p.rows, i),
                         sb[i])
            for i in shared.checked_groups(p.groups)}
    return a, b, sa, sb, shared.tuner_index(p.mode, p.groups, p.rows, dev), c, refs


def measure_config(p: gg.GroupedFp8Problem, cfg: Sm90Fp8Config, device, *, check: bool = True, data=None) -> float:
    """Median seconds of one grouped fp8 GEMM with tile `cfg` on the live device (torch needed for buffers and
    graphs; `data`: p's `inputs`, made here when not given). With `check`, NaN in any output or a checked group off its
    reference by more than the dense fp8 tuner's bound raises (shared.time_checked): the config does not win."""
    import torch

    from .grouped_plan import GroupedLaunch, Layout
    from .tune import ERROR_BOUND

    kernel = shared.kernel_for(p, cfg, device, gg.spec, gg.invalid, OP)
    dev = torch.device("cuda", device.ordinal)
    a, b, sa, sb, index, c, refs = data if data is not None else inputs(p, device)
    masked = p.mode == "masked"
    kb = sa.shape[-1]
    lay = Layout(rows=p.rows if masked else p.groups * p.rows, lda=p.k, stride_a=p.rows * p.k if masked else 0,
                 ldb=p.k, stride_b=p.n * p.k, stride_c=p.rows * p.n if masked else 0,
                 sa=(kb, 1, p.rows * kb if masked else 0), sb=(kb, 1, sb.shape[1] * kb))
    launch = GroupedLaunch(kernel, p, cfg, lay, device.sm_count)
    ptrs = (a.data_ptr(), b.data_ptr(), c.data_ptr(), sa.data_ptr(), sb.data_ptr(), index.data_ptr())
    return shared.time_checked(p, cfg, dev, lambda: launch.run(*ptrs, torch.cuda.current_stream(dev).cuda_stream), c,
                               refs, ERROR_BOUND, check)


def register_tuner() -> shared.GroupedTuner:
    """The family's tuner, registered on first use (the registry keeps the one instance)."""
    return tuning.register_or_get_tuner(shared.GroupedTuner(sys.modules[__name__]))  # type: ignore[return-value]
