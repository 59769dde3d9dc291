"""The fp8 GEMM tuner behind `rtckern tune gemm_fp8 --shapes MxNxK,...|FILE`: times every tile config the sm_90a
kernel supports for a shape (`sweep_configs`) on the live GPU (random e4m3 inputs and scales of the request's
granularity, CUDA-graph replays so that launch gaps do not hide the kernel time of decode shapes, whose weights are
read from device memory: `weight_copies`), checks each result against a float32 GEMM of the dequantized inputs
before it may win, and writes the fastest per shape into the `gemm_fp8` table, keyed (arch, SM count, device class,
scale kind, out dtype, m, n, k). configs.py reads it.

Shape lists of models (one MxNxK per line, `#` comments; the M = 1..256 decode range and prefill sizes) ship under
rtckern/tuning_tables/shapes/: `--shapes llama-3.1-8b` (or a path) names one.
"""
from __future__ import annotations

from typing import Any, Mapping

from rtckern import tuning
from rtckern.errors import RtckernError

from . import configs, geometry
from .candidates import problem
from .geometry import OP, Fp8Problem, Sm90Fp8Config

STAGES = (4, 6, 8, 10, 12)  # ring depths tried, where the ring fits in shared memory
TILES = ((64, 64, 1, 1), (64, 128, 1, 1), (128, 64, 1, 1), (128, 64, 2, 1), (128, 128, 2, 1), (256, 64, 2, 1),
         (128, 256, 2, 1), (128, 128, 2, 2), (128, 256, 2, 2))  # bm, bn, consumers, cluster
PARTIALS = (1, 2)  # one partial per consumer, or two in turn (bn <= 128)
# split-K clusters, timed where M <= 64 (one row block: N / bn tiles leave SMs idle), on 64 x 128 tiles at the deep
# end of the ring (a split streams b as the whole K does). On an H200 clusters of 3 and 64-column split tiles never
# won a decode shape (docs/performance.md).
SPLITS = (2, 4)
SPLIT_STAGES = (6, 8)


def sweep_configs(p: Fp8Problem) -> list[Sm90Fp8Config]:
    """Every tile config the sm_90a kernel accepts for p (Sm90Fp8Config.invalid), at each ring depth that fits;
    tiles of 128+ rows are left out where M <= 64 (their extra rows are padding), clusters where M spans fewer
    than two row blocks (nothing to share); where M <= 64, 64 x 128 tiles again, split over K in clusters of SPLITS
    blocks at SPLIT_STAGES. In a fixed order."""
    out = []
    for bm, bn, consumers, cluster in TILES:
        if (p.m <= 64 and bm > 64) or (cluster > 1 and p.m <= bm):
            continue
        for partials in PARTIALS:
            for stages in STAGES:
                cfg = Sm90Fp8Config(bm, bn, stages, consumers, cluster=cluster, partials=partials)
                if cfg.invalid(p) is None:
                    out.append(cfg)
    if p.m <= 64:
        for splits in SPLITS:
            for partials in PARTIALS:
                for stages in SPLIT_STAGES:
                    cfg = Sm90Fp8Config(64, 128, stages, 1, partials=partials, splits=splits)
                    if cfg.invalid(p) is None:
                        out.append(cfg)
    return out


class Fp8GemmTuner(tuning.Tuner):
    op = OP
    key_fields = configs.KEY_FIELDS

    def key(self, req) -> dict[str, Any]:
        return configs.key_of(problem(req))

    def configs(self, req) -> list[dict[str, Any]]:
        return [c.as_dict() for c in sweep_configs(problem(req))]

    def heuristic(self, key: Mapping[str, Any], device) -> Mapping[str, Any]:
        p = Fp8Problem(m=int(key["m"]), n=int(key["n"]), k=int(key["k"]), scale=str(key["scale"]),
                       out_dtype=str(key["out"]))
        return configs.heuristic(p, device.sm_count).as_dict()

    def valid(self, config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        try:
            p = Fp8Problem(m=int(key["m"]), n=int(key["n"]), k=int(key["k"]), scale=str(key["scale"]))
            return configs.config_from_dict(config).invalid(p) is None
        except (TypeError, ValueError):
            return False

    def validate(self, req) -> None:
        p = problem(req)
        if req.device.arch.gfx or req.device.arch.cc != (9, 0):
            raise ValueError(f"gemm_fp8 has tile configs to tune on sm_90 (H100 / H200: the wgmma kernel) only; "
                             f"{req.device.describe()} runs the CUDA-core fallback, which has none")
        if not p.aligned or p.k % geometry.K_MULTIPLE:
            raise ValueError(f"gemm_fp8 {p.m}x{p.n}x{p.k}: rows are timed on 16-byte aligned operands (K a multiple "
                             f"of {geometry.K_MULTIPLE}); this shape runs the fallback")
        if p.bias != "none":
            raise ValueError("gemm_fp8 rows are keyed without bias (the bias add is a cheap epilogue); tune without "
                             "--opt bias")
        if p.scale == "channel":
            raise ValueError("per-channel scales run the per-tensor kernel and use its rows: tune with "
                             "--opt scale=tensor")
        if p.dtype != "fp8_e4m3":
            raise ValueError(f"gemm_fp8 rows are timed with e4m3 a and serve {p.dtype} a too (the same tiles and "
                             "instruction rate): tune without --dtype")

    def measure(self, req, config: Mapping[str, Any]) -> float:
        return measure_config(problem(req), configs.config_from_dict(config), req.device)


def make_inputs(p: Fp8Problem, dev, seed: int = 1234):
    """(a, b, sa, sb, scale strides): random e4m3 operands and fp32 scales of p's granularity (per-tensor, per-channel
    or block) on torch device dev."""
    import torch

    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    a = (torch.randn(p.m, p.k, device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(p.n, p.k, device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
    if p.scale == "block":
        kb, nb = geometry.kb_count(p.k), (p.n + 127) // 128
        sa = torch.rand(p.m, kb, device=dev, generator=g) / 64 + 1e-3
        sb = torch.rand(nb, kb, device=dev, generator=g) / 64 + 1e-3
        strides = (sa.stride(0) if p.m > 1 else 0, sa.stride(1) if kb > 1 else 0,
                   sb.stride(0) if nb > 1 else 0, sb.stride(1) if kb > 1 else 0)
    elif p.scale == "channel":  # a scale per row of a and per row of b (column of the output), as (rows, 1)
        sa = torch.rand(p.m, 1, device=dev, generator=g) / 64 + 1e-3
        sb = torch.rand(p.n, 1, device=dev, generator=g) / 64 + 1e-3
        strides = (1, 0, 1, 0)
    else:
        sa = torch.full((1,), 0.01, device=dev)
        sb = torch.full((1,), 0.02, device=dev)
        strides = (0, 0, 0, 0)
    return a, b, sa, sb, strides


def reference(p: Fp8Problem, a, b, sa, sb):
    """float32 (a * sa) @ (b * sb)^T from the same rounded inputs."""
    import torch

    af, bf = a.float(), b.float()
    if p.scale == "block":
        af = af * sa.repeat_interleave(geometry.SCALE_BLOCK, 1)[:, :p.k]
        sb_full = sb.repeat_interleave(geometry.SCALE_BLOCK, 0)[:p.n].repeat_interleave(geometry.SCALE_BLOCK, 1)
        bf = bf * sb_full[:, :p.k]
    else:
        af, bf = af * sa, bf * sb
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return af @ bf.t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


ERROR_BOUND = 2.0 ** -6  # relative Frobenius error: bf16 output rounding plus fp32 accumulation, far below a bad tile
def weight_copies(p: Fp8Problem) -> int:
    """How many copies of b the timing of p cycles through (tuning.weight_copies: decode shapes' weights from device
    memory)."""
    return tuning.weight_copies(p.m, p.n * p.k)


def measure_config(p: Fp8Problem, cfg: Sm90Fp8Config, device, *, reps: int = 10, replays: int = 5,
                   check: bool = True) -> float:
    """Median seconds of one gemm_fp8 with tile `cfg` on the live device (torch needed for buffers and graphs). With
    `check`, a result off the float32 reference by more than ERROR_BOUND raises (the config does not win)."""
    import torch

    from rtckern.dtypes import torch_dtype
    from rtckern.manager import get_manager
    from rtckern.registry.core_api import target_for

    from .launch import GemmLaunch

    if device.ordinal is None:
        raise RtckernError("measuring a gemm_fp8 config needs a live GPU")
    bad = cfg.invalid(p)
    if bad:
        raise RtckernError(f"config {cfg.as_dict()} cannot run {p.m}x{p.n}x{p.k}: {bad}")
    kernel = get_manager().get(geometry.sm90_spec(p, cfg, target_for(device, True)), device.ordinal)
    dev = torch.device("cuda", device.ordinal)
    a, b, sa, sb, strides = make_inputs(p, dev)
    c = torch.full((p.m, p.n), float("nan"), device=dev, dtype=torch_dtype(p.out_dtype))
    plan = GemmLaunch(kernel, p, cfg, p.k, p.k, strides, device.sm_count)
    weights = tuning.WeightRotation(b, weight_copies(p))

    def run():
        plan.run(a.data_ptr(), weights.next_ptr(), c.data_ptr(), sa.data_ptr(), sb.data_ptr(), 0,
                 torch.cuda.current_stream(dev).cuda_stream)

    def verify():
        ref = reference(p, a, b, sa, sb)
        out = c.float()
        err = float("nan") if torch.isnan(out).any() else float(
            torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))
        if not err <= ERROR_BOUND:
            raise RtckernError(f"config {cfg.as_dict()} gave relative error {err:.3g} > {ERROR_BOUND:.3g}")
    return tuning.time_graphed(dev, run, verify if check else None, reps=max(reps, len(weights.copies)),
                               replays=replays)


def register_tuner() -> Fp8GemmTuner:
    """The family's tuner, registered on first use (the registry keeps the one instance)."""
    return tuning.register_or_get_tuner(Fp8GemmTuner())  # type: ignore[return-value]
