"""Registry candidates of the fp8 ops, highest priority first:

  gemm_fp8.gemv          sm_89+: M = 1, K >= 2048: warps streaming whole rows of b (16-byte aligned rows)
  gemm_fp8.sm90a_stream  sm_90a: M <= 64 (decode), b's rows streamed by cp.async into wgmma (16-byte aligned rows)
  gemm_fp8.sm90a_wgmma   sm_90a: TMA + wgmma e4m3, per-128-K promotion (needs 16-byte aligned rows: K % 16 == 0)
  gemm_fp8.sm89_skinny   sm_89+: M <= 64 (decode), mma.sync e4m3 streaming b once (16-byte aligned rows): the
                         decode path on sm_89; on sm_90 ranked after the streaming and tile kernels
  gemm_fp8.sm89_mma      sm_89+: M > 64, the same kernel in 64 x 64 output tiles: sm_89's prefill path
  gemm_fp8.simt          sm_89+: CUDA cores, fp32 (the fallback: sm_89, and what the wgmma kernel refuses)
  quantize_fp8.warp      sm_89+: per-token-group quantization, one warp per group

Requests carry everything that decides compilation or feasibility: output and bias dtypes, scale granularity,
m, n, k, alignment (gemm_fp8); input dtype, group, m, k (quantize_fp8). fp8 has no hardware conversion or tensor
cores before sm_89: both ops refuse older GPUs with that reason.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rtckern import tuning
from rtckern.caches import PlanCache
from rtckern.device import DeviceInfo
from rtckern.registry import Candidate, Cost, OpRequest, Resources, register_kernel_provider, select
from rtckern.registry import options as opts

from .._common import (ProblemCandidate, SelectionMemo, dtype_reason, WgmmaTileCandidate, register_missing_builder,
                       register_missing_candidates, run_once, tma_coordinates_reason)
from . import configs, geometry
from .geometry import OP, QUANT_OP, Fp8Problem, Sm90Fp8Config

FP8_MIN_ARCH = "sm_89"


def request(p: Fp8Problem, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"a": p.dtype, "out": p.out_dtype, "bias": p.bias},
                     shape={"m": p.m, "n": p.n, "k": p.k}, flags={"scale": p.scale, "aligned": p.aligned},
                     device=device)


def problem(req: OpRequest) -> Fp8Problem:
    return Fp8Problem(m=req.dim("m"), n=req.dim("n"), k=req.dim("k"), scale=str(req.flag("scale")),
                      out_dtype=req.dtype("out"), bias=req.dtype("bias"), aligned=bool(req.flag("aligned")),
                      dtype=req.dtype("a"))


def quant_request(dtype: str, group: int, m: int, k: int, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=QUANT_OP, dtypes={"x": dtype}, shape={"group": group, "m": m, "k": k}, device=device)


def _reason(p: Fp8Problem) -> str | None:
    return (dtype_reason("input dtype", p.dtype, geometry.INPUT_DTYPES)
            or dtype_reason("output dtype", p.out_dtype, geometry.OUTPUT_DTYPES)
            or (None if p.bias == "none" else dtype_reason("bias dtype", p.bias, geometry.BIAS_DTYPES))
            or (None if p.scale in geometry.SCALES else
                f"scale granularity {p.scale!r} not supported; supported: {', '.join(geometry.SCALES)}")
            or geometry.k_reason(p.k, OP))


def _tile_reason(p: Fp8Problem) -> str | None:
    """The sm_90a tile kernel's: _reason, and dimensions its 32-bit TMA coordinates reach."""
    return _reason(p) or tma_coordinates_reason(m=p.m, n=p.n, k=p.k)


def _unaligned(p: Fp8Problem) -> str | None:
    return None if p.aligned else "needs 16-byte aligned rows of a and b (bases and row strides multiples of 16 bytes)"


_configs = PlanCache("gemm_fp8.candidate_configs")


class Sm90aWgmmaCandidate(WgmmaTileCandidate, ProblemCandidate):
    name = "gemm_fp8.sm90a_wgmma"
    op = OP
    tile_memo = _configs
    work = "tensor cores (wgmma e4m3)"
    problem, reason, spec = staticmethod(problem), staticmethod(_tile_reason), staticmethod(geometry.sm90_spec)

    def tiled(self, req: OpRequest) -> tuple[Sm90Fp8Config, Any]:
        return configs.tuned(problem(req), req.device)

    @staticmethod
    def invalid(p: Fp8Problem, cfg: Sm90Fp8Config) -> str | None:
        return cfg.invalid(p)

    @staticmethod
    def smem(p: Fp8Problem, cfg: Sm90Fp8Config) -> int:
        return cfg.launch_smem(p)


class GeometryCandidate(Candidate):
    """A kernel taking gemm_fp8_skinny's parameters with a config from its geometry rule (`config(req)`, whose
    `launch_geometry(p)` gives grid, block and shared memory): its spec is `spec(p, config, target)`. The GEMV,
    streaming and mma.sync kernels; launch.GemmLaunch launches them alike."""

    op = OP
    spec: Any = None  # geometry.<kernel>_spec

    def config(self, req: OpRequest):
        raise NotImplementedError

    def kernel_specs(self, req: OpRequest):
        return (type(self).spec(problem(req), self.config(req), self.target(req)),)

    def launch_resources(self, req: OpRequest):
        _, block, smem = self.config(req).launch_geometry(problem(req))
        return (Resources(block=block[0], dynamic_smem=smem),)


def _fills_sms(blocks: int, sm_count: int) -> bool:
    """At least 3/4 of the SMs get a block: below it the tile kernel's split-K clusters fill them better (the GEMV and
    streaming kernels' ranking rules)."""
    return blocks * 4 >= sm_count * 3


def _fills_part(blocks: int, sm_count: int) -> bool:
    """At least 2/5 of the SMs get a block: where the streaming kernel still beats the tile kernel's split-K clusters
    at M = 2..32 (StreamCandidate.cost)."""
    return blocks * 5 >= sm_count * 2


# Weights of 2/5 to 3/4 of the SMs' blocks: the streaming kernel first from this K (the shortest measured) and, with
# block scales, up to this M (StreamCandidate.cost)
STREAM_NARROW_MIN_K = 4096
STREAM_NARROW_BLOCK_MAX_M = 8


class GemvCandidate(GeometryCandidate):
    """Batch-1 decode (M = 1, K >= GEMV_MIN_K): warps stream whole rows of b into registers, 512 contiguous bytes per
    warp-wide load, CUDA-core dot products against a's row held as floats in shared memory (gemm/gemm_fp8_gemv.cuh).
    Ranked before the tile kernel where its blocks (8 warps of 1 or 4 rows, geometry.gemv_config) fill 3/4 of the
    SMs (gemm_fp8_h200.md and docs/performance.md: faster than the tile kernel's TMA stream there; slower with fewer
    blocks, K < 2048 or M = 2)."""

    name = "gemm_fp8.gemv"
    priority = 350
    min_arch = FP8_MIN_ARCH
    spec = staticmethod(geometry.gemv_spec)

    @staticmethod
    def config(req: OpRequest) -> geometry.GemvConfig:
        return geometry.gemv_config(problem(req))

    def supports(self, req: OpRequest) -> str | None:
        p, limit = problem(req), req.device.max_smem_per_block_optin
        smem = geometry.GemvConfig.smem_bytes(p.k)
        if p.m > geometry.GEMV_MAX_M:
            return f"m={p.m}: the GEMV kernel takes M = 1 (the tile kernels take more rows)"
        if p.k < geometry.GEMV_MIN_K:
            return f"k={p.k}: the GEMV kernel takes K >= {geometry.GEMV_MIN_K} (a shorter row gives a lane too few " \
                   "loads; the tile kernels read it as fast or faster)"
        return _reason(p) or _unaligned(p) or (
            None if smem <= limit else
            f"k={p.k}: a's rows as floats take {smem} bytes, past the {limit} bytes of shared memory a block may have")

    def cost(self, req: OpRequest) -> Cost:
        p, cfg = problem(req), self.config(req)
        what = f"M = 1: whole rows of b streamed into registers ({cfg.rows} per warp, {cfg.unroll} load(s) per row " \
               "and round"
        if not _fills_sms(cfg.blocks(p.n), req.device.sm_count):
            # fewer blocks than 3/4 of the SMs: the tile kernel's split-K clusters filled them better with four rows
            # per warp (H200, 2112 x 7168 in 66 blocks: 13.1 us against 10.7, docs/performance.md; with one row per
            # warp the test passes from N = 785, below which it is unmeasured); ranked after it, ahead of the sm_89
            # kernels
            return Cost(1.1, "rule", f"{what}; {cfg.blocks(p.n)} blocks for {req.device.sm_count} SMs)")
        return Cost(0.9, "rule", f"{what}; memory-bound)")


class StreamCandidate(GeometryCandidate):
    """The decode range on sm_90a (M <= 64): b streamed once through a cp.async ring, each warp-wide copy 256-512
    contiguous bytes of a row, into wgmma with b's rows as A and the tokens as B (gemm/gemm_fp8_stream.cuh)."""

    name = "gemm_fp8.sm90a_stream"
    priority = 320
    min_arch = "sm_90"
    max_arch = "sm_90"
    arch_specific = True
    spec = staticmethod(geometry.stream_spec)

    @staticmethod
    def config(req: OpRequest) -> geometry.StreamConfig:
        return geometry.stream_config(problem(req), req.device.sm_count, req.device.max_smem_per_block_optin)

    def supports(self, req: OpRequest) -> str | None:
        p = problem(req)
        if p.m > geometry.STREAM_MAX_M:
            return f"m={p.m}: the streaming kernel takes M <= {geometry.STREAM_MAX_M} (the decode range; the tile " \
                   "kernel takes more rows)"
        return _reason(p) or _unaligned(p) or (
            None if self.config(req).stages >= 2 else
            f"a token tile of {self.config(req).nt} rows leaves no room for two stages in "
            f"{req.device.max_smem_per_block_optin} bytes of shared memory; the tile kernel (gemm_fp8.sm90a_wgmma) "
            "takes it")

    def cost(self, req: OpRequest) -> Cost:
        p, cfg = problem(req), self.config(req)
        what = f"M <= {geometry.STREAM_MAX_M}: b's rows streamed by cp.async into wgmma, a token tile of {cfg.nt}, " \
               f"{cfg.stages} stages of {cfg.span} K bytes"
        blocks, sms = cfg.blocks(p.n), req.device.sm_count
        wide = p.m > geometry.STREAM_FIRST_MAX_M
        if p.m == 1 and p.k >= geometry.GEMV_MIN_K and p.n * p.k >= geometry.STREAM_M1_MIN_BYTES and \
                _fills_sms(blocks, sms):
            # M = 1 on weights of 96 MiB and more: ahead of the GEMV kernel. H200, b from device memory, two rounds
            # on five weights of 126-252 MiB: 1.00-1.06x the GEMV kernel's GB/s per-tensor, 0.96-1.12x with block
            # scales; on 14-80 MiB weights 0.83-1.12x (the GEMV kernel 1.20x at 4096 x 7168, docs/performance.md).
            # Shorter rows (K < GEMV_MIN_K, where the GEMV kernel does not serve) were not measured: the tile kernel
            # keeps them
            return Cost(0.85, "rule", f"{what}; M = 1 on a weight of {p.n * p.k >> 20} MiB: more of b in flight than "
                                      "the GEMV kernel's rows (memory-bound)")
        # Fewer 64-row blocks than 3/4 of the SMs, M = 2..32, b from device memory (H200, CUDA-graph replays over
        # rotating copies of b, two rounds, docs/performance.md): from 2/5 of the SMs (64-96 blocks: N = 4096 and
        # 6144, K 4096-14336) 1.04-1.31x the tile kernel per-tensor, and 1.02-1.35x with block scales up to M = 8
        # (0.71-0.95x past it, but for 6144 x 4096); at 33 blocks (2112 x 7168) 0.99-1.03x per-tensor, 0.71-0.89x
        # block-scaled: the tile kernel's split-K clusters keep those, and shorter rows than measured
        narrow = not wide and _fills_part(blocks, sms) and p.k >= STREAM_NARROW_MIN_K and \
            (p.scale != "block" or p.m <= STREAM_NARROW_BLOCK_MAX_M)
        if p.m == 1 or not (_fills_sms(blocks, sms) or narrow) or (wide and (p.scale == "block" or cfg.per_sm < 2)):
            # M = 1 on smaller weights: the GEMV kernel (or the tile kernel where its blocks are few); M = 33..64
            # (measured at 64): 1.04-1.07x the tile kernel per-tensor with two blocks per SM (64 x 28672 x 8192, four
            # runs) but 0.87-0.89x with one (8192 x 28672, 7168 x 18432) and 0.81x with block scales (H200,
            # gemm_fp8_h200.md, docs/performance.md); narrow weights at M = 64 0.64-0.99x
            return Cost(1.2, "rule", f"{what}; {blocks} blocks for {sms} SMs, M = {p.m}, {p.scale} scales")
        return Cost(0.95, "rule", f"{what} (memory-bound)")


class SkinnyCandidate(GeometryCandidate):
    """The decode range (M <= 64) on tensor cores with mma.sync: b streamed once from device memory, no tiles to
    fill (gemm/gemm_fp8_skinny.cuh). sm_89's tensor-core path for decode; on sm_90 the streaming and tile kernels
    rank first."""

    name = "gemm_fp8.sm89_skinny"
    priority = 200
    min_arch = FP8_MIN_ARCH
    spec = staticmethod(geometry.skinny_spec)

    @staticmethod
    def config(req: OpRequest) -> geometry.SkinnyConfig:
        return geometry.skinny_config(problem(req), req.device.sm_count, req.device.max_smem_per_block_optin)

    @staticmethod
    def m_reason(m: int) -> str | None:
        if m > geometry.SKINNY_MAX_M:
            return f"m={m}: the skinny kernel takes M <= {geometry.SKINNY_MAX_M} (the decode range)"
        return None

    def supports(self, req: OpRequest) -> str | None:
        p = problem(req)
        return _reason(p) or self.m_reason(p.m) or _unaligned(p)

    def cost(self, req: OpRequest) -> Cost:
        # After the sm_90a streaming and tile kernels, which read b at a larger share of the copy bandwidth on an H200
        # (docs/performance.md, "fp8 GEMM and quantization"); ahead of the CUDA-core fallback, which it replaces on
        # sm_89 for M <= 64.
        return Cost(2.0, "rule", f"M <= {geometry.SKINNY_MAX_M}: mma.sync e4m3 streaming b once, "
                                 f"{self.config(req).slices} warp(s) per 8 rows of b (memory-bound)")


class Sm89MmaCandidate(SkinnyCandidate):
    """M past the decode range on the same mma.sync kernel in 64 x 64 output tiles, a grid row per 64 rows of a:
    sm_89's tensor-core path for prefill (it has no wgmma); on sm_90 ranked after the tile kernel."""

    name = "gemm_fp8.sm89_mma"
    MAX_M = 65535 * geometry.SKINNY_MAX_M  # the grid's y dimension

    @classmethod
    def m_reason(cls, m: int) -> str | None:
        if not geometry.SKINNY_MAX_M < m <= cls.MAX_M:
            return f"m={m}: this kernel takes {geometry.SKINNY_MAX_M} < M <= {cls.MAX_M} (M <= " \
                   f"{geometry.SKINNY_MAX_M}: gemm_fp8.sm89_skinny)"
        return None

    def cost(self, req: OpRequest) -> Cost:
        # After the sm_90a tile kernel (sm_90 runs each fp8 mma.sync as an unpack and two f16 HMMAs); ahead of the
        # CUDA-core fallback, which it replaces on sm_89 (docs/performance.md, "fp8 GEMM and quantization").
        return Cost(2.0, "rule", "M > 64: mma.sync e4m3 in 64 x 64 output tiles")


class SimtCandidate(Candidate):
    name = "gemm_fp8.simt"
    op = OP
    priority = 10
    min_arch = FP8_MIN_ARCH

    MAX_M = 65535 * geometry.SIMT_TILE[0]  # the grid's y dimension: a row of blocks per 64 rows of a

    def supports(self, req: OpRequest) -> str | None:
        p = problem(req)
        return _reason(p) or (None if p.m <= self.MAX_M else
                              f"m={p.m}: the CUDA-core kernel takes M <= {self.MAX_M} (a grid row per "
                              f"{geometry.SIMT_TILE[0]} rows of a); split the call along M")

    def cost(self, req: OpRequest) -> Cost:
        return Cost(8.0, "rule", "CUDA cores in fp32 (no fp8 tensor cores used): the fallback")

    def kernel_specs(self, req: OpRequest):
        return (geometry.simt_spec(problem(req), self.target(req)),)

    def launch_resources(self, req: OpRequest):
        return (Resources(block=geometry.SIMT_TILE[2]),)


class QuantCandidate(Candidate):
    name = "quantize_fp8.warp"
    op = QUANT_OP
    priority = 100
    min_arch = FP8_MIN_ARCH

    def supports(self, req: OpRequest) -> str | None:
        dt, g, k = req.dtype("x"), req.dim("group"), req.dim("k")
        why = dtype_reason("input dtype", dt, geometry.QUANT_DTYPES)
        if why:
            return why
        if g not in geometry.QUANT_GROUPS:
            return f"group={g} not supported; supported: {', '.join(map(str, geometry.QUANT_GROUPS))}"
        if k % g:
            return f"k={k} is not a multiple of group={g}"
        return None

    def cost(self, req: OpRequest) -> Cost:
        return Cost(1.0, "rule", "one memory-bound pass")

    def kernel_specs(self, req: OpRequest):
        return (geometry.quant_spec(req.dtype("x"), req.dim("group"), self.target(req)),)

    def launch_resources(self, req: OpRequest):
        return (Resources(block=256),)


CANDIDATES = (GemvCandidate, StreamCandidate, Sm90aWgmmaCandidate, SkinnyCandidate, Sm89MmaCandidate, SimtCandidate,
              QuantCandidate)

# ---- selection, memoized per request key and device -------------------------------------------------------------
_selections = SelectionMemo("gemm_fp8.selections")


def selection(req_key: tuple, make) -> Any:
    """The registry's selection for `make()`'s request, memoized under req_key per settings object."""
    return _selections.get(req_key, make, select)


# ---- explain / prefill ---------------------------------------------------------------------------------------------
_GEMM_OPTIONS = ("scale", "out", "bias", "aligned")


def build_request(shape, dtype, device, **options) -> OpRequest:
    """For `rtckern explain gemm_fp8`: shape MxNxK; options scale=tensor|channel|block, out=bf16|fp16|fp32,
    bias=none|bf16|fp16|fp32, aligned=0|1."""
    dims = [int(x) for x in shape]
    if len(dims) != 3:
        raise ValueError(f"gemm_fp8: shape {shape!r} should be MxNxK, e.g. 4096x4096x4096")
    opts.check_keys(OP, options, _GEMM_OPTIONS)
    m, n, k = dims
    dt = opts.parse_choice(OP, "dtype", dtype or "fp8_e4m3", geometry.INPUT_DTYPES)
    p = Fp8Problem(m=m, n=n, k=k, scale=opts.parse_choice(OP, "scale", options.get("scale", "tensor"),
                                                          geometry.SCALES),
                   out_dtype=opts.parse_choice(OP, "out", options.get("out", "bf16"), geometry.OUTPUT_DTYPES),
                   bias=opts.parse_choice(OP, "bias", options.get("bias", "none"), ("none",) + geometry.BIAS_DTYPES),
                   aligned=opts.flag(OP, options, "aligned", k % 16 == 0), dtype=dt)
    return request(p, device)


def build_quant_request(shape, dtype, device, **options) -> OpRequest:
    """For `rtckern explain quantize_fp8`: shape MxK; option group=32|64|128|256."""
    dims = [int(x) for x in shape]
    if len(dims) != 2:
        raise ValueError(f"quantize_fp8: shape {shape!r} should be MxK, e.g. 4096x7168")
    opts.check_keys(QUANT_OP, options, ("group",))
    group = int(options.get("group", 128))
    return quant_request(opts.parse_choice(QUANT_OP, "dtype", dtype or "bf16", geometry.QUANT_DTYPES), group,
                         dims[0], dims[1], device)


PREFILL_OUT = ("bf16",)


def prefill_specs(archs):
    """The kernels of the common requests on a typical device of each fp8-capable arch (prefill provider): both
    scale kinds with bf16 output, with and without a bf16 bias, at M = 1 (batch-1 decode: the GEMV kernel), 16 and
    4096 (both tile classes) on 4096 x 4096, and at M = 8 and 32 on 28672 x 8192 (sm_90a's streaming kernel, which
    serves decode on weights that fill the SMs); the quantizer for bf16 and fp16 inputs, groups of 128. Every
    candidate that serves a request is compiled, not only the one ranked first."""
    from rtckern.arch import ArchFilter
    from rtckern.registry.candidate import arch_filter

    out = {}
    for arch in ArchFilter.of(min_arch="8.9", vendors=("nvidia",)).targets(archs):
        dev = DeviceInfo.for_arch(arch)
        reqs = [build_request(shape, None, dev, scale=s, bias=b)
                for shape in ((1, 4096, 4096), (16, 4096, 4096), (4096, 4096, 4096), (8, 28672, 8192),
                              (32, 28672, 8192))
                for s in ("tensor", "block") for b in ("none", "bf16")]
        reqs += [quant_request(dt, 128, 4096, 4096, dev) for dt in ("bf16", "fp16")]
        for req in reqs:
            for cls in CANDIDATES:
                c = cls()
                if c.op != req.op or c.supports(req) is not None:
                    continue
                for target in arch_filter(c).targets([arch]):
                    for spec in c.kernel_specs(req):
                        out.setdefault(dataclasses.replace(spec, arch=target), None)
    return list(out)


@run_once
def register_all() -> None:
    """Register the fp8 candidates, request builders and kernel provider (idempotent)."""
    register_missing_candidates(CANDIDATES)
    register_missing_builder(OP, build_request, help="shape: MxNxK (a (M, K), b (N, K), both e4m3); options "
                             "scale=tensor|channel|block, out=bf16|fp16|fp32, bias=none|bf16|fp16|fp32, aligned=0|1",
                             example="--shape 4096x4096x4096 --opt scale=block")
    register_missing_builder(QUANT_OP, build_quant_request, help="shape: MxK; dtype fp32|fp16|bf16; option "
                             "group=32|64|128|256", example="--dtype bf16 --shape 4096x7168 --opt group=128")
    register_kernel_provider("gemm_fp8", prefill_specs)
    tuning.defer_tuners(f"{__package__}.tune", "register_tuner")  # imported by `rtckern tune` only
