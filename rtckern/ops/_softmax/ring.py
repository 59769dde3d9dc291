"""Launch planning of the ring softmax kernels (kernel_sources/softmax/softmax_ring.cuh, sm_90+): persistent
blocks with a producer warp that bulk-copies row chunks into a ring of shared-memory slots and consumer warps that
reduce them. Pure arithmetic, shared by the candidate, the benchmark and the tests.

A config: `warps` consumer warps, `group` threads per row (32: a warp per row, several rows per tile; warps * 32:
the block on one row), `items` 16-byte vectors per thread per chunk (chunk = group * vec * items keys), `rows` per
tile (a slot holds one chunk of each), `slots` in the ring. A row must fit the ring (chunks per row <= slots);
more slots than chunks per row let the next rows stream in while this one reduces.
"""
from __future__ import annotations

import dataclasses

from . import geometry

STATIC_SMEM = 256  # scratch for the block reduction


@dataclasses.dataclass(frozen=True)
class Ring:
    """The ring kernel's geometry."""
    warps: int
    group: int
    items: int
    rows: int
    slots: int
    min_blocks: int = 1

    def __post_init__(self):
        consumers = self.warps * 32
        if not 1 <= self.warps <= 16:
            raise ValueError(f"{self}: warps 1..16")
        if self.group not in (1, 2, 4, 8, 16, 32) and self.group != consumers:
            raise ValueError(f"{self}: group is a power of two up to 32, or warps * 32 = {consumers}")
        groups = consumers // self.group
        if self.rows % groups or self.rows > 32:
            raise ValueError(f"{self}: rows must be a multiple of the {groups} groups and at most 32")
        if self.group == consumers and self.warps > 1 and self.rows != 1:
            raise ValueError(f"{self}: a block-wide group takes one row per tile")
        if self.items < 1 or self.slots < 1 or self.min_blocks < 1 or self.rows < 1:
            raise ValueError(f"{self}: items, rows, slots, min_blocks >= 1")

    @property
    def threads(self) -> int:
        return (self.warps + 1) * 32

    def chunk(self, dtype: str) -> int:
        return self.group * vec(dtype) * self.items

    def chunks_per_row(self, dtype: str, n: int) -> int:
        return -(-n // self.chunk(dtype))

    def slot_bytes(self, direction: str, kind: int, dtype: str) -> int:
        per_key = geometry.ELEM_BYTES[dtype] * (2 if direction == geometry.BWD else 1)
        if direction == geometry.FWD and kind == geometry.MASKED:
            per_key += 1
        return self.rows * self.chunk(dtype) * per_key

    def smem_bytes(self, direction: str, kind: int, dtype: str) -> int:
        barriers = -(-16 * self.slots // 128) * 128
        return barriers + self.slots * self.slot_bytes(direction, kind, dtype)

    def grid(self, rows: int, sm_count: int, blocks_per_sm: int) -> int:
        tiles = -(-rows // self.rows)
        return max(1, min(tiles, sm_count * max(1, blocks_per_sm)))

    def template_args(self, direction: str, kind: int, dtype: str) -> tuple:
        k = kernel_kind(direction, kind)
        return (geometry.CTYPES[dtype], k, self.warps, self.group, self.items, self.rows, self.slots, self.min_blocks)


def vec(dtype: str) -> int:
    return 16 // geometry.ELEM_BYTES[dtype]


def kernel_kind(direction: str, kind: int) -> int:
    return kind if direction == geometry.FWD else (geometry.CAUSAL if kind == geometry.CAUSAL else geometry.PLAIN)


def kernel_name(direction: str) -> str:
    return f"softmax_{direction}_ring"


def _budget(smem_optin: int) -> int:
    return smem_optin - STATIC_SMEM


def warp_ring(direction: str, kind: int, dtype: str, n: int, warps: int, rows_per_warp: int, slot_factor: int,
              smem_optin: int) -> Ring | None:
    """A warp per row: rows = warps * rows_per_warp per tile, a chunk covers the row up to 8 vectors per lane;
    slots = slot_factor x chunks per row (at least 2)."""
    v = vec(dtype)
    items = max(1, min(8, -(-n // (32 * v))))
    probe = Ring(warps=warps, group=32, items=items, rows=warps * rows_per_warp, slots=1)
    slots = max(2, slot_factor * probe.chunks_per_row(dtype, n))
    cfg = dataclasses.replace(probe, slots=slots)
    return cfg if cfg.smem_bytes(direction, kind, dtype) <= _budget(smem_optin) else None


def block_ring(direction: str, kind: int, dtype: str, n: int, warps: int, chunk_bytes: int, slots: int | None,
               smem_optin: int) -> Ring | None:
    """The block on one row: chunks of about chunk_bytes per array; slots as given (None: two rows' worth, at
    least 4, capped by shared memory); None when the row plus one chunk does not fit."""
    v = vec(dtype)
    elem = geometry.ELEM_BYTES[dtype]
    items = max(1, chunk_bytes // (warps * 32 * v * elem))
    probe = Ring(warps=warps, group=warps * 32, items=items, rows=1, slots=1)
    cpr = probe.chunks_per_row(dtype, n)
    max_slots = (_budget(smem_optin) - 256) // probe.slot_bytes(direction, kind, dtype)
    if slots is None:
        slots = min(max_slots, max(2 * cpr, 4))
    if slots < cpr + 1 or slots > max_slots:
        return None
    return dataclasses.replace(probe, slots=slots)


def default_ring(direction: str, kind: int, dtype: str, n: int, smem_optin: int) -> Ring | None:
    """A config by rule (where the tuning table has none), or None when a row does not fit in shared memory with
    room for one chunk of the next. Rows up to 2 KB per array: a warp per row, 8 rows per tile. Longer rows:
    8 consumer warps on one row, chunks of 8 KB per array."""
    if n * geometry.ELEM_BYTES[dtype] <= 2048:
        return warp_ring(direction, kind, dtype, n, 8, 1, 4, smem_optin)
    return block_ring(direction, kind, dtype, n, 8, 8192, None, smem_optin)


def sweep_rings(direction: str, kind: int, dtype: str, n: int, smem_optin: int) -> list[Ring]:
    """The configs worth timing for rows of n keys (benchmarks/softmax.py --ring-sweep)."""
    out: list[Ring] = []
    if n * geometry.ELEM_BYTES[dtype] <= 8192:
        for warps, rpw, sf in ((4, 1, 2), (4, 1, 4), (8, 1, 2), (8, 1, 4), (8, 2, 2), (16, 1, 2), (16, 2, 2)):
            out.append(warp_ring(direction, kind, dtype, n, warps, rpw, sf, smem_optin))
    for warps in (4, 8, 16):
        for chunk_bytes in (4096, 8192, 16384):
            out.append(block_ring(direction, kind, dtype, n, warps, chunk_bytes, None, smem_optin))
    seen: dict[Ring, None] = {}
    for c in out:
        if c is not None and fits(c, direction, kind, dtype, n, smem_optin) is None:
            seen.setdefault(c, None)
    return list(seen)


def fits(cfg: Ring, direction: str, kind: int, dtype: str, n: int, smem_optin: int) -> str | None:
    """None when cfg can run rows of n keys, else why not."""
    if direction == geometry.FWD and kind == geometry.MASKED and cfg.chunk(dtype) % 16:
        return (f"{cfg}: mask chunks of {cfg.chunk(dtype)} bytes; bulk copies need multiples of 16 (use group 32 "
                "or more)")
    cpr = cfg.chunks_per_row(dtype, n)
    if cpr > cfg.slots:
        return f"a row of {n} keys takes {cpr} chunks of {cfg.chunk(dtype)}; the ring has {cfg.slots} slots"
    smem = cfg.smem_bytes(direction, kind, dtype)
    if smem + STATIC_SMEM > smem_optin:
        return f"the ring needs {smem} B of shared memory; the device allows {smem_optin} B per block"
    return None
