"""What decides a rope kernel and its launch: the storage dtypes, the vector width and the direction (head dim,
rows and strides are runtime values), and how many threads a block runs."""
from __future__ import annotations

import dataclasses

from rtckern.arch import Arch
from rtckern.dtypes import FLOATS, ctype, itemsize
from rtckern.spec import KernelSpec

OP = "rope"
SOURCE = "rope/rope.cuh"
KERNEL = "rtk_rope::rope"
DTYPES = FLOATS  # q, k and their outputs
VECTORS = (8, 4, 2, 1)  # elements per access, widest first
MAX_THREADS = 1024  # the kernels use at most 40 registers: 1024 threads fit an SM's register file
VEC_BYTES = 16
# the kernel's parameters in order (rope.cuh): q, k, cos, sin, out_q, out_k, then 20 long long
LAUNCH_KINDS = "P" * 6 + "q" * 20


@dataclasses.dataclass(frozen=True)
class RopeKernel:
    """One compiled variant: q / k dtype, cos / sin dtype (q's or fp32), elements per access, direction."""

    dtype: str
    cos_dtype: str
    vec: int
    backward: bool

    def spec(self, arch: Arch) -> KernelSpec:
        args = (ctype(self.dtype), ctype(self.cos_dtype), str(self.vec), "true" if self.backward else "false")
        return KernelSpec(source=SOURCE, name=KERNEL, arch=arch, op=OP, template_args=args)


def cos_dtypes(dtype: str) -> tuple[str, ...]:
    """The cos / sin dtypes a q / k dtype takes: its own (what transformers passes) or fp32."""
    return (dtype,) if dtype == "fp32" else (dtype, "fp32")


def max_vector(dtype: str, cos_dtype: str) -> int:
    """The widest access: 16 bytes of the wider of the two dtypes."""
    return VEC_BYTES // max(itemsize(dtype), itemsize(cos_dtype))


def vector_width(dtype: str, cos_dtype: str, half: int, x_addrs: tuple[int, ...], x_strides: tuple[int, ...],
                 c_addrs: tuple[int, ...], c_strides: tuple[int, ...]) -> int:
    """The widest vector V (elements) that divides half the head dim and keeps every access aligned: x_addrs are
    the byte addresses of q, k and the outputs and x_strides their row strides (elements); c_addrs and c_strides
    the same of cos and sin."""
    x_isz, c_isz = itemsize(dtype), itemsize(cos_dtype)
    top = max_vector(dtype, cos_dtype)
    for v in VECTORS:
        if v > top or half % v:
            continue
        if all(a % (v * x_isz) == 0 for a in x_addrs) and all(s % v == 0 for s in x_strides) \
                and all(a % (v * c_isz) == 0 for a in c_addrs) and all(s % v == 0 for s in c_strides):
            return v
    return 1


def variants() -> tuple[RopeKernel, ...]:
    """Every kernel the op can ask for."""
    return tuple(RopeKernel(dt, ct, v, bwd) for dt in DTYPES for ct in cos_dtypes(dt) for v in VECTORS
                 if v <= max_vector(dt, ct) for bwd in (False, True))


def block_threads(items: int) -> int:
    """Threads of a block for `items` pieces per position: as few passes over them as MAX_THREADS allows, each as
    full as the others (whole warps). (Against blocks of at most 256 threads, which left Llama-3.1-8B's 320 pieces
    a second pass a quarter full, the benchmark read the same: docs/performance.md.)"""
    passes = max(1, -(-items // MAX_THREADS))
    per_pass = -(-items // passes)
    return max(32, -(-per_pass // 32) * 32)
