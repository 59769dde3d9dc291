"""What decides a cross-entropy kernel and its launch: the logits' and labels' dtypes, the vector width, the
forward's block size and the direction (rows, n, strides and ignore_index are runtime values), and the grids."""
from __future__ import annotations

import dataclasses

from rtckern.arch import Arch
from rtckern.dtypes import FLOATS, ctype, itemsize
from rtckern.spec import KernelSpec

from .._common import widest_vector

OP = "cross_entropy"
SOURCE = "loss/cross_entropy.cuh"
KERNELS = ("rtk_ce::ce_fwd", "rtk_ce::ce_bwd")
REDUCE_KERNEL = "rtk_ce::ce_reduce"
REDUCE_THREADS = 1024
REDUCTIONS = ("none", "mean", "sum")
DTYPES = FLOATS
LABEL_DTYPES = ("int64", "int32")
VECTORS = (8, 4, 2, 1)  # elements per access, widest first
VEC_BYTES = 16
FWD_THREADS = (128, 256, 512)  # one block per row: wider blocks for longer rows (fwd_threads)
BWD_THREADS = 256
MAX_GRID_Y = 65535
MAX_ROWS = 2**31 - 1  # the forward's grid.x
# the kernels' parameters in order (cross_entropy.cuh): pointers, then long long
FWD_KINDS = "P" * 4 + "q" * 4  # x, labels, loss, lse; n, x_rs, label_stride, ignore_index
BWD_KINDS = "P" * 6 + "q" * 7  # dloss, x, labels, lse, count, dx; rows, n, dloss_stride, x_rs, label_stride, dx_rs,
#                                ignore_index
REDUCE_KINDS = "P" * 4 + "q" * 3 + "i"  # loss, labels, out, count; rows, label_stride, ignore_index; mean


@dataclasses.dataclass(frozen=True)
class CeKernel:
    """One compiled variant: logits dtype, labels dtype, elements per access, block size (the forward's; the
    backward's is BWD_THREADS), direction; `reduce`: a forward whose mean or sum is taken by the reduction kernel
    (reduce_spec) after it."""

    dtype: str
    label_dtype: str
    vec: int
    threads: int
    backward: bool
    reduce: bool = False

    def spec(self, arch: Arch) -> KernelSpec:
        targs = (ctype(self.dtype), ctype(self.label_dtype), str(self.vec))
        if not self.backward:
            targs += (str(self.threads),)
        return KernelSpec(source=SOURCE, name=KERNELS[self.backward], arch=arch, op=OP, template_args=targs)

    def specs(self, arch: Arch) -> tuple[KernelSpec, ...]:
        """The kernels a call of this variant launches, in order."""
        return (self.spec(arch), reduce_spec(self.label_dtype, arch)) if self.reduce else (self.spec(arch),)


def reduce_spec(label_dtype: str, arch: Arch) -> KernelSpec:
    return KernelSpec(source=SOURCE, name=REDUCE_KERNEL, arch=arch, op=OP,
                      template_args=(ctype(label_dtype), str(REDUCE_THREADS)))


def max_vector(dtype: str) -> int:
    return VEC_BYTES // itemsize(dtype)


def vector_width(dtype: str, n: int, addrs: tuple[int, ...], row_strides: tuple[int, ...]) -> int:
    """The widest vector V (elements) dividing n and every row stride, with every address (bytes) V-aligned."""
    return widest_vector(itemsize(dtype), n, addrs, row_strides, VECTORS, VEC_BYTES)


def fwd_threads(n: int, vec: int) -> int:
    """The forward's block for rows of n elements: 128 threads up to 1024 pieces (8 per thread at most), 256 up to
    4096 (16), 512 beyond (a 262144-class row: 64 per thread)."""
    pieces = -(-n // vec)
    if pieces <= 1024:
        return 128
    return 256 if pieces <= 4096 else 512


def kernel(dtype: str, label_dtype: str, vec: int, n: int, backward: bool, reduce: bool = False) -> CeKernel:
    return CeKernel(dtype, label_dtype, vec, BWD_THREADS if backward else fwd_threads(n, vec), backward,
                    reduce and not backward)


def variants() -> tuple[CeKernel, ...]:
    out = []
    for dt in DTYPES:
        for lt in LABEL_DTYPES:
            for v in VECTORS:
                if v <= max_vector(dt):
                    out += [CeKernel(dt, lt, v, t, False) for t in FWD_THREADS]
                    out.append(CeKernel(dt, lt, v, BWD_THREADS, True))
    return tuple(out)


def variant_specs(arch: Arch) -> list[KernelSpec]:
    """Every kernel of the family on arch: each variant's, and the reduction for each labels dtype."""
    return [k.spec(arch) for k in variants()] + [reduce_spec(lt, arch) for lt in LABEL_DTYPES]


def bwd_grid(rows: int, n: int, vec: int) -> tuple[int, int, int]:
    """Blocks of BWD_THREADS pieces across a row, one row (then every MAX_GRID_Y-th) per block row."""
    return -(-(n // vec) // BWD_THREADS), max(1, min(rows, MAX_GRID_Y)), 1
