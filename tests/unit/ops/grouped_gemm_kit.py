"""What the grouped GEMM unit tests share (tests/unit/ops/test_grouped_gemm*.py): hand-described arrays, and an
emulator of the grouped kernels' work split over CPU memory (gemm/grouped.cuh's group rows, tile prefix and unit map
in Python; tensor maps as views of the memory they describe). Importable as `sys.path.insert(0, "tests/unit/ops");
import grouped_gemm_kit`."""
from __future__ import annotations

import math


class Fake:
    """A hand-described device array (what the ops' array wrapper reads): shape, dtype name, element strides
    (contiguous unless given), device, address, library."""

    def __init__(self, shape, dtype="bf16", strides=None, device=0, ptr=1 << 20, lib="torch"):
        self.shape, self.dtype, self.device, self.ptr, self.lib = tuple(shape), dtype, device, ptr, lib
        if strides is None:
            strides, acc = [], 1
            for d in reversed(self.shape):
                strides.append(acc)
                acc *= max(d, 1)
            strides = tuple(reversed(strides))
        self.strides = tuple(strides)


class Memory:
    """CPU tensors by address: views at the addresses and strides the launch names (what a kernel would read)."""

    def __init__(self, torch):
        self.torch, self.tensors = torch, []

    def add(self, *ts):
        self.tensors.extend(ts)

    def view(self, ptr, shape, strides, dtype):
        for t in self.tensors:
            base, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if base <= ptr < base + size and t.dtype == dtype:
                es = t.element_size()
                flat = self.torch.empty(0, dtype=dtype).set_(t.untyped_storage(), 0, (size // es,), (1,))
                return flat.as_strided(shape, strides, (ptr - base) // es)
        raise AssertionError(f"the launch names address {ptr:#x}, which holds no {dtype} tensor of the call")


def tma_tensor(mem, desc, dtype):
    """The whole tensor a tensor map describes, as (dim2, dim1, dim0) (what its boxes are cut from)."""
    _, ptr, dims, strides, _ = desc
    es = 1 if "float8" in str(dtype) else mem.torch.empty(0, dtype=dtype).element_size()
    return mem.view(ptr, (dims[2], dims[1], dims[0]), (strides[1] // es, strides[0] // es, 1), dtype)


def box_rows(t2, row0, rows):
    """rows [row0, row0 + rows) of a (dim1, dim0) matrix, TMA's zeros past its end."""
    import torch
    out = torch.zeros((rows, t2.shape[1]), dtype=torch.float64)
    hi = min(row0 + rows, t2.shape[0])
    if hi > row0:
        out[:hi - row0] = t2[row0:hi].double()
    return out


def group_prefix(index, mode, groups, rows, bm):
    """The kernel's rtk_group_rows and tile prefix (gemm/grouped.cuh), in Python."""
    spans = []
    for g in range(groups):
        if mode == "contiguous":
            b = min(max(int(index[g]), 0), rows)
            e = min(max(int(index[g + 1]), b), rows)
        else:
            b, e = 0, min(max(int(index[g]), 0), rows)
        spans.append((b, e))
    prefix = [0]
    for b, e in spans:
        prefix.append(prefix[-1] + math.ceil((e - b) / bm))
    return spans, prefix


def tile_coords(t, tiles_m, tiles_n, group_m):
    per_group = group_m * tiles_n
    g, r = divmod(t, per_group)
    first = g * group_m
    rows = min(tiles_m - first, group_m)
    return first + r % rows, r // rows


def units(index, mode, groups, rows, bm, tiles_n, group_m):
    """Every work unit as (group, first row, row end, n-tile), as the blocks of the persistent loop walk them."""
    spans, prefix = group_prefix(index, mode, groups, rows, bm)
    for u in range(prefix[-1] * tiles_n):
        t, tn = tile_coords(u, prefix[-1], tiles_n, group_m)
        g = max(i for i in range(groups) if prefix[i] <= t)
        yield g, spans[g][0] + (t - prefix[g]) * bm, spans[g][1], tn
