"""The GEMM tuner behind `rtckern tune gemm --shapes MxNxK,...` and `benchmarks/gemm.py --tune`: times every
config of `configs.sweep_configs` on the live GPU (random inputs, CUDA-graph replays so that launch gaps do
not hide the kernel time of small problems) and checks each result against an fp32 reference before it may win.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Mapping

from rtckern import tuning
from rtckern.dtypes import torch_dtype, unit_roundoff
from rtckern.errors import RtckernError

from . import launch as L
from . import geometry as P
from . import configs as T


class GemmTuner(tuning.Tuner):
    op = T.OP
    key_fields = T.KEY_FIELDS

    def key(self, req) -> dict[str, Any]:
        from .candidates import problem

        return T.key_of(problem(req))

    def configs(self, req) -> list[dict[str, Any]]:
        from .candidates import problem

        return [c.as_dict() for c in T.sweep_configs(problem(req), req.device)]

    def heuristic(self, key: Mapping[str, Any], device) -> Mapping[str, Any]:
        p = P.GemmProblem(1, int(key["m"]), int(key["n"]), int(key["k"]), str(key["dtype"]), str(key["dtype"]),
                          key["layout"] == "tn")
        return T.heuristic(p, device).as_dict()

    def measure(self, req, config: Mapping[str, Any]) -> float:
        from .candidates import problem

        return measure_config(problem(req), P.config_from_dict(config), req.device)


def kernels_for(p: P.GemmProblem, cfg, device) -> list:
    from rtckern.manager import get_manager
    from rtckern.registry.core_api import target_for

    arch = target_for(device, cfg.kind == "sm90")
    return [get_manager().get(s, device.ordinal) for s in P.kernel_specs(p, cfg, arch)]


def measure_config(p: P.GemmProblem, cfg, device, *, reps: int = 10, replays: int = 5,
                   check: bool = True) -> float:
    """Median seconds of one GEMM with `cfg` on the live device (torch needed for buffers and graphs). With
    `check`, a result whose relative error against an fp32 reference exceeds the output dtype's bound raises."""
    import torch

    if device.ordinal is None:
        raise RtckernError("measuring a GEMM config needs a live GPU")
    kernels = kernels_for(p, cfg, device)
    dev = torch.device("cuda", device.ordinal)
    g = torch.Generator(device=dev)
    g.manual_seed(1234)
    dt, out_dt = torch_dtype(p.dtype), torch_dtype(p.out_dtype)
    a = torch.randn(p.batch, p.m, p.k, device=dev, generator=g).to(dt)
    bshape = (p.n, p.k) if p.trans_b else (p.k, p.n)
    b = (torch.randn(p.batch if p.b_batched else 1, *bshape, device=dev, generator=g) / math.sqrt(p.k)).to(dt)
    bias = torch.randn(p.n, device=dev, generator=g).to(dt) if p.bias else None
    res = torch.randn(p.batch, p.m, p.n, device=dev, generator=g).to(out_dt) if p.residual else None
    c = torch.full((p.batch, p.m, p.n), float("nan"), device=dev, dtype=out_dt)
    nbytes = P.plan_workspace_bytes(p, cfg)
    ws = torch.empty(max(1, nbytes // 4), device=dev, dtype=torch.float32) if nbytes else None
    ops = L.Operands(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), lda=p.k, ldb=b.stride(-2), ldc=p.n,
                     stride_a=a.stride(0), stride_b=b.stride(0) if p.b_batched else 0, stride_c=c.stride(0),
                     bias=bias.data_ptr() if bias is not None else 0, res=res.data_ptr() if res is not None else 0,
                     ldr=p.n if res is not None else 0, stride_r=res.stride(0) if res is not None else 0)

    plan = L.LaunchPlan(kernels, p, cfg, ops, device.sm_count)
    ws_ptr = ws.data_ptr() if ws is not None else 0

    def run():
        plan.run(ops.a, ops.b, ops.c, ops.bias, ops.res, torch.cuda.current_stream(dev).cuda_stream, ws_ptr)

    with torch.cuda.device(dev):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if check:
            err = relative_error(p, a, b, bias, res, c)
            bound = error_bound(p)
            if not err <= bound:
                raise RtckernError(f"config {cfg.as_dict()} gave relative error {err:.3g} > {bound:.3g}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                run()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3 / reps)
    return statistics.median(times)


def error_bound(p: P.GemmProblem) -> float:
    """Relative Frobenius error allowed: the output dtype's unit roundoff (at least 2^-16, the fp32 accumulation
    of 16-bit products) times sqrt(k)."""
    return max(unit_roundoff(p.out_dtype), 2.0 ** -16) * math.sqrt(p.k)


def reference(p: P.GemmProblem, a, b, bias, res, dtype=None):
    """act(a @ op(b) + bias) + res in float32 (or `dtype`), from the same rounded inputs."""
    import torch

    dtype = dtype or torch.float32
    bb = b.to(dtype)
    if p.trans_b:
        bb = bb.transpose(-1, -2)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y = torch.matmul(a.to(dtype), bb)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    if bias is not None:
        y = y + bias.to(dtype)
    if p.activation == "gelu_tanh":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    elif p.activation == "silu":
        y = torch.nn.functional.silu(y)
    if res is not None:
        y = y + res.to(dtype)
    return y


def relative_error(p: P.GemmProblem, a, b, bias, res, c) -> float:
    import torch

    ref = reference(p, a, b, bias, res)
    out = c.float()
    if torch.isnan(out).any():
        return float("nan")
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


_tuner: GemmTuner | None = None


def register_tuner() -> GemmTuner:
    global _tuner
    if _tuner is None:
        try:
            _tuner = tuning.register_tuner(GemmTuner())
        except ValueError:  # registered by an earlier import of this module under another name
            _tuner = tuning.get_tuner(T.OP)  # type: ignore[assignment]
    return _tuner
