"""The GEMM tuner behind `rtckern tune gemm --shapes MxNxK,...` and `benchmarks/gemm.py --tune`: times every
config of `sweep_configs` on the live GPU (random inputs, CUDA-graph replays so that launch gaps do not hide the
kernel time of small problems, decode shapes' weights read from device memory: `tuning.weight_copies`) and checks
each result against an fp32 reference before it may win. configs.py reads the table it writes.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from rtckern import tuning
from rtckern.dtypes import torch_dtype, unit_roundoff
from rtckern.errors import RtckernError

from . import configs, geometry, launch
from .geometry import SimtConfig, Sm80Config, Sm90Config
from .candidates import problem

ALLOW_PINGPONG = True  # benchmarks/gemm.py --no-pingpong turns the ping-pong schedule out of sweeps


class GemmTuner(tuning.Tuner):
    op = configs.OP
    key_fields = configs.KEY_FIELDS

    def key(self, req) -> dict[str, Any]:
        return configs.key_of(problem(req))

    def configs(self, req) -> list[dict[str, Any]]:
        return [c.as_dict() for c in sweep_configs(problem(req), req.device)]

    def validate(self, req) -> None:
        """Rows are keyed by (dtype, layout, M, N, K) and serve plain calls: refuse what would time another problem
        under that key (a row a plain call would then read as exact)."""
        p = problem(req)
        if not p.aligned:
            raise ValueError(f"gemm {p.m}x{p.n}x{p.k}: rows are timed on 16-byte aligned operands (K, and N with "
                             "trans_b=0, multiples of 8); an unaligned call runs the mma.sync kernel's heuristic "
                             "config: tune an aligned shape")
        if p.b_batched:
            raise ValueError(f"gemm rows are keyed by M x N x K with one B (batch x M rows); a batch of {p.batch} "
                             "separate B matrices is another problem: tune without b_batched")
        if p.bias or p.activation != "none" or p.residual or p.out_dtype != p.dtype:
            raise ValueError("gemm rows are keyed without the epilogue and with the output in the input dtype (the "
                             "epilogue is a cheap pass over the tile): tune without --opt bias / act / residual / out")

    def heuristic(self, key: Mapping[str, Any], device) -> Mapping[str, Any]:
        p = geometry.GemmProblem(1, int(key["m"]), int(key["n"]), int(key["k"]), str(key["dtype"]), str(key["dtype"]),
                                 key["layout"] == "tn")
        return configs.heuristic(p, device).as_dict()

    def measure(self, req, config: Mapping[str, Any]) -> float:
        return measure_config(problem(req), geometry.config_from_dict(config), req.device)


def sweep_configs(p: geometry.GemmProblem, device) -> list:
    """Configs worth timing for p on device (for `rtckern tune gemm` and benchmarks/gemm.py --tune)."""
    out: list = []
    is90 = device.arch.major == 9 and device.arch.minor == 0 and p.aligned
    rows = p.batch * p.m
    if is90:
        out += [Sm90Config(128, 256, 4, 2), Sm90Config(256, 128, 4, 2), Sm90Config(128, 128, 6, 2),
                Sm90Config(128, 128, 6, 2, pingpong=True), Sm90Config(64, 256, 5, 2, pingpong=True),
                Sm90Config(128, 192, 5, 2)]
        if rows <= 1024:
            for splits in (1, 2, 3, 4, 0):
                out += [Sm90Config(128, 128, 6, 2, splits=splits), Sm90Config(64, 128, 6, 1, splits=splits),
                        Sm90Config(64, 64, 8, 1, splits=splits),
                        Sm90Config(128, 128, 6, 2, pingpong=True, splits=splits)]
        if 32 < rows <= 256:
            # Skinny: B streams through once per 128-row tile; split-K inside clusters keeps ~1 block per SM
            # busy without a workspace round trip.
            out.append(Sm90Config(128, 64, 8, 2))
            for splits in (2, 4, 8):
                out += [Sm90Config(128, 128, 6, 2, splits=splits, cluster=True),
                        Sm90Config(128, 256, 4, 2, splits=splits, cluster=True)]
            for splits in (2, 4):
                out += [Sm90Config(128, 64, 8, 2, splits=splits, cluster=True),
                        Sm90Config(64, 128, 6, 1, splits=splits, cluster=True)]
    if device.arch.major >= 8:
        out += [Sm80Config(128, 128, 32, 64, 64, 4), Sm80Config(128, 128, 64, 64, 32, 4)]
        if rows <= 256:
            for splits in (1, 2, 4, 0):
                out += [Sm80Config(16, 128, 64, 16, 32, 4, splits=splits),
                        Sm80Config(64, 64, 64, 32, 32, 4, splits=splits)]
        if rows <= 64 and device.arch.major >= 9:
            # Decode-size rows: deeper pipelines and split-K inside clusters (2 blocks per SM fit at <= 110 KB).
            bm, wm = (16, 16) if rows <= 16 else (32, 32)
            for splits in (2, 4, 8):
                for stages in (4, 6):
                    out.append(Sm80Config(bm, 128, 64, wm, 32, stages, splits=splits, cluster=True))
            for splits in (4, 8):
                for stages in (6, 8):
                    out.append(Sm80Config(bm, 64, 64, wm, 16, stages, splits=splits, cluster=True))
    else:
        out.append(SimtConfig())
    seen, uniq = set(), []
    for c in out:
        c = geometry.with_splits(c, p, device.sm_count) if c.kind != "simt" else c
        if c.kind == "sm90" and c.pingpong and not ALLOW_PINGPONG:
            continue
        if c not in seen and configs.config_ok(c, p, device):
            seen.add(c)
            uniq.append(c)
    return uniq


def kernels_for(p: geometry.GemmProblem, cfg, device) -> list:
    from rtckern.manager import get_manager
    from rtckern.registry.core_api import target_for

    arch = target_for(device, cfg.kind == "sm90")
    return [get_manager().get(s, device.ordinal) for s in geometry.kernel_specs(p, cfg, arch)]


def measure_config(p: geometry.GemmProblem, cfg, device, *, reps: int = 10, replays: int = 5,
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
    nbytes = geometry.plan_workspace_bytes(p, cfg)
    ws = torch.empty(max(1, nbytes // 4), device=dev, dtype=torch.float32) if nbytes else None
    ops = launch.Operands(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), lda=p.k, ldb=b.stride(-2), ldc=p.n,
                          stride_a=a.stride(0), stride_b=b.stride(0) if p.b_batched else 0, stride_c=c.stride(0),
                          bias=bias.data_ptr() if bias is not None else 0, res=res.data_ptr() if res is not None else 0,
                          ldr=p.n if res is not None else 0, stride_r=res.stride(0) if res is not None else 0)

    plan = launch.LaunchPlan(kernels, p, cfg, ops, device.sm_count)
    ws_ptr = ws.data_ptr() if ws is not None else 0
    # decode shapes read the weight from device memory, as in a model (tuning.weight_copies)
    weights = tuning.WeightRotation(b, tuning.weight_copies(p.m, b.numel() * b.element_size()))

    def run():
        plan.run(ops.a, weights.next_ptr(), ops.c, ops.bias, ops.res, torch.cuda.current_stream(dev).cuda_stream,
                 ws_ptr)

    def verify():
        err = relative_error(p, a, b, bias, res, c)
        bound = error_bound(p)
        if not err <= bound:
            raise RtckernError(f"config {cfg.as_dict()} gave relative error {err:.3g} > {bound:.3g}")
    return tuning.time_graphed(dev, run, verify if check else None, reps=max(reps, len(weights.copies)),
                               replays=replays)


def error_bound(p: geometry.GemmProblem) -> float:
    """Relative Frobenius error allowed: the output dtype's unit roundoff (at least 2^-16, the fp32 accumulation
    of 16-bit products) times sqrt(k)."""
    return max(unit_roundoff(p.out_dtype), 2.0 ** -16) * math.sqrt(p.k)


def reference(p: geometry.GemmProblem, a, b, bias, res, dtype=None):
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


def relative_error(p: geometry.GemmProblem, a, b, bias, res, c) -> float:
    import torch

    ref = reference(p, a, b, bias, res)
    out = c.float()
    if torch.isnan(out).any():
        return float("nan")
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def register_tuner() -> GemmTuner:
    """The family's tuner, registered on first use (the registry keeps the one instance)."""
    return tuning.register_or_get_tuner(GemmTuner())  # type: ignore[return-value]
