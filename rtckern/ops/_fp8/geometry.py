"""fp8 GEMM and quantization plans: problem records, the sm_90a tile config, kernel specs. Nothing here touches a
GPU or validates user arrays (api.py does).

Kernels (kernel_sources/gemm/):
  gemm_fp8_wgmma_sm90   gemm_fp8_sm90.cuh: TMA + mbarrier ring + wgmma m64nNk32 e4m3, warp-specialized and
                        persistent; promotion of each K block of 128 into fp32 accumulators; sm_90a only
  gemm_fp8_gemv         gemm_fp8_gemv.cuh: M = 1, warps streaming whole rows of b into registers (sm_89+)
  gemm_fp8_stream       gemm_fp8_stream.cuh: M <= 64, a cp.async ring of b's rows into wgmma (sm_90a)
  gemm_fp8_skinny       gemm_fp8_skinny.cuh: M <= 64 on mma.sync, and sm_89's tiles past it (sm_89+)
  gemm_fp8_simt         gemm_fp8_simt.cuh: CUDA-core fallback (sm_89+, any alignment)
  quantize_fp8_groups   quantize_fp8.cuh: per-token-group quantization, one warp per group
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from rtckern.arch import Arch
from rtckern.dtypes import ctype
from rtckern.spec import KernelSpec

OP = "gemm_fp8"
QUANT_OP = "quantize_fp8"
INPUT_DTYPES = ("fp8_e4m3", "fp8_e5m2")  # a's; b is e4m3 (e5m2 a: gradients, RTK_FP8_A_E5M2)
GROUPED_INPUT_DTYPES = ("fp8_e4m3",)
OUTPUT_DTYPES = ("bf16", "fp16", "fp32")
BIAS_DTYPES = ("bf16", "fp16", "fp32")
QUANT_DTYPES = ("fp32", "fp16", "bf16")
QUANT_GROUPS = (32, 64, 128, 256)
# Scale granularities and their kernel ids (RTK_FP8_SCALE_* in kernel_sources/gemm/fp8.cuh). The fallback serves
# "tensor" with its "channel" epilogue (per row of a / per column of b, either side possibly per tensor); the sm_90a
# kernel has a scalar epilogue for "tensor".
SCALES = ("tensor", "channel", "block")
SCALE_IDS = MappingProxyType({"tensor": 0, "channel": 0, "block": 1})
SM90_SCALE_IDS = MappingProxyType({"tensor": 2, "channel": 0, "block": 1})
SCALE_BLOCK = 128  # block scales: 1 x 128 groups of a, 128 x 128 blocks of b
K_MULTIPLE = 16  # TMA row strides are multiples of 16 bytes; the fallback keeps the same contract
SMEM_LIMIT = 232448  # bytes a block may opt in to on sm_90
OUT_BYTES = MappingProxyType({"bf16": 2, "fp16": 2, "fp32": 4})
STORE_BOX_BYTES = 64 * 128  # RTK_FP8_TMA_STORE: one box of 64 output rows x 128 bytes; two per consumer


def k_reason(k: int, op: str) -> str | None:
    """Why `op` refuses K (its rows of a and b are read as 16-byte pieces), or None."""
    if k > 0 and k % K_MULTIPLE == 0:
        return None
    return (f"K={k} is not supported: {op} needs K a positive multiple of {K_MULTIPLE} (16-byte rows); pad K with "
            f"zeros (in a and b) to the next multiple of {K_MULTIPLE}")


@dataclass(frozen=True)
class Fp8Problem:
    """One gemm_fp8 call as far as kernel choice and compilation go. aligned: a's and b's bases are 16-byte
    aligned and their row strides multiples of 16 bytes (TMA)."""

    m: int
    n: int
    k: int
    scale: str = "tensor"
    out_dtype: str = "bf16"
    bias: str = "none"  # the bias dtype, or "none"
    aligned: bool = True
    dtype: str = "fp8_e4m3"  # a's (b is e4m3)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class Sm90Fp8Config:
    """bm x bn output tiles, `consumers` warpgroups of bm / consumers rows (multiples of 64), a ring of `stages`
    K blocks of 128; `cluster` 2: pairs of blocks on vertically adjacent tiles share B by TMA multicast
    (RTK_FP8_MULTICAST); `partials` 2: each consumer issues the next K block into a second partial accumulator
    before it promotes the last one (RTK_FP8_PARTIALS; bn <= 128); `splits` 2..4: clusters of that many blocks
    share each tile's K blocks and rank 0 adds their sums (RTK_FP8_SPLIT_K; decode shapes, whose few tiles leave SMs
    idle)."""

    kind = "sm90"

    bm: int = 128
    bn: int = 128
    stages: int = 6
    consumers: int = 2
    group_m: int = 8
    cluster: int = 1
    partials: int = 1
    splits: int = 1

    @property
    def threads(self) -> int:
        return (self.consumers + 1) * 128

    @property
    def smem_bytes(self) -> int:
        """The ring (and the slack to align it to 1024 B): what a kernel that stores from registers takes."""
        return self.stages * (self.bm + self.bn) * 128 + 1024

    def tma_store(self, p: Fp8Problem) -> bool:
        """Whether the kernel stores c with TMA (RTK_FP8_TMA_STORE): c's rows (n elements, the output the op
        allocates) are multiples of 16 bytes, and tiles of 128+ rows, where the epilogue is a share of a tile's time
        worth a tensor map per output address (64-row tiles serve decode shapes, whose calls are host-bound)."""
        return self.bm >= 128 and self.splits == 1 and p.n * OUT_BYTES.get(p.out_dtype, 1) % 16 == 0

    @property
    def cluster_size(self) -> int:
        """Blocks per cluster: the multicast pair, or the split-K ranks."""
        return self.cluster if self.cluster > 1 else self.splits

    def launch_smem(self, p: Fp8Problem) -> int:
        """Dynamic shared memory of the kernel for p: the ring, plus two store boxes per consumer (TMA store) or a
        peer's fp32 sums of the tile (split-K)."""
        extra = 2 * self.consumers * STORE_BOX_BYTES if self.tma_store(p) else 0
        return self.smem_bytes + extra + (self.bm * self.bn * 4 if self.splits > 1 else 0)

    def invalid(self, p: Fp8Problem) -> str | None:
        if self.consumers not in (1, 2) or (self.bm // self.consumers) % 64 or self.bm > 256:
            return f"bm={self.bm}, consumers={self.consumers}: each consumer needs a multiple of 64 rows, bm <= 256"
        if self.bn not in (64, 128, 256):
            return f"bn={self.bn}: supported 64, 128, 256"
        if self.cluster not in (1, 2) or (self.cluster == 2 and self.bn < 128):
            return f"cluster={self.cluster}, bn={self.bn}: clusters of 1, or of 2 with bn >= 128 (each block " \
                   "multicasts half of B's rows, a whole number of 64-row boxes)"
        if self.cluster == 2 and p.m <= self.bm:
            return f"cluster=2 with m={p.m} <= bm={self.bm}: one row block, nothing for a pair of blocks to share"
        if self.cluster == 2 and self.bn == 256 and (p.bias != "none" or p.scale == "block"):
            return "cluster=2 with bn=256 and a bias or block scales: beside the cluster's tile walk the consumers " \
                   "spill registers; bn=128 or cluster=1"
        if self.splits not in (1, 2, 3, 4) or (self.splits > 1 and self.cluster > 1):
            return f"splits={self.splits}, cluster={self.cluster}: split-K in clusters of 2 to 4 blocks, without " \
                   "multicast (cluster=1)"
        if self.splits > 1 and ((self.bm, self.consumers) != (64, 1) or self.bn > 128):
            return f"splits={self.splits} with a {self.bm}x{self.bn} tile, {self.consumers} consumer(s): split-K " \
                   "runs on the decode tiles, 64 rows, one consumer, up to 128 columns"
        if self.splits > 1 and p.m > self.bm:
            return f"splits={self.splits} with m={p.m}: split-K serves one row block (M <= {self.bm}); more rows " \
                   "fill the SMs without it"
        if self.splits > math.ceil(p.k / 128):
            return f"splits={self.splits} with k={p.k}: each split needs one of the {math.ceil(p.k / 128)} K " \
                   "blocks of 128"
        if self.partials not in (1, 2) or (self.partials == 2 and self.bn > 128):
            return f"partials={self.partials}, bn={self.bn}: 1, or 2 with bn <= 128 (one partial per K block)"
        # fp32 accumulators per thread: the tile's promoted sums (mi x bn / 2) and `partials` partials of at most
        # 128 columns (mi x min(bn, 128) / 2 each), within the 232 registers a consumer gets
        mi = (self.bm // self.consumers) // 64
        if mi * (self.bn + self.partials * min(self.bn, 128)) // 2 > 192:
            return f"{self.bm // self.consumers}x{self.bn} rows x columns per consumer: the promoted and partial " \
                   "accumulators exceed the registers"
        if p.scale == "channel" and self.bn > 128:
            return f"bn={self.bn}: per-channel scales need bn <= 128 (a scale per column pair in the epilogue, " \
                   "beside 128 x 256 accumulators, exceeds the registers)"
        if self.launch_smem(p) > SMEM_LIMIT:
            return f"{self.launch_smem(p)} bytes of shared memory exceed the 227 KB a block may have"
        if not p.aligned:
            return "TMA needs 16-byte aligned bases and row strides of a and b (K a multiple of 16)"
        return None

    def as_dict(self) -> dict:
        d = {"kind": self.kind, "bm": self.bm, "bn": self.bn, "stages": self.stages, "consumers": self.consumers,
             "group_m": self.group_m}
        if self.cluster != 1:  # rows of tables written before clusters stay as they were
            d["cluster"] = self.cluster
        if self.partials != 1:
            d["partials"] = self.partials
        if self.splits != 1:
            d["splits"] = self.splits
        return d


SIMT_TILE = (64, 64, 256)  # gemm_fp8_simt: bm, bn, threads

# gemm_fp8_skinny (the decode range, M <= SKINNY_MAX_M; larger M in row tiles of SKINNY_MAX_M): blocks of 8 warps,
# each octet of b's rows split over `slices` warps (1, 2 or 4) so that the grid has at least SKINNY_BLOCKS_PER_SM
# blocks per SM where N and M allow.
SKINNY_MAX_M = 64
SKINNY_THREADS = 256
SKINNY_BLOCKS_PER_SM = 3


@dataclass(frozen=True)
class SkinnyConfig:
    """gemm_fp8_skinny's geometry: `slices` warps share each octet's K; `half`: M <= 8 (the mma's upper rows are
    zeros); `stages` steps of 128 K in the cp.async ring; `mt` row tiles of 16 (M <= 16 mt)."""

    slices: int
    half: bool
    stages: int = 6
    mt: int = 1

    kind = "skinny"

    def blocks(self, n: int) -> int:
        return math.ceil(n / (8 * (8 // self.slices)))

    @staticmethod
    def row_tiles(m: int) -> int:
        """The grid's rows of blocks: one per SKINNY_MAX_M rows of a."""
        return max(1, math.ceil(m / SKINNY_MAX_M))

    @property
    def step_bytes(self) -> int:
        """rtk_fp8_skinny_step_bytes: b's 64 rows of 192 bytes and a's 8, or 16 per row tile, rows of slices x 128 + 64
        bytes."""
        return 64 * 192 + (8 if self.half else 16 * self.mt) * (self.slices * 128 + 64)

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.step_bytes

    def launch_geometry(self, p: Fp8Problem) -> tuple[tuple, tuple, int]:
        """(grid, block, dynamic shared memory) of the launch for p."""
        return (self.blocks(p.n), self.row_tiles(p.m), 1), (SKINNY_THREADS, 1, 1), self.smem_bytes

    def as_dict(self) -> dict:
        return {"kind": self.kind, "slices": self.slices, "half": self.half, "stages": self.stages, "mt": self.mt}


# The ring's share of a block's shared memory: two blocks per SM where the GPU has the room (sm_90: 227 KB per SM),
# one where a block may have less (sm_89: 99 KB).
SKINNY_RING_BYTES = 112 * 1024
SKINNY_MIN_STAGES = 3
SKINNY_MAX_STAGES = 12


def skinny_config(p: Fp8Problem, sm_count: int, smem_optin: int = SMEM_LIMIT) -> SkinnyConfig:
    """The fewest slices per octet (more octets per block, less of a's traffic) that give every SM
    SKINNY_BLOCKS_PER_SM blocks, at most 4, and no more than K's steps of 128 go round, and no more than let
    SKINNY_MIN_STAGES steps of a's rows fit; then as many ring stages (3..12) as fit in min(SKINNY_RING_BYTES, the
    block's shared memory). M > SKINNY_MAX_M: four row tiles per block, a grid row per 64 rows."""
    budget = min(SKINNY_RING_BYTES, smem_optin)
    steps = math.ceil(p.k / 128)
    half, mt, rows = p.m <= 8, min(4, max(1, math.ceil(p.m / 16))), SkinnyConfig.row_tiles(p.m)
    slices = 1
    while slices < 4 and math.ceil(p.n * slices / 64) * rows < SKINNY_BLOCKS_PER_SM * sm_count \
            and steps >= 2 * slices \
            and SKINNY_MIN_STAGES * SkinnyConfig(slices * 2, half, 1, mt).step_bytes <= budget:
        slices *= 2
    step = SkinnyConfig(slices, half, 1, mt).step_bytes
    return SkinnyConfig(slices, half, max(SKINNY_MIN_STAGES, min(SKINNY_MAX_STAGES, budget // step)), mt)


# gemm_fp8_gemv (batch-1 decode): warps of GEMV_WARPS stream `rows` rows of b each, `unroll` 512-byte loads per row
# and round, two rounds in flight; a's row as floats in shared memory. Where it serves (measured on an H200
# against the tile kernel at M = 1, docs/performance.md): one row of a and K of at least GEMV_MIN_K (a shorter row
# gives a lane too few loads); one row per warp up to GEMV_NARROW_N rows of b, four past it; two loads per row and
# round on narrow weights and past GEMV_LONG_K.
GEMV_MAX_M = 1
GEMV_MIN_K = 2048
GEMV_LONG_K = 8192
GEMV_NARROW_N = 4096
GEMV_WARPS = 8  # RTK_FP8_GEMV_WARPS


@dataclass(frozen=True)
class GemvConfig:
    """gemm_fp8_gemv's geometry: `rows` rows of b per warp, `unroll` loads of 16 bytes per lane, row and round."""

    rows: int = 4
    unroll: int = 1

    kind = "gemv"

    def blocks(self, n: int) -> int:
        return math.ceil(n / (GEMV_WARPS * self.rows))

    @staticmethod
    def smem_bytes(k: int) -> int:
        """a's row as floats, its 16-byte pieces rounded up to a warp's 32 (the kernel's piece-major layout)."""
        return math.ceil(k / 512) * 512 * 4

    def launch_geometry(self, p: Fp8Problem) -> tuple[tuple, tuple, int]:
        """(grid, block, dynamic shared memory) of the launch for p."""
        return (self.blocks(p.n), 1, 1), (32 * GEMV_WARPS, 1, 1), self.smem_bytes(p.k)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "rows": self.rows, "unroll": self.unroll}


def gemv_config(p: Fp8Problem) -> GemvConfig:
    """Up to GEMV_NARROW_N rows of b, one row per warp with two 16-byte loads per lane and round (four rows per warp
    leave each SM too few warps, too few loads in flight: on 1024-4096-row weights 0.69-1.25x the tile kernel's time
    with four, 0.45-0.73x with one); past it four rows per warp, one load up to K = GEMV_LONG_K, two past it: the
    fastest builds on 132-470 MB weights. Two rounds in flight; measured on an H200 at M = 1 (docs/performance.md)."""
    if p.n <= GEMV_NARROW_N:
        return GemvConfig(1, 2)
    return GemvConfig(4, 1 if p.k <= GEMV_LONG_K else 2)


# gemm_fp8_stream (sm_90a, the decode range M <= STREAM_MAX_M; M = 1 from STREAM_M1_MIN_BYTES): blocks of one
# warpgroup on 64 rows of b, a cp.async ring of stages of 256 or 512 K bytes (each warp-wide copy 256-512 contiguous
# bytes of a row), b's rows as wgmma's A and the tokens, rounded up to STREAM_TOKEN_TILES, as its B.
STREAM_MAX_M = 64
STREAM_FIRST_MAX_M = 32  # ranked ahead of the tile kernel up to here; past it only in some cases (StreamCandidate.cost)
# M = 1 with K >= GEMV_MIN_K: the streaming kernel ranks ahead of the GEMV kernel on weights (N x K bytes) from here
# (about twice the L2), where its rings keep more of b in flight (StreamCandidate.cost; measured on an H200)
STREAM_M1_MIN_BYTES = 96 << 20
STREAM_TOKEN_TILES = (8, 16, 32, 64)  # the wgmma N of the kernel's token tile (wgmma_fp8_narrow_ops.cuh)
STREAM_ROWS = 64
STREAM_THREADS = 128
STREAM_MAX_STAGES = 6
SMEM_RESERVED_PER_BLOCK = 1024  # shared memory the SM sets aside for each resident block (sm_80+)
STREAM_RING_ALIGN = 1024  # the ring's start rounded up to the swizzled sub-tiles' 1024-byte atoms


@dataclass(frozen=True)
class StreamConfig:
    """gemm_fp8_stream's geometry: a token tile of `nt` rows, a ring of `stages` stages of `span` K bytes (256 or
    512: each warp-wide copy two rows' or one row's contiguous bytes)."""

    nt: int
    stages: int
    span: int = 512
    per_sm: int = 1  # blocks per SM the ring leaves room for: 2 where the grid has two per SM

    kind = "stream"

    @staticmethod
    def stage_bytes(nt: int, span: int = 512) -> int:
        """b's and a's rows of `span` K bytes, then the block scales of its K blocks padded to 1024 bytes (reserved
        for every scale kind: rtk_fp8_stream_stage_bytes)."""
        return (STREAM_ROWS + nt) * span + math.ceil((nt + 1) * (span // 128) * 4 / 1024) * 1024

    @property
    def smem_bytes(self) -> int:
        """The ring, and the bytes to align it."""
        return self.stages * self.stage_bytes(self.nt, self.span) + STREAM_RING_ALIGN

    @staticmethod
    def blocks(n: int) -> int:
        return math.ceil(n / STREAM_ROWS)

    def launch_geometry(self, p: Fp8Problem) -> tuple[tuple, tuple, int]:
        """(grid, block, dynamic shared memory) of the launch for p."""
        return (self.blocks(p.n), 1, 1), (STREAM_THREADS, 1, 1), self.smem_bytes

    def as_dict(self) -> dict:
        return {"kind": self.kind, "nt": self.nt, "stages": self.stages, "span": self.span, "per_sm": self.per_sm}


def stream_config(p: Fp8Problem, sm_count: int = 132, smem_limit: int = 227 * 1024) -> StreamConfig:
    """The smallest token tile that holds M; where the grid has two blocks per SM or more, a ring that lets two
    blocks share an SM (3 stages of 512 K bytes where they fit in half the shared memory, else as many of 256), so
    one block's copies run while the other waits on its wgmmas; else one block per SM with as many stages of 512 as
    its shared memory takes (up to STREAM_MAX_STAGES). Measured on an H200 (docs/performance.md): at 28672 x 8192,
    two blocks per SM read 3.3-3.9 TB/s against 2.9-3.6 with one; at 8192 x 28672 and 7168 x 18432 (128 and 112
    blocks) the deepest ring was the fastest. smem_limit: a block's opt-in limit, 1 KB under the SM's shared memory
    (sm_80+), of which each resident block reserves 1 KB."""
    nt = next((t for t in STREAM_TOKEN_TILES if t >= p.m), None)
    if nt is None:
        raise ValueError(f"m={p.m}: the streaming kernel takes M <= {STREAM_MAX_M}; the tile kernel "
                         "(gemm_fp8.sm90a_wgmma) takes more rows")
    if StreamConfig.blocks(p.n) >= 2 * sm_count:
        # two blocks' rings, alignment and reservations within the SM's shared memory (the opt-in limit + one
        # reservation)
        budget = (smem_limit + SMEM_RESERVED_PER_BLOCK) // 2 - SMEM_RESERVED_PER_BLOCK - STREAM_RING_ALIGN
        if 3 * StreamConfig.stage_bytes(nt, 512) <= budget:
            return StreamConfig(nt, 3, 512, 2)
        return StreamConfig(nt, min(STREAM_MAX_STAGES, budget // StreamConfig.stage_bytes(nt, 256)), 256, 2)
    stages = (smem_limit - STREAM_RING_ALIGN) // StreamConfig.stage_bytes(nt, 512)
    return StreamConfig(nt, min(STREAM_MAX_STAGES, stages), 512)


def _skinny_params_spec(kernel: str, p: Fp8Problem, arch: Arch, *config_args) -> KernelSpec:
    """A kernel taking gemm_fp8_skinny's parameters (gemm/<kernel>.cuh): template arguments output, bias, whether
    there is one and the scale kind, then the config's."""
    return KernelSpec(source=f"gemm/{kernel}.cuh", name=kernel, arch=arch, op=OP,
                      template_args=(ctype(p.out_dtype), _bias_ctype(p), p.bias != "none", SCALE_IDS[p.scale],
                                     *config_args),
                      defines=_a_defines(p))


def stream_spec(p: Fp8Problem, cfg: StreamConfig, arch: Arch) -> KernelSpec:
    return _skinny_params_spec("gemm_fp8_stream", p, arch, cfg.nt, cfg.stages, cfg.span)


def gemv_spec(p: Fp8Problem, cfg: GemvConfig, arch: Arch) -> KernelSpec:
    return _skinny_params_spec("gemm_fp8_gemv", p, arch, cfg.rows, cfg.unroll)


def skinny_spec(p: Fp8Problem, cfg: SkinnyConfig, arch: Arch) -> KernelSpec:
    return _skinny_params_spec("gemm_fp8_skinny", p, arch, cfg.slices, cfg.half, cfg.stages, cfg.mt)


def _bias_ctype(p: Fp8Problem) -> str:
    return ctype(p.bias if p.bias != "none" else p.out_dtype)


def sm90_spec(p: Fp8Problem, cfg: Sm90Fp8Config, arch: Arch) -> KernelSpec:
    defines = ((("RTK_FP8_MULTICAST", "1"),) if cfg.cluster == 2 else ()) + \
        ((("RTK_FP8_TMA_STORE", "1"),) if cfg.tma_store(p) else ()) + \
        ((("RTK_FP8_PARTIALS", "2"),) if cfg.partials == 2 else ()) + \
        ((("RTK_FP8_SPLIT_K", str(cfg.splits)),) if cfg.splits > 1 else ()) + _a_defines(p)
    return KernelSpec(source="gemm/gemm_fp8_sm90.cuh", name="gemm_fp8_wgmma_sm90", arch=arch, op=OP,
                      template_args=(ctype(p.out_dtype), _bias_ctype(p), cfg.bm, cfg.bn, cfg.stages, cfg.consumers,
                                     p.bias != "none", SM90_SCALE_IDS[p.scale]),
                      defines=defines)


def simt_spec(p: Fp8Problem, arch: Arch) -> KernelSpec:
    return KernelSpec(source="gemm/gemm_fp8_simt.cuh", name="gemm_fp8_simt", arch=arch, op=OP,
                      template_args=(ctype(p.out_dtype), _bias_ctype(p), p.bias != "none", SCALE_IDS[p.scale]),
                      defines=_a_defines(p))


def _a_defines(p: Fp8Problem) -> tuple:
    return (("RTK_FP8_A_E5M2", "1"),) if p.dtype == "fp8_e5m2" else ()


def quant_spec(dtype: str, group: int, arch: Arch) -> KernelSpec:
    return KernelSpec(source="gemm/quantize_fp8.cuh", name="quantize_fp8_groups", arch=arch, op=QUANT_OP,
                      template_args=(ctype(dtype), group))


def tma_aligned_rows(m: int) -> int:
    """Rows of the column-major scale layout: m rounded up to 16 bytes of fp32 (DeepGEMM's get_tma_aligned_size)."""
    return math.ceil(m / 4) * 4


def kb_count(k: int) -> int:
    return math.ceil(k / SCALE_BLOCK)
