"""Specs, launch configs and launches of the norm kernels, independent of the registry (the candidates and the
benchmark's config sweep both call these).

A launch config comes from the tuned table (`rtckern/tuning_tables/norm_fwd.json`, `norm_bwd.json`, keyed by
kernel kind, norm, x dtype, N and vector width) and falls back to the heuristics of `geometry`.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import numpy as np

from rtckern.caches import PlanCache
from rtckern import tuning
from rtckern.arch import Arch
from rtckern.spec import KernelSpec

from . import geometry as K

TABLE_FWD = "norm_fwd"
TABLE_BWD = "norm_bwd"
TABLE_KIND = "norm_kind"
# OPT bits of the heuristic configs (the tuned tables carry their own): prefetch the next row.
FWD_DEFAULT_OPT = 0
BWD_DEFAULT_OPT = 1


# ---- configs ----------------------------------------------------------------------------------------------------
def _key(kind: str, p) -> dict:
    return {"kind": kind, "norm": "layer" if p.layer else "rms", "dtype": p.x, "n": p.n, "vec": p.vec}


def _cfg_from_json(kind: str, c: dict):
    if kind == "stage":
        return K.StageConfig(int(c["threads"]), int(c["depth"]), int(c.get("opt", 0)))
    if kind == "l2":
        return K.L2Config(int(c["threads"]), int(c.get("minb", 1)), int(c.get("opt", 0)), int(c.get("stash", 0)),
                          int(c.get("parts", 1)))
    if kind == "rows":
        return K.RowsConfig(int(c["tpr"]), int(c["rpb"]), int(c.get("opt", 0)))
    return K.SplitConfig(int(c["threads"]), int(c["parts"]), int(c.get("opt", 0)))


def cfg_to_json(cfg) -> dict:
    d = dataclasses.asdict(cfg)
    if isinstance(cfg, K.L2Config):  # the tables written before these fields existed stay byte-identical
        if not cfg.stash:
            del d["stash"]
        if cfg.parts == 1:
            del d["parts"]
    return d


def geometry_reason(n: int, vec: int, kind: str, cfg, warp: int = 32) -> str | None:
    """None when cfg is a launchable geometry for rows of n (vec-element packs), else why not."""
    if kind == "stage":
        if cfg.threads % warp or not warp <= cfg.threads <= 1024 or not 2 <= cfg.depth <= 8:
            return (f"{cfg.threads} threads x {cfg.depth} rows in flight is not a valid stage geometry (whole warps, "
                    f"at most 1024 threads, 2..8 rows)")
        return None
    if kind == "l2":
        if cfg.threads % warp or not warp <= cfg.threads <= 1024 or cfg.minb < 1 or cfg.minb * cfg.threads > 2048:
            return (f"{cfg.threads} threads x {cfg.minb} blocks per SM is not a valid l2 geometry (whole warps, "
                    f"at most 1024 threads, 2048 per SM)")
        if cfg.parts not in (1, 2, 4, 8):
            return f"an l2 row split over {cfg.parts} blocks: supported 1, 2, 4 or 8 (a portable cluster)"
        if cfg.parts > 1 and K.slice_cols(n, vec, cfg.parts) * (cfg.parts - 1) >= n:
            return f"N={n} is too short to split into {cfg.parts} slices of whole {vec}-element packs"
        return None
    if kind == "rows":
        if cfg.tpr < 1 or cfg.rpb < 1 or cfg.block > 1024 or (cfg.rpb > 1 and cfg.tpr > warp) or \
                (cfg.tpr > warp and cfg.tpr % warp) or (cfg.tpr <= warp and cfg.tpr & (cfg.tpr - 1)):
            return f"{cfg.tpr} threads per row x {cfg.rpb} rows per block is not a valid row-kernel geometry"
        return None
    cap = {"cluster": K.MAX_CLUSTER, "l2c": K.MAX_CLUSTER_L2C}.get(kind, warp)
    if not 2 <= cfg.parts <= cap or cfg.threads % warp or cfg.threads > 1024:
        return f"{cfg.parts} blocks of {cfg.threads} threads per row is not a valid {kind} geometry (2..{cap} blocks)"
    if K.slice_cols(n, vec, cfg.parts) * (cfg.parts - 1) >= n:
        return f"N={n} is too short to split into {cfg.parts} slices of whole {vec}-element packs"
    return None


def _geometry_text(kind: str, cfg) -> str:
    if kind in ("l2", "stage"):
        return f"{cfg.threads} threads per block"
    return f"{cfg.tpr} threads per row" if kind == "rows" else f"{cfg.parts} blocks x {cfg.threads} threads per row"


def fwd_feasible(p: K.FwdProblem, kind: str, cfg, warp: int = 32, smem_optin: int = 227 * 1024) -> str | None:
    """None when cfg can serve p, else why not."""
    why = geometry_reason(p.n, p.vec, kind, cfg, warp)
    if why is not None:
        return why
    if kind == "l2" and cfg.stash:
        nv = K.packs_per_thread(p.n, p.vec, cfg.threads, cfg.parts)
        if not 0 < cfg.stash <= nv:
            return f"a stash of {cfg.stash} packs per thread is not in 0..{nv} (the packs per thread of N={p.n})"
        need, room = K.fwd_l2_smem(p, cfg), smem_optin - K.FWD_L2_STATIC_SMEM
        if need > room:
            return (f"a stash of {cfg.stash} packs per thread needs {need} B of shared memory per block, over the "
                    f"{room} B this device allows: use a smaller stash")
    if kind == "cluster" and cfg.opt & K.PIPE_STATS and not (cfg.opt & K.PERSIST and cfg.opt & K.SMEM_AFFINE):
        return f"OPT {cfg.opt}: OPT 1024 (pipelined statistics) needs OPT 1 and 512 (persistent, two-sum statistics)"
    if kind == "cluster" and cfg.opt & K.SMEM_AFFINE:
        if not cfg.opt & K.PERSIST:
            return f"OPT {cfg.opt}: OPT 512 (weight and bias held per block) needs persistent clusters (OPT 1)"
        need, room = K.fwd_cluster_smem(p, cfg), smem_optin - K.FWD_L2_STATIC_SMEM
        if need > room:
            return (f"the weight and bias slice needs {need} B of shared memory per block, over the {room} B this "
                    f"device allows: use more blocks per row")
        rows = 3 if cfg.opt & K.PIPE_STATS else 2
        held = K.fwd_thread_bytes(p, kind, cfg) * rows * (2 if p.residual else 1)
        if held > K.FWD_PERSIST_HELD_BYTES:
            arrays = "x and the residual" if p.residual else "x"
            return (f"OPT {cfg.opt} keeps {held} B of rows per thread in registers ({arrays} of {rows} rows; limit "
                    f"{K.FWD_PERSIST_HELD_BYTES}): it spills; use more blocks per row or threads")
    b = K.fwd_thread_bytes(p, kind, cfg)
    if b > K.FWD_MAX_THREAD_BYTES:
        return (f"each thread would hold {b} bytes of the row with {_geometry_text(kind, cfg)} "
                f"(limit {K.FWD_MAX_THREAD_BYTES})")
    return None


def bwd_feasible(p: K.BwdProblem, kind: str, cfg, warp: int = 32, smem_optin: int = 227 * 1024) -> str | None:
    why = geometry_reason(p.n, p.vec, kind, cfg, warp)
    if why is not None:
        return why
    e = K.bwd_thread_elems(p, kind, cfg)
    if kind == "stage":
        if e > K.BWD_STAGE_MAX_THREAD_COLS:
            return (f"each thread would keep the sums of {e} columns in registers with {_geometry_text(kind, cfg)} "
                    f"(limit {K.BWD_STAGE_MAX_THREAD_COLS}): use more threads")
        need, room = K.stage_smem(p, cfg), smem_optin - K.BWD_L2_STATIC_SMEM
        if need > room:
            return (f"{cfg.depth} rows of x and dy need {need} B of shared memory per block, over the {room} B this "
                    f"device allows: use fewer rows in flight")
        return None
    if kind == "l2":
        if cfg.parts != 1:
            return f"the l2 backward does not split rows (parts={cfg.parts}): use the l2c kind"
        need, room = K.bwd_l2_smem(p), smem_optin - K.BWD_L2_STATIC_SMEM
        if need > room:
            return (f"the column sums of N={p.n} need {need} B of shared memory per block, over the "
                    f"{room} B this device allows")
        return None
    if kind == "l2c":
        if cfg.opt & K.L2C_RETIRED_OPT:
            return (f"OPT {cfg.opt}: the l2c OPT bits 16 (64-register cap) and 128 (four rows per iteration) were "
                    "removed (slower in every sweep, docs/performance.md)")
        if e > K.BWD_L2C_MAX_THREAD_COLS:
            return (f"each thread would keep the sums of {e} columns in registers with {_geometry_text(kind, cfg)} "
                    f"(limit {K.BWD_L2C_MAX_THREAD_COLS}): use more blocks per row or threads")
        smem = K.slice_cols(p.n, p.vec, cfg.parts) * 4 * ((1 if p.weight_grad else 0) + (1 if p.bias_grad else 0))
        if cfg.opt & K.L2C_SMEM_SUMS and smem > K.BWD_L2C_MAX_STATIC_SMEM:
            return (f"OPT {cfg.opt} keeps the column sums of a {K.slice_cols(p.n, p.vec, cfg.parts)}-column slice in "
                    f"{smem} B of static shared memory (limit {K.BWD_L2C_MAX_STATIC_SMEM}): use more blocks per row")
        return None
    if e > K.BWD_MAX_THREAD_ELEMS:
        return (f"each thread would hold {e} columns of x, dy and the gradient sums with {_geometry_text(kind, cfg)} "
                f"(limit {K.BWD_MAX_THREAD_ELEMS})")
    if kind == "rows" and cfg.rpb > 1 and p.n * 4 > 40 * 1024:
        return f"{cfg.rpb} rows per block need {p.n * 4} B of shared memory to combine the column sums"
    return None


def fwd_heuristic(p: K.FwdProblem, kind: str, warp: int = 32):
    if kind == "l2":
        return K.l2_config(p.n, p.vec, False, warp)
    if kind == "rows":
        c = K.rows_config(p.n, p.vec, warp)
        return K.RowsConfig(c.tpr, c.rpb, FWD_DEFAULT_OPT)
    cap = K.MAX_CLUSTER if kind == "cluster" else warp
    c = K.split_config(p.n, p.vec, K.ITEMSIZE[p.x], cap, warp)
    return K.SplitConfig(c.threads, c.parts, FWD_DEFAULT_OPT if kind == "cluster" else 0) if c else None


def bwd_heuristic(p: K.BwdProblem, kind: str, warp: int = 32):
    if kind == "stage":
        return K.stage_config(p, warp)
    if kind == "l2":
        return K.l2_config(p.n, p.vec, True, warp)
    if kind == "l2c":
        return K.l2c_config(p.n, p.vec, warp)
    if kind == "rows":
        c = K.rows_config(p.n, p.vec, warp, packs_per_thread=max(1, 8 // p.vec) if p.vec < 8 else 1)
        return K.RowsConfig(c.tpr, c.rpb, BWD_DEFAULT_OPT)
    cap = K.MAX_CLUSTER if kind == "cluster" else warp
    isz = max(K.ITEMSIZE[p.x], K.ITEMSIZE[p.dy])
    c = K.split_config(p.n, p.vec, isz, cap, warp, target_bytes=8 * isz,
                       max_bytes=K.BWD_TARGET_THREAD_ELEMS * isz)
    if c is None:
        c = K.split_config(p.n, p.vec, isz, cap, warp, target_bytes=8 * isz, max_bytes=K.BWD_MAX_THREAD_ELEMS * isz)
    return K.SplitConfig(c.threads, c.parts, BWD_DEFAULT_OPT if kind == "cluster" else 0) if c else None


def fwd_config(p: K.FwdProblem, kind: str, device, heuristic=fwd_heuristic) -> Any:
    """The tuned (or heuristic) config of `kind` for p on device; None when no feasible config exists."""
    optin = device.max_smem_per_block_optin

    def feasible(p_, kind_, cfg, warp):
        return fwd_feasible(p_, kind_, cfg, warp, optin)
    return _config(TABLE_FWD, p, kind, device, feasible, heuristic)


def bwd_config(p: K.BwdProblem, kind: str, device) -> Any:
    optin = device.max_smem_per_block_optin

    def feasible(p_, kind_, cfg, warp):
        return bwd_feasible(p_, kind_, cfg, warp, optin)

    def heuristic(p_, kind_, warp):  # the staged kernel's rows in flight depend on the device's shared memory
        return K.stage_config(p_, warp, optin) if kind_ == "stage" else bwd_heuristic(p_, kind_, warp)
    return _config(TABLE_BWD, p, kind, device, feasible, heuristic)


def tuned_fwd_config(p: K.FwdProblem, kind: str, device) -> Any:
    """The tuned table's config of `kind` for p (the nearest timed shape's, where p can run it); None where there is
    none (fwd_config falls back to a rule then)."""
    return fwd_config(p, kind, device, heuristic=lambda *_: None)


def _config(table: str, p, kind: str, device, feasible, heuristic):
    warp = device.warp_size
    key = _key(kind, p)

    def valid(cfg_json, k):
        try:
            return feasible(p, kind, _cfg_from_json(kind, cfg_json), warp) is None
        except (KeyError, TypeError, ValueError):  # a row of another kind's shape: not for us
            return False

    hit = tuning.lookup(table, device, key, valid=valid)
    if hit is not None:
        cfg = _cfg_from_json(kind, hit.config)
        if feasible(p, kind, cfg, warp) is None:
            return cfg
    cfg = heuristic(p, kind, warp)
    if cfg is None or feasible(p, kind, cfg, warp) is not None:
        return None
    return cfg


def preferred_kind(direction: str, p, device) -> str | None:
    """The fastest kernel kind measured for the nearest tuned shape on this arch ("rows" / "cluster" / "l2" /
    "l2c" / "stage" / "coop"), or None when the tables have nothing for this arch."""
    found = preferred_kind_row(direction, p, device)
    return None if found is None else found[0]


def preferred_kind_row(direction: str, p, device) -> tuple[str, Any] | None:
    """(kind, the norm_kind table's hit) as preferred_kind; the hit names the row (its shape, gbps, source)."""
    key = {"dir": direction, "norm": "layer" if p.layer else "rms", "dtype": p.x, "n": p.n}
    hit = tuning.lookup(TABLE_KIND, device, key)
    if hit is None:
        return None
    kind = str(hit.config.get("kind"))
    if kind == "cluster" and direction == "fwd":
        cfg = tuned_fwd_config(p, "cluster", device)
        if cfg is None:
            # No timed cluster config serves this row length (the nearest row's needs more registers per thread
            # than N allows): the l2 kernel, which any length runs, rather than an untimed cluster geometry.
            return "l2", hit
        if cfg.opt & K.SMEM_AFFINE and not p.flags & (K.WEIGHT | K.BIAS):
            # Chosen (and timed) for its weight and bias held per block; without them that kernel is slower than
            # l2 (fp32 LayerNorm 65536: 0.74 vs 0.88x copy, docs/performance.md, Norms).
            return "l2", hit
    return kind, hit


# ---- specs ------------------------------------------------------------------------------------------------------
def fwd_spec(p: K.FwdProblem, kind: str, cfg, arch: Arch, op: str = "") -> KernelSpec:
    src, name = K.SOURCES[("fwd", kind)]
    return KernelSpec(src, name, arch, template_args=K.fwd_template_args(p, kind, cfg), op=op)


def bwd_specs(p: K.BwdProblem, kind: str, cfg, arch: Arch, op: str = "") -> tuple[KernelSpec, ...]:
    src, name = K.SOURCES[("bwd", kind)]
    main = KernelSpec(src, name, arch, template_args=K.bwd_template_args(p, kind, cfg), op=op)
    if not (p.weight_grad or p.bias_grad):
        return (main,)
    rsrc, rname = K.DW_REDUCE
    return main, KernelSpec(rsrc, rname, arch, template_args=K.dw_reduce_template_args(p), op=op)


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
        if cluster > K.MAX_CLUSTER:
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
        if v <= 0 and not (answered and cluster > K.MAX_CLUSTER):
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


def launch_fwd(p: K.FwdProblem, kind: str, cfg, kernel, c: FwdCall) -> tuple:
    """Launches the forward; returns workspace objects the caller keeps alive until the stream passes them."""
    args = [c.x, c.residual, c.h, c.w, c.b, c.y, c.mean, c.rstd, np.float32(c.eps), c.rows, c.sx, c.sr, c.sh, c.sy]
    persist = cfg.opt & 1
    if kind == "l2":  # one block per row, or with parts > 1 a cluster of that many per row
        kernel.launch(c.rows * cfg.parts, cfg.threads, args, shared_mem=K.fwd_l2_smem(p, cfg), stream=c.stream,
                      cluster=(cfg.parts, 1, 1) if cfg.parts > 1 else None)
        return ()
    if kind == "rows":
        grid = K.grid_for_rows(c.rows, cfg)
        if persist:
            grid = min(grid, blocks_per_sm(kernel, cfg.block) * kernel.device.sm_count)
        kernel.launch(grid, cfg.block, args, stream=c.stream)
        return ()
    if kind == "cluster":
        smem = K.fwd_cluster_smem(p, cfg)
        clusters = min(c.rows, active_clusters(kernel, cfg.parts, cfg.threads, c.stream, smem)) if persist else c.rows
        kernel.launch(clusters * cfg.parts, cfg.threads, args, shared_mem=smem, stream=c.stream)
        return ()
    slots = min(c.rows, coop_slots(kernel, cfg))
    ws, ws_ptr = c.empty_f32(K.workspace_floats(slots, cfg.parts))
    cnt, cnt_ptr = c.zeros_u32(slots)
    kernel.launch(slots * cfg.parts, cfg.threads, args + [ws_ptr, cnt_ptr], stream=c.stream, cooperative=True)
    return ws, cnt


def coop_slots(kernel, cfg) -> int:
    return max(1, blocks_per_sm(kernel, cfg.threads) * kernel.device.sm_count // cfg.parts)


def bwd_smem(p: K.BwdProblem, kind: str, cfg) -> int:
    """Dynamic shared memory of the backward's main kernel."""
    if kind == "l2":
        return K.bwd_l2_smem(p)
    return K.stage_smem(p, cfg) if kind == "stage" else 0


def bwd_partial_rows(p: K.BwdProblem, kind: str, cfg, kernel, rows: int, stream: int, grid_scale: float = 1.0) -> int:
    """How many partial rows (persistent blocks, clusters or slots) the backward uses for `rows` rows."""
    if kind in ("rows", "l2", "stage"):
        smem = bwd_smem(p, kind, cfg)
        resident = blocks_per_sm(kernel, cfg.block, smem) * kernel.device.sm_count
        wanted = K.grid_for_rows(rows, cfg) if kind == "rows" else rows
        return max(1, min(wanted, int(resident * grid_scale)))
    if kind in ("cluster", "l2c"):
        return max(1, min(rows, int(active_clusters(kernel, cfg.parts, cfg.threads, stream) * grid_scale)))
    return max(1, min(rows, coop_slots(kernel, cfg)))


def launch_bwd(p: K.BwdProblem, kind: str, cfg, kernels, c: BwdCall, grid_scale: float = 1.0) -> tuple:
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
        if cfg.parts > K.MAX_CLUSTER:
            main.allow_non_portable_cluster_size()  # once per kernel; a flag test after that
        main.launch(parts * cfg.parts, cfg.threads, args, stream=c.stream)
    else:
        ws, ws_ptr = c.empty_f32(K.workspace_floats(parts, cfg.parts))
        cnt, cnt_ptr = c.zeros_u32(parts)
        keep += [ws, cnt]
        main.launch(parts * cfg.parts, cfg.threads, args + [ws_ptr, cnt_ptr], stream=c.stream, cooperative=True)
    if p.weight_grad or p.bias_grad:
        kernels[1].launch(-(-p.n // K.DW_REDUCE_COLS), K.DW_REDUCE_BLOCK, [dwp, dbp, c.dw, c.db, parts, p.n],
                          stream=c.stream)
    return tuple(keep)


def load(specs, ordinal: int) -> tuple:
    """The specs' kernels loaded on device `ordinal` (through the manager's caches)."""
    from rtckern.manager import get_manager

    m = get_manager()
    return tuple(m.get(s, ordinal) for s in specs)
