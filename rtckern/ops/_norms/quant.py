"""rms_norm_quant: RMSNorm and per-token-group fp8 quantization in one pass (the producer of gemm_fp8's activations).

    q, scales = rtckern.ops.rms_norm_quant(x, weight, eps=1e-6, group=128, scale_format="row", zero_centered=False)

x (..., N) fp32 / fp16 / bf16 with contiguous rows, N a multiple of group (32, 64, 128 or 256; fp32 at most 128),
rows aligned to max(2, group / 32) elements; weight (N,) like rms_norm's (x's dtype or fp32). y = x * rstd * weight
in fp32 (not rounded to x's dtype), then per group of `group` columns: scale = amax(|y|) / 448 (1 for an all-zero
group), q = y / scale as float8_e4m3fn, rounded to nearest even and saturated to +-448: what rms_norm(...,
out_dtype=fp32) followed by quantize_fp8 gives. q has x's shape; scales (M, N / group) fp32 with M = x.numel() / N
rows, in quantize_fp8's layouts: "row" (row-major) or "col_tma" (column-major, M padded to a multiple of 4: the
a_scale gemm_fp8's block-scaled kernel reads fastest for q.view(M, N)). Needs an sm_89+ NVIDIA GPU; torch tensors only.

Why a separate op rather than rms_norm(..., out_dtype=float8_e4m3fn, return_scales=True): its result is always a
pair (q, scales) with a layout option rms_norm does not have, so one fixed signature serves the ops, the torch
custom op (whose schema needs fixed returns) and `rtckern explain`; and rms_norm's memoized hot path and its
plans stay exactly as they were (no extra branch or output slot in the existing paths). rms_norm given an fp8
out_dtype points here. It is a variant of the norms row kernel (kernel_sources/norms/fwd_rows_fp8.cuh: the same
loads, statistics and persistent loop, a quantizing store), selected through the norms registry
(rms_norm_quant.rows): rows of a whole block take its own rule (persistent; one pack of two 16-byte vectors per
thread where the rows allow 16-byte loads), shorter rows RMSNorm's row config for the shape.
"""
from __future__ import annotations

import sys

import numpy as np

from rtckern.caches import PlanCache
from rtckern.config import settings
from rtckern.device import DeviceInfo
from rtckern.errors import InputError
from rtckern.registry import select
from rtckern.runtime.native import direct_front
from rtckern.runtime.streams import torch_stream

from . import geometry
from .._common import DIRECT_SLOTS
from .candidates import quant_request

SCALE_FORMATS = ("row", "col_tma")
ROW_FP8_KINDS = "PPPPfqqqq"  # x, w, q, scales, eps, rows, sx, s_row, s_col
plans = PlanCache("norms.quant_call_plans", 4096)
_selections = PlanCache("norms.quant_selections")


class QuantNormPlan:
    """One validated rms_norm_quant signature: output shapes and strides and the prepared launch."""

    __slots__ = ("settings", "torch", "device", "index", "shape", "s_alloc", "s_shape", "s_strides", "go", "tail")

    def run(self, xp: int, wp: int):
        torch = self.torch
        q = torch.empty(self.shape, dtype=torch.float8_e4m3fn, device=self.device)
        s = torch.empty(self.s_alloc, dtype=torch.float32, device=self.device)
        if self.go is not None:
            self.go(torch_stream(self.index), xp, wp, q.data_ptr(), s.data_ptr(), *self.tail)
        return q, torch.as_strided(s, self.s_shape, self.s_strides)


_SLOT = DIRECT_SLOTS.index("rms_norm_quant")


def rms_norm_quant(x, weight=None, eps: float = 1e-6, *, group: int = 128, scale_format: str = "row",
                   zero_centered: bool = False):
    """RMSNorm of x's rows quantized to fp8 e4m3 per group of columns, in one pass (gemm_fp8's activations).

    Args:
        x: (..., N) torch CUDA tensor, fp32 / fp16 / bf16, contiguous rows aligned to max(2, group / 32) elements;
            N a multiple of group.
        weight: (N,) in x's dtype or fp32, or None.
        eps: added to the mean square, finite and >= 0.
        group: columns per scale: 32, 64, 128 or 256 (fp32 x: at most 128).
        scale_format: "row" (scales (M, N / group) row-major) or "col_tma" (column-major, M padded to a multiple
            of 4: the a_scale layout gemm_fp8's block-scaled kernel reads fastest).
        zero_centered: the weight is stored as gamma - 1.

    Returns:
        (q, scales): q float8_e4m3fn of x's shape; scales fp32 (M, N / group) with M = x.numel() / N, where each
        group's scale = amax(|y|) / 448 (1 for an all-zero group) and q = y / scale, rounded to nearest even and
        saturated to +-448; y = x * rstd * weight in fp32. The same as rms_norm(..., out_dtype=fp32) followed by
        quantize_fp8.

    Raises:
        InputError: x not a torch tensor, a dtype, shape or alignment it does not take, an unsupported group or
            scale_format, or a GPU older than sm_89 (no fp8).
        UnsupportedRequestError: no kernel serves the request (RTCKERN_DISABLE_OPS names the op).
    """
    front = direct_front.call  # the torch plugin's native front, where loaded (its C++ replay; None: this path)
    if front is not None:
        out = front(_SLOT, x, weight, eps, group, scale_format, zero_centered)
        if out is not None:
            return out
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor) or (weight is not None and not isinstance(weight, torch.Tensor)):
        raise InputError(f"rms_norm_quant takes torch tensors; got x of type {type(x).__name__}")
    wkey = None if weight is None else (weight.dtype, weight.shape, weight.stride(), weight.device,
                                        weight.data_ptr() % 16)
    # eps, group and the flag by type and value: a tensor eps hashes by identity (an in-place change would hit the
    # memo with the old value), and 128.0 == 128 (which the slow path refuses as a group)
    key = (x.dtype, x.shape, x.stride(), x.device, x.data_ptr() % 16, wkey, type(eps), eps, type(group), group,
           scale_format, type(zero_centered), zero_centered) if type(eps) in (float, int) else None
    try:
        p = None if key is None else plans.get(key)
    except TypeError:
        p, key = None, None
    if p is None or p.settings is not settings():
        p = _build(x, weight, eps, group, scale_format, zero_centered)
        if key is not None:
            plans.put(key, p)
    return p.run(x.data_ptr(), 0 if weight is None else weight.data_ptr())


def _build(x, weight, eps, group, scale_format, zero_centered) -> QuantNormPlan:
    from .api import _affine, _check_x, _eps  # the checks rms_norm makes

    if scale_format not in SCALE_FORMATS:
        raise InputError(f"scale_format={scale_format!r} is not supported; pass 'row' ((M, N/group) row-major) or "
                         "'col_tma' (column-major, M padded to 4: the layout gemm_fp8's block scales read fastest)")
    if not isinstance(group, int) or group not in geometry.QUANT_GROUPS:
        raise InputError(f"group={group!r} is not supported; supported: "
                         f"{', '.join(map(str, geometry.QUANT_GROUPS))}")
    xa = _check_x(x)
    wa, _, w_dtype = _affine(weight, None, xa)
    e = _eps(eps)
    n, rows = xa.n, xa.rows
    if n % group:
        raise InputError(f"x has shape {xa.shape}: its last dimension N={n} is not a multiple of group={group}; "
                         "pick a group that divides N")
    why = geometry.quant_dtype_reason(xa.dtype, group)
    if why:
        raise InputError(why)
    isz = geometry.ITEMSIZE[xa.dtype]
    need = max(2, group // geometry.QUANT_MAX_LANES)
    pairs = [(isz, geometry.byte_alignment(xa.ptr, xa.row_stride * isz))]
    if wa is not None:
        pairs.append((geometry.ITEMSIZE[w_dtype], geometry.byte_alignment(wa.ptr, geometry.ITEMSIZE[w_dtype] * n)))
    vec = geometry.pick_vec(n, tuple(a for a, _ in pairs), tuple(b for _, b in pairs))
    if vec < need:
        raise InputError(f"x (and weight) must have rows aligned to {need} elements ({need * isz} bytes) for groups "
                         f"of {group}: x has row stride {xa.row_stride} at address {xa.ptr:#x}; pass x.contiguous()")
    groups = n // group
    p = QuantNormPlan()
    p.settings = settings()
    p.torch = sys.modules["torch"]
    p.device, p.index = x.device, xa.device
    p.shape = tuple(x.shape)
    if scale_format == "row":
        p.s_alloc, p.s_strides, s_row, s_col = (rows, groups), (groups, 1), groups, 1
    else:
        mp = (rows + 3) // 4 * 4
        p.s_alloc, p.s_strides, s_row, s_col = (groups, mp), (1, mp), 1, mp
    p.s_shape = (rows, groups)
    p.go = p.tail = None
    if rows == 0:
        return p
    dev = DeviceInfo.from_device(xa.device)
    if dev.arch.gfx or dev.arch.cc < (8, 9):
        raise InputError(f"rms_norm_quant needs an NVIDIA GPU of compute capability 8.9 or newer (fp8); device "
                         f"{xa.device} is {dev.arch}. Use rms_norm and keep bf16 activations on this GPU")
    sig = (xa.dtype, w_dtype, n, vec, group, bool(zero_centered), xa.device, id(p.settings))
    sel = _selections.get(sig)
    if sel is None:
        req = quant_request(xa.dtype, w_dtype, n, vec, group, zero_centered, dev)
        s = select(req)
        sel = _selections.put(sig, (req, s.candidate, s.kernels))
    req, cand, kernels = sel
    grid, block, smem = cand.row_launch_geometry(req, kernels, rows)
    p.go = kernels[0].prepare(grid, block, ROW_FP8_KINDS, smem, dependent=True)  # (it waits: fwd_rows_fp8.cuh)
    p.tail = (np.float32(e), rows, xa.row_stride, s_row, s_col)
    return p
