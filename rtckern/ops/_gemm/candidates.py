"""Registry candidates of the GEMM op, highest priority first:

  gemm.sm90_wgmma   sm_90a: wgmma + TMA + warp specialization, persistent (needs 16-byte aligned rows)
  gemm.sm80_mma     sm_80+: mma.sync + cp.async pipeline; an aligned fast path and a general element path
  gemm.simt         sm_75+: no tensor cores (the sm_75 fallback; also whatever the others refuse)

A request carries every feature that decides compilation or feasibility, with its real value: dtypes, m, n, k,
batch, layout, epilogue, alignment, shared-B. The tuned config (`configs`: the table's row, exact or nearest,
else the heuristic) names the kernel family expected fastest: that candidate costs 1.0 and serves with that config;
the other tensor-core candidate OTHER_COST with its own config; the SIMT kernel SIMT_COST (where the tuned config
is SIMT, sm_75, it is the only one). Costs computed once per request, as each candidate's config.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from rtckern.caches import PlanCache
from rtckern import tuning
from rtckern.device import DeviceInfo
from rtckern.registry import Cost, OpRequest, Resources, select
from rtckern.registry import options as opts

from .._common import (MemoizedConfigCandidate, SelectionMemo, dtype_reason, register_missing_builder,
                       register_missing_candidates, run_once, tma_coordinates_reason)
from . import configs, geometry
from .launch import REDUCE_THREADS, LaunchPlan, Operands, stream_int

OP = "gemm"


def request(p: geometry.GemmProblem, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"a": p.dtype, "out": p.out_dtype},
                     shape={"batch": p.batch, "m": p.m, "n": p.n, "k": p.k},
                     flags={"trans_b": p.trans_b, "bias": p.bias, "activation": p.activation,
                            "residual": p.residual, "aligned": p.aligned, "b_batched": p.b_batched},
                     device=device)


def problem(req: OpRequest) -> geometry.GemmProblem:
    return geometry.GemmProblem(batch=req.dim("batch"), m=req.dim("m"), n=req.dim("n"), k=req.dim("k"),
                                dtype=req.dtype("a"), out_dtype=req.dtype("out"), trans_b=bool(req.flag("trans_b")),
                                bias=bool(req.flag("bias")), activation=str(req.flag("activation")),
                                residual=bool(req.flag("residual")), aligned=bool(req.flag("aligned")),
                                b_batched=bool(req.flag("b_batched")))


_plans = PlanCache("gemm.tuned_configs")
_configs = PlanCache("gemm.candidate_configs")
# Expected cost relative to the kernel family the tuned config names (1.0): the other tensor-core family (the table
# measured it slower, or the heuristic expects it to be), and the SIMT kernel (no tensor cores: the last resort).
OTHER_COST = 1.5
SIMT_COST = 4.0


def tuned_plan(req: OpRequest) -> tuple[Any, str]:
    """(config, source) for the request, memoized (the launch path reads it on every call)."""
    hit = _tuned(req)
    return hit[0], hit[1]


def _tuned(req: OpRequest) -> tuple[Any, str, Any]:
    key = (req,)
    hit = _plans.get(key)
    if hit is None:
        hit = _plans.put(key, configs.tuned_config_row(problem(req), req.device))
    return hit


def _dtype_reason(req: OpRequest) -> str | None:
    a, out = req.dtype("a"), req.dtype("out")
    return (dtype_reason("input dtype", a, geometry.INPUT_DTYPES)
            or dtype_reason("output dtype", out, geometry.OUTPUT_DTYPES))


def tuned_cost(kind: str, req: OpRequest, other: float) -> Cost:
    """1.0 where the tuned config is of `kind` (source: the table's row or the heuristic), else `other`."""
    cfg, source, found = _tuned(req)
    src = "table" if source in ("exact", "nearest") else "rule"
    where = f"the {found.describe()}," if src == "table" and found is not None else "the heuristic"
    if cfg.kind == kind:
        return Cost(1.0, src, f"{where} names the {kind} kernel ({cfg.as_dict()})")
    return Cost(other, src, f"{where} names the {cfg.kind} kernel")


class _GemmCandidate(MemoizedConfigCandidate):
    op = OP
    vendors = ("nvidia",)
    config_memo = _configs

    def kernel_specs(self, req: OpRequest):
        return geometry.kernel_specs(problem(req), self.config(req), self.target(req))

    def launch_resources(self, req: OpRequest):
        cfg = self.config(req)
        if getattr(cfg, "cluster", False):
            return None  # the generic per-SM occupancy query does not know clusters: check_resources asks the driver
        main = Resources(block=cfg.threads, dynamic_smem=geometry.launch_smem(problem(req), cfg))
        return (main, Resources(block=REDUCE_THREADS)) if cfg.splits > 1 else (main,)

    def check_resources(self, req: OpRequest, kernels) -> str | None:
        cfg = self.config(req)
        if not getattr(cfg, "cluster", False):
            return None
        k = kernels[0]
        if k.num_regs * cfg.threads > req.device.regs_per_sm:
            return f"{k.num_regs} registers x {cfg.threads} threads > {req.device.regs_per_sm} per SM"
        fit = active_clusters(k, cfg)
        if fit == 0:
            return (f"no cluster of {cfg.splits} blocks ({cfg.threads} threads, {cfg.smem_bytes} B shared memory "
                    "each) fits on the device")
        return None

    def prepare(self, req: OpRequest, kernels, ops: Operands) -> LaunchPlan:
        """The launches of this request with the operand addresses left open (`ops` gives the strides; its
        addresses are ignored): a repeated call of the same signature only runs the plan."""
        return LaunchPlan(kernels, problem(req), self.config(req), ops, req.device.sm_count)

    def launch(self, req: OpRequest, kernels, ops: Operands, *, stream, workspace_alloc) -> Any:
        """Run on `stream`; `workspace_alloc(nbytes)` returns (keepalive, address) for split-K partial sums.
        Returns the workspace keepalive (None without a workspace): the caller drops it after the launch, which
        the stream-ordered allocators of torch and CuPy make safe."""
        plan = self.prepare(req, kernels, ops)
        ws_obj, ws_ptr = None, 0
        if plan.workspace_bytes:
            ws_obj, ws_ptr = workspace_alloc(plan.workspace_bytes)
        plan.run(ops.a, ops.b, ops.c, ops.bias, ops.res, stream_int(stream), ws_ptr)
        return ws_obj


class Sm90WgmmaCandidate(_GemmCandidate):
    name = "gemm.sm90_wgmma"
    priority = 300
    min_arch = "sm_90"
    max_arch = "sm_90"
    arch_specific = True

    def supports(self, req: OpRequest) -> str | None:
        why = _dtype_reason(req)
        if why:
            return why
        if not req.flag("aligned"):
            return ("TMA needs 16-byte aligned operands: base addresses, row strides and batch strides that are "
                    "multiples of 8 elements, k a multiple of 8 and, with trans_b=False, n a multiple of 8")
        p = problem(req)
        return tma_coordinates_reason(rows=p.batch * p.m, n=p.n, k=p.k) or self.config(req).invalid(p)

    def cost(self, req: OpRequest) -> Cost:
        return tuned_cost("sm90", req, OTHER_COST)

    def _config(self, req: OpRequest):
        cfg, _ = tuned_plan(req)
        return cfg if cfg.kind == "sm90" else configs.sm90_heuristic(problem(req), req.device)


class Sm80MmaCandidate(_GemmCandidate):
    name = "gemm.sm80_mma"
    priority = 200
    min_arch = "sm_80"

    def supports(self, req: OpRequest) -> str | None:
        why = _dtype_reason(req)
        if why:
            return why
        return self.config(req).invalid(problem(req))

    def cost(self, req: OpRequest) -> Cost:
        return tuned_cost("sm80", req, OTHER_COST)

    def _config(self, req: OpRequest):
        cfg, _ = tuned_plan(req)
        if cfg.kind != "sm80":
            cfg = configs.sm80_heuristic(problem(req), req.device)
        if cfg.kind == "sm80" and cfg.cluster and req.device.arch.major < 9:  # clusters need sm_90+
            cfg = geometry.with_splits(replace(cfg, cluster=False, splits=0), problem(req), req.device.sm_count)
        if cfg.kind == "sm80":
            return cfg
        return geometry.with_splits(geometry.Sm80Config(64, 64, 64, 32, 32, 3), problem(req), req.device.sm_count)


class SimtCandidate(_GemmCandidate):
    name = "gemm.simt"
    vendors = ("nvidia", "amd")  # the portable path; the mma/wgmma ones are NVIDIA-only
    priority = 10
    min_arch = "sm_75"

    def supports(self, req: OpRequest) -> str | None:
        return _dtype_reason(req) or geometry.SimtConfig().invalid(problem(req))

    def cost(self, req: OpRequest) -> Cost:
        return tuned_cost("simt", req, SIMT_COST)

    def _config(self, req: OpRequest):
        return geometry.SimtConfig()


_clusters_fit = PlanCache("gemm.clusters_fit")


def active_clusters(kernel, cfg) -> int:
    """How many clusters of cfg's kernel fit on the device at once (the driver's answer, which knows the GPC
    layout); -1 when the driver cannot say (the launch itself will)."""
    dims = (1, cfg.splits, 1) if cfg.kind == "sm80" else (cfg.splits, 1, 1)
    key = (id(kernel), dims, cfg.threads, cfg.smem_bytes)
    hit = _clusters_fit.get(key)
    if hit is None:
        hit = _clusters_fit.put(key, kernel.max_active_clusters(dims, cfg.threads, cfg.smem_bytes))
    return hit


# ---- selection, memoized per problem and device -----------------------------------------------------------------
_selections = SelectionMemo("gemm.selections")


def selection(p: geometry.GemmProblem, ordinal: int):
    """The registry's selection for this call, memoized per settings object (a change of settings, such as
    RTCKERN_FORCE_IMPL, decides again, as the registry's own memo does)."""
    return _selections.get((p, ordinal), lambda: request(p, DeviceInfo.from_device(ordinal)), select)


_OPTIONS = ("trans_b", "out", "bias", "act", "residual", "aligned", "b_batched")


def build_request(shape, dtype, device, **options) -> OpRequest:
    """For `rtckern explain/tune gemm`: shape MxNxK or BxMxNxK; options trans_b, out, bias, act, residual,
    aligned, b_batched (an unknown key or a value outside what is accepted is an OptionError)."""
    dims = [int(x) for x in shape]
    if len(dims) not in (3, 4):
        raise ValueError(f"gemm: shape {shape!r} should be MxNxK or BxMxNxK, e.g. 4096x4096x4096")
    opts.check_keys(OP, options, _OPTIONS)
    batch, (m, n, k) = (dims[0], dims[1:]) if len(dims) == 4 else (1, dims)
    dt = dtype or "bf16"

    def flag(name: str, default: bool) -> bool:
        return opts.flag(OP, options, name, default)

    trans_b = flag("trans_b", True)
    p = geometry.GemmProblem(batch=batch, m=m, n=n, k=k, dtype=dt,
                             out_dtype=opts.parse_choice(OP, "out", options.get("out", dt), geometry.OUTPUT_DTYPES),
                             trans_b=trans_b, bias=flag("bias", False),
                             activation=opts.parse_choice(OP, "act", options.get("act", "none"), geometry.ACTIVATIONS),
                             # the API's rule for contiguous operands: B (N, K) needs K % 8, B (K, N) also N % 8
                             residual=flag("residual", False), aligned=flag("aligned", k % 8 == 0 and
                                                                           (trans_b or n % 8 == 0)),
                             b_batched=flag("b_batched", batch != 1))
    return request(p, device)


@run_once
def register_all() -> None:
    """Register the GEMM candidates, request builder and tuner (idempotent)."""
    register_missing_candidates((Sm90WgmmaCandidate, Sm80MmaCandidate, SimtCandidate))
    register_missing_builder(OP, build_request, help="shape: MxNxK or BxMxNxK; options trans_b=0|1 (default 1: B is "
                             "(n, k)), out=fp16|bf16|fp32, bias=0|1, act=none|gelu_tanh|silu, residual=0|1, "
                             "aligned=0|1, b_batched=0|1",
                             example="--dtype bf16 --shape 4096x4096x4096 --opt trans_b=1")
    tuning.defer_tuners(f"{__package__}.tune", "register_tuner")  # imported by `rtckern tune` only
