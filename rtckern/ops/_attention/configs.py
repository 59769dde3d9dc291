"""Tile configurations of the attention kernels: what each kernel template is specialized on, its launch
geometry and its shared memory. Pure data and arithmetic (no GPU, no compile), shared by the candidates, the
benchmark and the tests.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

from rtckern.dtypes import ctypes

HEAD_DIMS = (32, 64, 96, 128, 256)
# `rtckern ops` asks the candidates about these head dims (the catalogue shows which each one serves)
HEAD_DIM_SAMPLES = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256, 512)
DTYPES = ctypes(("bf16", "fp16"))  # op dtype name -> kernel storage type

SM80_SOURCE = "attention/flash_fwd_sm80.cuh"
SM80_KERNEL = "rtk_attn::flash_fwd_sm80"
SM90_SOURCE = "attention/flash_fwd_sm90.cuh"
SM90_KERNEL = "rtk_attn::flash_fwd_sm90"
SM90_HEAD_DIMS = (64, 128, 256)  # whole 64-element swizzle blocks
# The warp-specialized kernel also serves head dim 96, padded to 128 inside the kernel (RTK_ATTN_DV): a third more
# tensor-core work than the head dim needs, against the mma.sync kernel's 0.44-0.64x cuDNN there (docs/performance.md).
SM90_WS_PADDED = MappingProxyType({96: 128})
SM90_WS_HEAD_DIMS = tuple(sorted(SM90_HEAD_DIMS + tuple(SM90_WS_PADDED)))


def ws_kernel_dim(head_dim: int) -> int:
    """The head dim the warp-specialized kernel is compiled for (its tiles, shared memory and wgmma shapes)."""
    return SM90_WS_PADDED.get(head_dim, head_dim)

SM90_WS_SOURCE = "attention/flash_fwd_sm90_ws.cuh"
SM90_WS_KERNEL = "rtk_attn::flash_fwd_sm90_ws"
SIMT_SOURCE = "attention/attn_fwd_simt.cuh"
SIMT_KERNEL = "rtk_attn::attn_fwd_simt"


@dataclasses.dataclass(frozen=True)
class Sm80Tile:
    """flash_fwd_sm80<T, HD, BM, BN, NWARPS, STAGES, CAUSAL, Q_IN_REGS>."""

    bm: int
    bn: int
    warps: int
    stages: int = 2
    q_in_regs: bool = False

    def __post_init__(self):
        if self.bm % (16 * self.warps):
            raise ValueError(f"tile {self}: bm must be a multiple of 16 * warps")
        if self.bn % 16 or self.stages < 2:
            raise ValueError(f"tile {self}: bn must be a multiple of 16 and stages >= 2")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int) -> int:
        # Q tile + STAGES x (K tile + V tile), rows padded by 8 elements (16 bytes); 2-byte elements.
        return (self.bm + 2 * self.stages * self.bn) * (head_dim + 8) * 2

    def template_args(self, dtype: str, head_dim: int, causal: bool) -> tuple:
        return (DTYPES[dtype], head_dim, self.bm, self.bn, self.warps, self.stages, bool(causal), self.q_in_regs)

    def grid(self, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
        return (-(-seqlen_q // self.bm), heads_q, batch)

    def label(self) -> str:
        return f"{self.bm}x{self.bn}w{self.warps}s{self.stages}{'q' if self.q_in_regs else ''}"


# Defaults per (head dim, causal), in order of preference; the first whose shared memory fits the device's
# per-block opt-in limit is used (227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86/89). Register budget: the O
# accumulator (BM/warps x HD fp32 per warp) plus the S tile (BM/warps x BN) fit 255 registers per thread without
# spilling in the main loop. The first entries are the fastest measured on the H200 (docs/performance.md); the
# later ones are for smaller shared memory.
_SM80_EITHER_CAUSAL = (  # head dims whose tiles do not depend on causal
    (32, (Sm80Tile(128, 128, 4, 2, True),)),
    (64, (Sm80Tile(128, 64, 4, 3, True), Sm80Tile(128, 64, 4, 2, True))),
    (96, (Sm80Tile(128, 64, 4, 2, False), Sm80Tile(128, 32, 4, 2, True))),
    (256, (Sm80Tile(64, 64, 4, 2, False), Sm80Tile(64, 32, 4, 2, False))),
)
SM80_TILES: Mapping[tuple[int, bool], tuple[Sm80Tile, ...]] = MappingProxyType({
    **{(hd, causal): tiles for causal in (False, True) for hd, tiles in _SM80_EITHER_CAUSAL},
    (128, False): (Sm80Tile(128, 64, 4, 2, False), Sm80Tile(128, 32, 4, 2, True)),
    (128, True): (Sm80Tile(128, 128, 8, 2, True), Sm80Tile(128, 64, 4, 2, False), Sm80Tile(128, 32, 4, 2, True)),
})


def qkv_reason(req, head_dims: tuple[int, ...]) -> str | None:
    """Why a kernel cannot serve the request's q / k / v dtype or head dim (one of `head_dims`); None when it
    can. The forward and backward candidates alike."""
    dt = req.dtype("qkv")
    if dt not in DTYPES:
        return f"dtype {dt} not supported (bf16, fp16)"
    hd = req.dim("head_dim")
    if hd not in head_dims:
        return f"head_dim {hd} not supported (supported: {', '.join(map(str, head_dims))})"
    return None


def pick_tile(tiles, head_dim: int, smem_limit: int):
    """The first tile of `tiles` whose shared memory fits `smem_limit` bytes, else None."""
    for t in tiles:
        if t.smem_bytes(head_dim) <= smem_limit:
            return t
    return None


@dataclasses.dataclass(frozen=True)
class Sm90Tile:
    """flash_fwd_sm90<T, HD, BN, NWG, CAUSAL>: NWG consumer warpgroups of 64 query rows each."""

    bn: int
    nwg: int = 2

    @property
    def bm(self) -> int:
        return 64 * self.nwg

    @property
    def threads(self) -> int:
        return 128 * self.nwg

    def smem_bytes(self, head_dim: int) -> int:
        # Q tile, 2 K tiles, 3 V tiles (128-byte swizzled, no padding), 1024 bytes of alignment slack.
        return self.bm * head_dim * 2 + 5 * self.bn * head_dim * 2 + 1024

    def template_args(self, dtype: str, head_dim: int, causal: bool) -> tuple:
        return (DTYPES[dtype], head_dim, self.bn, self.nwg, bool(causal))

    def grid(self, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
        return (-(-seqlen_q // self.bm), heads_q, batch)

    def label(self) -> str:
        return f"wg{self.bm}x{self.bn}"


# Fastest measured on the H200 (docs/performance.md): for head dim 64 the 64-key tile
# (116 registers, 57 KB) lets two blocks share an SM, which interleaves their softmax and GEMM phases.
SM90_TILES: Mapping[int, Sm90Tile] = MappingProxyType({
    64: Sm90Tile(64, 2),
    128: Sm90Tile(128, 2),
    256: Sm90Tile(64, 2),
})


@dataclasses.dataclass(frozen=True)
class Sm90WsTile:
    """flash_fwd_sm90_ws<T, HD, BN, NWG, KS, VS, CAUSAL, PINGPONG>: a TMA producer warpgroup plus NWG consumer
    warpgroups of 64 query rows; KS / VS shared-memory stages for K / V; pingpong: the two consumer warpgroups
    take turns issuing GEMMs (FA3's schedule)."""

    bn: int
    nwg: int = 2
    ks: int = 2
    vs: int = 2
    pingpong: bool = False

    @property
    def bm(self) -> int:
        return 64 * self.nwg

    @property
    def threads(self) -> int:
        return 128 * (self.nwg + 1)

    def smem_bytes(self, head_dim: int) -> int:
        # Q tile, KS K tiles, VS V tiles, 2 mbarriers per stage, 1024 bytes of alignment slack.
        return self.bm * head_dim * 2 + (self.ks + self.vs) * self.bn * head_dim * 2 + 16 * (self.ks + self.vs) + 1024

    def template_args(self, dtype: str, head_dim: int, causal: bool) -> tuple:
        return (DTYPES[dtype], head_dim, self.bn, self.nwg, self.ks, self.vs, bool(causal), self.pingpong)

    def grid(self, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
        return (-(-seqlen_q // self.bm), heads_q, batch)

    def label(self) -> str:
        return f"ws{self.bm}x{self.bn}k{self.ks}v{self.vs}{'p' if self.pingpong else ''}"


# Per (head dim, causal), fastest measured on the H200 (docs/performance.md):
# ping-pong pays for causal head dim 128 (392 vs 364 TFLOP/s at 1k, 670 vs 659 at 16k; 551 vs 558 at 4k) and
# costs elsewhere (hd128 non-causal 16k: 596 vs 692; hd64 4k: 399 vs 439).
SM90_WS_TILES: Mapping[tuple[int, bool], Sm90WsTile] = MappingProxyType({
    (64, False): Sm90WsTile(128, 2, 2, 2),
    (64, True): Sm90WsTile(128, 2, 2, 2),
    (128, False): Sm90WsTile(128, 2, 2, 2),
    (128, True): Sm90WsTile(128, 2, 2, 2, pingpong=True),
    (256, False): Sm90WsTile(64, 2, 2, 2),
    (256, True): Sm90WsTile(64, 2, 2, 2),
})


@dataclasses.dataclass(frozen=True)
class SimtTile:
    """attn_fwd_simt<T, HD, CAUSAL>: 128 threads, 32 query rows x 32 keys per step."""

    bm: int = 32
    bn: int = 32
    threads: int = 128

    def smem_bytes(self, head_dim: int) -> int:
        qk_row = head_dim + 2
        return (self.bm * qk_row + self.bn * qk_row + self.bn * head_dim) * 2 + self.bm * (self.bn + 1) * 4

    def template_args(self, dtype: str, head_dim: int, causal: bool) -> tuple:
        return (DTYPES[dtype], head_dim, bool(causal))

    def grid(self, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
        return (-(-seqlen_q // self.bm), heads_q, batch)

    def label(self) -> str:
        return "simt32x32"


SIMT_TILE = SimtTile()


def name_expression(kernel: str, template_args: tuple) -> str:
    rendered = ", ".join(("true" if a else "false") if isinstance(a, bool) else str(a) for a in template_args)
    return f"{kernel}<{rendered}>"
