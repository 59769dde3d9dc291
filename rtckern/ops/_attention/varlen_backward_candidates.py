"""Registry candidates of attention_varlen_backward: the attention backward kernels compiled with RTK_ATTN_VARLEN=1
(one source serves both ops; see attention/attn_bwd_rows.cuh and attention/varlen.cuh), mirroring
attention_backward's candidates in the same order and with the same tiles:

  attention_varlen_backward.sm90a_ws     sm_90 only, head dims 64 and 128: prep, flash_bwd_sm90_ws (TMA producer,
                                         dQ by bulk reductions into the swizzled accumulator), its convert
  attention_varlen_backward.sm90a_wgmma  sm_90 only, head dims 64 and 128: prep, flash_bwd_sm90 (wgmma), convert
  attention_varlen_backward.sm80_mma     sm_80 and newer (sm_90 for head dims 32, 96, 256): prep, flash_bwd_sm80,
                                         convert
  attention_varlen_backward.simt         sm_75 and newer, and AMD: prep, then the dk/dv and dq fp32 FMA kernels

A request is what decides compilation and feasibility: dtype, head dim, causal, deterministic; sequence lengths,
their number, heads and strides are run-time arguments.

Workspace (one allocation, every part 16-byte aligned), with R = round_up(total_q, 128) + 128 * batch padded rows per
q head (attn_bwd_rows.cuh: sequence b's rows start at 128 * (cu_seqlens_q[b] // 128 + b), a multiple of 128, so
every sequence's rows are padded to a multiple of 128 with no host computation):
  lse2, dsum     float32 (heads_q, R) each
  cu_q, cu_k     int32 (batch + 1,) each: the prefix sums clamped to [0, total] by the prep kernel, which the later
                 kernels read (then 128-byte alignment)
  dq accumulator float32 (heads_q, total_q, head_dim)            (mma kernels)
  counters       int32 (heads_q, R / BM): one per BM padded rows (mma kernels, deterministic)
Grids: x covers the longest sequence (max_seqlen_q for prep / convert / the SIMT dq kernel, max_seqlen_k for the
main kernels), y the heads, z the sequences; blocks past their sequence exit.
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import numpy as np

from rtckern.device import DeviceInfo
from rtckern.registry import OpRequest, register, register_request_builder
from rtckern.registry import options as opts

from . import backward_candidates as dense
from . import backward_configs as cfgs
from . import candidates as dense_fwd
from . import launch as tma
from . import varlen_candidates as vc

OP = "attention_varlen_backward"
DEFINES = (("RTK_ATTN_VARLEN", "1"),)
_LOG2E = math.log2(math.e)
_i64 = np.int64


def request(dtype: str, head_dim: int, causal: bool, deterministic: bool, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"qkv": dtype}, shape={"head_dim": int(head_dim)},
                     flags={"causal": bool(causal), "deterministic": bool(deterministic)}, device=device)


def dense_request(req: OpRequest) -> OpRequest:
    """The attention_backward request with req's dtype, head dim, flags and device."""
    return dense.request(req.dtype("qkv"), req.dim("head_dim"), req.flag("causal"), req.flag("deterministic"),
                         req.device)


def padded_rows(total_q: int, batch: int) -> int:
    """R: rows per q head of the lse2 / dsum workspace (and of the counters, in BM-row blocks)."""
    return cfgs.padded_rows(total_q) + cfgs.ROW_PAD * batch


def layout(total_q: int, heads_q: int, head_dim: int, batch: int, accum: bool, sem_bm: int) -> tuple[dict, int]:
    """Byte offsets of the workspace parts and the total (sem_bm: BM of the counters, 0 for none). "cu_q" / "cu_k":
    the prefix sums clamped to [0, total], written by the prep kernel for the kernels after it."""
    rows = heads_q * padded_rows(total_q, batch)
    lay = {"lse2": 0, "dsum": 4 * rows, "cu_q": 8 * rows, "cu_k": 8 * rows + 4 * (batch + 1)}
    end = 8 * rows + 8 * (batch + 1)
    end += -end % 128  # the accumulator and counters start 128-byte aligned, as before
    if accum:
        lay["accum"] = end
        end += 4 * heads_q * total_q * head_dim
    if sem_bm:
        lay["sem"] = end
        end += 4 * (rows // sem_bm)
    return lay, end


def _s3(a) -> tuple:
    """A packed (total, heads, head_dim) array's strides as the kernels' (batch, row, head) triple: no batch."""
    return (_i64(0), _i64(a.strides[0]), _i64(a.strides[1]))


def _packed3(shape) -> tuple:
    _, h, d = shape
    return (_i64(0), _i64(h * d), _i64(d))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Prepared:
    """The launches of one call signature with every size and stride fixed: `run` takes the pointers (inputs,
    outputs, prefix sums, workspace), max_seqlen_q / max_seqlen_k (grid x) and the stream."""

    __slots__ = ("workspace_bytes", "_steps")

    def __init__(self, workspace_bytes: int, steps: list):
        self.workspace_bytes = workspace_bytes
        self._steps = steps  # (kernel.launch, grid(max_q, max_k), block, smem, build(ptrs) -> args)

    def run(self, ptrs: dict, max_q: int, max_k: int, stream) -> None:
        for launch, grid, block, smem, build in self._steps:
            launch(grid(max_q, max_k), block, build(ptrs), shared_mem=smem, stream=stream)


def _prep_step(kernels, q, k, out, dout, lse, batch: int, lay: dict, sem_rows: int):
    tq, hq, _ = q.shape
    tail = (_i64(tq), _i64(padded_rows(tq, batch)), _i64(hq), *_s3(out), *_s3(dout),
            _i64(0), _i64(lse.strides[0]), _i64(lse.strides[1]), _i64(sem_rows), _i64(0))
    lse2_off, dsum_off, acc_off, sem_off = lay["lse2"], lay["dsum"], lay.get("accum"), lay.get("sem")
    total_k, cu_off = _i64(k.shape[0]), lay["cu_q"]
    rpb = cfgs.ROWS.rows_per_block

    def build(p):
        ws = p["ws"]
        return (p["out"], p["dout"], p["lse"], ws + lse2_off, ws + dsum_off,
                ws + acc_off if acc_off is not None else 0, ws + sem_off if sem_off is not None else 0) + tail + \
            (p["cu_q"], p["cu_k"], total_k, ws + cu_off)

    def grid(max_q, max_k):
        return (cfgs.padded_rows(max_q) // rpb, hq, batch)
    return (kernels[0].launch, grid, cfgs.ROWS.threads, 0, build)


class _Varlen:
    """The dense candidate's kernels with RTK_ATTN_VARLEN=1 and its tile. Mixed in before the dense class."""

    op = OP

    def tile(self, req: OpRequest):
        return super().tile(dense_request(req))

    def kernel_specs(self, req: OpRequest):
        return tuple(dataclasses.replace(s, defines=DEFINES, op=OP) for s in super().kernel_specs(req))

    def _varlen_main_step(self, req: OpRequest, kernel, q, k, v, dout, batch: int, main_args):
        """The main kernel's step: (launch, grid(max_q, max_k), block, smem, build(ptrs) -> args)."""
        tile = self.tile(req)
        bn, hk = tile.bn, k.shape[1]
        return (kernel.launch, lambda mq, mk: (_cdiv(mk, bn), hk, batch), tile.threads, tile.smem_bytes(q.shape[2]),
                main_args)

    def launch(self, req: OpRequest, kernels, q, k, v, dout, out, lse, cu_q_ptr: int, cu_k_ptr: int, batch: int,
               max_q: int, max_k: int, dq_ptr: int, dk_ptr: int, dv_ptr: int, ws_ptr: int, scale: float,
               stream) -> None:
        """The generic path (CuPy, first calls): prepare and run at once."""
        prepared = self.prepare(req, kernels, q, k, v, dout, out, lse, batch, scale)
        prepared.run({"q": q.ptr, "k": k.ptr, "v": v.ptr, "dout": dout.ptr, "out": out.ptr, "lse": lse.ptr,
                      "cu_q": cu_q_ptr, "cu_k": cu_k_ptr, "dq": dq_ptr, "dk": dk_ptr, "dv": dv_ptr, "ws": ws_ptr},
                     max_q, max_k, stream)


class Sm80Mma(_Varlen, dense.Sm80Mma):
    name = "attention_varlen_backward.sm80_mma"

    def prepare(self, req: OpRequest, kernels, q, k, v, dout, out, lse, batch: int, scale: float) -> Prepared:
        tile = self.tile(req)
        tq, hq, d = q.shape
        tk, hk, _ = k.shape
        det = req.flag("deterministic")
        lay, total = layout(tq, hq, d, batch, True, tile.bm if det else 0)
        prep = _prep_step(kernels, q, k, out, dout, lse, batch, lay, tile.bm)
        lse2_off, dsum_off, acc_off, sem_off = lay["lse2"], lay["dsum"], lay["accum"], lay.get("sem")
        cu_q, cu_k = lay["cu_q"], lay["cu_k"]  # the prep kernel's clamped prefix sums
        main_tail = (_i64(tq), _i64(tk), _i64(hq), _i64(hk), _i64(padded_rows(tq, batch)), *_s3(q), *_s3(k),
                     *_s3(v), *_s3(dout), *_packed3(k.shape), np.float32(scale * _LOG2E), np.float32(scale))

        def main_args(p):
            ws = p["ws"]
            return (p["q"], p["k"], p["v"], p["dout"], ws + lse2_off, ws + dsum_off, ws + acc_off, p["dk"], p["dv"],
                    ws + sem_off if sem_off is not None else 0) + main_tail + (ws + cu_q, ws + cu_k)

        conv_tail = (_i64(tq), _i64(hq), *_packed3(q.shape), np.float32(scale))

        def conv_args(p):
            return (p["ws"] + acc_off, p["dq"]) + conv_tail + (p["ws"] + cu_q,)

        rpb = cfgs.ROWS.rows_per_block
        steps = [prep, self._varlen_main_step(req, kernels[1], q, k, v, dout, batch, main_args),
                 (kernels[2].launch, lambda mq, mk: (_cdiv(mq, rpb), hq, batch), cfgs.ROWS.threads, 0, conv_args)]
        return Prepared(total, steps)


class Sm90Wgmma(_Varlen, dense.Sm90Wgmma):
    """The wgmma kernel on the sm80_mma launch path."""

    name = "attention_varlen_backward.sm90a_wgmma"
    prepare = Sm80Mma.prepare

    # No head split here (its cost model needs the sequence lengths, which stay on the device): the dense
    # candidate's three launches, without its dK / dV sum kernel.
    def kernel_specs(self, req: OpRequest):
        return super().kernel_specs(req)[:3]

    def launch_resources(self, req: OpRequest):
        return super().launch_resources(req)[:3]


# Kernel.launch_packed's parameter kinds of the argument types a step builds
_TYPED = MappingProxyType({bytes: "map", int: "u64", np.int64: "i64", np.float32: "f32"})


class Sm90WgmmaWs(_Varlen, dense.Sm90WgmmaWs):
    """The warp-specialized kernel (flash_bwd_sm90_ws with RTK_ATTN_VARLEN=1): tensor maps over the packed q, k, v,
    dout, launched with typed parameters; no head split, as sm90a_wgmma."""

    name = "attention_varlen_backward.sm90a_ws"
    prepare = Sm80Mma.prepare

    def kernel_specs(self, req: OpRequest):
        return super().kernel_specs(req)[:3]

    def launch_resources(self, req: OpRequest):
        return super().launch_resources(req)[:3]

    def _varlen_main_step(self, req: OpRequest, kernel, q, k, v, dout, batch: int, main_args):
        tile = self.tile(req)
        dtype = req.dtype("qkv")
        bn, hk = tile.bn, k.shape[1]
        operands = (("q", q.at(q.ptr), tile.bm), ("k", k.at(k.ptr), tile.bn), ("v", v.at(v.ptr), tile.bn),
                    ("dout", dout.at(dout.ptr), tile.bm))

        maps = tma.maps_by_address(dtype, operands, vc.packed_4d)

        def build(p):
            # flash_bwd_sm80's varlen list: q, k, v, dout; six workspace / output pointers; five sizes; the strides of
            # q, k, v, dout (the maps hold them); dk / dv's strides, two scales, cu_seqlens_q / _k
            a = main_args(p)
            return (*maps(p), *a[4:15], *a[-7:])

        def launch(grid, block, args, shared_mem=0, stream=None):
            kernel.launch_packed(grid, (block, 1, 1), [(_TYPED[type(x)], x) for x in args], shared_mem, stream)

        return (launch, lambda mq, mk: (hk, _cdiv(mk, bn), batch), tile.threads, tile.smem_bytes(q.shape[2]), build)


class Simt(_Varlen, dense.Simt):
    name = "attention_varlen_backward.simt"

    def tile(self, req: OpRequest):
        return cfgs.SIMT_BWD_TILE

    def prepare(self, req: OpRequest, kernels, q, k, v, dout, out, lse, batch: int, scale: float) -> Prepared:
        t = cfgs.SIMT_BWD_TILE
        tq, hq, d = q.shape
        tk, hk, _ = k.shape
        lay, total = layout(tq, hq, d, batch, False, 0)
        prep = _prep_step(kernels, q, k, out, dout, lse, batch, lay, 1)
        lse2_off, dsum_off, cu_q, cu_k = lay["lse2"], lay["dsum"], lay["cu_q"], lay["cu_k"]
        head = (_i64(tq), _i64(tk), _i64(hq), _i64(hk), _i64(padded_rows(tq, batch)), *_s3(q), *_s3(k), *_s3(v),
                *_s3(dout))
        dkv_tail = head + _packed3(k.shape) + (np.float32(scale * _LOG2E), np.float32(scale))
        dq_tail = head + _packed3(q.shape) + (np.float32(scale * _LOG2E), np.float32(scale))

        def dkdv_args(p):
            ws = p["ws"]
            return (p["q"], p["k"], p["v"], p["dout"], ws + lse2_off, ws + dsum_off, p["dk"], p["dv"]) + dkv_tail + \
                (ws + cu_q, ws + cu_k)

        def dq_args(p):
            ws = p["ws"]
            return (p["q"], p["k"], p["v"], p["dout"], ws + lse2_off, ws + dsum_off, p["dq"]) + dq_tail + \
                (ws + cu_q, ws + cu_k)

        tl = t.tile(d)
        smem = t.smem_bytes(d)
        steps = [prep,
                 (kernels[1].launch, lambda mq, mk: (_cdiv(mk, tl), hk, batch), t.threads, smem, dkdv_args),
                 (kernels[2].launch, lambda mq, mk: (_cdiv(mq, tl), hq, batch), t.threads, smem, dq_args)]
        return Prepared(total, steps)


def _build_request(shape: tuple[int, ...], dtype: str | None, device: DeviceInfo, **options: str) -> OpRequest:
    """For `rtckern explain/tune/selftest attention_varlen_backward`: shape is the head dim, or q's (total_q, heads,
    head_dim); options causal=0/1, deterministic=0/1."""
    opts.check_keys(OP, options, ("causal", "deterministic"))
    causal = opts.flag(OP, options, "causal", False)
    det = opts.flag(OP, options, "deterministic", False)
    return request(dtype or "bf16", dense_fwd.head_dim_of(OP, shape, "TxHxD"), causal, det, device)


CANDIDATES = (Sm90WgmmaWs(), Sm90Wgmma(), Sm80Mma(), Simt())
_registered = False


def register_all() -> None:
    global _registered
    if _registered:
        return
    for c in CANDIDATES:
        register(c)
    register_request_builder(OP, _build_request, help="shape: head_dim, or q's TxHxD (packed tokens); "
                                                      "--opt causal=0/1, --opt deterministic=0/1",
                             example="--dtype bf16 --shape 16384x16x128 --opt causal=1",
                             limits=dense_fwd.HEAD_DIM_LIMITS)
    _registered = True
