"""What decides a SwiGLU kernel and its launch: the storage dtype, the vector width and the direction (rows, n and
strides are runtime values), and the grid over the rows."""
from __future__ import annotations

import dataclasses

from rtckern.arch import Arch
from rtckern.dtypes import FLOATS, ctype, itemsize
from rtckern.spec import KernelSpec

from .._common import widest_vector

OP = "swiglu"
SOURCE = "glu/swiglu.cuh"
KERNELS = ("rtk_glu::swiglu_fwd", "rtk_glu::swiglu_bwd")
DTYPES = FLOATS
VECTORS = (8, 4, 2, 1)  # elements per access, widest first
VEC_BYTES = 16
THREADS = 256
MAX_GRID_Y = 65535
# the kernels' parameters in order (swiglu.cuh): pointers, then long long
FWD_KINDS = "P" * 3 + "q" * 5  # gate, up, y; rows, n, gate_rs, up_rs, y_rs
BWD_KINDS = "P" * 5 + "q" * 7  # dy, gate, up, dgate, dup; rows, n, dy_rs, gate_rs, up_rs, dg_rs, du_rs


@dataclasses.dataclass(frozen=True)
class GluKernel:
    """One compiled variant: storage dtype, elements per access, direction."""

    dtype: str
    vec: int
    backward: bool

    def spec(self, arch: Arch) -> KernelSpec:
        return KernelSpec(source=SOURCE, name=KERNELS[self.backward], arch=arch, op=OP,
                          template_args=(ctype(self.dtype), str(self.vec)))


def max_vector(dtype: str) -> int:
    return VEC_BYTES // itemsize(dtype)


def vector_width(dtype: str, n: int, addrs: tuple[int, ...], row_strides: tuple[int, ...]) -> int:
    """The widest vector V (elements) dividing n and every row stride, with every address (bytes) V-aligned."""
    return widest_vector(itemsize(dtype), n, addrs, row_strides, VECTORS, VEC_BYTES)


def variants() -> tuple[GluKernel, ...]:
    return tuple(GluKernel(dt, v, bwd) for dt in DTYPES for v in VECTORS if v <= max_vector(dt)
                 for bwd in (False, True))


def grid(rows: int, n: int, vec: int) -> tuple[int, int, int]:
    """Blocks of THREADS pieces across a row, one row (then every MAX_GRID_Y-th) per block row."""
    return -(-(n // vec) // THREADS), max(1, min(rows, MAX_GRID_Y)), 1
