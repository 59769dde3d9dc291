"""Launches of the attention kernels: the parameter list every kernel takes (`kernel_args`) and the host side of
the TMA kernel (flash_fwd_sm90_ws): tensor maps over K and V, and its launch.

The TMA kernel takes two CUtensorMap structs by value (128 bytes each, __grid_constant__), so it launches through
the core's Kernel.launch_packed (typed parameters, device context handled), or on the hot path through a
PreparedWs parameter block. Tensor maps come from the core's encoder (rtckern/runtime/tma.py), cached per
buffer.
"""
from __future__ import annotations

import math

import numpy as np

from rtckern.runtime.tma import encode_tiled

from .configs import ws_kernel_dim

LOG2E = math.log2(math.e)  # the kernels take the softmax scale times log2(e) (they exponentiate with exp2)


def kernel_args(q, k, v, o_ptr: int, lse_ptr: int, scale: float) -> tuple:
    """The kernels' common parameter list (see flash_fwd_sm80.cuh): pointers, sizes, element strides, scale."""
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    o_strides = (sq * hq * q.shape[3], hq * q.shape[3], q.shape[3])  # o is allocated contiguous
    i64 = np.int64
    return (np.uint64(q.ptr), np.uint64(k.ptr), np.uint64(v.ptr), np.uint64(o_ptr), np.uint64(lse_ptr),
            i64(sq), i64(sk), i64(hq), i64(hk),
            i64(q.strides[0]), i64(q.strides[1]), i64(q.strides[2]),
            i64(k.strides[0]), i64(k.strides[1]), i64(k.strides[2]),
            i64(v.strides[0]), i64(v.strides[1]), i64(v.strides[2]),
            i64(o_strides[0]), i64(o_strides[1]), i64(o_strides[2]),
            np.float32(scale * LOG2E))


def kv_tensor_map(dtype: str, t, box_rows: int) -> bytes:
    """CUtensorMap over a (batch, seqlen, heads, head_dim) array `t` (a DeviceArray, or a view of one at another
    address): dims innermost first (head_dim, seqlen, heads, batch), 128-byte swizzle, box (64, box_rows, 1, 1),
    zeros outside the tensor."""
    b, s, h, d = t.shape
    isz = t.itemsize
    row, head, batch = t.strides[1] * isz, t.strides[2] * isz, t.strides[0] * isz
    # Size-1 (or empty) dimensions may carry any stride in a view; TMA wants a legal one (a multiple of 16).
    if h <= 1:
        head = row * max(s, 1)
    if b <= 1:
        batch = head * max(h, 1)
    dims = (d, max(s, 1), max(h, 1), max(b, 1))
    return encode_tiled(dtype, t.ptr, dims, (row, head, batch), (64, box_rows, 1, 1))


def maps_by_address(dtype: str, operands, view=lambda t: t):
    """maps(ptrs) -> the tensor maps of `operands` ((name, array view without its array, box rows), in order) at the
    addresses ptrs[name]: each operand's last map is kept and encoded again only when its address changes (a memoized
    plan sees the same buffers call after call). `view` reshapes a view for the map (the varlen ops' packed 4-d one)."""
    last = [(None, b"")] * len(operands)  # per operand: the last (address, map), replaced as one tuple

    def maps(ptrs) -> list[bytes]:
        out = []
        for i, (name, t, box) in enumerate(operands):
            ptr, m = last[i]
            if ptr != ptrs[name]:
                ptr = ptrs[name]
                m = kv_tensor_map(dtype, view(t.at(ptr)), box)
                last[i] = (ptr, m)
            out.append(m)
        return out
    return maps


def launch(kernel, grid, threads: int, smem: int, stream: int, params) -> None:
    """By-value TMA maps need typed parameters: the core's Kernel.launch_packed (device context handled);
    ("map", 128 bytes), ("u64"|"i64", int), ("f32", float)."""
    kernel.launch_packed(grid, (threads, 1, 1), params, smem, stream)


def launch_ws(kernel, tile, dtype: str, q, k, v, o_ptr: int, lse_ptr: int, scale: float, stream) -> None:
    """One launch of the TMA kernel with its parameters packed for this call (PreparedWs: the hot path's form)."""
    b, sq, hq, d = q.shape
    params = [("map", kv_tensor_map(dtype, k, tile.bn)), ("map", kv_tensor_map(dtype, v, tile.bn)),
              ("u64", q.ptr), ("u64", o_ptr), ("u64", lse_ptr), ("i64", sq), ("i64", k.shape[1]), ("i64", hq),
              ("i64", k.shape[2]), ("i64", q.strides[0]), ("i64", q.strides[1]), ("i64", q.strides[2]),
              ("i64", sq * hq * d), ("i64", hq * d), ("i64", d), ("f32", scale * LOG2E)]
    launch(kernel, tile.grid(b, hq, sq), tile.threads, tile.smem_bytes(ws_kernel_dim(d)), stream, params)


# flash_fwd_sm90_ws's parameters: the K and V tensor maps (by value), q / o / lse, ten sizes and strides, the scale
WS_KINDS = "MMPPP" + "q" * 10 + "f"


class PreparedWs:
    """The TMA kernel's launch for one call signature: a prepared launch (Kernel.prepare: the native launcher where it
    is built) with the sizes, strides and scale bound. A call passes the three addresses and the K / V tensor maps,
    encoded again only when K's or V's address changed (the last (address, map) pair per operand, replaced as one
    tuple so threads never pair one address with another's map)."""

    def __init__(self, kernel, tile, dtype: str, q, k, v, scale: float):
        b, sq, hq, d = q.shape
        # Views without the arrays: a memoized plan must not keep a caller's K/V cache alive.
        self.tile, self.dtype, self.k, self.v = tile, dtype, k.at(k.ptr), v.at(v.ptr)
        self.tail = (sq, k.shape[1], hq, k.shape[2], q.strides[0], q.strides[1], q.strides[2], sq * hq * d, hq * d,
                     d, scale * LOG2E)
        smem = tile.smem_bytes(ws_kernel_dim(d))
        self.go = kernel.prepare(tile.grid(b, hq, sq), (tile.threads, 1, 1), WS_KINDS, smem)
        self.kmap = self.vmap = (None, b"")

    def launch(self, qp: int, kp: int, vp: int, op: int, lp: int, stream: int) -> None:
        km, vm = self.kmap, self.vmap
        if km[0] != kp:
            km = self.kmap = (kp, kv_tensor_map(self.dtype, self.k.at(kp), self.tile.bn))
        if vm[0] != vp:
            vm = self.vmap = (vp, kv_tensor_map(self.dtype, self.v.at(vp), self.tile.bn))
        self.go(stream, km[1], vm[1], qp, op, lp, *self.tail)
