"""Registry candidates of the attention backward op (op name "attention_backward"), in priority order:

  attention_backward.sm90a_ws     sm_90 only, head dims 64 and 128: sm90a_wgmma's launches with the warp-specialized
                                main kernel (flash_bwd_sm90_ws.cuh: TMA producer warp, mbarriers, dQ added by bulk
                                reductions into a swizzled accumulator that its convert kernel reads)
  attention_backward.sm90a_wgmma  sm_90 only (arch-specific sm_90a cubin), head dims 64 and 128: the same three
                                launches as sm80_mma with the main kernel on wgmma (flash_bwd_sm90.cuh, FA3 tiles);
                                where the model of backward_configs.head_splits says so, the GQA group's q heads
                                split over several blocks per key block and a fourth launch adds their fp32 dK / dV
  attention_backward.sm80_mma   sm_80 and newer (on sm_90 for head dims 32, 96, 256): a
                                FlashAttention-2-class kernel on mma.sync m16n8k16 (flash_bwd_sm80.cuh) between
                                the prep kernel (lse in log2, rowsum(dO * O), zeroed dQ accumulator) and the
                                convert kernel (dq = scale * accumulator, in the input dtype)
  attention_backward.simt       sm_75 and newer, and HIP: fp32 FMA, one kernel for dk/dv and one for dq, no atomics

A request carries what decides compilation and feasibility: dtype, head dim, causal, deterministic. Sequence
lengths, batch, heads and strides are run-time arguments (no recompile per shape).
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any

import numpy as np

from rtckern.device import DeviceInfo
from rtckern.registry import Candidate, OpRequest, Resources
from rtckern.registry import options as opts
from rtckern.registry.core_api import target_for
from rtckern.spec import KernelSpec

from rtckern.runtime.streams import stream_handle

from . import backward_configs as cfgs
from . import launch as tma
from .candidates import head_dim_of, registrar
from .configs import qkv_reason

OP = "attention_backward"
_LOG2E = math.log2(math.e)
_i64 = np.int64


def request(dtype: str, head_dim: int, causal: bool, deterministic: bool, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"qkv": dtype}, shape={"head_dim": int(head_dim)},
                     flags={"causal": bool(causal), "deterministic": bool(deterministic)}, device=device)


def _strides3(a) -> tuple:
    return tuple(_i64(s) for s in a.strides[:3])


def _contiguous3(shape) -> tuple:
    _, s, h, d = shape
    return (_i64(s * h * d), _i64(h * d), _i64(d))


# Launch parameter kinds (Kernel.prepare) of the argument types the steps build
_KINDS = MappingProxyType({int: "P", np.int64: "q", np.float32: "f", bytes: "M"})


class Prepared:
    """The launches of one call signature with every size and stride argument fixed: `run` takes the pointers
    (inputs, outputs, workspace) and the stream. `workspace_bytes`: scratch memory the launches need. Each launch is
    prepared once (Kernel.prepare: the native launcher where it is built), at the first run, with the parameter
    kinds of the arguments its step builds."""

    __slots__ = ("workspace_bytes", "_steps", "_launches")

    def __init__(self, workspace_bytes: int, steps: list):
        self.workspace_bytes = workspace_bytes
        self._steps = steps  # (kernel, grid, block, smem, build(ptrs) -> args)
        self._launches = None

    def run(self, ptrs: dict, stream) -> None:
        if type(stream) is not int:
            stream = 0 if stream is None else stream_handle(stream)
        launches = self._launches
        if launches is None:
            launches = []
            for kernel, grid, block, smem, build in self._steps:
                kinds = "".join(_KINDS[type(a)] for a in build(ptrs))
                launches.append((kernel.prepare(grid, (block, 1, 1), kinds, smem), build))
            self._launches = launches
        for go, build in launches:
            go(stream, *build(ptrs))


def _row_kernels_steps(kernels, q, out, dout, lse, lay: dict, with_accum: bool, sem_rows: int, sem_blocks: int):
    """The prep launch: lse2, dsum (and the zeroed dQ accumulator and counters)."""
    b, sq, hq, _ = q.shape
    sqp = cfgs.padded_rows(sq)
    tail = (_i64(sq), _i64(sqp), _i64(hq), *_strides3(out), *_strides3(dout), *_strides3(lse), _i64(sem_rows),
            _i64(sem_blocks))
    lse2_off, dsum_off, acc_off, sem_off = lay["lse2"], lay["dsum"], lay.get("accum"), lay.get("sem")

    def build(p):
        ws = p["ws"]
        return (p["out"], p["dout"], p["lse"], ws + lse2_off, ws + dsum_off,
                ws + acc_off if with_accum else 0, ws + sem_off if sem_off is not None else 0) + tail
    return (kernels[0], cfgs.ROWS.prep_grid(b, hq, sq), cfgs.ROWS.threads, 0, build)


def _layout(q, head_dim: int, accum: bool, sem_count: int, dkv_part_floats: int = 0) -> tuple[dict, int]:
    """Byte offsets of the workspace parts (each 16-byte aligned) and the total."""
    b, sq, hq, _ = q.shape
    rows = b * hq * cfgs.padded_rows(sq)
    lay = {"lse2": 0, "dsum": 4 * rows}
    end = 8 * rows
    if accum:
        lay["accum"] = end
        end += 4 * b * hq * sq * head_dim
    if sem_count:
        lay["sem"] = end
        end += 4 * sem_count
    if dkv_part_floats:  # the head split's fp32 dK and dV slices (16-byte vectors in the sum kernel)
        end = -(-end // 16) * 16
        lay["part_k"] = end
        lay["part_v"] = end + 4 * dkv_part_floats
        end += 8 * dkv_part_floats
    return lay, end


class _BwdCandidate(Candidate):
    op = OP
    vendors = ("nvidia",)

    def supports(self, req: OpRequest) -> str | None:
        return qkv_reason(req, cfgs.HEAD_DIMS)

    def _row_spec(self, req: OpRequest, kernel: str) -> KernelSpec:
        return KernelSpec(cfgs.ROWS_SOURCE, kernel, target_for(req.device, self.arch_specific),
                          template_args=cfgs.ROWS.template_args(req.dtype("qkv"), req.dim("head_dim")), op=OP)

    def launch(self, req: OpRequest, kernels, q, k, v, dout, out, lse, dq_ptr: int, dk_ptr: int, dv_ptr: int,
               ws_ptr: int, scale: float, stream) -> None:
        """The generic path (CuPy, first calls): prepare and run at once."""
        prepared = self.prepare(req, kernels, q, k, v, dout, out, lse, scale)
        prepared.run({"q": q.ptr, "k": k.ptr, "v": v.ptr, "dout": dout.ptr, "out": out.ptr, "lse": lse.ptr,
                      "dq": dq_ptr, "dk": dk_ptr, "dv": dv_ptr, "ws": ws_ptr}, stream)

    def prepare(self, req: OpRequest, kernels, q, k, v, dout, out, lse, scale: float) -> Prepared:
        raise NotImplementedError


class Sm80Mma(_BwdCandidate):
    name = "attention_backward.sm80_mma"
    priority = 200
    min_arch = "sm_80"
    source = cfgs.SM80_SOURCE
    kernel = cfgs.SM80_KERNEL

    def __init__(self):
        self._tiles: dict[OpRequest, Any] = {}

    def tile(self, req: OpRequest) -> cfgs.Sm80BwdTile:
        t = self._tiles.get(req)
        if t is None:
            tiles = cfgs.SM80_BWD_TILES[req.dim("head_dim")]
            # None fits: keep the first, so the registry's resource check rejects it with the numbers.
            t = cfgs.pick_tile(tiles, req.dim("head_dim"), req.device.max_smem_per_block_optin) or tiles[0]
            self._tiles[req] = t
        return t

    def config(self, req: OpRequest) -> str:
        return self.tile(req).label()

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        tile = self.tile(req)
        targs = tile.template_args(req.dtype("qkv"), req.dim("head_dim"), req.flag("causal"),
                                   req.flag("deterministic"))
        main = KernelSpec(self.source, self.kernel, target_for(req.device, self.arch_specific),
                          template_args=targs, op=OP)
        return (self._row_spec(req, cfgs.PREP_KERNEL), main, self._row_spec(req, cfgs.CONVERT_KERNEL))

    def launch_resources(self, req: OpRequest) -> tuple[Resources, ...]:
        tile = self.tile(req)
        rows = Resources(block=cfgs.ROWS.threads)
        return (rows, Resources(block=tile.threads, dynamic_smem=tile.smem_bytes(req.dim("head_dim"))), rows)

    def head_splits(self, req: OpRequest, q, k) -> int:
        """Blocks per (key block, kv head); 1: this kernel walks the whole GQA group in one block."""
        return 1

    def _main_step(self, req: OpRequest, kernel, grid, q, k, v, dout, outputs, tail: tuple):
        """The main kernel's launch step (kernel, grid, block, smem, build(ptrs) -> args): its parameter list is
        q, k, v, dout, then outputs(ptrs) (the six workspace / output pointers), then `tail` (sizes, strides,
        scales)."""
        tile = self.tile(req)

        def build(p):
            return (p["q"], p["k"], p["v"], p["dout"]) + outputs(p) + tail
        return (kernel, grid, tile.threads, tile.smem_bytes(q.shape[3]), build)

    def prepare(self, req: OpRequest, kernels, q, k, v, dout, out, lse, scale: float) -> Prepared:
        tile = self.tile(req)
        b, sq, hq, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        det = req.flag("deterministic")
        m_blocks = tile.m_blocks(sq)
        splits = self.head_splits(req, q, k)
        count = b * sk * hk * d  # elements of dk (and dv)
        lay, total = _layout(q, d, True, b * hq * m_blocks if det else 0, splits * count if splits > 1 else 0)
        prep = _row_kernels_steps(kernels, q, out, dout, lse, lay, True, tile.bm, m_blocks)
        lse2_off, dsum_off, acc_off = lay["lse2"], lay["dsum"], lay["accum"]
        sem_off, pk_off, pv_off = lay.get("sem"), lay.get("part_k"), lay.get("part_v")
        main_tail = (_i64(sq), _i64(sk), _i64(hq), _i64(hk), _i64(cfgs.padded_rows(sq)), *_strides3(q),
                     *_strides3(k), *_strides3(v), *_strides3(dout), *_contiguous3(k.shape),
                     np.float32(scale * _LOG2E), np.float32(scale))

        def outputs(p):
            ws = p["ws"]
            dk, dv = (ws + pk_off, ws + pv_off) if pk_off is not None else (p["dk"], p["dv"])
            return (ws + lse2_off, ws + dsum_off, ws + acc_off, dk, dv, ws + sem_off if sem_off is not None else 0)

        conv_tail = (_i64(sq), _i64(hq), *_contiguous3(q.shape), np.float32(scale))

        def conv_args(p):
            return (p["ws"] + acc_off, p["dq"]) + conv_tail

        steps = [prep, self._main_step(req, kernels[1], tile.grid(b, hk * splits, sk), q, k, v, dout, outputs,
                                       main_tail),
                 (kernels[2], cfgs.ROWS.convert_grid(b, hq, sq), cfgs.ROWS.threads, 0, conv_args)]
        if splits > 1:
            sum_tail = (_i64(count), _i64(splits))

            def sum_args(p):
                return (p["ws"] + pk_off, p["ws"] + pv_off, p["dk"], p["dv"]) + sum_tail

            per_block = 4 * cfgs.DKV_SUM_THREADS
            blocks = min(-(-count // per_block), 8 * req.device.sm_count)
            steps.append((kernels[3], (blocks, 1, 1), cfgs.DKV_SUM_THREADS, 0, sum_args))
        return Prepared(total, steps)


class Sm90Wgmma(Sm80Mma):
    """The wgmma kernel: the sm80_mma launch path (prep, main, convert; workspace, counters) with its own tiles."""

    name = "attention_backward.sm90a_wgmma"
    priority = 300
    min_arch = "sm_90"
    max_arch = "sm_90"
    arch_specific = True
    source = cfgs.SM90_SOURCE
    kernel = cfgs.SM90_KERNEL

    def supports(self, req: OpRequest) -> str | None:
        why = super().supports(req)
        if why is None and req.dim("head_dim") not in cfgs.SM90_HEAD_DIMS:
            why = (f"head_dim {req.dim('head_dim')} not supported (supported: "
                   f"{', '.join(map(str, cfgs.SM90_HEAD_DIMS))})")
        return why

    def tile(self, req: OpRequest) -> cfgs.Sm90BwdTile:
        return cfgs.SM90_BWD_TILES[req.dim("head_dim")]

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        return super().kernel_specs(req) + (self._row_spec(req, cfgs.DKV_SUM_KERNEL),)

    def launch_resources(self, req: OpRequest) -> tuple[Resources, ...]:
        return super().launch_resources(req) + (Resources(block=cfgs.DKV_SUM_THREADS),)

    def head_splits(self, req: OpRequest, q, k) -> int:
        b, sq, hq, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        return cfgs.head_splits(self.tile(req), b, hk, hq // hk, sq, sk, req.flag("causal"), d, req.device.sm_count)


class Sm90WgmmaWs(Sm90Wgmma):
    """The warp-specialized wgmma kernel: Sm90Wgmma's launches and head split with flash_bwd_sm90_ws (a TMA producer
    warpgroup and mbarriers) as the main kernel."""

    name = "attention_backward.sm90a_ws"
    priority = 350
    source = cfgs.SM90_WS_SOURCE
    kernel = cfgs.SM90_WS_KERNEL

    def tile(self, req: OpRequest) -> cfgs.Sm90WsBwdTile:
        return cfgs.SM90_WS_BWD_TILES[req.dim("head_dim")]

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        # the convert kernel reads the main kernel's swizzled dQ accumulator
        prep, main, convert, dkv_sum = super().kernel_specs(req)
        return prep, main, dataclasses.replace(convert, template_args=convert.template_args + (True,)), dkv_sum

    def _main_step(self, req: OpRequest, kernel, grid, q, k, v, dout, outputs, tail: tuple):
        tile = self.tile(req)
        dtype = req.dtype("qkv")
        # flash_bwd_sm90's tail without the strides of q, k, v, dout (the maps hold them): five sizes, dk / dv's
        # strides, two scales
        tail = tail[:5] + tail[-5:]
        # Views without the arrays (a memoized plan must not keep the caller's tensors alive), with their boxes.
        operands = (("q", q.at(q.ptr), tile.bm), ("k", k.at(k.ptr), tile.bn), ("v", v.at(v.ptr), tile.bn),
                    ("dout", dout.at(dout.ptr), tile.bm))

        maps = tma.maps_by_address(dtype, operands)

        def build(p):
            return (*maps(p), *outputs(p), *tail)

        return (kernel, grid, tile.threads, tile.smem_bytes(q.shape[3]), build)


class Simt(_BwdCandidate):
    name = "attention_backward.simt"
    vendors = ("nvidia", "amd")  # the portable path
    priority = 100
    min_arch = "sm_75"

    def config(self, req: OpRequest) -> str:
        return cfgs.SIMT_BWD_TILE.label()

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        targs = cfgs.SIMT_BWD_TILE.template_args(req.dtype("qkv"), req.dim("head_dim"), req.flag("causal"))
        target = target_for(req.device, self.arch_specific)
        return (self._row_spec(req, cfgs.PREP_KERNEL),
                KernelSpec(cfgs.SIMT_SOURCE, cfgs.SIMT_DKDV_KERNEL, target, template_args=targs, op=OP),
                KernelSpec(cfgs.SIMT_SOURCE, cfgs.SIMT_DQ_KERNEL, target, template_args=targs, op=OP))

    def launch_resources(self, req: OpRequest) -> tuple[Resources, ...]:
        t = cfgs.SIMT_BWD_TILE
        smem = t.smem_bytes(req.dim("head_dim"))
        return (Resources(block=cfgs.ROWS.threads), Resources(block=t.threads, dynamic_smem=smem),
                Resources(block=t.threads, dynamic_smem=smem))

    def prepare(self, req: OpRequest, kernels, q, k, v, dout, out, lse, scale: float) -> Prepared:
        t = cfgs.SIMT_BWD_TILE
        b, sq, hq, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        lay, total = _layout(q, d, False, 0)
        prep = _row_kernels_steps(kernels, q, out, dout, lse, lay, False, 1, 0)
        lse2_off, dsum_off = lay["lse2"], lay["dsum"]
        head = (_i64(sq), _i64(sk), _i64(hq), _i64(hk), _i64(cfgs.padded_rows(sq)), *_strides3(q), *_strides3(k),
                *_strides3(v), *_strides3(dout))
        dkv_tail = head + _contiguous3(k.shape) + (np.float32(scale * _LOG2E), np.float32(scale))
        dq_tail = head + _contiguous3(q.shape) + (np.float32(scale * _LOG2E), np.float32(scale))

        def dkdv_args(p):
            ws = p["ws"]
            return (p["q"], p["k"], p["v"], p["dout"], ws + lse2_off, ws + dsum_off, p["dk"], p["dv"]) + dkv_tail

        def dq_args(p):
            ws = p["ws"]
            return (p["q"], p["k"], p["v"], p["dout"], ws + lse2_off, ws + dsum_off, p["dq"]) + dq_tail

        smem = t.smem_bytes(d)
        steps = [prep, (kernels[1], t.dkdv_grid(d, b, hk, sk), t.threads, smem, dkdv_args),
                 (kernels[2], t.dq_grid(d, b, hq, sq), t.threads, smem, dq_args)]
        return Prepared(total, steps)


def _build_request(shape: tuple[int, ...], dtype: str | None, device: DeviceInfo, **options: str) -> OpRequest:
    """For `rtckern explain/tune/selftest attention_backward`: shape is the head dim, or q's (batch, seqlen, heads,
    head_dim); options causal=0/1, deterministic=0/1."""
    hd = head_dim_of(OP, shape, "BxSxHxD")
    opts.check_keys(OP, options, ("causal", "deterministic"))
    causal = opts.flag(OP, options, "causal", False)
    det = opts.flag(OP, options, "deterministic", False)
    return request(dtype or "bf16", hd, causal, det, device)


CANDIDATES = (Sm90WgmmaWs(), Sm90Wgmma(), Sm80Mma(), Simt())
register_all = registrar(CANDIDATES, OP, _build_request,
                         help="shape: head_dim, or q's BxSxHxD; --opt causal=0/1, --opt deterministic=0/1",
                         example="--dtype bf16 --shape 4x4096x16x128 --opt causal=1")
