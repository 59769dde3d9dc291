"""Host side of the TMA attention kernel (flash_fwd_sm90_ws): tensor maps over K and V, and its launch.

The kernel takes two CUtensorMap structs by value (128 bytes each, __grid_constant__): the hot path launches it
through a PreparedWs (a runtime PreparedLaunch with "map" parameters), the full path through the core's
Kernel.launch_packed. Tensor maps come from the runtime's encoder and its one cache (rtckern/runtime/tma.py).
"""
from __future__ import annotations

from rtckern.runtime.prepared import PreparedLaunch
from rtckern.runtime.tma import MapLayout


def kv_map_layout(dtype: str, t, box_rows: int) -> MapLayout:
    """The CUtensorMap layout over a (batch, seqlen, heads, head_dim) array `t` (a DeviceArray, or a view of one
    at another address): dims innermost first (head_dim, seqlen, heads, batch), 128-byte swizzle, box (64,
    box_rows, 1, 1), zeros outside the tensor."""
    b, s, h, d = t.shape
    isz = t.itemsize
    row, head, batch = t.strides[1] * isz, t.strides[2] * isz, t.strides[0] * isz
    # Size-1 (or empty) dimensions may carry any stride in a view; TMA wants a legal one (a multiple of 16).
    if h <= 1:
        head = row * max(s, 1)
    if b <= 1:
        batch = head * max(h, 1)
    dims = (d, max(s, 1), max(h, 1), max(b, 1))
    return MapLayout(dtype, dims, (row, head, batch), (64, box_rows, 1, 1))


def kv_tensor_map(dtype: str, t, box_rows: int) -> bytes:
    """The 128-byte CUtensorMap over `t` (see kv_map_layout), from the runtime's one cache."""
    return kv_map_layout(dtype, t, box_rows).at(t.ptr)


def launch(kernel, grid, threads: int, smem: int, stream: int, params) -> None:
    """By-value TMA maps need typed parameters: the core's Kernel.launch_packed (device context handled);
    ("map", 128 bytes), ("u64"|"i64", int), ("f32", float)."""
    kernel.launch_packed(grid, (threads, 1, 1), params, smem, stream)


class PreparedWs:
    """The TMA kernel's launch for one call signature: a `PreparedLaunch` (parameter block built once: sizes,
    strides, scale) and the K/V tensor-map layouts; a call looks up the two maps (the last ones when K/V did not
    move, else the runtime's one cache) and writes them with the three addresses."""

    __slots__ = ("kmap", "vmap", "prepared")

    def __init__(self, kernel, tile, dtype: str, q, k, v, scale: float):
        from rtckern.ops._attention_candidates import _LOG2E

        b, sq, hq, d = q.shape
        self.kmap, self.vmap = kv_map_layout(dtype, k, tile.bn), kv_map_layout(dtype, v, tile.bn)
        ints = (sq, k.shape[1], hq, k.shape[2], q.strides[0], q.strides[1], q.strides[2], sq * hq * d, hq * d, d)
        self.prepared = PreparedLaunch(kernel, tile.grid(b, hq, sq), (tile.threads, 1, 1), tile.smem_bytes(d),
                                       ["map", "map", "ptr", "ptr", "ptr"] + ["i64"] * 10 + ["f32"],
                                       [None] * 5 + [int(i) for i in ints] + [scale * _LOG2E])

    def launch(self, qp: int, kp: int, vp: int, op: int, lp: int, stream: int) -> None:
        self.prepared.launch(stream, self.kmap.at(kp), self.vmap.at(vp), qp, op, lp)
