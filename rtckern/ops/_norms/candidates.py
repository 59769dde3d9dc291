"""Registry candidates of the norm ops: for each of rms_norm, layer_norm, rms_norm_backward and
layer_norm_backward, a row kernel (registers, one group per row), a cluster kernel (sm_90+, distributed shared
memory), an L2 re-read kernel (no row data in registers) and a cooperative kernel (any arch, several co-resident
blocks per row); the backward ops also have the cluster-split L2 re-read kernel (l2c, sm_90+) and the cp.async
staged kernel (stage, sm_80+).

Each candidate says whether it can serve a request (a geometry within its register / shared-memory budget, the
arch it needs) and at what expected cost (`kind_costs`, one answer per request shared by every kind): the kind the
norm_kind table measured fastest near the request's shape costs 1.0 (without a table for the arch: the kinds the
row-size rules name); the row kernel, where another kind is expected fastest, 1.25; the cooperative kernel 2.0
(it serves rows too long for anything else); the kinds the table or the rules did not name 4.0. The registry ranks
by cost, then priority: l2 (130) > stage (128, backward) > l2c (125) > cluster (120) > rows (100) > coop (80).
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

from rtckern.caches import PlanCache
from rtckern.errors import OptionError
from rtckern.registry import Candidate, Cost, LimitProbe, OpRequest, Resources
from rtckern.registry import options as opts

from .._common import dtype_reason
from . import configs, geometry
from .launch import active_clusters, blocks_per_sm, bwd_partial_rows, bwd_smem, launch_bwd, launch_fwd

FWD_OPS = ("rms_norm", "layer_norm")
BWD_OPS = ("rms_norm_backward", "layer_norm_backward")

# Row bytes (N x x's itemsize) from which the cluster kernel beats the row kernel on sm_90 (measured on H200,
# docs/performance.md, Norms); the row kernel keeps everything shorter.
SPLIT_FROM_BYTES = MappingProxyType({"fwd": 64 * 1024, "bwd": 32 * 1024})
# Row bytes from which the l2 kernel takes over where no table covers the arch (measured on H200 by the sweep;
# docs/performance.md, Norms).
L2_FROM_BYTES = MappingProxyType({"fwd": 32 * 1024, "bwd": 24 * 1024})
# Row bytes from which the l2c backward takes over on sm_90+ where no table covers the arch (H200 sweep,
# docs/performance.md, Norms).
L2C_FROM_BYTES = 32 * 1024


def fwd_problem(req: OpRequest) -> geometry.FwdProblem:
    w = req.dtype("w")
    return geometry.FwdProblem(layer=req.op == "layer_norm", n=req.dim("n"), x=req.dtype("x"), y=req.dtype("y"),
                               w=None if w == "none" else w, has_weight=bool(req.flag("weight")),
                               bias=bool(req.flag("bias")),
                               zero_centered=bool(req.flag("zero_centered")), residual=bool(req.flag("residual")),
                               save_stats=bool(req.flag("save_stats")), vec=req.dim("vec"))


def bwd_problem(req: OpRequest) -> geometry.BwdProblem:
    w = req.dtype("w")
    return geometry.BwdProblem(layer=req.op == "layer_norm_backward", n=req.dim("n"), x=req.dtype("x"),
                               dy=req.dtype("dy"), dx=req.dtype("dx"), w=None if w == "none" else w,
                               has_weight=bool(req.flag("weight")),
                               weight_grad=bool(req.flag("weight_grad")), bias_grad=bool(req.flag("bias_grad")),
                               zero_centered=bool(req.flag("zero_centered")), dresidual=bool(req.flag("dresidual")),
                               vec=req.dim("vec"))


def _is_sm90_plus(req: OpRequest) -> bool:
    a = req.device.arch
    return not a.gfx and a.cc >= (9, 0)


# Expected cost of a kind relative to the one expected fastest for the request (1.0): the general row kernel where
# another kind is expected fastest (it takes over when that kind fails its probe), the cooperative kernel (several
# blocks per row: the last resort), and the kinds the table measured slower or the rules do not name.
ROWS_BEHIND = 1.25
COOP_COST = 2.0
NOT_NAMED = 4.0

_costs = PlanCache("norms.kind_costs")
_configs = PlanCache("norms.candidate_configs")


def kind_costs(direction: str, p, device) -> dict[str, Cost]:
    """Every norm kind's expected cost for problem p on device, memoized (one table lookup per request)."""
    key = (direction, p, device)
    hit = _costs.get(key)
    if hit is None:
        hit = _costs.put(key, _kind_costs(direction, p, device))
    return hit


def _kind_costs(direction: str, p, device) -> dict[str, Cost]:
    kinds = ("rows", "cluster", "l2", "coop") + (("stage", "l2c") if direction == "bwd" else ())
    found = configs.preferred_kind_row(direction, p, device)
    row_bytes = p.n * geometry.ITEMSIZE[p.x]
    if found is not None:
        kind, hit = found
        named = {kind}
        row = hit.row
        at = dict(row.shape).get("n") if row is not None else None
        gbps = f", {row.meta['gbps']} GB/s" if row is not None and "gbps" in row.meta else ""
        named_src, why = "table", (f"norm_kind {hit.source} row {row.arch}/{row.sm_count} n={at}: {kind} "
                                   f"measured fastest{gbps}" if row is not None else f"norm_kind: {kind} fastest")
        if row is not None and str(row.config.get("kind")) != kind:
            why += f" (the row names {row.config.get('kind')}, which has no tuned config for N={p.n})"
        other = f"norm_kind: {kind} measured faster near N={p.n}"
    else:
        limits = {"l2": L2_FROM_BYTES[direction], "cluster": SPLIT_FROM_BYTES[direction]}
        if direction == "bwd":
            limits["l2c"] = L2C_FROM_BYTES
        named = {k for k, lim in limits.items() if row_bytes >= lim}
        named_src = "rule"
        why = (f"rows of {row_bytes} B >= the {'/'.join(sorted(named))} thresholds "
               f"(no norm_kind table for {device.arch.sm})" if named else
               f"rows of {row_bytes} B < every other kind's threshold (no norm_kind table for {device.arch.sm})")
        if not named:
            named = {"rows"}
        other = f"rows of {row_bytes} B: not named by the rules (no norm_kind table for {device.arch.sm})"
    out = {}
    for k in kinds:
        if k in named:
            out[k] = Cost(1.0, named_src, why)
        elif k == "rows":
            out[k] = Cost(ROWS_BEHIND, "rule", f"the row kernel, behind {'/'.join(sorted(named))}")
        elif k == "coop":
            out[k] = Cost(COOP_COST, "rule", "the cooperative kernel: the last resort")
        else:
            out[k] = Cost(NOT_NAMED, named_src, other)
    return out


class _NormCandidate(Candidate):
    kind = ""
    direction = ""
    vendors = ("nvidia",)

    def problem(self, req: OpRequest):
        return fwd_problem(req) if self.direction == "fwd" else bwd_problem(req)

    def config(self, req: OpRequest):
        return self._memo_of(req)[1]

    def cost(self, req: OpRequest) -> Cost:
        return kind_costs(self.direction, self._memo_of(req)[0], req.device)[self.kind]

    def supports(self, req: OpRequest) -> str | None:
        cfg = self.config(req)
        if cfg is None:
            return f"no {self.kind} geometry keeps N={req.dim('n')} ({req.dtype('x')}) within the register budget"
        return None

    def kernel_specs(self, req: OpRequest):
        p, cfg, arch = self.problem(req), self.config(req), self.target(req)
        if self.direction == "fwd":
            return (geometry.fwd_spec(p, self.kind, cfg, arch, op=req.op),)
        return geometry.bwd_specs(p, self.kind, cfg, arch, op=req.op)

    def launch_resources(self, req: OpRequest):
        p, cfg = self.problem(req), self.config(req)
        block = cfg.block if self.kind == "rows" else cfg.threads
        smem = 0
        if self.kind == "l2":  # the forward's stash, the backward's column sums
            smem = geometry.fwd_l2_smem(p, cfg) if self.direction == "fwd" else geometry.bwd_l2_smem(p)
        main = Resources(block=block, dynamic_smem=smem, cooperative_grid=cfg.parts if self.kind == "coop" else None)
        if self.direction == "fwd":
            return (main,)
        return (main,) + ((Resources(block=geometry.DW_REDUCE_BLOCK),) if (p.weight_grad or p.bias_grad) else ())

    def launch(self, req: OpRequest, kernels: tuple[Any, ...], call: Any, cfg: Any = None) -> tuple:
        p, memo_cfg = self._memo_of(req)
        cfg = cfg if cfg is not None else memo_cfg
        if self.direction == "fwd":
            return launch_fwd(p, self.kind, cfg, kernels[0], call)
        return launch_bwd(p, self.kind, cfg, kernels, call)

    def row_launch_geometry(self, req: OpRequest, kernels: tuple[Any, ...],
                            rows: int) -> tuple[int, int, int] | None:
        """(grid, block, dynamic shared memory) of the forward row kernel for `rows` rows (what launch_fwd
        computes per call), for the ops' memoized plans; None for the other kinds and the backward (they
        allocate per call: use launch)."""
        if self.kind not in ("rows", "l2") or self.direction != "fwd":
            return None
        p, cfg = self._memo_of(req)
        if self.kind == "l2":
            if cfg.parts > 1:
                return None  # a cluster launch: the candidate's own launch
            return rows, cfg.threads, geometry.fwd_l2_smem(p, cfg)
        grid = geometry.grid_for_rows(rows, cfg)
        if cfg.opt & 1:
            grid = min(grid, blocks_per_sm(kernels[0], cfg.block) * kernels[0].device.sm_count)
        return grid, cfg.block, 0

    def bwd_launch_geometry(self, req: OpRequest, kernels: tuple[Any, ...],
                            rows: int) -> tuple[int, int, int] | None:
        """(partial rows, block, dynamic shared memory) of the backward row kernels (rows, l2, stage: what
        launch_bwd computes per call) for `rows` rows, for the ops' memoized plans; None for the other kinds
        (cluster, cooperative: their launch)."""
        if self.kind not in ("rows", "l2", "stage") or self.direction != "bwd":
            return None
        p, cfg = self._memo_of(req)
        return bwd_partial_rows(p, self.kind, cfg, kernels[0], rows, 0), cfg.block, bwd_smem(p, self.kind, cfg)

    def _memo_of(self, req: OpRequest):
        """(problem, config) of req, computed once per request (supports, cost, specs, resources and every
        launch read them)."""
        key = (self.name, req)
        hit = _configs.get(key)
        if hit is None:
            p = self.problem(req)
            cfg = (configs.fwd_config if self.direction == "fwd" else configs.bwd_config)(p, self.kind, req.device)
            hit = _configs.put(key, (p, cfg))
        return hit


class _Rows(_NormCandidate):
    vendors = ("nvidia", "amd")  # portable source (common/); compiled for gfx90a by hiprtc in CI
    kind = "rows"
    priority = 100
    min_arch = "sm_75"

    # Where another kind is expected fastest, the row kernel ranks next (ROWS_BEHIND): if that kind fails its
    # probe, the row kernel serves, not the cooperative one.


class _Cluster(_NormCandidate):
    kind = "cluster"
    priority = 120
    min_arch = "sm_90"

    def launch_resources(self, req: OpRequest):
        return None  # the generic per-SM occupancy check does not know clusters: check_resources asks the driver

    def check_resources(self, req: OpRequest, kernels: tuple[Any, ...]) -> str | None:
        cfg = self.config(req)
        k = kernels[0]
        if k.num_regs * cfg.threads > req.device.regs_per_sm:
            return f"{k.num_regs} registers x {cfg.threads} threads > {req.device.regs_per_sm} per SM"
        smem = geometry.fwd_cluster_smem(self.problem(req), cfg) if self.direction == "fwd" else 0
        if active_clusters(k, cfg.parts, cfg.threads, 0, smem) < 1:
            return (f"no cluster of {cfg.parts} blocks x {cfg.threads} threads with {smem} B of shared memory "
                    f"each fits on {req.device.describe()}")
        return None


class _L2(_NormCandidate):
    kind = "l2"
    priority = 130
    min_arch = "sm_75"

    def supports(self, req: OpRequest) -> str | None:
        if self.direction == "bwd" and self.config(req) is None:
            p = self.problem(req)
            return geometry.bwd_feasible(p, "l2", geometry.l2_config(p.n, p.vec, True),
                                         smem_optin=req.device.max_smem_per_block_optin)
        cfg = self.config(req)
        if cfg is not None and cfg.parts > 1 and not _is_sm90_plus(req):
            return (f"the tuned l2 config splits rows over clusters of {cfg.parts} blocks, which need sm_90+; "
                    f"{req.device.arch.sm} has none")
        return super().supports(req)

    def check_resources(self, req: OpRequest, kernels: tuple[Any, ...]) -> str | None:
        """A forward split over clusters: the driver must hold one cluster of them (the generic check is per
        block; a partitioned GPU may hold no cluster with this shared memory)."""
        if self.direction != "fwd":
            return None
        p, cfg = self.problem(req), self.config(req)
        smem = geometry.fwd_l2_smem(p, cfg)
        if cfg.parts > 1 and active_clusters(kernels[0], cfg.parts, cfg.threads, 0, smem) < 1:
            return (f"no cluster of {cfg.parts} blocks x {cfg.threads} threads with {smem} B of shared memory each "
                    f"fits on {req.device.describe()}")
        return None


class _L2C(_Cluster):
    kind = "l2c"
    priority = 125


class _Stage(_NormCandidate):
    """Backward only: rows staged through shared memory with cp.async. Ranked first only where the norm_kind table
    measured it fastest (no row-size rule: without a table for the arch the other kinds keep their shapes)."""

    kind = "stage"
    priority = 128
    min_arch = "sm_80"

    def supports(self, req: OpRequest) -> str | None:
        if self.config(req) is None:
            p = self.problem(req)
            return (f"no stage geometry for N={p.n}: it needs 256-1024 threads with at most "
                    f"{geometry.BWD_STAGE_MAX_THREAD_COLS} columns each (and at least half of them with a pack of the "
                    f"row), and two rows of x and dy in shared memory")
        return None

    def launch_resources(self, req: OpRequest):
        p, cfg = self.problem(req), self.config(req)
        main = Resources(block=cfg.threads, dynamic_smem=geometry.stage_smem(p, cfg))
        return (main,) + ((Resources(block=geometry.DW_REDUCE_BLOCK),) if (p.weight_grad or p.bias_grad) else ())


class _Coop(_NormCandidate):
    vendors = ("nvidia", "amd")
    kind = "coop"
    priority = 80
    min_arch = "sm_75"


def _make(op: str, base: type, direction: str) -> Candidate:
    cls = type(f"{op.title().replace('_', '')}{base.__name__.strip('_')}", (base,),
               {"name": f"{op}.{base.kind}", "op": op, "direction": direction})
    return cls()


QUANT_OP = "rms_norm_quant"
FP8 = "fp8_e4m3"


def quant_rows_config(p, group: int):
    """rms_norm_quant's own rule for rows that take a whole block: (problem, config) with the kernel's pack width in
    the problem, or None for shorter rows (RMSNorm's config then, not measured). Persistent (each block prefetches
    its next row), about 16 elements per thread: one pack of two 16-byte vectors where the rows allow 16-byte loads,
    else two packs. Measured (GB/s, graph replays, bf16, group 128; docs/performance.md): RMSNorm's configs (four
    packs at 64 registers, tuned for a 2-byte output) against two packs of 8, persistent, on an H100: 4096 x 7168
    1966 vs 2485 with 448 threads, 16384 x 7168 2289 vs 2717, 8192 x 4096 2568 vs 2571, 16384 x 2048 2446 vs 2583;
    then one pack of 16 against two of 8 on an H200: 2842-3297 -> 3428-3743 over those four shapes (each lane's
    share of its group's maximum, division and reciprocal covers twice the elements). The wide pack changes no
    alignment need: it is loaded and stored as 16-byte pieces."""
    wide = p.vec * geometry.ITEMSIZE[p.x] == 16
    kp = dataclasses.replace(p, vec=2 * p.vec) if wide else p
    base = geometry.rows_config(kp.n, kp.vec, packs_per_thread=1 if wide else 2)
    if base.rpb != 1 or base.tpr < 128 or geometry.quant_reason(kp.n, kp.vec, group, base):
        return None
    return kp, geometry.RowsConfig(base.tpr, 1, 1)


class RmsNormQuantRows(Candidate):
    """rms_norm_quant: the row kernel with the fp8 store (norms/fwd_rows_fp8.cuh): its own rule for long rows
    (quant_rows_config), else RMSNorm's row config for the same (x dtype, N, vec) (its tuned table row or rule)
    where that config holds whole groups, else RMSNorm's rule. sm_89+ (fp8 conversions); one memory-bound pass."""

    name = "rms_norm_quant.rows"
    op = QUANT_OP
    priority = 100
    min_arch = "sm_89"
    vendors = ("nvidia",)

    def _memo_of(self, req: OpRequest):
        key = (self.name, req)
        hit = _configs.get(key)
        if hit is None:
            p = fwd_problem(req)
            group = req.dim("group")
            cfg = None
            rule = quant_rows_config(p, group)
            if rule is not None and not geometry.fwd_feasible(rule[0], "rows", rule[1]):
                p, cfg = rule
            if cfg is None:
                cfg = configs.fwd_config(p, "rows", req.device)
            if cfg is not None and geometry.quant_reason(p.n, p.vec, group, cfg):
                cfg = configs.fwd_heuristic(p, "rows")
                if geometry.fwd_feasible(p, "rows", cfg):
                    cfg = None
            hit = _configs.put(key, (p, cfg))
        return hit

    def config(self, req: OpRequest):
        return self._memo_of(req)[1]

    def supports(self, req: OpRequest) -> str | None:
        if req.dtype("y") != FP8:
            return f"output dtype {req.dtype('y')} not supported; rms_norm_quant writes {FP8}"
        why = dtype_reason("input dtype", req.dtype("x"), geometry.DTYPES) or \
            geometry.quant_dtype_reason(req.dtype("x"), req.dim("group"))
        if why:
            return why
        p, cfg = self._memo_of(req)
        if cfg is None:
            return f"no row geometry keeps N={p.n} ({p.x}) within the register budget"
        return geometry.quant_reason(p.n, p.vec, req.dim("group"), cfg)

    def cost(self, req: OpRequest) -> Cost:
        return Cost(1.0, "rule", "one memory-bound pass: the row kernel with a quantizing store")

    def kernel_specs(self, req: OpRequest):
        p, cfg = self._memo_of(req)
        return (geometry.quant_spec(p, cfg, req.dim("group"), self.target(req), op=req.op),)

    def launch_resources(self, req: OpRequest):
        return (Resources(block=self.config(req).block),)

    def row_launch_geometry(self, req: OpRequest, kernels: tuple[Any, ...], rows: int) -> tuple[int, int, int]:
        cfg = self.config(req)
        grid = geometry.grid_for_rows(rows, cfg)
        if cfg.opt & 1:
            grid = min(grid, blocks_per_sm(kernels[0], cfg.block) * kernels[0].device.sm_count)
        return grid, cfg.block, 0


def quant_request(x: str, w: str | None, n: int, vec: int, group: int, zero_centered: bool, device) -> OpRequest:
    """rms_norm_quant's request: dtypes x, w (or "none"), y (fp8_e4m3); shape n, vec, group; flags weight,
    zero_centered (the scale layout is a runtime stride: not in the request)."""
    return OpRequest(op=QUANT_OP, dtypes=(("w", w or "none"), ("x", x), ("y", FP8)),
                     shape=(("group", group), ("n", n), ("vec", vec)),
                     flags=(("bias", False), ("residual", False), ("save_stats", False), ("weight", w is not None),
                            ("zero_centered", bool(zero_centered))), device=device)


def build_quant_request(shape: tuple, dtype: str | None, device, **options: str) -> OpRequest:
    """`rtckern explain rms_norm_quant`: shape N or ROWSxN; --opt w= (a dtype or none), group=, vec=,
    zero_centered=0/1."""
    op = QUANT_OP
    if not shape or shape[-1] < 1:
        raise ValueError(f"shape {shape!r}: give N or ROWSxN with N >= 1")
    x = dtype or "bf16"
    if x not in geometry.DTYPES:
        raise ValueError(f"dtype {x!r}: expected one of {', '.join(geometry.DTYPES)}")
    opts.check_keys(op, options, ("vec", "w", "group", "zero_centered"))
    n = int(shape[-1])
    vec = opts.parse_vec(op, options, n, geometry.ITEMSIZE[x], geometry.pick_vec(n, (geometry.ITEMSIZE[x],), (16,)))
    w = _dtype_opt(op, options, "w", x)
    group = int(opts.parse_choice(op, "group", options.get("group", "128"), tuple(map(str, geometry.QUANT_GROUPS))))
    return quant_request(x, None if w == "none" else w, n, vec, group, opts.flag(op, options, "zero_centered", False),
                         device)


def all_candidates() -> list[Candidate]:
    out = [RmsNormQuantRows()]
    for op in FWD_OPS:
        out += [_make(op, b, "fwd") for b in (_Rows, _Cluster, _L2, _Coop)]
    for op in BWD_OPS:
        out += [_make(op, b, "bwd") for b in (_Rows, _Cluster, _L2, _Stage, _L2C, _Coop)]
    return out


# ---- requests from the command line (rtckern explain / selftest) -------------------------------------------------
_FWD_OPTIONS = ("vec", "w", "y", "bias", "residual", "save_stats", "zero_centered")
_BWD_OPTIONS = ("vec", "w", "dx", "dy", "bias_grad", "dresidual", "weight_grad", "zero_centered")


def _dtype_opt(op: str, options: dict, name: str, default: str) -> str:
    allowed = geometry.DTYPES + ("none",) if name == "w" else geometry.DTYPES
    return opts.parse_choice(op, name, options.get(name, default), allowed)


def build_request(op: str, shape: tuple, dtype: str | None, device, **options: str) -> OpRequest:
    """An op request from a shape (N, or rows x N) and --opt key=value pairs (w, y/dy/dx dtypes; bias, residual,
    zero_centered, save_stats, weight_grad, dresidual as booleans; vec, default the 16-byte width). An unknown
    key or a value outside what is accepted is an OptionError."""
    if not shape or shape[-1] < 1:
        raise ValueError(f"shape {shape!r}: give N or ROWSxN with N >= 1")
    x = dtype or "bf16"
    if x not in geometry.DTYPES:
        raise ValueError(f"dtype {x!r}: expected one of {', '.join(geometry.DTYPES)}")
    opts.check_keys(op, options, _FWD_OPTIONS if op in FWD_OPS else _BWD_OPTIONS)
    n = int(shape[-1])
    vec = opts.parse_vec(op, options, n, geometry.ITEMSIZE[x], geometry.pick_vec(n, (geometry.ITEMSIZE[x],), (16,)))
    layer = op.startswith("layer")
    w = _dtype_opt(op, options, "w", x)

    def flag(name: str, default: bool) -> bool:
        return opts.flag(op, options, name, default)

    if op == "rms_norm" and str(options.get("y", "")).startswith("fp8"):
        raise OptionError(f"{op}: option y={options['y']!r}: an fp8 output is rms_norm_quant's (normalize and quantize "
                          "per group in one pass; rms_norm(..., out_dtype=float8_e4m3fn, return_scales=True) calls "
                          "it): `rtckern explain rms_norm_quant --opt group=128`")
    if op in FWD_OPS:
        flags = (("bias", flag("bias", layer)), ("residual", flag("residual", False)),
                 ("save_stats", flag("save_stats", False)), ("weight", w != "none"),
                 ("zero_centered", flag("zero_centered", False)))
        return OpRequest(op=op, dtypes=(("w", w), ("x", x), ("y", _dtype_opt(op, options, "y", x))),
                         shape=(("n", n), ("vec", vec)), flags=flags, device=device)
    flags = (("bias_grad", flag("bias_grad", layer)), ("dresidual", flag("dresidual", False)),
             ("weight", w != "none"), ("weight_grad", flag("weight_grad", w != "none")),
             ("zero_centered", flag("zero_centered", False)))
    return OpRequest(op=op, dtypes=(("dx", _dtype_opt(op, options, "dx", x)), ("dy", _dtype_opt(op, options, "dy", x)),
                                    ("w", w), ("x", x)), shape=(("n", n), ("vec", vec)), flags=flags, device=device)


# The row lengths `rtckern ops` asks the candidates about (each kind's register, shared-memory and cluster limits).
ROW_LIMITS = LimitProbe("N", tuple(1 << k for k in range(6, 22)))


def register_builders(registry) -> None:
    import functools

    if QUANT_OP not in registry.builder_ops():
        registry.register_request_builder(
            QUANT_OP, build_quant_request,
            help="shape: N or ROWSxN; --opt w=fp32|none group=32|64|128|256 zero_centered=0/1 vec=",
            example="--dtype bf16 --shape 8192x7168 --opt group=128", limits=ROW_LIMITS)

    for op in FWD_OPS + BWD_OPS:
        if op in registry.builder_ops():
            continue
        registry.register_request_builder(
            op, functools.partial(build_request, op),
            help="shape: N or ROWSxN; --opt w=fp32 y=fp32 bias=0/1 residual=0/1 zero_centered=0/1 save_stats=0/1 "
                 "(backward: dy= dx= weight_grad= bias_grad= dresidual=)",
            example=f"--dtype bf16 --shape 8192x4096{' --opt w=fp32' if op in FWD_OPS else ''}", limits=ROW_LIMITS)
