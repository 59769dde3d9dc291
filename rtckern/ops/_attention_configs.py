"""Tile configurations of the attention kernels: what each kernel template is specialized on, its launch
geometry and its shared memory. Pure data and arithmetic (no GPU, no compile), shared by the candidates, the
benchmark and the tests.
"""
from __future__ import annotations

import dataclasses

HEAD_DIMS = (32, 64, 96, 128, 256)
DTYPES = {"bf16": "rtk_bf16", "fp16": "rtk_half"}  # op dtype name -> kernel storage type

SM80_SOURCE = "attention/flash_fwd_sm80.cuh"
SM80_KERNEL = "rtk_attn::flash_fwd_sm80"
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


# Defaults per head dim (causal, non-causal alike unless listed), chosen by register budget: the O accumulator
# (BM/warps x HD fp32 per warp) plus the S tile (BM/warps x BN) must fit in 255 registers per thread without
# spilling in the main loop. Benchmarks in benchmarks/results/ pick among these.
SM80_TILES: dict[int, Sm80Tile] = {
    32: Sm80Tile(128, 128, 4, 2, True),
    64: Sm80Tile(128, 128, 4, 2, False),
    96: Sm80Tile(128, 64, 4, 2, False),
    128: Sm80Tile(128, 64, 4, 2, False),
    256: Sm80Tile(64, 64, 4, 2, False),
}


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
