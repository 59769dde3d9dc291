"""The sm_90a fp8 kernel's tile config per shape class (no tuned table yet: `rtckern tune gemm_fp8` is issue 23's
dispatch part). Each consumer warpgroup keeps two accumulator sets (the K block's wgmma partial sums and the
promoted fp32 sums), so a consumer owns at most 64 x 192 outputs; 128 x 128 tiles with two consumers is the
DeepGEMM-style default, 64-row tiles with one consumer where M is small (decode, M <= 64)."""
from __future__ import annotations

from .geometry import Fp8Problem, Sm90Fp8Config


def heuristic(p: Fp8Problem, sm_count: int) -> Sm90Fp8Config:
    if p.m <= 64:
        return Sm90Fp8Config(64, 128, 8, 1)  # 8 x 24 KB ring: B streams once, deep prefetch
    return Sm90Fp8Config(128, 128, 6, 2)  # 6 x 32 KB
