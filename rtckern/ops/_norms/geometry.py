"""Launch geometry of the norm kernels: the problem records (a call's compile-relevant features), the config
records of each kernel kind, the geometry rules (vector width, threads and blocks per row, shared memory), whether
a config can serve a problem (`fwd_feasible`, `bwd_feasible`: register and shared-memory budgets) and the kernel
specs (source, name, template arguments) of a (problem, kind, config). Pure Python (no GPU, no array library):
the plans, candidates, configs, tuner, tests and benchmark share it.

Four kernel kinds per direction (kernel_sources/norms/):
  rows    one group of TPR threads per row, the row in registers (RPB rows per block when TPR <= warp)
  cluster sm_90+: a cluster of C blocks per row, slices in registers, statistics through distributed smem
  coop    any arch: G blocks per row, co-resident (cooperative launch), statistics through global memory
  l2      one block per row, no row data in registers: pass 1 computes the statistics, pass 2 re-reads the row
          from L2 (backward: persistent blocks, the column sums in shared memory)
  l2c     backward only, sm_90+: the l2 backward with each row's columns split over a cluster of C blocks (row
          sums through distributed shared memory), each block's column sums and weights in registers
  stage   backward only, sm_80+: persistent blocks staging DEPTH rows of x and dy in shared memory with cp.async
          (loads in flight cost no registers), column sums and weights in registers
Backward kernels write fp32 partial column sums of dy * x_hat (and dy); `rtk_norm_dw_reduce` adds them in a
fixed order, so dweight is bitwise repeatable for a given device and shape.
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

from rtckern.arch import Arch
from rtckern.dtypes import FLOATS, ctype, itemsizes
from rtckern.spec import KernelSpec

# Mirrors kernel_sources/norms/norm_common.cuh.
LAYER, WEIGHT, BIAS, ZERO_CENTERED, RESIDUAL, SAVE_STATS, WEIGHT_GRAD = 1, 2, 4, 8, 16, 32, 64

DTYPES = FLOATS
ITEMSIZE = itemsizes(DTYPES)  # a plain dict: read in the launch planning loops

SOURCES = MappingProxyType({
    ("fwd", "rows"): ("norms/fwd_rows.cuh", "rtk_norm_fwd_rows"),
    ("fwd", "cluster"): ("norms/fwd_cluster.cuh", "rtk_norm_fwd_cluster"),
    ("fwd", "coop"): ("norms/coop.cuh", "rtk_norm_fwd_coop"),
    ("bwd", "rows"): ("norms/bwd_rows.cuh", "rtk_norm_bwd_rows"),
    ("bwd", "cluster"): ("norms/bwd_cluster.cuh", "rtk_norm_bwd_cluster"),
    ("bwd", "coop"): ("norms/coop.cuh", "rtk_norm_bwd_coop"),
    ("fwd", "l2"): ("norms/fwd_l2.cuh", "rtk_norm_fwd_l2"),
    ("bwd", "l2"): ("norms/bwd_l2.cuh", "rtk_norm_bwd_l2"),
    ("bwd", "l2c"): ("norms/bwd_l2c.cuh", "rtk_norm_bwd_l2c"),
    ("bwd", "stage"): ("norms/bwd_stage.cuh", "rtk_norm_bwd_stage"),
})
KINDS = ("rows", "cluster", "coop", "l2", "l2c", "stage")
BWD_ONLY_KINDS = ("l2c", "stage")
DW_REDUCE = ("norms/dw_reduce.cuh", "rtk_norm_dw_reduce")
DW_REDUCE_BLOCK = 512
DW_REDUCE_COLS = 32

# Register budget of one thread's share of a row, in bytes of storage (x, plus dy in the backward). Past it
# the row kernels spill or lose occupancy and the multi-block kernels take over.
FWD_MAX_THREAD_BYTES = 128
BWD_MAX_THREAD_ELEMS = 32  # feasibility; the heuristics aim at BWD_TARGET_THREAD_ELEMS
BWD_TARGET_THREAD_ELEMS = 16
MAX_CLUSTER = 8  # the portable cluster size
# l2c only: clusters of up to 16 blocks with the non-portable cluster size opt-in (H100 / H200 allow 16).
MAX_CLUSTER_L2C = 16
# l2 backward: its fp32 column sums (dweight, dbias) live in dynamic shared memory, N * 4 bytes each; the static
# scratch of the block reduction takes the rest of the opt-in limit.
BWD_L2_STATIC_SMEM = 1024
FWD_L2_STATIC_SMEM = 1024  # l2 forward: the block reduction's static scratch, beside the stash
# l2c backward: columns per thread (its fp32 dweight / dbias sums and effective weight live in registers).
BWD_L2C_MAX_THREAD_COLS = 32
BWD_L2C_TARGET_THREAD_COLS = 16
BWD_STAGE_MAX_THREAD_COLS = 32  # stage backward: column sums per thread in registers (2 per column with dbias)
L2C_SMEM_SUMS = 64  # OPT bit: the column sums in static shared memory (kOptSmemSums), under the 48 KB static limit
L2C_RETIRED_OPT = 16 | 128  # l2c OPT bits no longer built (64-register cap, four rows per iteration)
L2_POLICY = 256  # OPT bit of the l2 / l2c kernels: the first read L2 evict_last, the re-read evict_first (sm_80+)
# OPT bits of the cluster forward: persistent clusters (1); with it, kOptSmemAffine (512): two-sum slice
# statistics, and a weight / bias slice too large for registers held in dynamic shared memory for every row.
PERSIST = 1
SMEM_AFFINE = 512
PIPE_STATS = 1024  # with both: row k+1's statistics and cluster barrier run before row k is written
EARLY_AFFINE_BYTES = 64  # rtk_norm_early_affine: weight + bias bytes per thread held in registers
# OPT 512 persistent cluster forward: bytes of rows one thread keeps in registers (this row and the next, with OPT
# 1024 a third; x and the residual each). Past it ptxas spills (a residual at 128 B per row: 84-516 B of spills).
FWD_PERSIST_HELD_BYTES = 384
BWD_L2C_MAX_STATIC_SMEM = 44 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Problem:
    """What a forward and a backward call share: the norm (layer: LayerNorm, else RMSNorm), the row length, x's
    dtype, w (the weight's dtype; see each direction for a bias alone), zero-centering, the vector width."""

    layer: bool
    n: int
    x: str
    w: str | None = None
    has_weight: bool = True
    zero_centered: bool = False
    vec: int = 1  # elements per access; N % vec == 0 and every array aligned to min(16, vec * itemsize)

    # The FLAGS template argument's bit (norm_common.cuh) of each boolean field, besides WEIGHT (a weight given);
    # each direction adds its own.
    FLAG_BITS = (("layer", LAYER), ("zero_centered", ZERO_CENTERED))

    @property
    def flags(self) -> int:
        bits = WEIGHT if (self.w and self.has_weight) else 0
        for field, bit in self.FLAG_BITS:
            if getattr(self, field):
                bits |= bit
        return bits

    @property
    def w_type(self) -> str:
        return ctype(self.w or self.x)  # unused pointer type when there is no weight


@dataclasses.dataclass(frozen=True, kw_only=True)
class FwdProblem(_Problem):
    """A forward call's compile-relevant features. w: dtype of the weight and bias (None with neither);
    has_weight False for a bias without a weight."""

    y: str
    bias: bool = False
    residual: bool = False
    save_stats: bool = False

    FLAG_BITS = _Problem.FLAG_BITS + (("bias", BIAS), ("residual", RESIDUAL), ("save_stats", SAVE_STATS))

    def type_args(self) -> tuple[str, str, str]:
        return ctype(self.x), self.w_type, ctype(self.y)

    def bytes_moved(self, rows: int) -> int:
        """Bytes the op must move: x (+ residual) read, y (+ h) written, weight (+ bias) read once."""
        per_row = self.n * (ITEMSIZE[self.x] * (3 if self.residual else 1) + ITEMSIZE[self.y])
        affine = self.n * ITEMSIZE[self.w] * ((1 if self.has_weight else 0) + (1 if self.bias else 0)) if self.w else 0
        return rows * per_row + affine


@dataclasses.dataclass(frozen=True, kw_only=True)
class BwdProblem(_Problem):
    """A backward call's compile-relevant features. w: the weight's dtype (None without a weight; the bias's
    dtype, with has_weight False, for a bias alone); weight_grad / bias_grad: dweight / dbias wanted."""

    dy: str
    dx: str
    weight_grad: bool = False
    bias_grad: bool = False
    dresidual: bool = False

    FLAG_BITS = _Problem.FLAG_BITS + (("weight_grad", WEIGHT_GRAD), ("bias_grad", BIAS), ("dresidual", RESIDUAL))

    def type_args(self) -> tuple[str, str, str, str]:
        return ctype(self.x), self.w_type, ctype(self.dy), ctype(self.dx)

    def bytes_moved(self, rows: int) -> int:
        """x, dy (+ dresidual) read, dx written, weight read, dweight (+ dbias) written."""
        per_row = self.n * (ITEMSIZE[self.x] + ITEMSIZE[self.dy] + ITEMSIZE[self.dx] * (2 if self.dresidual else 1))
        wsize = ITEMSIZE[self.w] if self.w else 0
        reads = 1 if (self.w and self.has_weight) else 0
        grads = (1 if self.weight_grad else 0) + (1 if self.bias_grad else 0)
        return rows * per_row + self.n * wsize * (reads + grads)


# ---- vector width -----------------------------------------------------------------------------------------------
def pick_vec(n: int, itemsizes: tuple[int, ...], alignments: tuple[int, ...]) -> int:
    """Elements per access: 16 bytes of the widest-needed storage type (x's), halved until it divides N and every
    array's byte alignment (address and row stride) allows min(16, vec * itemsize)."""
    vec = 16 // itemsizes[0]
    while vec > 1:
        if n % vec == 0 and all(al % min(16, vec * sz) == 0 for sz, al in zip(itemsizes, alignments)):
            break
        vec //= 2
    return vec


def byte_alignment(address: int, row_stride_bytes: int) -> int:
    """The largest power of two (up to 16) dividing both the address and the row stride in bytes."""
    a = 16
    while a > 1 and (address % a or row_stride_bytes % a):
        a //= 2
    return a


# ---- geometry ---------------------------------------------------------------------------------------------------
def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    """The row kernel's config: threads per row, rows per block, OPT bits."""
    tpr: int  # threads per row
    rpb: int  # rows per block
    opt: int = 0  # OPT bits: 1 persistent / prefetch the next row, 2 default-cached loads

    @property
    def block(self) -> int:
        return self.tpr * self.rpb


def rows_config(n: int, vec: int, warp: int = 32, packs_per_thread: int = 4, block_rows_min: int = 128,
                max_tpr: int = 1024) -> RowsConfig:
    """Threads per row so each thread holds about `packs_per_thread` packs: short rows share a warp (several
    rows per block), long rows take a whole block (a multiple of the warp size; exact division preferred so no
    thread idles on a partial last pack)."""
    packs = n // vec
    if packs <= warp:
        tpr = _pow2_at_least(packs)
        return RowsConfig(tpr, max(1, block_rows_min // tpr))
    if packs <= warp * packs_per_thread:
        return RowsConfig(warp, max(1, block_rows_min // warp))
    for nv in (packs_per_thread, packs_per_thread * 2, packs_per_thread // 2 or 1, 3, 5, 6, 7):
        if packs % nv == 0 and (packs // nv) % warp == 0 and packs // nv <= max_tpr:
            return RowsConfig(packs // nv, 1)
    tpr = min(max_tpr, _ceil(_ceil(packs, packs_per_thread), warp) * warp)
    return RowsConfig(tpr, 1)


def packs_per_thread(n: int, vec: int, tpr: int, parts: int = 1) -> int:
    """NV in the kernels: packs per thread of one slice of a row split `parts` ways."""
    slice_packs = _ceil(n // vec, parts)
    return _ceil(slice_packs, tpr)


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Several blocks per row: `parts` blocks (cluster size C or coop group G) of `threads` threads."""

    threads: int
    parts: int
    opt: int = 0


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """Persistent blocks of `threads` threads, each with `depth` rows of x and dy in flight in shared memory."""

    threads: int
    depth: int
    opt: int = 0

    @property
    def block(self) -> int:
        return self.threads


def stage_smem(p: "BwdProblem", cfg: StageConfig) -> int:
    """Dynamic shared memory of the staged backward: `depth` buffers of one row of x and one of dy (each rounded up
    to 16 bytes)."""
    def row(itemsize: int) -> int:
        return -(-p.n * itemsize // 16) * 16
    return cfg.depth * (row(ITEMSIZE[p.x]) + row(ITEMSIZE[p.dy]))


def stage_config(p: "BwdProblem", warp: int = 32, smem: int = 227 * 1024) -> StageConfig | None:
    """The fewest threads (from 256) that keep each thread's column sums at most BWD_STAGE_MAX_THREAD_COLS
    columns, with as many rows in flight (2-4) as one block's shared memory holds."""
    packs = p.n // p.vec
    for threads in (256, 384, 512, 768, 1024):
        if packs_per_thread(p.n, p.vec, threads) * p.vec <= BWD_STAGE_MAX_THREAD_COLS and packs >= threads // 2:
            for depth in (4, 3, 2):
                cfg = StageConfig(threads, depth)
                if stage_smem(p, cfg) <= smem - BWD_L2_STATIC_SMEM:
                    return cfg
            return None
    return None


@dataclasses.dataclass(frozen=True)
class L2Config:
    """One block of `threads` threads per row (forward) or persistent blocks walking rows (backward); `minb`:
    the blocks per SM asked of __launch_bounds__ (caps registers); `stash` (forward): packs per thread kept in
    dynamic shared memory between the passes instead of re-read from L2; `parts` (forward, sm_90+): each row split
    over a cluster of that many blocks (finer work units for few long rows)."""

    threads: int
    minb: int = 1
    opt: int = 0
    stash: int = 0
    parts: int = 1

    @property
    def block(self) -> int:
        return self.threads


def l2_config(n: int, vec: int, backward: bool, warp: int = 32) -> L2Config:
    """The fewest threads (from 256) that give each thread at most 8 (forward) or 4 (backward) packs per row; the
    backward fuses pass 2 of a row with pass 1 of the next (OPT 1)."""
    packs = n // vec
    per = 4 if backward else 8
    for threads in (256, 512, 1024):
        if _ceil(packs, threads) <= per:
            break
    return L2Config(threads, 1, 1 if backward else 0)


def affine_thread_bytes(p: FwdProblem, cfg: SplitConfig) -> int:
    """Bytes of weight and bias packs one thread of a cluster forward block covers."""
    count = (1 if (p.w and p.has_weight) else 0) + (1 if p.bias else 0)
    return count * packs_per_thread(p.n, p.vec, cfg.threads, cfg.parts) * p.vec * (ITEMSIZE[p.w] if p.w else 0)


def fwd_cluster_smem(p: FwdProblem, cfg: SplitConfig) -> int:
    """Dynamic shared memory of the cluster forward: with SMEM_AFFINE (and PERSIST), the block's weight and bias
    slice (NV * threads packs each) where they are too large for registers."""
    ab = affine_thread_bytes(p, cfg)
    return ab * cfg.threads if cfg.opt & SMEM_AFFINE and cfg.opt & PERSIST and ab > EARLY_AFFINE_BYTES else 0


def fwd_l2_smem(p: FwdProblem, cfg: L2Config) -> int:
    """Dynamic shared memory of the l2 forward: its stash of `cfg.stash` packs per thread."""
    return cfg.stash * cfg.threads * p.vec * ITEMSIZE[p.x]


def bwd_l2_smem(p: "BwdProblem") -> int:
    """Dynamic shared memory of the l2 backward: the block's fp32 column sums."""
    return p.n * 4 * ((1 if p.weight_grad else 0) + (1 if p.bias_grad else 0))


def l2c_config(n: int, vec: int, warp: int = 32) -> SplitConfig | None:
    """The smallest cluster (then the fewest threads, from 256) that leaves each thread at most
    BWD_L2C_TARGET_THREAD_COLS columns of its slice (then at most BWD_L2C_MAX_THREAD_COLS)."""
    packs = n // vec
    for limit in (BWD_L2C_TARGET_THREAD_COLS, BWD_L2C_MAX_THREAD_COLS):
        for parts in (2, 4, 8):
            for threads in (256, 512):
                if packs_per_thread(n, vec, threads, parts) * vec <= limit and _ceil(packs, parts) >= threads // 2:
                    return SplitConfig(threads, parts)
    return None


def split_config(n: int, vec: int, itemsize: int, max_parts: int, warp: int = 32,
                 target_bytes: int = 64, max_bytes: int = FWD_MAX_THREAD_BYTES) -> SplitConfig | None:
    """The fewest blocks per row (then the fewest threads) that keep each thread's share of the row at about
    `target_bytes` (at most `max_bytes`)."""
    packs = n // vec
    # 1024-thread blocks only as a last resort: their 64-register cap makes long slices spill.
    for limit, sizes in ((target_bytes, (256, 512)), (max_bytes, (256, 512)), (max_bytes // 2, (1024,))):
        parts = 2
        while parts <= max_parts:
            for threads in sizes:
                nv = packs_per_thread(n, vec, threads, parts)
                if nv * vec * itemsize <= limit and _ceil(packs, parts) >= threads // 2:
                    return SplitConfig(threads, parts)
            parts *= 2
    return None


# ---- feasibility ----------------------------------------------------------------------------------------------
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
        if cfg.parts > 1 and slice_cols(n, vec, cfg.parts) * (cfg.parts - 1) >= n:
            return f"N={n} is too short to split into {cfg.parts} slices of whole {vec}-element packs"
        return None
    if kind == "rows":
        if cfg.tpr < 1 or cfg.rpb < 1 or cfg.block > 1024 or (cfg.rpb > 1 and cfg.tpr > warp) or \
                (cfg.tpr > warp and cfg.tpr % warp) or (cfg.tpr <= warp and cfg.tpr & (cfg.tpr - 1)):
            return f"{cfg.tpr} threads per row x {cfg.rpb} rows per block is not a valid row-kernel geometry"
        return None
    cap = {"cluster": MAX_CLUSTER, "l2c": MAX_CLUSTER_L2C}.get(kind, warp)
    if not 2 <= cfg.parts <= cap or cfg.threads % warp or cfg.threads > 1024:
        return f"{cfg.parts} blocks of {cfg.threads} threads per row is not a valid {kind} geometry (2..{cap} blocks)"
    if slice_cols(n, vec, cfg.parts) * (cfg.parts - 1) >= n:
        return f"N={n} is too short to split into {cfg.parts} slices of whole {vec}-element packs"
    return None


def _geometry_text(kind: str, cfg) -> str:
    if kind in ("l2", "stage"):
        return f"{cfg.threads} threads per block"
    return f"{cfg.tpr} threads per row" if kind == "rows" else f"{cfg.parts} blocks x {cfg.threads} threads per row"


def fwd_feasible(p: FwdProblem, kind: str, cfg, warp: int = 32, smem_optin: int = 227 * 1024) -> str | None:
    """None when cfg can serve p, else why not."""
    why = geometry_reason(p.n, p.vec, kind, cfg, warp)
    if why is not None:
        return why
    if kind == "l2" and cfg.stash:
        nv = packs_per_thread(p.n, p.vec, cfg.threads, cfg.parts)
        if not 0 < cfg.stash <= nv:
            return f"a stash of {cfg.stash} packs per thread is not in 0..{nv} (the packs per thread of N={p.n})"
        need, room = fwd_l2_smem(p, cfg), smem_optin - FWD_L2_STATIC_SMEM
        if need > room:
            return (f"a stash of {cfg.stash} packs per thread needs {need} B of shared memory per block, over the "
                    f"{room} B this device allows: use a smaller stash")
    if kind == "cluster" and cfg.opt & PIPE_STATS and not (cfg.opt & PERSIST and cfg.opt & SMEM_AFFINE):
        return f"OPT {cfg.opt}: OPT 1024 (pipelined statistics) needs OPT 1 and 512 (persistent, two-sum statistics)"
    if kind == "cluster" and cfg.opt & SMEM_AFFINE:
        if not cfg.opt & PERSIST:
            return f"OPT {cfg.opt}: OPT 512 (weight and bias held per block) needs persistent clusters (OPT 1)"
        need, room = fwd_cluster_smem(p, cfg), smem_optin - FWD_L2_STATIC_SMEM
        if need > room:
            return (f"the weight and bias slice needs {need} B of shared memory per block, over the {room} B this "
                    f"device allows: use more blocks per row")
        rows = 3 if cfg.opt & PIPE_STATS else 2
        held = fwd_thread_bytes(p, kind, cfg) * rows * (2 if p.residual else 1)
        if held > FWD_PERSIST_HELD_BYTES:
            arrays = "x and the residual" if p.residual else "x"
            return (f"OPT {cfg.opt} keeps {held} B of rows per thread in registers ({arrays} of {rows} rows; limit "
                    f"{FWD_PERSIST_HELD_BYTES}): it spills; use more blocks per row or threads")
    b = fwd_thread_bytes(p, kind, cfg)
    if b > FWD_MAX_THREAD_BYTES:
        return (f"each thread would hold {b} bytes of the row with {_geometry_text(kind, cfg)} "
                f"(limit {FWD_MAX_THREAD_BYTES})")
    return None


def bwd_feasible(p: BwdProblem, kind: str, cfg, warp: int = 32, smem_optin: int = 227 * 1024) -> str | None:
    why = geometry_reason(p.n, p.vec, kind, cfg, warp)
    if why is not None:
        return why
    e = bwd_thread_elems(p, kind, cfg)
    if kind == "stage":
        if e > BWD_STAGE_MAX_THREAD_COLS:
            return (f"each thread would keep the sums of {e} columns in registers with {_geometry_text(kind, cfg)} "
                    f"(limit {BWD_STAGE_MAX_THREAD_COLS}): use more threads")
        need, room = stage_smem(p, cfg), smem_optin - BWD_L2_STATIC_SMEM
        if need > room:
            return (f"{cfg.depth} rows of x and dy need {need} B of shared memory per block, over the {room} B this "
                    f"device allows: use fewer rows in flight")
        return None
    if kind == "l2":
        if cfg.parts != 1:
            return f"the l2 backward does not split rows (parts={cfg.parts}): use the l2c kind"
        need, room = bwd_l2_smem(p), smem_optin - BWD_L2_STATIC_SMEM
        if need > room:
            return (f"the column sums of N={p.n} need {need} B of shared memory per block, over the "
                    f"{room} B this device allows")
        return None
    if kind == "l2c":
        if cfg.opt & L2C_RETIRED_OPT:
            return (f"OPT {cfg.opt}: the l2c OPT bits 16 (64-register cap) and 128 (four rows per iteration) were "
                    "removed (slower in every sweep, docs/performance.md)")
        if e > BWD_L2C_MAX_THREAD_COLS:
            return (f"each thread would keep the sums of {e} columns in registers with {_geometry_text(kind, cfg)} "
                    f"(limit {BWD_L2C_MAX_THREAD_COLS}): use more blocks per row or threads")
        smem = slice_cols(p.n, p.vec, cfg.parts) * 4 * ((1 if p.weight_grad else 0) + (1 if p.bias_grad else 0))
        if cfg.opt & L2C_SMEM_SUMS and smem > BWD_L2C_MAX_STATIC_SMEM:
            return (f"OPT {cfg.opt} keeps the column sums of a {slice_cols(p.n, p.vec, cfg.parts)}-column slice in "
                    f"{smem} B of static shared memory (limit {BWD_L2C_MAX_STATIC_SMEM}): use more blocks per row")
        return None
    if e > BWD_MAX_THREAD_ELEMS:
        return (f"each thread would hold {e} columns of x, dy and the gradient sums with {_geometry_text(kind, cfg)} "
                f"(limit {BWD_MAX_THREAD_ELEMS})")
    if kind == "rows" and cfg.rpb > 1 and p.n * 4 > 40 * 1024:
        return f"{cfg.rpb} rows per block need {p.n * 4} B of shared memory to combine the column sums"
    return None


# ---- specs ------------------------------------------------------------------------------------------------------
def fwd_template_args(p: FwdProblem, kind: str, cfg) -> tuple:
    tx, tw, ty = p.type_args()
    if kind == "l2":
        args = (tx, tw, ty, p.n, p.vec, cfg.threads, cfg.minb, p.flags, cfg.opt)
        if cfg.parts > 1:
            return args + (cfg.stash, cfg.parts)
        return args + (cfg.stash,) if cfg.stash else args
    if kind == "rows":
        return (tx, tw, ty, p.n, p.vec, cfg.tpr, cfg.rpb, p.flags, cfg.opt)
    return (tx, tw, ty, p.n, p.vec, cfg.threads, cfg.parts, p.flags, cfg.opt)


def bwd_template_args(p: BwdProblem, kind: str, cfg) -> tuple:
    tx, tw, tdy, tdx = p.type_args()
    if kind == "stage":
        return (tx, tw, tdy, tdx, p.n, p.vec, cfg.threads, cfg.depth, p.flags, cfg.opt)
    if kind == "l2":
        return (tx, tw, tdy, tdx, p.n, p.vec, cfg.threads, cfg.minb, p.flags, cfg.opt)
    if kind == "rows":
        return (tx, tw, tdy, tdx, p.n, p.vec, cfg.tpr, cfg.rpb, p.flags, cfg.opt)
    return (tx, tw, tdy, tdx, p.n, p.vec, cfg.threads, cfg.parts, p.flags, cfg.opt)


def dw_reduce_template_args(p: BwdProblem) -> tuple:
    return (p.w_type, 1 if p.weight_grad else 0, 1 if p.bias_grad else 0)


def fwd_thread_bytes(p: FwdProblem, kind: str, cfg) -> int:
    if kind == "l2":
        return 0  # nothing of the row is held across the reduction
    if kind == "rows":
        return packs_per_thread(p.n, p.vec, cfg.tpr) * p.vec * ITEMSIZE[p.x]
    return packs_per_thread(p.n, p.vec, cfg.threads, cfg.parts) * p.vec * ITEMSIZE[p.x]


def bwd_thread_elems(p: BwdProblem, kind: str, cfg) -> int:
    if kind == "stage":
        return packs_per_thread(p.n, p.vec, cfg.threads) * p.vec
    if kind in ("rows", "l2"):
        return packs_per_thread(p.n, p.vec, cfg.tpr if kind == "rows" else cfg.threads) * p.vec
    return packs_per_thread(p.n, p.vec, cfg.threads, cfg.parts) * p.vec


def slice_cols(n: int, vec: int, parts: int) -> int:
    return _ceil(n // vec, parts) * vec


def workspace_floats(slots: int, parts: int) -> int:
    """coop kernels: fp32 slot statistics (2 parities x G x 2 values per slot)."""
    return 4 * slots * parts


def grid_for_rows(rows: int, cfg: RowsConfig) -> int:
    return _ceil(rows, cfg.rpb)


def log2(v: int) -> float:
    return math.log2(max(1, v))


def fwd_spec(p: FwdProblem, kind: str, cfg, arch: Arch, op: str = "") -> KernelSpec:
    src, name = SOURCES[("fwd", kind)]
    return KernelSpec(src, name, arch, template_args=fwd_template_args(p, kind, cfg), op=op)


def bwd_specs(p: BwdProblem, kind: str, cfg, arch: Arch, op: str = "") -> tuple[KernelSpec, ...]:
    src, name = SOURCES[("bwd", kind)]
    main = KernelSpec(src, name, arch, template_args=bwd_template_args(p, kind, cfg), op=op)
    if not (p.weight_grad or p.bias_grad):
        return (main,)
    rsrc, rname = DW_REDUCE
    return main, KernelSpec(rsrc, rname, arch, template_args=dw_reduce_template_args(p), op=op)


# ---- rms_norm_quant: RMSNorm with per-group fp8 output (norms/fwd_rows_fp8.cuh) ---------------------------------
QUANT_SOURCE = ("norms/fwd_rows_fp8.cuh", "rtk_norm_fwd_rows_fp8")
QUANT_GROUPS = (32, 64, 128, 256)
QUANT_MAX_LANES = 32  # a group's lanes (group / vec) share one warp


def quant_dtype_reason(x: str, group: int) -> str | None:
    """None when x's dtype can take groups of `group`: a group spans at most QUANT_MAX_LANES lanes of one 16-byte
    load each (the host refuses wider groups before any alignment check, and so does the candidate)."""
    widest = QUANT_MAX_LANES * (16 // ITEMSIZE[x])
    if group > widest:
        return (f"group={group} is too wide for {x} x: a group spans at most {QUANT_MAX_LANES} lanes of one 16-byte "
                f"load ({16 // ITEMSIZE[x]} elements each), so {x} takes groups of at most {widest}; pick a smaller "
                "group")
    return None


def quant_reason(n: int, vec: int, group: int, cfg: RowsConfig | None) -> str | None:
    """None when the fp8 row kernel can serve rows of n with this vector width, group and row config."""
    if group not in QUANT_GROUPS:
        return f"group={group} not supported; supported: {', '.join(map(str, QUANT_GROUPS))}"
    if n % group:
        return f"N={n} is not a multiple of group={group}"
    if vec < 2 or group // vec > QUANT_MAX_LANES:
        return (f"vector width {vec} is too narrow for groups of {group} (each group must fit {QUANT_MAX_LANES} "
                f"lanes of at least max(2, {group // QUANT_MAX_LANES}) elements): x's rows must be aligned to "
                f"{max(2, group // QUANT_MAX_LANES)} elements")
    if cfg is not None and cfg.tpr % (group // vec):
        return f"{cfg.tpr} threads per row do not hold whole groups of {group // vec} lanes"
    return None


def quant_spec(p: FwdProblem, cfg: RowsConfig, group: int, arch: Arch, op: str = "") -> KernelSpec:
    src, name = QUANT_SOURCE
    return KernelSpec(src, name, arch, op=op,
                      template_args=(ctype(p.x), p.w_type, p.n, p.vec, cfg.tpr, cfg.rpb, p.flags, cfg.opt, group))


def quant_bytes_moved(p: FwdProblem, rows: int, group: int) -> int:
    """x read, q (1 byte per element) and the fp32 scales written, the weight read once."""
    return rows * (p.n * (ITEMSIZE[p.x] + 1) + 4 * (p.n // group)) + (p.n * ITEMSIZE[p.w] if p.w else 0)
