"""Launches of the attention kernels: the parameter list every kernel takes (`kernel_args`) and the host side of
the TMA kernel (flash_fwd_sm90_ws): tensor maps over K and V, and its launch.

The TMA kernel takes two CUtensorMap structs by value (128 bytes each, __grid_constant__), so it launches through
the core's Kernel.launch_packed (typed parameters, device context handled), or on the hot path through a
PreparedWs parameter block. Tensor maps come from the core's encoder (rtckern/runtime/tma.py), cached per
buffer.
"""
from __future__ import annotations

import ctypes
import math
import threading

import numpy as np

from rtckern.errors import LaunchError
from rtckern.runtime.tma import encode_tiled

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
    launch(kernel, tile.grid(b, hq, sq), tile.threads, tile.smem_bytes(d), stream, params)


class _WsParams(ctypes.Structure):
    """flash_fwd_sm90_ws's parameters, in order: two tensor maps, q/o/lse addresses, 10 sizes and strides, scale."""

    _fields_ = (("kmap", ctypes.c_uint8 * 128), ("vmap", ctypes.c_uint8 * 128), ("q", ctypes.c_uint64),
                ("o", ctypes.c_uint64), ("lse", ctypes.c_uint64), ("ints", ctypes.c_int64 * 10),
                ("scale", ctypes.c_float))


_WS_OFFSETS = ((_WsParams.kmap.offset, _WsParams.vmap.offset, _WsParams.q.offset, _WsParams.o.offset,
                _WsParams.lse.offset) + tuple(_WsParams.ints.offset + 8 * i for i in range(10))
               + (_WsParams.scale.offset,))


class PreparedWs:
    """The TMA kernel's launch for one call signature, with the parameter block built once: a call writes the
    three addresses (and the K/V tensor maps when their addresses changed) and launches through cuLaunchKernel,
    as Kernel.launch_packed does, without packing 16 typed parameters each time. A lock keeps the shared block
    consistent between threads (the driver copies the parameters at launch). When the kernel's device context is
    not the current one, it goes through Kernel.launch_packed, which makes it current."""

    def __init__(self, kernel, tile, dtype: str, q, k, v, scale: float):
        b, sq, hq, d = q.shape
        # Views without the arrays: a memoized plan must not keep a caller's K/V cache alive.
        self.kernel, self.tile, self.dtype, self.k, self.v = kernel, tile, dtype, k.at(k.ptr), v.at(v.ptr)
        self.ordinal = kernel.device.ordinal
        from rtckern.runtime import kernel as kmod
        from rtckern.runtime.driver import driver

        self.driver = driver()
        self.primary_ctx = getattr(kmod, "_primary_ctx", {})  # ordinal -> the context launch_packed makes current
        self.grid = tile.grid(b, hq, sq)
        self.g3 = self.grid + (1,) * (3 - len(self.grid)) if isinstance(self.grid, tuple) else (self.grid, 1, 1)
        self.threads, self.smem = tile.threads, tile.smem_bytes(d)
        self.ints = (sq, k.shape[1], hq, k.shape[2], q.strides[0], q.strides[1], q.strides[2], sq * hq * d, hq * d,
                     d)
        self.scale = scale * LOG2E
        self.block = _WsParams()
        base = ctypes.addressof(self.block)
        self.ptrs = (ctypes.c_void_p * len(_WS_OFFSETS))(*[base + o for o in _WS_OFFSETS])
        self.block.ints[:] = self.ints
        self.block.scale = self.scale
        self.kp = self.vp = None
        self.lock = threading.Lock()
        self.streams: dict[int, object] = {}
        if self.smem > 48 * 1024:
            kernel.set_max_dynamic_shared_memory(self.smem)

    def params(self, qp: int, kp: int, vp: int, op: int, lp: int) -> list:
        """The typed parameter list Kernel.launch_packed takes (the fallback)."""
        k, v = self.k.at(kp), self.v.at(vp)
        bn = self.tile.bn
        return [("map", kv_tensor_map(self.dtype, k, bn)), ("map", kv_tensor_map(self.dtype, v, bn)),
                ("u64", qp), ("u64", op), ("u64", lp)] + [("i64", i) for i in self.ints] + [("f32", self.scale)]

    def launch(self, qp: int, kp: int, vp: int, op: int, lp: int, stream: int) -> None:
        d = self.driver
        cur = d.cuCtxGetCurrent()[1]
        if cur is None or int(cur) != self.primary_ctx.get(self.ordinal):
            self.kernel.launch_packed(self.grid, (self.threads, 1, 1), self.params(qp, kp, vp, op, lp), self.smem,
                                      stream)
            return
        s = self.streams.get(stream)
        if s is None:
            s = self.streams[stream] = d.CUstream(stream)
        blk = self.block
        g = self.g3
        with self.lock:
            if kp != self.kp:
                ctypes.memmove(ctypes.addressof(blk.kmap), kv_tensor_map(self.dtype, self.k.at(kp),
                                                                         self.tile.bn), 128)
                self.kp = kp
            if vp != self.vp:
                ctypes.memmove(ctypes.addressof(blk.vmap), kv_tensor_map(self.dtype, self.v.at(vp),
                                                                         self.tile.bn), 128)
                self.vp = vp
            blk.q, blk.o, blk.lse = qp, op, lp
            err, = d.cuLaunchKernel(self.kernel.core.handle, g[0], g[1], g[2], self.threads, 1, 1, self.smem, s,
                                    ctypes.addressof(self.ptrs), 0)
        if err != d.CUresult.CUDA_SUCCESS:
            raise LaunchError(f"launch of {self.kernel.label} failed: {err} (grid {g}, block ({self.threads}, 1, 1), "
                              f"shared memory {self.smem}, {len(_WS_OFFSETS)} params)")
