"""GEMM plans: the problem description, tile configs, kernel specs and launch geometry of each kernel family.

Nothing here validates user arrays (api.py does) or touches a GPU; `launch.py` does the launches.

Kernel families (kernel_sources/gemm/):
  sm80  gemm_mma_sm80   mma.sync + cp.async pipeline; any sm_80+ GPU; split-K; aligned or general loads
        gemm_mma_sm80_ck    the same with split-K inside a thread-block cluster (sm_90+): no workspace, one kernel
  sm90  gemm_wgmma_sm90 wgmma + TMA + warp specialization, persistent; sm_90a only; 16-byte aligned rows
        gemm_wgmma_sm90_ck  the same with split-K inside a cluster (one block per unit, cooperative schedule)
  simt  gemm_simt       no tensor cores; any arch (the sm_75 fallback)
  gemm_splitk_reduce    adds split-K partial sums from a workspace and applies the epilogue

Split-K comes in two forms: through a global workspace of fp32 partial sums and the reduce kernel (any arch,
any split count), or, with `cluster=True` in a config, inside a thread-block cluster of 2, 4 or 8 blocks that add
their partial tiles through distributed shared memory (sm_90+; kernel_sources/gemm/cluster_reduce.cuh).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType

from rtckern.arch import Arch
from rtckern.dtypes import ctype, itemsize
from rtckern.spec import KernelSpec

# Activation ids: RTK_GEMM_ACT_* in kernel_sources/gemm/epilogue.cuh.
ACTIVATIONS = MappingProxyType({"none": 0, "gelu_tanh": 1, "silu": 2})
INPUT_DTYPES = ("fp16", "bf16")
OUTPUT_DTYPES = ("fp16", "bf16", "fp32")
MAX_GRID_YZ = 65535
CLUSTER_SPLITS = (2, 4, 8)  # cluster split-K sizes: powers of two (the tile's quads split evenly), portable <= 8
RED_PAD = 8  # RTK_GEMM_RED_PAD in cluster_reduce.cuh: row padding (floats) of the partial tile in shared memory


@dataclass(frozen=True)
class GemmProblem:
    """Everything about one GEMM call that decides which kernel works and how it is compiled.

    aligned: A's and B's base addresses are 16-byte aligned and their row (and batch) strides are multiples of
    8 elements, so tiles can move as 16-byte chunks (cp.async) or TMA boxes.
    b_batched: B has its own matrix per batch entry (False: one B shared by every batch entry).
    """

    batch: int
    m: int
    n: int
    k: int
    dtype: str
    out_dtype: str
    trans_b: bool
    bias: bool = False
    activation: str = "none"
    residual: bool = False
    aligned: bool = True
    b_batched: bool = True

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def act_id(self) -> int:
        return ACTIVATIONS[self.activation]

    def epilogue_args(self) -> tuple:
        return (self.bias, self.act_id, self.residual)


@dataclass(frozen=True, kw_only=True)
class _SplitSchedule:
    """What the tensor-core configs share, passed by keyword: split-K `splits` (0: chosen per problem),
    `group_m` tile rows walked together (L2 reuse), and `cluster`: split-K inside a thread-block cluster (sm_90+)
    instead of through a workspace."""

    splits: int = 1
    group_m: int = 8
    cluster: bool = False


@dataclass(frozen=True)
class Sm80Config(_SplitSchedule):
    """Block tile bm x bn x bk, warp tile wm x wn, `stages` shared-memory stages."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    wm: int = 64
    wn: int = 32
    stages: int = 4

    kind = "sm80"

    @property
    def threads(self) -> int:
        return (self.bm // self.wm) * (self.bn // self.wn) * 32

    @property
    def smem_bytes(self) -> int:
        ring = self.stages * (self.bm + self.bn) * self.bk * 2
        return max(ring, self.bm * (self.bn + RED_PAD) * 4) if self.cluster else ring

    def invalid(self, p: GemmProblem) -> str | None:
        """Why this config cannot compile or run for p (None when it can)."""
        if self.bm % self.wm or self.bn % self.wn or self.wm % 16 or self.wn % 16:
            return f"warp tile {self.wm}x{self.wn} must divide block tile {self.bm}x{self.bn} in multiples of 16"
        if self.bk not in (32, 64, 128):
            return f"bk={self.bk}: supported 32, 64, 128"
        if not p.trans_b and self.bn % 64:
            return f"bn={self.bn}: an N-major B tile needs bn a multiple of 64"
        if self.stages < 2:
            return f"stages={self.stages}: the pipeline needs at least 2"
        if not 32 <= self.threads <= 1024:
            return f"{self.threads} threads per block"
        if p.batch > MAX_GRID_YZ:
            return f"batch {p.batch} > {MAX_GRID_YZ} (grid z)"
        if self.splits > MAX_GRID_YZ:
            return f"splits {self.splits} > {MAX_GRID_YZ}"
        return _cluster_reason(self)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "bm": self.bm, "bn": self.bn, "bk": self.bk, "wm": self.wm, "wn": self.wn,
                "stages": self.stages, "splits": self.splits, "group_m": self.group_m, "cluster": self.cluster}


@dataclass(frozen=True)
class Sm90Config(_SplitSchedule):
    """Block tile bm x bn (bk is 64), `consumers` consumer warpgroups (each owns bm / consumers rows); a cluster
    split-K runs one block per unit (not persistent)."""

    bm: int = 128
    bn: int = 256
    stages: int = 4
    consumers: int = 2
    pingpong: bool = False  # consumers take turns at whole tiles (epilogue overlaps the other's mainloop)

    kind = "sm90"

    @property
    def threads(self) -> int:
        return (self.consumers + 1) * 128

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * 64 * 2 + 1024  # + slack to align the ring to 1024 B

    def invalid(self, p: GemmProblem) -> str | None:
        if self.consumers not in (1, 2):
            return f"consumers={self.consumers}: supported 1, 2"
        if (self.bm // self.consumers) % 64 or self.bm > 256:
            return f"bm={self.bm}: each consumer needs a multiple of 64 rows, bm <= 256"
        if self.bn not in (64, 128, 192, 256):
            return f"bn={self.bn}: supported 64, 128, 192, 256"
        if self.pingpong and self.consumers != 2:
            return "ping-pong takes 2 consumers"
        rows = self.bm if self.pingpong else self.bm // self.consumers
        if rows * self.bn // 128 > 128:
            return f"{rows}x{self.bn} accumulators per consumer warpgroup exceed 128 registers per thread"
        if self.smem_bytes > SM90_SMEM_LIMIT:
            return f"{self.smem_bytes} bytes of shared memory exceed the 227 KB a block may have"
        if not p.aligned:
            return "TMA needs 16-byte aligned operand bases and row strides (a multiple of 8 elements)"
        if self.splits > 1 << 20:
            return f"splits {self.splits} too large"
        if self.cluster:
            if self.pingpong:
                return "cluster split-K takes the cooperative schedule (pingpong=False)"
            if self.bm * (self.bn + RED_PAD) * 4 > self.stages * (self.bm + self.bn) * 64 * 2:
                return (f"cluster split-K: the {self.bm}x{self.bn} fp32 partial tile does not fit the "
                        f"{self.stages}-stage ring it reuses; use more stages")
        return _cluster_reason(self)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "bm": self.bm, "bn": self.bn, "stages": self.stages,
                "consumers": self.consumers, "splits": self.splits, "group_m": self.group_m,
                "pingpong": self.pingpong, "cluster": self.cluster}


# What a block may opt in to on sm_90, less the kernel's static shared memory: its mbarriers, 8 bytes for each of
# 2 x stages + 2 (at most 240 B, at the 14 stages of 64 x 64 tiles; the fp8 grouped kernel reserves the same 256 B)
SM90_STATIC_RESERVE = 256
SM90_SMEM_LIMIT = 232448 - SM90_STATIC_RESERVE
STORE_BOX_BYTES = 64 * 128  # one TMA store box of the wgmma kernel: 64 rows x 128 bytes


def tma_store(p: GemmProblem, cfg, beside: int = 0) -> bool:
    """Whether the wgmma kernel stores c with TMA (RTK_GEMM_TMA_STORE): tiles of at least 128 x 128 (the epilogue is
    a share of a tile's time worth a tensor map per output address; 64-row tiles serve skinny, host-bound calls, and
    128 x 64 tiles read 1-3% slower with it on an H100) without split-K or a residual, c's rows (n elements: the
    output the op allocates) multiples of 16 bytes, and two store boxes per consumer beside the ring (and
    `beside` them: the grouped kernel's tile prefix) in shared memory."""
    return (cfg.kind == "sm90" and cfg.bm >= 128 and cfg.bn >= 128 and cfg.splits == 1 and not cfg.cluster
            and not p.residual and p.n * itemsize(p.out_dtype) % 16 == 0
            and cfg.smem_bytes + 2 * cfg.consumers * STORE_BOX_BYTES + beside <= SM90_SMEM_LIMIT)


def launch_smem(p: GemmProblem, cfg, beside: int = 0) -> int:
    """Dynamic shared memory of cfg's main kernel for p: its ring, plus the store boxes where it stores with TMA.
    beside: shared memory the caller's variant keeps after them (the grouped kernel's tile prefix), which decides
    whether the boxes fit; the caller adds it to the result."""
    boxes = 2 * cfg.consumers * STORE_BOX_BYTES if tma_store(p, cfg, beside) else 0
    return cfg.smem_bytes + boxes


def _cluster_reason(cfg) -> str | None:
    if cfg.cluster and cfg.splits not in CLUSTER_SPLITS:
        return (f"cluster split-K takes {', '.join(map(str, CLUSTER_SPLITS))} splits (one block each in a cluster); "
                f"this config has {cfg.splits}")
    return None


@dataclass(frozen=True)
class SimtConfig:
    """The SIMT kernel's config: nothing to tune."""
    splits: int = 1  # never split; present so every config answers .splits

    kind = "simt"
    threads = 256
    smem_bytes = 0

    def invalid(self, p: GemmProblem) -> str | None:
        if p.batch > MAX_GRID_YZ:
            return f"batch {p.batch} > {MAX_GRID_YZ} (grid z)"
        if math.ceil(p.m / 64) > MAX_GRID_YZ:
            return f"m={p.m} needs more than {MAX_GRID_YZ} row tiles (grid y)"
        return None

    def as_dict(self) -> dict:
        return {"kind": self.kind}


def config_from_dict(d: dict):
    d = dict(d)
    kind = d.pop("kind", None)
    cls = {"sm80": Sm80Config, "sm90": Sm90Config, "simt": SimtConfig}.get(kind)
    if cls is None:
        raise ValueError(f"GEMM config kind {kind!r}: expected 'sm80', 'sm90' or 'simt'")
    return cls(**d)


# -- split-K ------------------------------------------------------------------------------------------------------
def k_blocks(p: GemmProblem, bk: int) -> int:
    return max(1, math.ceil(p.k / bk))


def normalize_splits(p: GemmProblem, bk: int, splits: int) -> tuple[int, int]:
    """(splits, k-blocks per split) with every split non-empty."""
    kb = k_blocks(p, bk)
    splits = max(1, min(int(splits), kb))
    per = math.ceil(kb / splits)
    return math.ceil(kb / per), per


def choose_splits(p: GemmProblem, tiles: int, bk: int, sm_count: int, min_k_blocks: int = 4,
                  allowed: tuple[int, ...] | None = None, blocks_per_sm: int = 1) -> int:
    """Split K when the output tiles cannot fill the GPU: the split count whose work units keep the largest share
    of block slots (blocks_per_sm x SMs) busy over the run (units / (waves x slots)), less 1% per extra split
    (each adds partial-sum traffic), each split at least `min_k_blocks` k-blocks long. `allowed`: the split counts
    to consider besides 1 (cluster split-K: 2, 4, 8)."""
    units = tiles * p.batch
    if units >= sm_count:
        return 1
    slots = sm_count * max(1, blocks_per_sm)
    most = max(1, min(64, k_blocks(p, bk) // min_k_blocks))
    best, best_score = 1, -1.0
    for s in range(1, most + 1):
        if allowed is not None and s != 1 and s not in allowed:
            continue
        u = units * s
        score = u / (math.ceil(u / slots) * slots) - 0.01 * (s - 1)
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


def workspace_bytes(p: GemmProblem, splits: int) -> int:
    return 0 if splits <= 1 else p.batch * splits * p.m * p.n * 4


def plan_workspace_bytes(p: GemmProblem, cfg) -> int:
    """Global scratch a plan needs: the fp32 partial sums of workspace split-K (none for cluster split-K)."""
    return 0 if getattr(cfg, "cluster", False) else workspace_bytes(p, cfg.splits)


# -- kernel specs -------------------------------------------------------------------------------------------------
def _epi_flags(p: GemmProblem, splitk: bool) -> tuple:
    # A split-K main kernel stores raw partial sums: its epilogue lives in the reduce kernel.
    return (False, 0, False) if splitk else p.epilogue_args()


def sm80_spec(p: GemmProblem, cfg: Sm80Config, arch: Arch) -> KernelSpec:
    if cfg.cluster:
        return KernelSpec(source="gemm/gemm_sm80.cuh", name="gemm_mma_sm80_ck", arch=arch, op="gemm",
                          template_args=(ctype(p.dtype), ctype(p.out_dtype), cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn,
                                         cfg.stages, p.trans_b, p.aligned, *p.epilogue_args(), cfg.splits))
    splitk = cfg.splits > 1
    bias, act, res = _epi_flags(p, splitk)
    return KernelSpec(source="gemm/gemm_sm80.cuh", name="gemm_mma_sm80", arch=arch, op="gemm",
                      template_args=(ctype(p.dtype), ctype(p.out_dtype), cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn,
                                     cfg.stages, p.trans_b, p.aligned, bias, act, res, splitk))


def sm90_spec(p: GemmProblem, cfg: Sm90Config, arch: Arch, beside: int = 0) -> KernelSpec:
    """beside: shared memory the caller's variant keeps after the ring (the grouped kernel's tile prefix), which
    decides whether the store boxes fit (`tma_store`)."""
    if cfg.cluster:
        return KernelSpec(source="gemm/gemm_sm90.cuh", name="gemm_wgmma_sm90_ck", arch=arch, op="gemm",
                          template_args=(ctype(p.dtype), ctype(p.out_dtype), cfg.bm, cfg.bn, cfg.stages,
                                         cfg.consumers, p.trans_b, *p.epilogue_args(), cfg.splits))
    splitk = cfg.splits > 1
    bias, act, res = _epi_flags(p, splitk)
    return KernelSpec(source="gemm/gemm_sm90.cuh", name="gemm_wgmma_sm90", arch=arch, op="gemm",
                      template_args=(ctype(p.dtype), ctype(p.out_dtype), cfg.bm, cfg.bn, cfg.stages,
                                     cfg.consumers, cfg.pingpong, p.trans_b, bias, act, res, splitk),
                      defines=(("RTK_GEMM_TMA_STORE", "1"),) if tma_store(p, cfg, beside) else ())


def simt_spec(p: GemmProblem, arch: Arch) -> KernelSpec:
    return KernelSpec(source="gemm/gemm_simt.cuh", name="gemm_simt", arch=arch, op="gemm",
                      template_args=(ctype(p.dtype), ctype(p.out_dtype), p.trans_b, *p.epilogue_args()))


def reduce_spec(p: GemmProblem, arch: Arch) -> KernelSpec:
    return KernelSpec(source="gemm/epilogue.cuh", name="gemm_splitk_reduce", arch=arch, op="gemm",
                      template_args=(ctype(p.out_dtype), ctype(p.dtype), *p.epilogue_args()))


def kernel_specs(p: GemmProblem, cfg, arch: Arch) -> tuple[KernelSpec, ...]:
    """The kernels one launch plan needs: the main kernel, plus the reduce kernel when K is split."""
    if cfg.kind == "sm80":
        main = sm80_spec(p, cfg, arch)
    elif cfg.kind == "sm90":
        main = sm90_spec(p, cfg, arch)
    else:
        return (simt_spec(p, arch),)
    return (main, reduce_spec(p, arch)) if cfg.splits > 1 and not cfg.cluster else (main,)


def with_splits(cfg, p: GemmProblem, sm_count: int):
    """cfg with its split count settled for p (heuristic when cfg.splits == 0, clamped otherwise). A cluster
    config keeps the largest of 8, 4, 2 splits (at most the asked count) that leaves every split non-empty, and
    becomes a plain one-split config when none does."""
    if cfg.kind == "simt":
        return cfg
    bk = cfg.bk if cfg.kind == "sm80" else 64
    splits = cfg.splits
    if splits == 0:
        tiles = math.ceil(p.m / cfg.bm) * math.ceil(p.n / cfg.bn)
        # Small mma.sync cluster blocks stream best two to an SM (H200, M = 16: 32 tiles x 8 splits 9.8 us
        # against x 4 splits 10.9 us; docs/performance.md, GEMM).
        two = cfg.kind == "sm80" and cfg.cluster and cfg.bm <= 32
        splits = choose_splits(p, tiles, bk, sm_count, allowed=CLUSTER_SPLITS if cfg.cluster else None,
                               blocks_per_sm=2 if two else 1)
    splits, _ = normalize_splits(p, bk, splits)
    if cfg.cluster:
        fit = [s for s in CLUSTER_SPLITS if s <= splits and normalize_splits(p, bk, s)[0] == s]
        if not fit:
            return replace(cfg, splits=1, cluster=False)
        splits = fit[-1]
    return replace(cfg, splits=splits)
