"""Registry candidates of the norm ops: for each of rms_norm, layer_norm, rms_norm_backward and
layer_norm_backward, a row kernel (registers, one group per row), a cluster kernel (sm_90+, distributed shared
memory) and a cooperative kernel (any arch, several co-resident blocks per row).

Priority: cluster (120) > rows (100) > coop (80). The cluster kernel declines shapes where the tuned table (or,
without one, the row-size rule) says the row kernel is faster; the row kernel serves whatever fits its register
budget; the cooperative kernel serves the rest (and rows too long for anything else).
"""
from __future__ import annotations

from typing import Any

from rtckern.registry import Candidate, OpRequest, Resources

from . import _norms_kernels as K
from . import _norms_launch as L

FWD_OPS = ("rms_norm", "layer_norm")
BWD_OPS = ("rms_norm_backward", "layer_norm_backward")

# Row bytes (N x x's itemsize) from which the cluster kernel beats the row kernel on sm_90 (measured on H200,
# benchmarks/results/norms_*.json); the row kernel keeps everything shorter.
SPLIT_FROM_BYTES = {"fwd": 64 * 1024, "bwd": 32 * 1024}


def fwd_problem(req: OpRequest) -> K.FwdProblem:
    w = req.dtype("w")
    return K.FwdProblem(layer=req.op == "layer_norm", n=req.dim("n"), x=req.dtype("x"), y=req.dtype("y"),
                        w=None if w == "none" else w, has_weight=bool(req.flag("weight")),
                        bias=bool(req.flag("bias")),
                        zero_centered=bool(req.flag("zero_centered")), residual=bool(req.flag("residual")),
                        save_stats=bool(req.flag("save_stats")), vec=req.dim("vec"))


def bwd_problem(req: OpRequest) -> K.BwdProblem:
    w = req.dtype("w")
    return K.BwdProblem(layer=req.op == "layer_norm_backward", n=req.dim("n"), x=req.dtype("x"),
                        dy=req.dtype("dy"), dx=req.dtype("dx"), w=None if w == "none" else w,
                        has_weight=bool(req.flag("weight")),
                        weight_grad=bool(req.flag("weight_grad")), bias_grad=bool(req.flag("bias_grad")),
                        zero_centered=bool(req.flag("zero_centered")), dresidual=bool(req.flag("dresidual")),
                        vec=req.dim("vec"))


def _is_sm90_plus(req: OpRequest) -> bool:
    a = req.device.arch
    return not a.gfx and a.cc >= (9, 0)


class _NormCandidate(Candidate):
    kind = ""
    direction = ""
    vendors = ("nvidia",)

    def problem(self, req: OpRequest):
        return fwd_problem(req) if self.direction == "fwd" else bwd_problem(req)

    def config(self, req: OpRequest):
        p = self.problem(req)
        return (L.fwd_config if self.direction == "fwd" else L.bwd_config)(p, self.kind, req.device)

    def _row_bytes(self, req: OpRequest) -> int:
        return req.dim("n") * K.ITEMSIZE[req.dtype("x")]

    def supports(self, req: OpRequest) -> str | None:
        cfg = self.config(req)
        if cfg is None:
            return f"no {self.kind} geometry keeps N={req.dim('n')} ({req.dtype('x')}) within the register budget"
        return None

    def kernel_specs(self, req: OpRequest):
        p, cfg, arch = self.problem(req), self.config(req), self.target(req)
        if self.direction == "fwd":
            return (L.fwd_spec(p, self.kind, cfg, arch, op=req.op),)
        return L.bwd_specs(p, self.kind, cfg, arch, op=req.op)

    def launch_resources(self, req: OpRequest):
        cfg = self.config(req)
        block = cfg.block if self.kind == "rows" else cfg.threads
        main = Resources(block=block, cooperative_grid=cfg.parts if self.kind == "coop" else None)
        if self.direction == "fwd":
            return (main,)
        p = self.problem(req)
        return (main,) + ((Resources(block=K.DW_REDUCE_BLOCK),) if (p.weight_grad or p.bias_grad) else ())

    def prefers_cluster(self, req: OpRequest) -> tuple[bool, str]:
        """Whether the cluster kernel should serve req on an sm_90+ device, and why: the measured choice for the
        nearest tuned shape (norm_kind table), else the row-size rule."""
        kind = L.preferred_kind(self.direction, self.problem(req), req.device)
        if kind in ("rows", "cluster"):
            return kind == "cluster", f"the tuned table's fastest kind near N={req.dim('n')} is {kind}"
        split = self._row_bytes(req) >= SPLIT_FROM_BYTES[self.direction]
        return split, (f"rows of {self._row_bytes(req)} B {'>=' if split else '<'} "
                       f"{SPLIT_FROM_BYTES[self.direction]} B (no tuned table for {req.device.arch.sm})")

    def launch(self, req: OpRequest, kernels: tuple[Any, ...], call: Any, cfg: Any = None) -> tuple:
        cfg = cfg if cfg is not None else self._cfg_memo(req)
        if self.direction == "fwd":
            return L.launch_fwd(fwd_problem(req), self.kind, cfg, kernels[0], call)
        return L.launch_bwd(bwd_problem(req), self.kind, cfg, kernels, call)

    def _cfg_memo(self, req: OpRequest):
        memo = self.__dict__.setdefault("_memo", {})
        cfg = memo.get(req)
        if cfg is None:
            cfg = memo[req] = (self.problem(req), self.config(req))
        return cfg[1]


class _Rows(_NormCandidate):
    kind = "rows"
    priority = 100
    min_arch = "sm_75"

    # No preference check here: the cluster kernel (higher priority) declines shapes where rows are faster, and
    # where it is preferred but fails its probe, the row kernel is the next best, not the cooperative one.


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
        if L.active_clusters(k, cfg.parts, cfg.threads, 0) < 1:
            return f"no cluster of {cfg.parts} blocks x {cfg.threads} threads fits on {req.device.describe()}"
        return None

    def supports(self, req: OpRequest) -> str | None:
        cluster, why = self.prefers_cluster(req)
        if not cluster:
            return f"the row kernel is faster here (rows fit one block): {why}"
        return super().supports(req)


class _Coop(_NormCandidate):
    kind = "coop"
    priority = 80
    min_arch = "sm_75"


def _make(op: str, base: type, direction: str) -> Candidate:
    cls = type(f"{op.title().replace('_', '')}{base.__name__.strip('_')}", (base,),
               {"name": f"{op}.{base.kind}", "op": op, "direction": direction})
    return cls()


def all_candidates() -> list[Candidate]:
    out = []
    for op in FWD_OPS:
        out += [_make(op, b, "fwd") for b in (_Rows, _Cluster, _Coop)]
    for op in BWD_OPS:
        out += [_make(op, b, "bwd") for b in (_Rows, _Cluster, _Coop)]
    return out
