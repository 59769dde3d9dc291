"""Registry candidates of attention_varlen: the attention forward kernels compiled with RTK_ATTN_VARLEN=1 (one source
serves both ops; see attention/varlen.cuh), mirroring attention's candidates in the same order:

  attention_varlen.sm90a_ws      sm_90 only: the warp-specialized TMA kernel; its tensor maps cover the packed K / V
                                 tensors, a sequence's tiles start at its first row, the rows of the next sequence
                                 that its last tile reads are masked (scores) and zeroed (values)
  attention_varlen.sm90a_wgmma   sm_90 only: wgmma with cp.async loads
  attention_varlen.sm80_mma      sm_80 and newer: mma.sync (also sm_90 for head dims 32 and 96)
  attention_varlen.simt          sm_75 and newer, and AMD: the fp32 FMA fallback

Each takes the tile its dense twin would take for the same dtype, head dim, causal flag and device (the tuned table
`attention` included), so the two ops share tile decisions. A request is what decides compilation and feasibility:
dtype, head dim, causal; sequence lengths, their number, heads and strides are run-time arguments.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from rtckern.device import DeviceInfo
from . import candidates as dense
from . import configs
from rtckern.registry import OpRequest
from rtckern.registry import options as opts
from rtckern.runtime.arrays import DeviceArray

OP = "attention_varlen"
DEFINES = (("RTK_ATTN_VARLEN", "1"),)
_LOG2E = math.log2(math.e)


def request(dtype: str, head_dim: int, causal: bool, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"qkv": dtype}, shape={"head_dim": int(head_dim)}, flags={"causal": bool(causal)},
                     device=device)


def dense_request(req: OpRequest) -> OpRequest:
    """The attention request with req's dtype, head dim, causal flag and device."""
    return dense.request(req.dtype("qkv"), req.dim("head_dim"), req.flag("causal"), req.device)


def grid(tile, max_seqlen_q: int, heads_q: int, batch: int) -> tuple[int, int, int]:
    """x: query tiles of the longest sequence (a block past its own sequence's end exits); y: q heads; z: sequences."""
    return (-(-max_seqlen_q // tile.bm), heads_q, batch)


def kernel_args(q, k, v, cu_q_ptr: int, cu_k_ptr: int, o_ptr: int, lse_ptr: int, scale: float) -> tuple:
    """The parameter list of the cp.async / mma kernels in varlen mode: the dense list (flash_fwd_sm80.cuh) with
    total_q / total_k for seqlen_q / seqlen_k, zero batch strides, the token stride as the row stride, and the two
    prefix-sum pointers after the scale."""
    tq, hq, d = q.shape
    tk, hk, _ = k.shape
    i64 = np.int64
    return (np.uint64(q.ptr), np.uint64(k.ptr), np.uint64(v.ptr), np.uint64(o_ptr), np.uint64(lse_ptr),
            i64(tq), i64(tk), i64(hq), i64(hk),
            i64(0), i64(q.strides[0]), i64(q.strides[1]),
            i64(0), i64(k.strides[0]), i64(k.strides[1]),
            i64(0), i64(v.strides[0]), i64(v.strides[1]),
            i64(0), i64(hq * d), i64(d),  # o is allocated contiguous
            np.float32(scale * _LOG2E), np.uint64(cu_q_ptr), np.uint64(cu_k_ptr))


def packed_4d(t: DeviceArray) -> DeviceArray:
    """A packed (total, heads, head_dim) array as the (1, total, heads, head_dim) view the TMA encoder takes."""
    total, h, d = t.shape
    return DeviceArray(None, t.lib, t.ptr, (1, total, h, d), (total * t.strides[0], t.strides[0], t.strides[1], 1),
                       t.dtype, t.itemsize, t.device)


def ws_params(tile, dtype: str, q, k, v, cu_q_ptr: int, cu_k_ptr: int, o_ptr: int, lse_ptr: int, scale: float) -> list:
    """flash_fwd_sm90_ws's typed parameters in varlen mode (Kernel.launch_packed): the K / V maps over the packed
    tensors, q / o / lse, the 10 sizes and strides (totals, zero batch strides), the scale, the prefix sums."""
    from . import launch as tma

    tq, hq, d = q.shape
    return [("map", tma.kv_tensor_map(dtype, packed_4d(k), tile.bn)),
            ("map", tma.kv_tensor_map(dtype, packed_4d(v), tile.bn)),
            ("u64", q.ptr), ("u64", o_ptr), ("u64", lse_ptr)] + \
        [("i64", x) for x in ws_ints(q, k)] + [("f32", scale * _LOG2E), ("u64", cu_q_ptr), ("u64", cu_k_ptr)]


def ws_ints(q, k) -> tuple[int, ...]:
    """seqlen_q, seqlen_k, heads_q, heads_kv, q_bs, q_rs, q_hs, o_bs, o_rs, o_hs of the TMA kernel in varlen mode."""
    tq, hq, d = q.shape
    return (tq, k.shape[0], hq, k.shape[1], 0, q.strides[0], q.strides[1], 0, hq * d, d)


class _Varlen:
    """The dense candidate `dense_name`'s kernel with RTK_ATTN_VARLEN=1 and its tile; same arch range, head dims and
    reasons. Mixed in before the dense class."""

    op = OP
    dense_name = ""

    def tile(self, req: OpRequest):
        t = dense._tiles.get((self.name, req))
        if t is None:
            twin = next(c for c in dense.CANDIDATES if c.name == self.dense_name)
            t = dense._tiles.put((self.name, req), twin.tile(dense_request(req)))
        return t

    def kernel_specs(self, req: OpRequest):
        return tuple(dataclasses.replace(s, defines=tuple(s.defines) + DEFINES, op=OP)
                     for s in super().kernel_specs(req))

    def launch(self, req: OpRequest, kernels, q, k, v, cu_q_ptr: int, cu_k_ptr: int, batch: int, max_seqlen_q: int,
               o_ptr: int, lse_ptr: int, scale: float, stream) -> None:
        tile = self.tile(req)
        kernels[0].launch(grid(tile, max_seqlen_q, q.shape[1], batch), tile.threads,
                          kernel_args(q, k, v, cu_q_ptr, cu_k_ptr, o_ptr, lse_ptr, scale),
                          shared_mem=tile.smem_bytes(q.shape[2]), stream=stream)


class Sm90Ws(_Varlen, dense.Sm90Ws):
    name = "attention_varlen.sm90a_ws"
    dense_name = "attention.sm90a_ws"

    def launch(self, req: OpRequest, kernels, q, k, v, cu_q_ptr: int, cu_k_ptr: int, batch: int, max_seqlen_q: int,
               o_ptr: int, lse_ptr: int, scale: float, stream) -> None:
        tile = self.tile(req)
        params = ws_params(tile, req.dtype("qkv"), q, k, v, cu_q_ptr, cu_k_ptr, o_ptr, lse_ptr, scale)
        kernels[0].launch_packed(grid(tile, max_seqlen_q, q.shape[1], batch), (tile.threads, 1, 1), params,
                                 tile.smem_bytes(configs.ws_kernel_dim(q.shape[2])), stream)


class Sm90Wgmma(_Varlen, dense.Sm90Wgmma):
    name = "attention_varlen.sm90a_wgmma"
    dense_name = "attention.sm90a_wgmma"


class Sm80Mma(_Varlen, dense.Sm80Mma):
    name = "attention_varlen.sm80_mma"
    dense_name = "attention.sm80_mma"


class Simt(_Varlen, dense.Simt):
    name = "attention_varlen.simt"
    dense_name = "attention.simt"


def _build_request(shape: tuple[int, ...], dtype: str | None, device: DeviceInfo, **options: str) -> OpRequest:
    """For `rtckern explain/tune/selftest attention_varlen`: shape is the head dim, or q's (total_q, heads,
    head_dim); option causal=0/1."""
    opts.check_keys(OP, options, ("causal",))
    causal = opts.flag(OP, options, "causal", False)
    return request(dtype or "bf16", dense.head_dim_of(OP, shape, "TxHxD"), causal, device)


CANDIDATES = (Sm90Ws(), Sm90Wgmma(), Sm80Mma(), Simt())
register_all = dense.registrar(CANDIDATES, OP, _build_request,
                               help="shape: head_dim, or q's TxHxD (packed tokens); --opt causal=0/1",
                               example="--dtype bf16 --shape 16384x16x128 --opt causal=1")
