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
from typing import Any, Mapping

from rtckern import tuning
from rtckern.errors import RtckernError

from .. import _common_grouped as shared
from . import grouped_configs
from . import grouped_geometry as gg
from .geometry import Sm90Config
from .grouped_candidates import problem

# (bm, bn, consumers, pingpong) x ring depths tried where the ring and the tile prefix fit
TILES = (((64, 64, 1, False), (8, 10)), ((64, 128, 1, False), (6, 8)), ((64, 256, 1, False), (4, 5)),
         ((128, 64, 2, False), (6, 8)), ((128, 128, 2, False), (4, 6)), ((128, 192, 2, False), (4, 5)),
         ((128, 256, 2, False), (3, 4)), ((256, 128, 2, False), (3, 4)), ((128, 128, 2, True), (4, 6)))


def sweep_configs(p: gg.GroupedProblem) -> list[Sm90Config]:
    """Every tile of TILES that can serve p, in a fixed order: tiles taller than the rows per group are left out
    (their extra rows are padding: 128-row tiles from 65 rows, 256-row tiles from 129)."""
    out = []
    for (bm, bn, consumers, pingpong), depths in TILES:
        if bm > 64 and p.rows <= bm // 2:
            continue
        for stages in depths:
            cfg = Sm90Config(bm, bn, stages, consumers, pingpong=pingpong)
            if gg.invalid(p, cfg) is None:
                out.append(cfg)
    return out


class GroupedGemmTuner(tuning.Tuner):
    op = gg.OP
    key_fields = grouped_configs.KEY_FIELDS

    def key(self, req) -> dict[str, Any]:
        return grouped_configs.key_of(problem(req))

    def configs(self, req) -> list[dict[str, Any]]:
        return [c.as_dict() for c in sweep_configs(problem(req))]

    def heuristic(self, key: Mapping[str, Any], device) -> Mapping[str, Any]:
        return gg.sm90_config(_problem_of(key)).as_dict()

    def valid(self, config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        return grouped_configs.serves(config, _problem_of(key))

    def validate(self, req) -> None:
        p = problem(req)
        if req.device.arch.gfx or req.device.arch.cc != (9, 0):
            raise ValueError(f"grouped_gemm has wgmma tiles to tune on sm_90 (H100 / H200) only; "
                             f"{req.device.describe()} runs the mma.sync kernel by its rule")
        if not p.aligned:
            raise ValueError(f"grouped_gemm {p.groups}x{p.rows}x{p.n}x{p.k}: rows are timed on 16-byte aligned "
                             "operands (K a multiple of 8); this shape runs the mma.sync fallback")

    def prepare(self, req, configs) -> None:
        from rtckern.registry.core_api import target_for

        p, arch = problem(req), target_for(req.device, True)
        tuning.compile_ahead([gg.spec(p, grouped_configs.config_from_dict(c), arch) for c in configs])
        self._data = None  # a new shape: the last one's buffers go before this one's are made

    def measure(self, req, config: Mapping[str, Any]) -> float:
        p = problem(req)
        if self._data is None or self._data[0] != p:
            self._data = None
            self._data = (p, inputs(p, req.device))
        return measure_config(p, grouped_configs.config_from_dict(config), req.device, data=self._data[1])

    _data: tuple | None = None  # (problem, inputs) of the shape being timed: every config reads the same ones


def _problem_of(key: Mapping[str, Any]) -> gg.GroupedProblem:
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
    refs = {i: reference(dense, _rows_of(a, p, i), b[i], None, None) for i in shared.checked_groups(p.groups)}
    return a, b, shared.tuner_index(p.mode, p.groups, p.rows, dev), c, refs


def _rows_of(x, p: gg.GroupedProblem, i: int):
    return x[i] if p.mode == "masked" else x[i * p.rows:(i + 1) * p.rows]


def measure_config(p: gg.GroupedProblem, cfg: Sm90Config, device, *, check: bool = True, data=None) -> float:
    """Median seconds of one grouped GEMM with tile `cfg` on the live device (torch needed for buffers and graphs;
    `data`: p's `inputs`, made here when not given). With `check`, NaN in any output (filled with NaN before the
    first call) or a checked group off its fp32 reference by more than the dense tuner's bound raises: the config
    does not win."""
    import torch

    from rtckern.manager import get_manager
    from rtckern.registry.core_api import target_for

    from .grouped_plan import GroupedLaunch, Layout
    from .tune import error_bound

    if device.ordinal is None:
        raise RtckernError("measuring a grouped_gemm config needs a live GPU")
    bad = gg.invalid(p, cfg)
    if bad:
        raise RtckernError(f"config {cfg.as_dict()} cannot run {p.groups}x{p.rows}x{p.n}x{p.k}: {bad}")
    kernel = get_manager().get(gg.spec(p, cfg, target_for(device, True)), device.ordinal)
    dev = torch.device("cuda", device.ordinal)
    a, b, index, c, refs = data if data is not None else inputs(p, device)
    c.fill_(float("nan"))
    masked = p.mode == "masked"
    lay = Layout(rows=p.rows if masked else p.groups * p.rows, lda=p.k, stride_a=p.rows * p.k if masked else 0,
                 ldb=b.stride(1), stride_b=b.stride(0), stride_c=p.rows * p.n if masked else 0)
    launch = GroupedLaunch(kernel, p, cfg, lay, device.sm_count)

    ptrs = (a.data_ptr(), b.data_ptr(), c.data_ptr(), index.data_ptr())

    def run():
        launch.run(*ptrs, torch.cuda.current_stream(dev).cuda_stream)

    def verify():
        if torch.isnan(c).any():
            raise RtckernError(f"config {cfg.as_dict()} left NaN in the output (tiles not written)")
        bound = error_bound(p.dense())
        for i, ref in refs.items():
            out = _rows_of(c, p, i).float()
            err = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))
            if not err <= bound:
                raise RtckernError(f"config {cfg.as_dict()} gave relative error {err:.3g} > {bound:.3g} in group {i}")
    reps, replays = shared.tuner_reps(2.0 * p.groups * p.rows * p.n * p.k)
    return tuning.time_graphed(dev, run, verify if check else None, reps=reps, replays=replays)


def register_tuner() -> GroupedGemmTuner:
    """The family's tuner, registered on first use (the registry keeps the one instance)."""
    return tuning.register_or_get_tuner(GroupedGemmTuner())  # type: ignore[return-value]
