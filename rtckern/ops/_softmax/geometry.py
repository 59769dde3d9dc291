"""Launch planning for the softmax kernels (kernel_sources/softmax/): vector width, one-pass configs, shared
memory, online chunks, template arguments and kernel arguments. Pure arithmetic (no GPU, no compile), shared by
the candidates, the benchmark and the tests.

Template arguments depend on the dtype, the mask kind, the vector width and a power-of-two bucket of the row
length, never on the exact row length: rows of 3000 and 4000 keys run the same binary (DESIGN principle 1).
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

from rtckern.dtypes import FLOATS, ctypes, itemsizes

SOURCE = "softmax/softmax.cuh"
CTYPES = ctypes(FLOATS)  # the dtypes the kernels serve, with their storage types
ELEM_BYTES = itemsizes(FLOATS)
PLAIN, MASKED, CAUSAL = 0, 1, 2  # RTK_SOFTMAX_* in softmax_common.cuh
FWD, BWD = "fwd", "bwd"
# Static shared memory of a block (reduction scratch) plus slack; what the dynamic stash may not use.
SMEM_STATIC_RESERVE = 1024
ONLINE_THREADS = 512
ONLINE_VECTORS_PER_THREAD = 8


def pow2ceil(v: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, v))))


def vector_width(dtype: str, n: int, addresses: tuple[int, ...] = (), mask_address: int | None = None) -> int:
    """Largest VEC (elements per access, 16 bytes at most) that divides the row length and keeps every row of
    every array (and of the byte mask) aligned to VEC elements."""
    elem = ELEM_BYTES[dtype]
    vec = 16 // elem
    while vec > 1:
        if (n % vec == 0 and all(a % (vec * elem) == 0 for a in addresses)
                and (mask_address is None or mask_address % vec == 0)):
            return vec
        vec //= 2
    return 1


KERNELS = ("regs", "async", "l2")


@dataclasses.dataclass(frozen=True)
class OnePass:
    """A one-launch kernel config.

    kernel "regs" (softmax_fwd / softmax_bwd): `group` threads per row (<= 32: several rows per block; == threads:
    one row per block, the part of the row past the registers in dynamic shared memory), `items` vectors per
    thread kept in registers. Device memory is read once.
    kernel "async" (softmax_fwd_async / softmax_bwd_async): one row per block copied whole into shared memory
    with cp.async (backward: y and dy); no row data in registers, so many rows per SM. Device memory is read once.
    kernel "l2" (softmax_fwd_l2 / softmax_bwd_l2): one row per block; the second pass reads the row again, from
    L2 while the block runs (any row length). `stash` vectors per thread (the row's first stash * threads vectors;
    backward: of y and of dy) kept in shared memory instead, so only the rest is read again.
    `min_blocks` is the __launch_bounds__ occupancy hint (a register budget). For async and l2, group == threads
    and items == 0.
    `heads` (regs kernel, masked forward): a group handles that many heads of one (batch, query) in turn and
    loads their shared mask row once, into registers, instead of once per head.
    `cached` (regs kernel): inputs and outputs with default caching instead of evict-first loads and stores.
    `policy` (l2 kernel, sm_80+): the first read under an L2 evict_last access policy and the re-read under
    evict_first (1), instead of plain and evict-first loads (0).
    """

    threads: int
    group: int
    items: int
    min_blocks: int = 1
    kernel: str = "regs"
    stash: int = 0
    heads: int = 1
    cached: int = 0
    policy: int = 0

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"{self}: kernel must be one of {KERNELS}")
        if self.stash < 0 or (self.stash and self.kernel != "l2"):
            raise ValueError(f"{self}: stash (vectors per thread in shared memory) is for the l2 kernel, >= 0")
        if self.heads < 1 or (self.heads > 1 and self.kernel != "regs"):
            raise ValueError(f"{self}: heads (a head loop sharing one mask row) is for the regs kernel, >= 1")
        if self.cached not in (0, 1) or (self.cached and self.kernel != "regs"):
            raise ValueError(f"{self}: cached (0 or 1: default-cached loads and stores) is for the regs kernel")
        if self.policy not in (0, 1) or (self.policy and self.kernel != "l2"):
            raise ValueError(f"{self}: policy (0 or 1: L2 access policies on the two reads) is for the l2 kernel")
        if not 0 < self.threads <= 1024 or self.min_blocks < 1:
            raise ValueError(f"{self}: threads 1..1024, min_blocks >= 1")
        if self.kernel != "regs":
            if self.group != self.threads or self.items != 0 or self.threads % 32 or self.threads <= 32:
                raise ValueError(f"{self}: {self.kernel} kernels take one row per block of whole warps "
                                 "(group == threads > 32) and no register items (items == 0)")
            return
        if self.group & (self.group - 1) or self.threads % self.group:
            raise ValueError(f"{self}: group must be a power of two dividing threads")
        if self.group > 32 and self.group != self.threads:
            raise ValueError(f"{self}: a group wider than a warp must be the whole block")
        if self.items < 1:
            raise ValueError(f"{self}: items >= 1")

    @property
    def block_row(self) -> bool:
        return self.group == self.threads and self.group > 32

    @property
    def rows_per_block(self) -> int:
        return self.threads // self.group

    def register_keys(self, vec: int) -> int:
        return self.group * self.items * vec

    def smem_bytes(self, direction: str, dtype: str, n: int, vec: int, kind: int = PLAIN) -> int:
        """Dynamic shared memory for a row of n keys: for "regs", the part past the registers in the storage
        type (y and dy for the backward); for "async", the whole row (and, masked, its mask bytes after the row
        at a 16-byte boundary); for "l2", its stash."""
        if self.kernel == "async":
            row = n * ELEM_BYTES[dtype]
            if direction == BWD:
                return -(-row // 16) * 16 + row  # y, then dy at a 16-byte boundary
            return -(-row // 16) * 16 + n if kind == MASKED else row
        if self.kernel == "l2":
            return self.stash * self.threads * vec * ELEM_BYTES[dtype] * (2 if direction == BWD else 1)
        reg = self.register_keys(vec)
        if n <= reg:
            return 0
        if not self.block_row:
            raise ValueError(f"{self} holds {reg} keys per row and has no shared-memory stash; n={n}")
        return (n - reg) * ELEM_BYTES[dtype] * (2 if direction == BWD else 1)

    def grid(self, rows: int) -> int:
        return -(-rows // self.rows_per_block)

    def launch_grid(self, g: "RowGeometry") -> int:
        """Blocks for g's rows: one group per row, or with a head loop one per (batch, query, chunk of heads)."""
        if self.heads == 1:
            return self.grid(g.rows)
        return self.grid(g.rows // g.heads * -(-g.heads // self.heads))


def register_vectors(direction: str, dtype: str, vec: int, threads: int) -> int:
    """How many vectors per thread the register part may hold without spilling: about 32 registers of data at
    up to 512 threads (64 registers/thread budget), 16 at 1024 threads. Forward keeps fp32 logits (1 register per
    key); backward keeps y and dy in the storage type (2 * elem / 4 registers per key)."""
    regs = 32 if threads <= 512 else 16
    per_key = 1.0 if direction == FWD else 2 * ELEM_BYTES[dtype] / 4
    return max(1, int(regs / per_key) // vec)


def max_onepass_keys(direction: str, dtype: str, vec: int, smem_optin: int) -> int:
    """The longest row the one-pass kernels hold (1024 threads, full registers, the rest in shared memory)."""
    cfg = OnePass(1024, 1024, register_vectors(direction, dtype, vec, 1024))
    per_key = ELEM_BYTES[dtype] * (2 if direction == BWD else 1)
    stash = (smem_optin - SMEM_STATIC_RESERVE) // per_key
    return cfg.register_keys(vec) + stash // vec * vec


def default_onepass(direction: str, dtype: str, n: int, vec: int, smem_optin: int) -> OnePass | None:
    """A config by rule (used where the tuned table has no entry); None when no one-pass config holds n keys."""
    nvec = -(-n // vec)
    cap = register_vectors(direction, dtype, vec, 128)
    if nvec <= 32 * cap:  # a warp or less per row
        if nvec <= 32:
            return OnePass(128, pow2ceil(nvec), 1)
        return OnePass(128, 32, pow2ceil(-(-nvec // 32)))
    for threads in (256, 512, 1024):
        if nvec <= threads * register_vectors(direction, dtype, vec, threads):
            return OnePass(threads, threads, pow2ceil(-(-nvec // threads)))
    cfg = OnePass(1024, 1024, register_vectors(direction, dtype, vec, 1024))
    if cfg.smem_bytes(direction, dtype, n, vec) <= smem_optin - SMEM_STATIC_RESERVE:
        return cfg
    return None


def fits(cfg: OnePass, direction: str, dtype: str, n: int, vec: int, smem_optin: int, kind: int = PLAIN) -> str | None:
    """None when cfg can run rows of n keys (of mask kind `kind`), else why not."""
    limit = smem_optin - SMEM_STATIC_RESERVE
    if cfg.heads > 1 and (direction, kind) != (FWD, MASKED):
        return "a head loop (heads > 1) shares one mask row between heads: masked forward rows only"
    if cfg.kernel == "l2":
        smem = cfg.smem_bytes(direction, dtype, n, vec, kind)
        if smem > limit:
            return (f"a stash of {cfg.stash} vectors per thread needs {smem} B of shared memory; the device allows "
                    f"{limit} B")
        return None
    if cfg.kernel == "async":
        smem = cfg.smem_bytes(direction, dtype, n, vec, kind)
        if smem > limit:
            return f"a row of {n} {dtype} keys needs {smem} B of shared memory; the device allows {limit} B per block"
        return None
    reg = cfg.register_keys(vec)
    if n > reg and not cfg.block_row:
        return f"{cfg} holds {reg} keys per row in registers and has no shared-memory stash, row has {n}"
    smem = cfg.smem_bytes(direction, dtype, n, vec) if n > reg else 0
    if smem > limit:
        return (f"a row of {n} {dtype} keys needs {smem} B of shared memory past the {reg} keys in registers; "
                f"the device allows {limit} B per block")
    return None


_KERNEL_NAMES = MappingProxyType({(FWD, "regs"): "softmax_fwd", (FWD, "async"): "softmax_fwd_async", (FWD, "l2"): "softmax_fwd_l2",
                 (BWD, "regs"): "softmax_bwd", (BWD, "async"): "softmax_bwd_async", (BWD, "l2"): "softmax_bwd_l2"})


def onepass_template_args(direction: str, dtype: str, kind: int, vec: int, cfg: OnePass) -> tuple:
    k = kind if direction == FWD else (CAUSAL if kind == CAUSAL else PLAIN)
    if cfg.heads > 1 and (direction, kind) != (FWD, MASKED):
        raise ValueError(f"{cfg}: a head loop serves masked forward rows only")
    if cfg.kernel == "regs":
        # Trailing template arguments only when they differ from their defaults: the names (and cached binaries)
        # of the configs from before them stay valid.
        base = (CTYPES[dtype], k, vec, cfg.items, cfg.group, cfg.threads, cfg.min_blocks)
        if direction == BWD:
            return base + ((1,) if cfg.cached else ())
        if cfg.cached:
            return base + (cfg.heads, 1)
        return base + ((cfg.heads,) if cfg.heads > 1 else ())
    if cfg.policy:
        return (CTYPES[dtype], k, vec, cfg.threads, cfg.min_blocks, cfg.stash, 1)
    if cfg.stash:
        return (CTYPES[dtype], k, vec, cfg.threads, cfg.min_blocks, cfg.stash)
    return (CTYPES[dtype], k, vec, cfg.threads, cfg.min_blocks)


def onepass_kernel_name(direction: str, cfg: OnePass | None = None) -> str:
    kernel = cfg.kernel if cfg is not None else "regs"
    try:
        return _KERNEL_NAMES[(direction, kernel)]
    except KeyError:
        raise ValueError(f"no {kernel} kernel for the {direction} direction") from None


@dataclasses.dataclass(frozen=True)
class Online:
    """Two-launch online config: blocks of `threads`, rows cut into chunks of `chunk` keys."""

    threads: int
    vec: int
    chunk: int

    def chunks(self, n: int) -> int:
        return -(-n // self.chunk)

    def stats_floats(self, direction: str, rows: int, n: int) -> int:
        return rows * self.chunks(n) * (2 if direction == FWD else 1)


def online_config(n: int, vec: int) -> Online:
    step = ONLINE_THREADS * vec
    chunk = min(-(-n // step) * step, step * ONLINE_VECTORS_PER_THREAD)
    return Online(ONLINE_THREADS, vec, chunk)


def online_kernels(direction: str, dtype: str, kind: int, cfg: Online) -> tuple[tuple[str, tuple], ...]:
    """(kernel name, template args) of the stats launch and the finalize launch."""
    k = kind if direction == FWD else (CAUSAL if kind == CAUSAL else PLAIN)
    args = (CTYPES[dtype], k, cfg.vec, cfg.threads)
    return ((f"softmax_{direction}_stats", args), (f"softmax_{direction}_finalize", args))


@dataclasses.dataclass(frozen=True)
class RowGeometry:
    """How rows map to queries and mask rows. rows = prod(leading dims); sq: queries per (batch, head) (1 when
    there is no mask); heads: H of (B, H, Sq, Sk) for the boolean mask; mask_batch_stride: Sq when the mask has
    one slice per batch, 0 when one slice serves all; diag_offset: Sk - Sq for bottom-right causal, 0 square."""

    rows: int
    n: int
    sq: int = 1
    heads: int = 1
    mask_batch_stride: int = 0
    diag_offset: int = 0

    def valid_keys(self, row: int, kind: int) -> int:
        if kind != CAUSAL:
            return self.n
        return max(0, min(self.n, row % self.sq + 1 + self.diag_offset))


def fwd_args(x: int, y: int, mask: int, g: RowGeometry, scale) -> tuple:
    return (x, y, mask, g.rows, g.n, g.sq, g.heads, g.mask_batch_stride, g.diag_offset, scale)


def bwd_args(y: int, dy: int, dx: int, g: RowGeometry, scale) -> tuple:
    return (y, dy, dx, g.rows, g.n, g.sq, g.diag_offset, scale)
