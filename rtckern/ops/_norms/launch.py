"""Launches of the norm kernels, independent of the registry (the candidates, the plans, the tuner and the
benchmark call these): occupancy queries (memoized per kernel), the per-call addresses (`FwdCall`, `BwdCall`), the
forward and backward launches with their workspaces, and loading a problem's kernels.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import numpy as np

from rtckern.caches import PlanCache

from . import geometry


# ---- occupancy (memoized: a driver query per new kernel and block size only) -------------------------------------
_occ = PlanCache("norms.occupancy")
_occ_lock = threading.Lock()


def blocks_per_sm(kernel, block: int, smem: int = 0) -> int:
    key = (id(kernel), block, smem)
    v = _occ.get(key)
    if v is None:
        if smem:  # opt in first: the runtime's default limit does not count the kernel's static shared memory
            kernel.set_max_dynamic_shared_memory(smem)
        v = max(0, int(kernel.max_active_blocks_per_sm(block, smem)))
        with _occ_lock:
            _occ.put(key, v)
    return v


def active_clusters(kernel, cluster: int, block: int, stream: int, smem: int = 0) -> int:
    """How many clusters of `cluster` blocks (each with `smem` bytes of dynamic shared memory) fit on the device at
    once (the driver's answer, which knows the GPC layout); without that query, blocks per SM x SMs / cluster. A
    non-portable size (more than 8 blocks) keeps the driver's 0: a partitioned GPU (MIG, MPS limits) may hold no
    cluster of 16, and the candidate must decline."""
    key = (id(kernel), block, "cluster", cluster, smem)
    v = _occ.get(key)
    if v is None:
        if cluster > geometry.MAX_CLUSTER:
            kernel.allow_non_portable_cluster_size()
        try:
            from cuda.core import LaunchConfig

            from rtckern.runtime import core_stream

            if smem:
                kernel.set_max_dynamic_shared_memory(smem)  # opt in before the query, as a launch does
            cfg = LaunchConfig(grid=1, cluster=cluster, block=block, shmem_size=smem)
            v = int(kernel.core.occupancy.max_active_clusters(cfg, stream=core_stream(stream)))
            answered = True
        except Exception:  # an older cuda.core or driver without the query: a conservative estimate
            v, answered = 0, False
        if v <= 0 and not (answered and cluster > geometry.MAX_CLUSTER):
            try:
                per_sm = blocks_per_sm(kernel, block, smem)
            except Exception:  # the per-SM query may refuse cluster kernels too: one block per SM is safe
                per_sm = 1
            v = max(1, per_sm * kernel.device.sm_count // cluster)
        with _occ_lock:
            _occ.put(key, v)
    return v


# ---- launches ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class FwdCall:
    """Device addresses (0 where absent), runtime sizes and the stream of one forward call."""

    x: int
    residual: int
    h: int
    w: int
    b: int
    y: int
    mean: int
    rstd: int
    eps: float
    rows: int
    sx: int
    sr: int
    sh: int
    sy: int
    stream: int
    zeros_u32: Callable[[int], tuple[Any, int]]  # counters for the cooperative kernel
    empty_f32: Callable[[int], tuple[Any, int]]  # workspace


@dataclasses.dataclass
class BwdCall:
    """Device addresses (0 where absent), runtime sizes and the stream of one backward call."""
    x: int
    w: int
    dy: int
    dres: int
    mean: int
    rstd: int
    dx: int
    dw: int
    db: int
    rows: int
    sx: int
    sdy: int
    sdres: int
    sdx: int
    stream: int
    zeros_u32: Callable[[int], tuple[Any, int]]
    empty_f32: Callable[[int], tuple[Any, int]]


def launch_fwd(p: geometry.FwdProblem, kind: str, cfg, kernel, c: FwdCall) -> tuple:
    """Launches the forward; returns workspace objects the caller keeps alive until the stream passes them."""
    args = [c.x, c.residual, c.h, c.w, c.b, c.y, c.mean, c.rstd, np.float32(c.eps), c.rows, c.sx, c.sr, c.sh, c.sy]
    persist = cfg.opt & 1
    if kind == "l2":  # one block per row, or with parts > 1 a cluster of that many per row
        kernel.launch(c.rows * cfg.parts, cfg.threads, args, shared_mem=geometry.fwd_l2_smem(p, cfg), stream=c.stream,
                      cluster=(cfg.parts, 1, 1) if cfg.parts > 1 else None)
        return ()
    if kind == "rows":
        grid = geometry.grid_for_rows(c.rows, cfg)
        if persist:
            grid = min(grid, blocks_per_sm(kernel, cfg.block) * kernel.device.sm_count)
        kernel.launch(grid, cfg.block, args, stream=c.stream)
        return ()
    if kind == "cluster":
        smem = geometry.fwd_cluster_smem(p, cfg)
        clusters = min(c.rows, active_clusters(kernel, cfg.parts, cfg.threads, c.stream, smem)) if persist else c.rows
        kernel.launch(clusters * cfg.parts, cfg.threads, args, shared_mem=smem, stream=c.stream)
        return ()
    slots = min(c.rows, coop_slots(kernel, cfg))
    ws, ws_ptr = c.empty_f32(geometry.workspace_floats(slots, cfg.parts))
    cnt, cnt_ptr = c.zeros_u32(slots)
    kernel.launch(slots * cfg.parts, cfg.threads, args + [ws_ptr, cnt_ptr], stream=c.stream, cooperative=True)
    return ws, cnt


def coop_slots(kernel, cfg) -> int:
    return max(1, blocks_per_sm(kernel, cfg.threads) * kernel.device.sm_count // cfg.parts)


def bwd_smem(p: geometry.BwdProblem, kind: str, cfg) -> int:
    """Dynamic shared memory of the backward's main kernel."""
    if kind == "l2":
        return geometry.bwd_l2_smem(p)
    return geometry.stage_smem(p, cfg) if kind == "stage" else 0


def bwd_partial_rows(p: geometry.BwdProblem, kind: str, cfg, kernel, rows: int, stream: int,
                     grid_scale: float = 1.0) -> int:
    """How many partial rows (persistent blocks, clusters or slots) the backward uses for `rows` rows."""
    if kind in ("rows", "l2", "stage"):
        smem = bwd_smem(p, kind, cfg)
        resident = blocks_per_sm(kernel, cfg.block, smem) * kernel.device.sm_count
        wanted = geometry.grid_for_rows(rows, cfg) if kind == "rows" else rows
        return max(1, min(wanted, int(resident * grid_scale)))
    if kind in ("cluster", "l2c"):
        return max(1, min(rows, int(active_clusters(kernel, cfg.parts, cfg.threads, stream) * grid_scale)))
    return max(1, min(rows, coop_slots(kernel, cfg)))


def launch_bwd(p: geometry.BwdProblem, kind: str, cfg, kernels, c: BwdCall, grid_scale: float = 1.0) -> tuple:
    main = kernels[0]
    parts = bwd_partial_rows(p, kind, cfg, main, c.rows, c.stream, grid_scale)
    keep = []
    dwp = dbp = 0
    if p.weight_grad:
        o, dwp = c.empty_f32(parts * p.n)
        keep.append(o)
    if p.bias_grad:
        o, dbp = c.empty_f32(parts * p.n)
        keep.append(o)
    args = [c.x, c.w, c.dy, c.dres, c.mean, c.rstd, c.dx, dwp, dbp, c.rows, c.sx, c.sdy, c.sdres, c.sdx]
    if kind in ("rows", "l2", "stage"):
        main.launch(parts, cfg.block, args, shared_mem=bwd_smem(p, kind, cfg), stream=c.stream)
    elif kind in ("cluster", "l2c"):
        if cfg.parts > geometry.MAX_CLUSTER:
            main.allow_non_portable_cluster_size()  # once per kernel; a flag test after that
        main.launch(parts * cfg.parts, cfg.threads, args, stream=c.stream)
    else:
        ws, ws_ptr = c.empty_f32(geometry.workspace_floats(parts, cfg.parts))
        cnt, cnt_ptr = c.zeros_u32(parts)
        keep += [ws, cnt]
        main.launch(parts * cfg.parts, cfg.threads, args + [ws_ptr, cnt_ptr], stream=c.stream, cooperative=True)
    if p.weight_grad or p.bias_grad:
        kernels[1].launch(-(-p.n // geometry.DW_REDUCE_COLS), geometry.DW_REDUCE_BLOCK,
                          [dwp, dbp, c.dw, c.db, parts, p.n], stream=c.stream)
    return tuple(keep)


def load(specs, ordinal: int) -> tuple:
    """The specs' kernels loaded on device `ordinal` (through the manager's caches)."""
    from rtckern.manager import get_manager

    m = get_manager()
    return tuple(m.get(s, ordinal) for s in specs)
