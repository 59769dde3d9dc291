"""Tile configurations of the attention backward kernels: what each kernel template is specialized on, its launch
geometry and its shared memory. Pure data and arithmetic (no GPU, no compile), shared by the candidates, the
benchmark and the tests.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import ClassVar, Mapping

# pick_tile is the forward's: the backward tiles answer the same smem_bytes(head_dim), so one search serves both
from .configs import DTYPES, HEAD_DIMS, pick_tile

__all__ = ("DTYPES", "HEAD_DIMS", "ROWS_SOURCE", "PREP_KERNEL", "CONVERT_KERNEL", "SM80_SOURCE", "SM80_KERNEL",
           "SIMT_SOURCE", "SIMT_DKDV_KERNEL", "SIMT_DQ_KERNEL", "ROW_PAD", "RowKernels", "ROWS", "Sm80BwdTile",
           "SM80_BWD_TILES", "pick_tile", "SimtBwdTile", "SIMT_BWD_TILE", "padded_rows", "SM90_SOURCE", "SM90_KERNEL",
           "Sm90BwdTile", "SM90_BWD_TILES", "SM90_HEAD_DIMS", "DKV_SUM_KERNEL", "DKV_SUM_THREADS", "head_splits",
           "SM90_WS_SOURCE", "SM90_WS_KERNEL", "Sm90WsBwdTile", "SM90_WS_BWD_TILES")

ROWS_SOURCE = "attention/attn_bwd_rows.cuh"
PREP_KERNEL = "rtk_attn::attn_bwd_prep"
CONVERT_KERNEL = "rtk_attn::attn_bwd_convert"
DKV_SUM_KERNEL = "rtk_attn::attn_bwd_dkv_sum"  # adds the head split's fp32 dK / dV slices (256 threads)
DKV_SUM_THREADS = 256
SM80_SOURCE = "attention/flash_bwd_sm80.cuh"
SM80_KERNEL = "rtk_attn::flash_bwd_sm80"
SM90_SOURCE = "attention/flash_bwd_sm90.cuh"
SM90_KERNEL = "rtk_attn::flash_bwd_sm90"
SM90_WS_SOURCE = "attention/flash_bwd_sm90_ws.cuh"
SM90_WS_KERNEL = "rtk_attn::flash_bwd_sm90_ws"
SIMT_SOURCE = "attention/attn_bwd_simt.cuh"
SIMT_DKDV_KERNEL = "rtk_attn::attn_bwd_dkdv_simt"
SIMT_DQ_KERNEL = "rtk_attn::attn_bwd_dq_simt"

ROW_PAD = 128  # bwd_rows::pad in attn_bwd_rows.cuh: lse2 / dsum rows per (batch, head), and a multiple of every BM


def padded_rows(seqlen_q: int) -> int:
    return -(-seqlen_q // ROW_PAD) * ROW_PAD


@dataclasses.dataclass(frozen=True)
class RowKernels:
    """attn_bwd_prep / attn_bwd_convert<T, HD>: 128 threads, 32 rows per block."""

    threads: int = 128
    rows_per_block: int = 32

    def prep_grid(self, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
        return (padded_rows(seqlen_q) // self.rows_per_block, heads_q, batch)

    def convert_grid(self, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
        return (-(-seqlen_q // self.rows_per_block), heads_q, batch)

    @staticmethod
    def template_args(dtype: str, head_dim: int) -> tuple:
        return (DTYPES[dtype], head_dim)


ROWS = RowKernels()


@dataclasses.dataclass(frozen=True)
class Sm80BwdTile:
    """flash_bwd_sm80<T, HD, BM, BN, NWARPS, STAGES, CAUSAL, DETERMINISTIC>: one block per BN keys; warps own 16 keys
    each (split = warps / (bn / 16) = 2: two warps share 16 keys, each taking half the queries of S^T and half the
    head dim of dK, dV)."""

    bm: int
    bn: int
    warps: int
    stages: int = 2

    def __post_init__(self):
        if self.bn % 16 or self.warps not in (self.bn // 16, 2 * self.bn // 16):
            raise ValueError(f"tile {self}: bn must be a multiple of 16 and warps bn / 16 or 2 * bn / 16")
        if self.bm % (16 * self.split) or ROW_PAD % self.bm or self.stages < 1:
            raise ValueError(f"tile {self}: bm must be a multiple of 16 * split dividing {ROW_PAD}, stages >= 1")

    @property
    def split(self) -> int:
        return self.warps // (self.bn // 16)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int) -> int:
        # K, V tiles; STAGES x (Q, dO tiles); dS^T (and P^T when split); rows padded by 8 elements; lse2, dsum.
        srow, prow = head_dim + 8, self.bm + 8
        elems = 2 * self.bn * srow + 2 * self.stages * self.bm * srow + self.split * self.bn * prow
        return elems * 2 + 2 * self.stages * self.bm * 4

    def fits(self, head_dim: int) -> bool:
        """The kernel's static warp tiling holds for head_dim (per-warp slices in whole 16-column steps)."""
        dq_wm = min(self.warps, self.bm // 16)
        dq_wn = self.warps // dq_wm
        return (self.bm // self.split) % 16 == 0 and (head_dim // self.split) % 16 == 0 and \
            head_dim % dq_wn == 0 and (head_dim // dq_wn) % 16 == 0 and dq_wm * dq_wn == self.warps

    def template_args(self, dtype: str, head_dim: int, causal: bool, deterministic: bool) -> tuple:
        return (DTYPES[dtype], head_dim, self.bm, self.bn, self.warps, self.stages, bool(causal), bool(deterministic))

    def grid(self, batch: int, heads_kv: int, seqlen_k: int) -> tuple[int, int, int]:
        return (-(-seqlen_k // self.bn), heads_kv, batch)

    def m_blocks(self, seqlen_q: int) -> int:
        return -(-seqlen_q // self.bm)

    def label(self) -> str:
        return f"{self.bm}x{self.bn}w{self.warps}s{self.stages}"


# Per head dim, in order of preference; the first whose shared memory fits the device's per-block opt-in limit is
# used (227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86/89). Registers: the dK and dV accumulators (16 keys x
# HD / split per warp) plus S^T and dP^T (16 keys x BM / split) stay under 255 per thread without spilling
# (checked per variant by tests/unit/ops/test_attention_backward.py).
SM80_BWD_TILES: Mapping[int, tuple[Sm80BwdTile, ...]] = MappingProxyType({
    32: (Sm80BwdTile(64, 128, 8, 2),),
    64: (Sm80BwdTile(64, 128, 8, 2),),
    96: (Sm80BwdTile(64, 128, 8, 2), Sm80BwdTile(64, 64, 4, 2)),
    128: (Sm80BwdTile(32, 128, 8, 2), Sm80BwdTile(32, 64, 4, 2)),
    256: (Sm80BwdTile(32, 64, 8, 2), Sm80BwdTile(32, 32, 4, 1)),
})


@dataclasses.dataclass(frozen=True)
class Sm90BwdTile:
    """flash_bwd_sm90<T, HD, BM, BN, STAGES, CAUSAL, DETERMINISTIC>: one block per BN keys, BN / 64 warpgroups of 64
    keys each; BM query rows per step (whole 64-row wgmma tiles); STAGES buffers of Q, dO, lse2, dsum."""

    bm: int
    bn: int = 128
    stages: int = 3
    heads_fastest: ClassVar[bool] = False  # grid (key blocks, heads, batch), else (heads, key blocks, batch)

    def __post_init__(self):
        if self.bn not in (64, 128) or self.bm % 64 or ROW_PAD % self.bm or self.stages < 2:
            raise ValueError(f"tile {self}: bn must be 64 or 128, bm a multiple of 64 dividing {ROW_PAD}, "
                             "stages >= 2")

    @property
    def threads(self) -> int:
        return 2 * self.bn

    def smem_bytes(self, head_dim: int) -> int:
        # K, V; STAGES x (Q, dO); dS^T; lse2, dsum rings; 1024 bytes of alignment slack (flash_bwd_sm90_smem).
        return (2 * self.bn * head_dim * 2 + 2 * self.stages * self.bm * head_dim * 2 + self.bn * self.bm * 2
                + 2 * self.stages * self.bm * 4 + 1024)

    def fits(self, head_dim: int) -> bool:
        """The kernel's static warpgroup tiling of dQ holds (64-column head-dim slices per warpgroup)."""
        nwg = self.bn // 64
        dq_wm = min(self.bm // 64, nwg)
        dq_wn = nwg // dq_wm
        return head_dim % 64 == 0 and dq_wm * dq_wn == nwg and (head_dim // dq_wn) % 64 == 0

    def template_args(self, dtype: str, head_dim: int, causal: bool, deterministic: bool) -> tuple:
        return (DTYPES[dtype], head_dim, self.bm, self.bn, self.stages, bool(causal), bool(deterministic))

    def grid(self, batch: int, heads_kv: int, seqlen_k: int) -> tuple[int, int, int]:
        return (-(-seqlen_k // self.bn), heads_kv, batch)

    def m_blocks(self, seqlen_q: int) -> int:
        return -(-seqlen_q // self.bm)

    def label(self) -> str:
        return f"wg{self.bm}x{self.bn}s{self.stages}"


# FlashAttention-3's Hopper tiles: 128 keys (2 warpgroups of 64), 128 queries per step at head dim 64, 64 at 128
# (S^T, dP^T: 64 x BM accumulators per warpgroup; dK, dV: 64 x HD). 255 registers, no spills (ptxas -v, checked
# by tests/unit/ops/test_attention_backward.py); 163 KB / 178 KB of shared memory (one block per SM either way).
SM90_BWD_TILES: Mapping[int, Sm90BwdTile] = MappingProxyType({
    64: Sm90BwdTile(128, 128, 3),
    128: Sm90BwdTile(64, 128, 3),
})
SM90_HEAD_DIMS = tuple(SM90_BWD_TILES)


@dataclasses.dataclass(frozen=True)
class Sm90WsBwdTile(Sm90BwdTile):
    """flash_bwd_sm90_ws<T, HD, BM, BN, STAGES, CAUSAL, DETERMINISTIC>: Sm90BwdTile's math with a producer warpgroup
    (TMA into STAGES stages of Q, dO, lse2, dsum under mbarriers) beside the two consumer warpgroups, and two dS^T
    buffers."""

    heads_fastest: ClassVar[bool] = True  # see grid()

    def __post_init__(self):
        super().__post_init__()
        if self.bn != 128:
            raise ValueError(f"tile {self}: bn must be 128 (two consumer warpgroups)")

    @property
    def threads(self) -> int:
        return 2 * self.bn + 128

    def smem_bytes(self, head_dim: int) -> int:
        # K, V; STAGES x (Q, dO); two dS^T; lse2, dsum stages; dQ in fp32; mbarriers; alignment slack
        # (flash_bwd_sm90_ws_smem).
        return (2 * self.bn * head_dim * 2 + 2 * self.stages * self.bm * head_dim * 2 + 2 * self.bn * self.bm * 2
                + 2 * self.stages * self.bm * 4 + self.bm * head_dim * 4 + (2 * self.stages + 1) * 8 + 1024)

    def label(self) -> str:
        return f"ws{self.bm}x{self.bn}s{self.stages}"

    def grid(self, batch: int, heads: int, seqlen_k: int) -> tuple[int, int, int]:
        """Heads (kv heads x head splits) fastest, then key blocks, then batch: under causal masking the longest blocks
        of a batch entry (its first key blocks) start first."""
        return (heads, -(-seqlen_k // self.bn), batch)


# The wgmma tiles, stages of two (FlashAttention-3's; three measured no faster): 194 KB of shared memory at head
# dim 128, 195 KB at 64.
SM90_WS_BWD_TILES: Mapping[int, Sm90WsBwdTile] = MappingProxyType({
    64: Sm90WsBwdTile(128, 128, 2),
    128: Sm90WsBwdTile(64, 128, 2),
})

# Cost model of the head split (head_splits): one key block's step (five GEMMs of BN x BM x HD) at the per-SM rate
# the wgmma kernel reaches (~350 TFLOP/s over 132 SMs on an H100), and the split's extra traffic (fp32 slices of
# dK and dV written by the main kernel and read back by attn_bwd_dkv_sum) at ~2.5 TB/s. Only the ratio matters.
_SM_FLOPS = 2.6e12
_BYTES_PER_S = 2.5e12


def _makespan(works, sms: int) -> float:
    """Steps until the last block ends when blocks start in launch order, one per SM, each on the SM that frees
    first (the hardware's block scheduler, to a first approximation)."""
    import heapq

    if len(works) <= sms:
        return float(max(works))
    free = [0.0] * sms
    for w in works:
        heapq.heapreplace(free, free[0] + w)
    return max(free)


def head_splits(tile: "Sm90BwdTile", batch: int, heads_kv: int, group: int, seqlen_q: int, seqlen_k: int,
                causal: bool, head_dim: int, sms: int) -> int:
    """How many blocks share each (key block, kv head) of flash_bwd_sm90, each walking group / splits of its q heads
    (a divisor of the GQA group): the count with the least modelled time. A GQA step with few kv heads launches
    few blocks, and under causal masking the first key blocks (which see every query) set the pace; splitting
    trades that for fp32 partial sums of dK / dV added by one more kernel.

    The warp-specialized kernel (tile.heads_fastest) walks at most CAUSAL_HEADS_PER_BLOCK q heads per block under
    causal masking whatever the model says: its key blocks start their walks at different query blocks and drift
    apart, so that over a long walk the blocks running at once read Q and dO of more heads than the L2 holds
    (H100, 32 q over 4 kv heads, batch 4 x 4k causal: 370 TFLOP/s walking 8 heads per block, 446 walking 4, which the
    balance model does not see)."""
    if group <= 1:
        return 1
    floor = 1
    if causal and tile.heads_fastest:
        floor = next(s for s in range(1, group + 1) if group % s == 0 and group // s <= CAUSAL_HEADS_PER_BLOCK)
    return max(floor, _balanced_splits(tile, batch, heads_kv, group, seqlen_q, seqlen_k, causal, head_dim, sms))


CAUSAL_HEADS_PER_BLOCK = 4


def _balanced_splits(tile, batch: int, heads_kv: int, group: int, seqlen_q: int, seqlen_k: int, causal: bool,
                     head_dim: int, sms: int) -> int:
    """head_splits' cost model: the split count with the least modelled time (list-scheduled blocks plus the
    split's extra traffic)."""
    nk = -(-seqlen_k // tile.bn)
    if nk * heads_kv * batch >= 8 * sms:  # eight waves or more balance by themselves (and the model would cost ms)
        return 1
    m_blocks = -(-seqlen_q // tile.bm)
    diag = seqlen_k - seqlen_q
    per_key = [max(0, m_blocks - (max(0, j * tile.bn - diag) // tile.bm if causal else 0)) for j in range(nk)]
    step_s = 10.0 * tile.bn * tile.bm * head_dim / _SM_FLOPS
    best, best_t = 1, None
    for s in range(1, group + 1):
        if group % s or nk * heads_kv * batch * s > 32 * sms:  # past 32 waves a split buys nothing
            continue
        per_block = [group // s * w + 1 for w in per_key]  # + 1: load K / V, epilogue
        if tile.heads_fastest:  # the launch order of the blocks
            works = [w for w in per_block for _ in range(heads_kv * s)] * batch
        else:
            works = per_block * (heads_kv * s * batch)
        t = _makespan(works, sms) * step_s
        if s > 1:
            t += (s * 8 * 2 + 2 * 2) * batch * seqlen_k * heads_kv * head_dim / _BYTES_PER_S
        if best_t is None or t < best_t * 0.97:  # a split must win by more than the model's slack
            best, best_t = s, t
    return best


@dataclasses.dataclass(frozen=True)
class SimtBwdTile:
    """attn_bwd_dkdv_simt / attn_bwd_dq_simt<T, HD, TILE, CAUSAL>: 128 threads, TILE x TILE tiles (TILE 32, or 16 for
    head dim 256, whose 32-row tiles would not fit sm_75's 64 KB of shared memory)."""

    threads: int = 128

    @staticmethod
    def tile(head_dim: int) -> int:
        return 16 if head_dim > 128 else 32

    def smem_bytes(self, head_dim: int) -> int:
        t = self.tile(head_dim)
        return 4 * t * (head_dim + 2) * 2 + 2 * t * (t + 1) * 4 + 2 * t * 4

    def template_args(self, dtype: str, head_dim: int, causal: bool) -> tuple:
        return (DTYPES[dtype], head_dim, self.tile(head_dim), bool(causal))

    def dkdv_grid(self, head_dim: int, batch: int, heads_kv: int, seqlen_k: int) -> tuple[int, int, int]:
        return (-(-seqlen_k // self.tile(head_dim)), heads_kv, batch)

    def dq_grid(self, head_dim: int, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
        return (-(-seqlen_q // self.tile(head_dim)), heads_q, batch)

    @staticmethod
    def label() -> str:
        return "simt"


SIMT_BWD_TILE = SimtBwdTile()
