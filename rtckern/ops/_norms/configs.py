"""Launch configs of the norm kernels: the tuned tables (`rtckern/tuning_tables/norm_fwd.json`, `norm_bwd.json`,
keyed by kernel kind, norm, x dtype, N and vector width; `norm_kind.json`, the fastest kind per shape), their JSON
form, and the rules used where no row serves (`fwd_heuristic`, `bwd_heuristic`). Whether a config can serve a
problem at all is `geometry.fwd_feasible` / `bwd_feasible`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rtckern import tuning

from . import geometry

TABLE_FWD = "norm_fwd"
TABLE_BWD = "norm_bwd"
TABLE_KIND = "norm_kind"
# OPT bits of the heuristic configs (the tuned tables carry their own): prefetch the next row.
FWD_DEFAULT_OPT = 0
BWD_DEFAULT_OPT = 1


def _key(kind: str, p) -> dict:
    return {"kind": kind, "norm": "layer" if p.layer else "rms", "dtype": p.x, "n": p.n, "vec": p.vec}


def cfg_from_json(kind: str, c: dict):
    if kind == "stage":
        return geometry.StageConfig(int(c["threads"]), int(c["depth"]), int(c.get("opt", 0)))
    if kind == "l2":
        return geometry.L2Config(int(c["threads"]), int(c.get("minb", 1)), int(c.get("opt", 0)), int(c.get("stash", 0)),
                                 int(c.get("parts", 1)))
    if kind == "rows":
        return geometry.RowsConfig(int(c["tpr"]), int(c["rpb"]), int(c.get("opt", 0)))
    return geometry.SplitConfig(int(c["threads"]), int(c["parts"]), int(c.get("opt", 0)))


def cfg_to_json(cfg) -> dict:
    d = dataclasses.asdict(cfg)
    if isinstance(cfg, geometry.L2Config):  # the tables written before these fields existed stay byte-identical
        if not cfg.stash:
            del d["stash"]
        if cfg.parts == 1:
            del d["parts"]
    return d


def fwd_heuristic(p: geometry.FwdProblem, kind: str, warp: int = 32):
    if kind == "l2":
        return geometry.l2_config(p.n, p.vec, False, warp)
    if kind == "rows":
        c = geometry.rows_config(p.n, p.vec, warp)
        return geometry.RowsConfig(c.tpr, c.rpb, FWD_DEFAULT_OPT)
    cap = geometry.MAX_CLUSTER if kind == "cluster" else warp
    c = geometry.split_config(p.n, p.vec, geometry.ITEMSIZE[p.x], cap, warp)
    return geometry.SplitConfig(c.threads, c.parts, FWD_DEFAULT_OPT if kind == "cluster" else 0) if c else None


def bwd_heuristic(p: geometry.BwdProblem, kind: str, warp: int = 32):
    if kind == "stage":
        return geometry.stage_config(p, warp)
    if kind == "l2":
        return geometry.l2_config(p.n, p.vec, True, warp)
    if kind == "l2c":
        return geometry.l2c_config(p.n, p.vec, warp)
    if kind == "rows":
        c = geometry.rows_config(p.n, p.vec, warp, packs_per_thread=max(1, 8 // p.vec) if p.vec < 8 else 1)
        return geometry.RowsConfig(c.tpr, c.rpb, BWD_DEFAULT_OPT)
    cap = geometry.MAX_CLUSTER if kind == "cluster" else warp
    isz = max(geometry.ITEMSIZE[p.x], geometry.ITEMSIZE[p.dy])
    c = geometry.split_config(p.n, p.vec, isz, cap, warp, target_bytes=8 * isz,
                              max_bytes=geometry.BWD_TARGET_THREAD_ELEMS * isz)
    if c is None:
        c = geometry.split_config(p.n, p.vec, isz, cap, warp, target_bytes=8 * isz,
                                  max_bytes=geometry.BWD_MAX_THREAD_ELEMS * isz)
    return geometry.SplitConfig(c.threads, c.parts, BWD_DEFAULT_OPT if kind == "cluster" else 0) if c else None


def fwd_config(p: geometry.FwdProblem, kind: str, device, heuristic=fwd_heuristic) -> Any:
    """The tuned (or heuristic) config of `kind` for p on device; None when no feasible config exists."""
    optin = device.max_smem_per_block_optin

    def feasible(p_, kind_, cfg, warp):
        return geometry.fwd_feasible(p_, kind_, cfg, warp, optin)
    return _config(TABLE_FWD, p, kind, device, feasible, heuristic)


def bwd_config(p: geometry.BwdProblem, kind: str, device) -> Any:
    optin = device.max_smem_per_block_optin

    def feasible(p_, kind_, cfg, warp):
        return geometry.bwd_feasible(p_, kind_, cfg, warp, optin)

    def heuristic(p_, kind_, warp):  # the staged kernel's rows in flight depend on the device's shared memory
        return geometry.stage_config(p_, warp, optin) if kind_ == "stage" else bwd_heuristic(p_, kind_, warp)
    return _config(TABLE_BWD, p, kind, device, feasible, heuristic)


def tuned_fwd_config(p: geometry.FwdProblem, kind: str, device) -> Any:
    """The tuned table's config of `kind` for p (the nearest timed shape's, where p can run it); None where there is
    none (fwd_config falls back to a rule then)."""
    return fwd_config(p, kind, device, heuristic=lambda *_: None)


def _config(table: str, p, kind: str, device, feasible, heuristic):
    warp = device.warp_size
    key = _key(kind, p)

    def valid(cfg_json, k):
        try:
            return feasible(p, kind, cfg_from_json(kind, cfg_json), warp) is None
        except (KeyError, TypeError, ValueError):  # a row of another kind's shape: not for us
            return False

    hit = tuning.lookup(table, device, key, valid=valid)
    if hit is not None:
        cfg = cfg_from_json(kind, hit.config)
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
        if cfg.opt & geometry.SMEM_AFFINE and not p.flags & (geometry.WEIGHT | geometry.BIAS):
            # Chosen (and timed) for its weight and bias held per block; without them that kernel is slower than
            # l2 (fp32 LayerNorm 65536: 0.74 vs 0.88x copy, docs/performance.md, Norms).
            return "l2", hit
    return kind, hit
